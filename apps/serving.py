"""Concurrent callers served from one running batch (the web apps' requests), each within its
time budget, waiting for a slot included.

A caller `run`s a request with its `Deadline`: the request is queued, joins the batch at the next
step with a free slot, and the caller waits at most the time left (`wait`). A request still queued
when its budget ends, or when what is left of it is less than reading its prompt costs
(`limits.estimate_s`: it could only time out, after taking a slot and others' time), leaves the
queue with the time-budget error and never takes a slot; a running one stops at its next step (its
`on_step` checks the deadline). Each step admits prompts of at most
`max_prompt_tokens` tokens in all (at least one request), so that a burst of long prefills does not
stall every other caller's decode step.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from concurrent.futures import Future

from specsuite.apps.limits import Deadline, TimeBudgetExceeded, estimate_s
from specsuite.core.engine import BatchEngine, Request
from specsuite.core.sequence import Generation

MAX_PROMPT_TOKENS_PER_STEP = 1024


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


class BatchServer:
    """One running batch for concurrent callers (a web app's requests): `run` (or `submit`) from
    any thread; a request joins the batch at the next step instead of waiting for the others to
    finish. The engine runs in a daemon thread, started on the first request."""

    def __init__(self, engine: BatchEngine, max_prompt_tokens: int = MAX_PROMPT_TOKENS_PER_STEP) -> None:
        self.engine = engine
        self.max_prompt_tokens = max_prompt_tokens
        self._queue: queue.Queue[tuple[Request, Future, Deadline]] = queue.Queue()
        self._futures: list[Future] = []  # by request number
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def run(self, request: Request, deadline: Deadline) -> Generation:
        """Decode `request` in the batch; TimeBudgetExceeded once `deadline` passes, queued or not.
        The request's `on_step` should check the deadline (`Deadline.on_step`) to stop it in flight."""
        return wait(self.submit(request, deadline), deadline)

    def submit(self, request: Request, deadline: Deadline | None = None) -> Future:
        future: Future = Future()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="specsuite-batch", daemon=True)
                self._thread.start()
        self._queue.put((request, future, deadline or Deadline(None)))
        return future

    def _requests(self) -> Iterator[Request | None]:
        admitted = 0  # prompt tokens admitted in this step
        while True:
            if admitted >= self.max_prompt_tokens:  # enough prefill for one step: the rest next step
                admitted = 0
                yield None
                continue
            try:  # block only while nothing is decoding
                request, future, deadline = self._queue.get(block=self.engine.in_flight == 0)
            except queue.Empty:
                admitted = 0
                yield None
                continue
            if not future.set_running_or_notify_cancel():
                continue  # its caller gave up while it was queued
            if deadline.expired():
                future.set_exception(deadline.queued())
                continue
            need = estimate_s(self.engine.model, len(request.prompt))
            if need is not None and deadline.remaining() is not None and need > deadline.remaining():
                future.set_exception(deadline.queued(need))  # it could only time out, after taking others' time
                continue
            self._futures.append(future)
            admitted += len(request.prompt)
            yield request

    def _serve(self) -> None:
        try:
            for index, result in self.engine.run(self._requests()):
                future = self._futures[index]
                self._futures[index] = None  # type: ignore[call-overload] - done: drop the reference
                if isinstance(result, Exception):
                    future.set_exception(result)
                else:
                    future.set_result(result)
        except BaseException as e:  # the batch itself failed: fail its callers, restart on the next request
            with self._lock:
                self._thread = None
                waiting, self._futures = [f for f in self._futures if f is not None], []
            for future in waiting:
                future.set_exception(e)
            raise
