"""Concurrent callers served from one running batch (the web apps' requests), each within its
time budget, waiting for a slot included.

A caller `run`s a request with its `Deadline`: the request is queued, joins the batch at a step
with a free slot, and the caller waits at most the time left (`wait`); a running one stops at its
next step past its deadline (its `on_step` checks it). Each step admits prompts of at most
`max_prompt_tokens` tokens in all (at least one request), so that a burst of long prefills does not
stall every other caller's decode step.

Admission by deadline: a queued request joins the batch only while everyone is expected to
finish in time (`_Plan`), by the engine's measured step cost: its prefill delays every running
request, and each step costs more with one more sequence. If it would make someone late it waits
for a step; if it cannot finish in time even alone, it leaves the queue at once with the
time-budget error and never takes a slot. The queued requests are tried cheapest prefill first:
fewest prompt rows past the prefix cache (as SGLang's longest-prefix-match policy) per caller
queued with the same prompt. Callers whose prompt another caller's prefill left in the cache (the
same question over the same passages) join at once instead of waiting behind a prompt that cannot
fit yet, and of two uncached prompts the one that answers more callers goes first. Under a burst
of callers (48 at once with a 30 s budget) the batch then finishes the requests it took, instead
of taking as many as fit in the slots and having most of them time out together. Greedy requests
queued together with the same prompt and limits (`twin_key`: the same question over the same
passages from several callers) decode as one sequence: greedy output depends on nothing else, so
each caller gets what it would have alone, for one slot and one prefill (`_Callers`). How many steps a request takes is learned from the ones
that finished here (PRIOR_STEPS until then), and how much slower than the curve a step runs here
from every step (`step_slowdown`, `prefill_slowdown`: drafts' rows, a busy machine).
"""

from __future__ import annotations

import dataclasses
import queue
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from specsuite.apps.limits import Deadline, TimeBudgetExceeded, step_cost
from specsuite.core.scheduler.engine import BatchEngine, Request
from specsuite.core.scheduler.prefix_cache import common_prefix
from specsuite.core.scheduler.sequence import Generation

MAX_PROMPT_TOKENS_PER_STEP = 1024
# Engine steps a request is assumed to take until one has finished here: a short answer (the
# apps' demo questions and sentences take 10-40 on the presets). Then the mean of the finished
# ones (exponentially weighted, LEARN_RATE), as is the rows a sequence adds to a step.
PRIOR_STEPS = 24
LEARN_RATE = 0.2
# Bounds of the learned slowdowns (`BatchServer.step_slowdown`, `prefill_slowdown`): never below
# the curve (measured on a quiet machine: a step can run slower, not faster), and one odd step
# cannot swing admission far.
MIN_SLOWDOWN, MAX_SLOWDOWN = 1.0, 20.0
# A request that finds the engine idle waits for the rest of its burst before admission: callers
# who arrive together are then admitted cheapest prefill first and twins together, not whichever
# came first (a long prefill taken alone at once can leave no time for the others). A lone request
# waits BURST_GAP_S; once a second comes within it, the server waits as long as the next comes
# within BURST_GAP_S x BURST_SPREAD (RAG callers retrieve one at a time, `RagQA.retrieve`: ~40 ms
# apart), at most BURST_WINDOW_S in all.
BURST_GAP_S, BURST_SPREAD, BURST_WINDOW_S = 0.05, 3, 2.0
# Seconds with nothing to decode after which the engine's KV cache is freed (a server's cache grows
# with its busiest moment; bursts closer together keep it).
IDLE_SHRINK_S = 30.0
# Worker threads of a web app (`launch(max_threads=...)`): every caller waiting for the batch holds
# one, so with gradio's default of 40 the 41st concurrent caller, even one to be refused at once,
# would wait for a thread.
UI_THREADS = 256


def warm_up(what: str, call: Callable[[], object]) -> None:
    """Run `call` once before a web app listens, through the visitors' path (kernel checks, weight
    packing, the step cost, the batch's first steps per request), saying so in the log."""
    start = time.perf_counter()
    print(f"warming up before serving: kernel checks, weight packing, the step cost, {what}",
          file=sys.stderr, flush=True)
    call()
    print(f"warm-up done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def wait(future: Future, deadline: Deadline):
    """The future's result within what is left of `deadline`; past it, the request is cancelled
    (a queued one never takes a slot; a running one stops at its next step) and the caller gets
    TimeBudgetExceeded."""
    try:
        return future.result(timeout=deadline.remaining())
    except TimeBudgetExceeded:
        raise
    except TimeoutError:
        future.cancel()  # fails for a running request: its on_step ends it at the next step
        raise deadline.queued() if future.cancelled() else deadline.exceeded() from None


@dataclass
class _Running:
    """A request in the batch: its deadline, the engine steps it is expected to take, and the
    engine's forward count when it joined."""

    deadline: Deadline
    steps: float
    joined: int


def _toward(slowdown: float, ratio: float) -> float:
    """A learned slowdown moved toward one step's measured ratio, bounded (MIN/MAX_SLOWDOWN)."""
    return slowdown + LEARN_RATE * (min(max(ratio, MIN_SLOWDOWN), MAX_SLOWDOWN) - slowdown)


def twin_key(request: Request) -> tuple | None:
    """What decides a greedy request's tokens: its prompt and limits (the drafter changes the speed
    only). None for a sampled one: each caller draws its own."""
    p = request.params
    if p.sampling is not None:
        return None
    return tuple(request.prompt), p.max_new_tokens, p.stop_strings, p.ignore_eos


class _Callers:
    """The callers of one sequence (a request and its queued twins), as its `on_step`: each step
    goes to every caller's own; a caller whose on_step raises (its time budget, a closed stream)
    leaves with that error, and the sequence stops when none is left."""

    def __init__(self, callers: list[tuple[Callable | None, Future]]) -> None:
        self.callers = callers

    def __call__(self, tokens, flags) -> None:
        error = None
        for caller in list(self.callers):
            on_step, future = caller
            try:
                if on_step is not None:
                    on_step(tokens, flags)
            except Exception as e:  # noqa: BLE001 - the caller's own end, passed to it
                self.callers.remove(caller)
                future.set_exception(e)
                error = e
        if not self.callers:
            raise error

    def end(self, result: Generation | Exception) -> None:
        for _, future in self.callers:
            future.set_exception(result) if isinstance(result, Exception) else future.set_result(result)


class EngineFailure(RuntimeError):
    """The running batch failed (not one request's input): its requests are lost."""


def _fail(future: Future, error: Exception) -> None:
    """End a queued request with `error`, unless its caller cancelled it already."""
    if future.set_running_or_notify_cancel():
        future.set_exception(error)


class BatchServer:
    """One running batch for concurrent callers (a web app's requests): `run` (or `submit`) from
    any thread; a request joins the batch at a step with a free slot instead of waiting for the
    others to finish. The engine runs in a daemon thread, started on the first request."""

    def __init__(self, engine: BatchEngine, max_prompt_tokens: int = MAX_PROMPT_TOKENS_PER_STEP,
                 burst_gap_s: float = BURST_GAP_S) -> None:
        self.engine = engine
        self.max_prompt_tokens, self.burst_gap_s = max_prompt_tokens, burst_gap_s
        # seconds of an engine step by its rows: the engine's own curve, else the measured one
        self.cost = engine.budget.cost if engine.budget is not None else step_cost(engine.model, engine.store.backend)
        self.steps, self.rows = float(PRIOR_STEPS), 1.0  # per request; per sequence and step
        # measured seconds / the curve's, of decode steps and of prefills, learned from every step:
        # the curve was measured on a quiet machine, with no drafts priced in, on few rows
        self.step_slowdown = self.prefill_slowdown = 1.0
        self._queue: queue.Queue[tuple[Request, Future, Deadline]] = queue.Queue()
        self._pending: list[tuple[Request, Future, Deadline]] = []  # taken from the queue, in arrival order, not yet admitted
        self._callers: dict[int, _Callers] = {}  # by engine request id (the engine thread's alone)
        self._running: dict[int, _Running] = {}  # by engine request id (the engine thread's alone)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.failure: EngineFailure | None = None  # the last batch failure, until a request is answered again

    def run(self, request: Request, deadline: Deadline) -> Generation:
        """Decode `request` in the batch; TimeBudgetExceeded once `deadline` passes, queued or not.
        The request's `on_step` should check the deadline (`Deadline.on_step`) to stop it in flight."""
        return wait(self.submit(request, deadline), deadline)

    def submit(self, request: Request, deadline: Deadline | None = None) -> Future:
        future: Future = Future()
        self._queue.put((request, future, deadline or Deadline(None)))
        self._start()
        return future

    def _start(self) -> None:
        """Start the engine thread unless it runs."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="specsuite-batch", daemon=True)
                self._thread.start()

    def _admit(self) -> int:
        """Move queued requests into the engine while it has free slots, the cheapest prefill
        first (`_prompt_rows`: a caller whose prompt another's left in the prefix cache costs a
        few rows), at most `max_prompt_tokens` of prompt a step (at least one request), each only
        once it keeps everyone in time (until then it waits a step: sequences finish, the batch
        gets cheaper). Blocks while nothing is decoding or pending, freeing the KV cache after
        IDLE_SHRINK_S of that. Returns the prompt rows admitted."""
        engine = self.engine
        while True:
            self._collect()
            admitted, prefilling = 0, []  # the prompts this step prefills
            for item, rows in self._admission_order():
                if engine.in_flight + len(engine.waiting) >= engine.batch_size:
                    break
                if not any(item is pending for pending in self._pending):
                    continue  # a twin of one admitted this step
                request, future, deadline = item
                if self._shares_a_prefill(request, rows, prefilling):
                    continue  # next step that prefix is cached: it prefills the rest only
                if future.cancelled() or deadline.expired():
                    self._pending.remove(item)
                    _fail(future, deadline.queued())
                    continue
                plan = self._plan(request, rows, prefilled_with=admitted)
                if admitted and admitted + plan.prompt_rows > self.max_prompt_tokens:
                    continue  # over this step's prompt rows: a step of two long prefills costs more than two steps
                alone = plan.finish_alone()
                if alone is not None and deadline.remaining() is not None and alone > deadline.remaining():
                    self._pending.remove(item)  # it could only time out, after taking others' time
                    _fail(future, deadline.queued(alone))
                    continue
                if not plan.keeps_everyone_in_time(deadline):
                    continue  # a cheaper prompt behind it may fit now; it waits for a step
                self._pending.remove(item)
                if not future.set_running_or_notify_cancel():
                    continue  # its caller gave up while it was queued
                callers = _Callers([(request.on_step, future), *self._take_twins(request)])
                request_id = engine.add_request(dataclasses.replace(request, on_step=callers))
                self._running[request_id] = _Running(deadline, plan.steps, engine.forward_passes)
                self._callers[request_id] = callers
                admitted += plan.prompt_rows
                prefilling.append(request.prompt)
            if engine.has_unfinished_requests():
                return admitted

    def _take_twins(self, request: Request) -> list[tuple[Callable | None, Future]]:
        """Take the queued requests that decode the same tokens as `request` (`twin_key`) out of
        the queue, as callers of its sequence (those whose callers gave up are dropped)."""
        key = twin_key(request)
        if key is None:
            return []
        twins = [item for item in self._pending if twin_key(item[0]) == key]
        for item in twins:
            self._pending.remove(item)
        return [(twin.on_step, future) for twin, future, _ in twins if future.set_running_or_notify_cancel()]

    def _collect(self) -> None:
        """Move queued requests to `_pending`; while nothing is decoding or pending, wait for one
        (giving the KV cache's memory back after IDLE_SHRINK_S of nothing), then for the rest of
        its burst (`burst_gap_s`, BURST_SPREAD, BURST_WINDOW_S)."""
        idle = not (self._pending or self.engine.has_unfinished_requests())
        while True:
            try:
                while True:
                    self._pending.append(self._queue.get_nowait())
            except queue.Empty:
                pass
            if self._pending or self.engine.has_unfinished_requests():
                break
            try:
                self._pending.append(self._queue.get(timeout=IDLE_SHRINK_S))
            except queue.Empty:
                self.engine.store.shrink()
        end, gap = time.monotonic() + BURST_WINDOW_S, self.burst_gap_s
        while idle and gap > 0 and (left := end - time.monotonic()) > 0:
            try:
                self._pending.append(self._queue.get(timeout=min(gap, left)))
            except queue.Empty:
                return
            gap = self.burst_gap_s * BURST_SPREAD  # a burst: its callers may come a little apart

    def _admission_order(self) -> list[tuple[tuple[Request, Future, Deadline], int]]:
        """The pending requests, each with the rows its prefill computes (`_prompt_rows`, worked
        out once a step), by those rows per caller it answers (callers queued with the same prompt
        take it from the prefix cache a step later), in arrival order among equals."""
        order = [(item, self._prompt_rows(item[0])) for item in self._pending]
        if self.engine.config.prefix_cache is None:
            return order
        callers = Counter(tuple(request.prompt) for request, _, _ in self._pending)
        return sorted(order, key=lambda entry: entry[1] / callers[tuple(entry[0][0].prompt)])

    def _prompt_rows(self, request: Request) -> int:
        """The rows `request`'s prefill computes: its prompt past what the prefix cache holds."""
        cache = self.engine.config.prefix_cache
        return len(request.prompt) - (cache.cached_length(request.prompt) if cache is not None else 0)

    def _shares_a_prefill(self, request: Request, rows: int, prefilling: list[list[int]]) -> bool:
        """Whether at least half of the `rows` rows `request`'s prefill would compute are the
        prefix of a prompt prefilled this step (the same question and passages as another
        caller's): admitted a step later, it finds them in the prefix cache instead of computing
        them twice."""
        if self.engine.config.prefix_cache is None:
            return False
        cached = len(request.prompt) - rows
        return any(2 * (common_prefix(request.prompt, p) - cached) >= rows for p in prefilling)

    def _learn_speed(self, seconds: float, prompt_rows: int, decoding: int) -> None:
        """The slowdowns, from one step that took `seconds`: it prefilled `prompt_rows` rows and
        stepped `decoding` sequences already in the batch (priced as `_Plan` prices them). A step
        whose prefill the curve prices above its decoding teaches the prefill's slowdown (the
        decoding's share at its own), any other the decode steps'."""
        if self.cost is None or not (prompt_rows or decoding):
            return
        prefill = self.cost(prompt_rows) if prompt_rows else 0.0
        step = self.cost(max(1, round(decoding * self.rows))) if decoding else 0.0
        if prefill > step:
            self.prefill_slowdown = _toward(self.prefill_slowdown, (seconds - self.step_slowdown * step) / prefill)
        else:
            self.step_slowdown = _toward(self.step_slowdown, seconds / (prefill + step))

    def _plan(self, request: Request, prompt_rows: int | None = None, prefilled_with: int = 0) -> _Plan:
        """What admitting `request` now would do; prompt_rows: its `_prompt_rows`, where known;
        prefilled_with: the prompt rows admitted before it to this step's prefill."""
        rows = self._prompt_rows(request) if prompt_rows is None else prompt_rows
        return _Plan(self.cost, request, self.steps, self.rows, list(self._running.values()),
                     self.engine.forward_passes, rows, self.step_slowdown, self.prefill_slowdown, prefilled_with)

    def _learn(self, generation: Generation) -> None:
        """The steps a request takes and the rows a sequence adds to a step, from one that finished."""
        s = generation.stats
        if s.forward_passes:
            self.steps += LEARN_RATE * (s.forward_passes - self.steps)
            self.rows += LEARN_RATE * (1 + sum(s.drafted) / s.forward_passes - self.rows)

    def _serve(self) -> None:
        """The engine thread: admit, step, hand each ended request to its caller; again."""
        try:
            self.engine.reset()  # a failed batch's sequences are gone
            while True:
                decoding = self.engine.in_flight
                prompt_rows = self._admit()
                start = time.perf_counter()
                ended = self.engine.step()
                self._learn_speed(time.perf_counter() - start, prompt_rows, decoding)
                for request_id, result in ended:
                    self._running.pop(request_id, None)
                    if not isinstance(result, Exception):
                        self._learn(result)
                        self.failure = None  # answering again
                    self._callers.pop(request_id).end(result)
        except BaseException as e:  # the batch itself failed: fail its callers, go on with the queued ones
            failure = EngineFailure(f"the model's batch failed ({type(e).__name__}: {e}); the requests in it were "
                                    "lost, the engine restarts with the next one; try again")
            with self._lock:
                self._thread = None
                self.failure = failure
                waiting, self._callers, self._running = list(self._callers.values()), {}, {}
            for callers in waiting:
                callers.end(failure)
            if self._pending or not self._queue.empty():
                self._start()
            raise


@dataclass
class _Plan:
    """What admitting `request` now would do, by the step cost curve `cost` (None: not measured,
    then every request is admitted) times the slowdowns measured here: its prefill delays every
    running request by cost(its prompt rows: those past a cached prefix) x `prefill_slowdown`;
    then every step costs cost(rows) x `step_slowdown`, each sequence adding `rows` rows, until
    each has taken its expected steps (`steps`, at most the request's answer budget). Prompts
    admitted to one step are prefilled in one forward: each waits for all of them
    (`prefilled_with`: the rows admitted before this one).
    Conservative: the batch is priced as if nobody left it early."""

    cost: Callable[[int], float] | None
    request: Request
    steps_each: float
    rows: float
    running: list[_Running]
    now_step: int
    prompt_rows: int  # the prompt's rows its prefill computes (those past a cached prefix)
    step_slowdown: float = 1.0
    prefill_slowdown: float = 1.0
    prefilled_with: int = 0

    @property
    def steps(self) -> float:
        return min(self.steps_each, self.request.params.max_new_tokens)

    def _step_s(self, sequences: int) -> float:
        return self.step_slowdown * self.cost(max(1, round(sequences * self.rows)))

    def _prefill_s(self, rows: int) -> float:
        return self.prefill_slowdown * self.cost(rows)

    def finish_alone(self) -> float | None:
        """Seconds the request takes with the batch to itself (None: no cost curve)."""
        if self.cost is None:
            return None
        return self._prefill_s(self.prompt_rows) + self.steps * self._step_s(1)

    def keeps_everyone_in_time(self, deadline: Deadline) -> bool:
        """Whether the request and every running one are expected to end within their budgets."""
        if self.cost is None:
            return True
        prefill, step = self._prefill_s(self.prefilled_with + self.prompt_rows), self._step_s(len(self.running) + 1)
        ends = [(deadline, prefill + self.steps * step)]
        ends += [(r.deadline, prefill + max(1.0, r.steps - (self.now_step - r.joined)) * step) for r in self.running]
        return all(d.remaining() is None or end <= d.remaining() for d, end in ends)
