"""Many callers on one running batch (apps/serving/batch_server.py), each within its time budget, waiting for a
slot included; and the batched apps under concurrent gradio_client calls with hostile input among
them (real apps launched in-process on the small model)."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # before gradio is imported

import pytest
from conftest import REPO, free_port

from specsuite.core import EngineConfig, SamplingParams
from specsuite.apps.limits import Deadline, OverBudgetError, TimeBudgetExceeded
from specsuite.apps.serving.batch_server import UI_THREADS

DEMO_CORPUS = REPO / "demos" / "corpus"
QUESTION = "Who was the commander of Apollo 11?"
ONE_LETTER = "x" * 200_000  # 200,000 characters of one letter
NATURAL = "All work and no play makes Jack a dull boy. " * 3000  # ~30,000 tokens of natural text
REFUSAL_S = 2.0


def _prompt(tok, n: int, caller: int = 0) -> list[int]:
    """A prompt of n tokens; callers > 0 get their own (identical greedy requests decode as one)."""
    return tok(f"Caller {caller}. " * bool(caller) + "Count from one to one thousand: " + "one two three " * n)["input_ids"][:n]


class Steps:
    """An on_step callback that records the engine's forward count at each of its steps."""

    def __init__(self, engine) -> None:
        self.engine, self.at = engine, []

    def __call__(self, tokens, flags) -> None:
        self.at.append(self.engine.forward_passes)


@pytest.fixture(scope="module")
def backend(smollm2):
    """One backend for the engines of the admission tests: each would build its own weights' forms."""
    from specsuite.core.model.backend import choose_backend

    return choose_backend(smollm2[0])


@pytest.fixture(scope="module")
def engine(smollm2):
    from specsuite.core.scheduler.engine import BatchEngine

    return BatchEngine(smollm2[0], EngineConfig(batch_size=1, draft_budget=False))


def test_a_request_queued_past_its_budget_leaves_the_queue_without_a_slot(smollm2, engine):
    from specsuite.apps.serving.batch_server import BatchServer
    from specsuite.core.scheduler.engine import Request

    tok = smollm2[1]
    server = BatchServer(engine)  # one slot: the second request waits for the first to finish
    first = server.submit(Request(_prompt(tok, 20), params=SamplingParams(max_new_tokens=150), on_step=Steps(engine)))
    waited, abandoned = Steps(engine), Steps(engine)
    start = time.monotonic()
    with pytest.raises(TimeBudgetExceeded, match="busy with other requests for the whole time budget of 0.3 s"):
        server.run(Request(_prompt(tok, 20), params=SamplingParams(max_new_tokens=8), on_step=abandoned), Deadline(0.3))
    assert time.monotonic() - start < 1.5, "the caller waited past its budget"
    queued = server.submit(Request(_prompt(tok, 20), params=SamplingParams(max_new_tokens=8), on_step=waited), Deadline(0.3))
    assert first.result(timeout=120).tokens and not first.exception()
    with pytest.raises(TimeBudgetExceeded, match="busy with other requests"):
        queued.result(timeout=30)  # expired in the queue, though its caller never gave up
    assert abandoned.at == [] and waited.at == [], "a request past its budget took a slot"
    later = Steps(engine)
    assert server.run(Request(_prompt(tok, 20), params=SamplingParams(max_new_tokens=4), on_step=later), Deadline(60)).tokens and later.at


def test_an_idle_batch_gives_its_kv_cache_back_and_answers_alike_after(smollm2, monkeypatch, backend):
    from specsuite.apps.serving import batch_server as serving
    from specsuite.core.scheduler.engine import BatchEngine, Request

    monkeypatch.setattr(serving, "IDLE_SHRINK_S", 0.3)
    tok = smollm2[1]
    server = serving.BatchServer(BatchEngine(smollm2[0], EngineConfig(batch_size=2, backend=backend, draft_budget=False)))
    first = server.run(Request(_prompt(tok, 20), params=SamplingParams(max_new_tokens=12)), Deadline(60))
    store = server.engine.store
    assert store.keys, "a cache while it decodes"
    deadline = time.monotonic() + 10
    while (store.keys or store.values) and time.monotonic() < deadline:  # shrink sets them one after the other
        time.sleep(0.1)
    assert store.keys == [] and store.values == []
    assert server.run(Request(_prompt(tok, 20), params=SamplingParams(max_new_tokens=12)), Deadline(60)).tokens == first.tokens


def test_a_running_request_stops_at_its_next_step(smollm2, engine):
    from specsuite.apps.limits import estimate_s
    from specsuite.apps.serving.batch_server import BatchServer
    from specsuite.core.scheduler.engine import Request

    prompt = _prompt(smollm2[1], 20)
    budget = 2 * estimate_s(smollm2[0], len(prompt), engine.store.backend, 6) + 0.5  # admitted: it may finish in time
    steps = Steps(engine)

    def slow_step(tokens, flags):  # each step takes a third of the budget: the third one ends it
        steps(tokens, flags)
        time.sleep(budget / 3)

    deadline = Deadline(budget)
    start = time.monotonic()
    with pytest.raises(TimeBudgetExceeded, match=f"time budget of {budget:g} s"):
        BatchServer(engine).run(Request(prompt, params=SamplingParams(max_new_tokens=6), on_step=deadline.on_step(slow_step)), deadline)
    assert 1 <= len(steps.at) < 6 and time.monotonic() - start < budget + 1


def test_each_step_admits_at_most_the_prompt_token_cap(smollm2, backend):
    """Two 600-token prompts and a 300-token one arriving together, a cap of 1,024 prompt rows a
    step: the first and the short one join the first step (900), the second long one the next
    step (1,500 would pass the cap), so the others' decode steps are not stalled by all of them."""
    from specsuite.apps.serving.batch_server import BatchServer
    from specsuite.core.scheduler.engine import BatchEngine, Request

    engine = BatchEngine(smollm2[0], EngineConfig(batch_size=4, backend=backend, draft_budget=False))
    server = BatchServer(engine, max_prompt_tokens=1024, burst_gap_s=0)  # the holder runs before the others queue
    steps = [Steps(engine) for _ in range(3)]
    queued = threading.Event()
    # A running request keeps the engine stepping (its first step waits until all three are queued).
    holder = server.submit(Request(_prompt(smollm2[1], 10), params=SamplingParams(max_new_tokens=3), on_step=lambda *a: queued.wait(30)))
    futures = [server.submit(Request(_prompt(smollm2[1], n, caller), params=SamplingParams(max_new_tokens=2), on_step=s))
               for caller, n, s in zip((1, 2, 3), (600, 600, 300), steps)]
    queued.set()
    for f in [holder, *futures]:
        f.result(timeout=120)
    first = [s.at[0] for s in steps]
    assert first[0] == first[2] and first[1] == first[0] + 1, first


def test_a_burst_joins_the_batch_only_while_everyone_can_finish_in_time(smollm2, backend):
    """Admission by deadline, on a step cost curve given to the engine (0.05 s a row, so a prompt
    of 10 tokens costs 0.5 s and a step of n sequences 0.05 n s): with a 3.2 s budget and 20
    answer tokens, two requests fit together (prefilled in one step, 1.0 + 20 x 0.1 s), a third
    never does (at least 0.5 + 20 x 0.15 s), so at most two are in the batch at once and the
    others wait for them; one whose budget is below what it needs alone (1.0 s for 10 answer
    tokens) is refused at once without a slot."""
    from specsuite.apps.serving.batch_server import PRIOR_STEPS, BatchServer
    from specsuite.core.speculation.draft_budget import StepCost
    from specsuite.core.scheduler.engine import BatchEngine, Request

    engine = BatchEngine(smollm2[0], EngineConfig(batch_size=8, backend=backend), cost=StepCost({1: 0.05, 64: 3.2}))
    server = BatchServer(engine, burst_gap_s=0)  # admission by deadline alone: no wait for a burst
    in_flight: list[int] = []
    hopeless = Steps(engine)
    start = time.monotonic()
    with pytest.raises(TimeBudgetExceeded, match=r"less than this request needs \(at least 1.0 s"):
        server.run(Request(_prompt(smollm2[1], 10), params=SamplingParams(max_new_tokens=10), on_step=hopeless), Deadline(0.7))
    assert time.monotonic() - start < 0.5 and hopeless.at == []
    calls = [(Request(_prompt(smollm2[1], 10, caller), params=SamplingParams(max_new_tokens=20),
                      on_step=lambda *a: in_flight.append(engine.in_flight)), Deadline(3.2)) for caller in range(1, 7)]
    start = time.monotonic()
    futures = [server.submit(request, deadline) for request, deadline in calls]
    answered = 0
    for future in futures:
        try:
            answered += bool(future.result(timeout=30).tokens)
        except TimeBudgetExceeded:
            pass
    assert time.monotonic() - start < 3.2 + 1.0  # every call ended, answered or refused in time
    assert answered >= 2 and in_flight and max(in_flight) == 2, in_flight
    assert server.steps < PRIOR_STEPS  # learned from the finished ones: at most 21 forwards each



def test_prompts_admitted_to_one_step_are_priced_as_one_prefill(smollm2, backend):
    """Three 100-token prompts queued together, 0.1 s a row on the given cost curve (far above
    this model's real cost, so that real time is a small part of the budget), a 25 s budget: each
    alone (10 s of prefill) fits, and two prefilled in one step (20 s) do, but three in one step
    (30 s) would make all three late: the third joins a step later."""
    from specsuite.apps.serving.batch_server import BatchServer
    from specsuite.core.speculation.draft_budget import StepCost
    from specsuite.core.scheduler.engine import BatchEngine, Request

    tok = smollm2[1]
    engine = BatchEngine(smollm2[0], EngineConfig(batch_size=4, backend=backend), cost=StepCost({1: 0.1, 64: 6.4}))
    server = BatchServer(engine, burst_gap_s=0)  # the holder runs before the others queue
    queued = threading.Event()
    holder = server.submit(Request(_prompt(tok, 10), params=SamplingParams(max_new_tokens=3), on_step=lambda *a: queued.wait(30)))
    steps = [Steps(engine) for _ in range(3)]
    futures = [server.submit(Request(_prompt(tok, 100, caller), params=SamplingParams(max_new_tokens=2), on_step=s),
                             Deadline(25)) for caller, s in enumerate(steps, 1)]
    queued.set()
    for f in [holder, *futures]:
        f.result(timeout=60)
    first = sorted(s.at[0] for s in steps)
    assert first[0] == first[1] and first[2] > first[1], first


def test_a_burst_to_an_idle_server_is_admitted_cheapest_prefill_first(smollm2, backend):
    """A 200-token prompt and then a 10-token one sent together to an idle server with one slot:
    the server waits for the rest of the burst (`burst_gap_s`), so the short one runs first; with
    no wait, the first to arrive takes the slot."""
    from specsuite.apps.serving.batch_server import BatchServer
    from specsuite.core import PrefixCache
    from specsuite.core.scheduler.engine import BatchEngine, Request

    tok = smollm2[1]
    for gap, short_first in ((0.5, True), (0, False)):
        engine = BatchEngine(smollm2[0], EngineConfig(batch_size=1, backend=backend, prefix_cache=PrefixCache(smollm2[0].config)))
        server = BatchServer(engine, burst_gap_s=gap)
        long_steps, short_steps = Steps(engine), Steps(engine)
        long = server.submit(Request(_prompt(tok, 200), params=SamplingParams(max_new_tokens=2), on_step=long_steps))
        time.sleep(0.05)  # the long one is queued first, the engine thread started
        short = server.submit(Request(_prompt(tok, 10), params=SamplingParams(max_new_tokens=2), on_step=short_steps))
        for future in (long, short):
            future.result(timeout=60)
        assert (short_steps.at[0] < long_steps.at[0]) == short_first, (gap, short_steps.at, long_steps.at)


def test_identical_greedy_requests_queued_together_decode_as_one_sequence(smollm2, backend):
    """Three callers with the same prompt and one with another, sent together: the three share one
    sequence (two in flight, not four), each gets the tokens it gets alone and sees every step;
    one of them leaving (its on_step raises: a time budget, a closed stream) does not stop the
    others'."""
    from specsuite.apps.serving.batch_server import BatchServer
    from specsuite.core.scheduler.engine import BatchEngine, Request

    tok = smollm2[1]
    engine = BatchEngine(smollm2[0], EngineConfig(batch_size=4, backend=backend))
    server = BatchServer(engine, burst_gap_s=0.5)
    same, other = _prompt(tok, 30), _prompt(tok, 12)
    params = SamplingParams(max_new_tokens=8)
    alone = server.run(Request(same, params=params), Deadline(None)).tokens
    in_flight, steps = [], [Steps(engine) for _ in range(3)]

    def leaves_after_two(tokens, flags):
        if len(steps[2].at) == 2:
            raise RuntimeError("this caller left")
        steps[2](tokens, flags)
        in_flight.append(engine.in_flight)

    futures = [server.submit(Request(same, params=params, on_step=on_step))
               for on_step in (steps[0], steps[1], leaves_after_two)]
    futures.append(server.submit(Request(other, params=params)))
    assert [f.result(timeout=60).tokens for f in futures[:2]] == [alone, alone]
    with pytest.raises(RuntimeError, match="this caller left"):
        futures[2].result(timeout=60)
    assert futures[3].result(timeout=60).tokens
    assert steps[0].at == steps[1].at and len(steps[0].at) > 2 and steps[2].at == steps[0].at[:2]
    assert max(in_flight) == 2, in_flight


def test_admission_prices_only_the_prompt_rows_past_a_cached_prefix(smollm2, backend):
    """A prompt whose prefix the engine's prefix cache holds prefills only the rest: admission
    prices that (a RAG caller asking about passages another caller's prompt left there), and
    the answer is the same as the first one's."""
    from specsuite.apps.serving.batch_server import BatchServer
    from specsuite.core import PrefixCache
    from specsuite.core.speculation.draft_budget import StepCost
    from specsuite.core.scheduler.engine import BatchEngine, Request

    cache = PrefixCache(smollm2[0].config)
    engine = BatchEngine(smollm2[0], EngineConfig(batch_size=2, backend=backend, prefix_cache=cache), cost=StepCost({1: 0.01, 64: 0.64}))
    server = BatchServer(engine)
    prompt = _prompt(smollm2[1], 60)
    request = lambda: Request(prompt, params=SamplingParams(max_new_tokens=5))  # noqa: E731
    assert server._plan(request()).prompt_rows == 60
    first = server.run(request(), Deadline(None))
    assert server._plan(request()).prompt_rows == cache.fresh_tokens  # the rest is cached
    again = server.run(request(), Deadline(None))
    assert again.tokens == first.tokens and again.stats.cached_prompt_tokens == 60 - cache.fresh_tokens

def test_a_cached_prompt_joins_before_an_uncached_one_that_cannot_fit_yet(smollm2, backend):
    """Cheapest prefill first: with a running request whose budget a 600-row prefill would break
    (0.01 s a row on the given cost curve: 6 s against its 4 s), the long prompt waits; a caller
    whose prompt is in the prefix cache, queued after it, joins the batch at once instead of
    waiting behind it."""
    from specsuite.apps.serving.batch_server import BatchServer
    from specsuite.core import PrefixCache
    from specsuite.core.speculation.draft_budget import StepCost
    from specsuite.core.scheduler.engine import BatchEngine, Request

    tok = smollm2[1]
    engine = BatchEngine(smollm2[0], EngineConfig(batch_size=4, backend=backend, prefix_cache=PrefixCache(smollm2[0].config)),
                         cost=StepCost({1: 0.01, 64: 0.64}))
    server = BatchServer(engine, burst_gap_s=0)  # the holder runs before the others queue
    cached = _prompt(tok, 60)
    first = server.run(Request(cached, params=SamplingParams(max_new_tokens=5)), Deadline(None))
    queued = threading.Event()
    holder = server.submit(Request(_prompt(tok, 10), params=SamplingParams(max_new_tokens=8),
                                   on_step=lambda *a: queued.wait(30)), Deadline(4))
    long_steps, cached_steps = Steps(engine), Steps(engine)
    long = server.submit(Request(_prompt(tok, 600), params=SamplingParams(max_new_tokens=2), on_step=long_steps))
    again = server.submit(Request(cached, params=SamplingParams(max_new_tokens=5), on_step=cached_steps))
    queued.set()
    for future in (holder, long, again):
        future.result(timeout=120)
    assert cached_steps.at[0] < long_steps.at[0], (cached_steps.at, long_steps.at)
    assert again.result().tokens == first.tokens


def test_admission_learns_how_much_slower_than_the_curve_steps_run_here(smollm2, backend):
    """A cost curve far cheaper than this machine (1e-5 s a row: a curve measured while quiet, a
    step that drafts more rows than priced): after a few requests the server has measured its
    steps slower, and a request whose budget the curve alone would call ample but the measured
    steps cannot meet is refused at once, without a slot."""
    from specsuite.apps.serving.batch_server import MAX_SLOWDOWN, BatchServer
    from specsuite.core.speculation.draft_budget import StepCost
    from specsuite.core.scheduler.engine import BatchEngine, Request

    tok = smollm2[1]
    engine = BatchEngine(smollm2[0], EngineConfig(batch_size=2, backend=backend), cost=StepCost({1: 1e-5, 64: 64e-5}))
    server = BatchServer(engine, burst_gap_s=0)  # no wait for a burst: the budget below is milliseconds
    for _ in range(3):
        server.run(Request(_prompt(tok, 20), params=SamplingParams(max_new_tokens=8)), Deadline(60))
    assert server.step_slowdown == pytest.approx(MAX_SLOWDOWN, rel=0.5)  # a step here takes ~1e-3 s or more, not 1e-5
    request = Request(_prompt(tok, 400), params=SamplingParams(max_new_tokens=8), on_step=Steps(engine))
    curve_alone = engine.budget.cost(400) + server.steps * engine.budget.cost(1)  # ~4 ms
    budget = min(server.step_slowdown, server.prefill_slowdown) * curve_alone / 2  # ample by the curve, short of the measured steps
    assert curve_alone < budget / 2
    with pytest.raises(TimeBudgetExceeded, match="less than this request needs"):
        server.run(request, Deadline(budget))
    assert request.on_step.at == []


# ---- the running apps --------------------------------------------------------------------------

def _launch(app) -> str:
    port = free_port()
    app.queue().launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True,
                       max_threads=UI_THREADS)
    return f"http://127.0.0.1:{port}/"


@pytest.fixture(scope="module")
def batched_rag(smollm2):
    """A RagQA serving concurrent calls from one batch of 8, and a client of its app."""
    from gradio_client import Client

    from specsuite.apps.rag.qa import RagQA
    from specsuite.apps.rag.ui import build_app
    from specsuite.retrieval import Embedder, PassageIndex, load_documents

    index = PassageIndex.build(load_documents([DEMO_CORPUS]), Embedder("minilm-l6"))
    qa = RagQA.from_loaded(*smollm2, index, max_new_tokens=32, batch_size=8)
    app = build_app(qa, k=3, time_budget_s=30, warm_up=True)  # kernels, the step cost, steps per request
    url = _launch(app)
    yield qa, url, Client(url, verbose=False)
    app.close()


def _refusal_s(match: str, call, *args, **kwargs) -> float:
    """Seconds until `call(*args, **kwargs)` was refused with an error matching `match`."""
    start = time.monotonic()
    with pytest.raises(Exception, match=match):
        call(*args, **kwargs)
    return time.monotonic() - start


@pytest.mark.parametrize("question", [ONE_LETTER, NATURAL], ids=["one_letter", "natural"])
def test_huge_questions_are_refused_at_once_while_a_normal_call_is_answered(batched_rag, question):
    qa, url, client = batched_rag
    from gradio_client import Client

    from specsuite.apps.serving.batch_server import PRIOR_STEPS

    assert qa._server.steps != PRIOR_STEPS  # the warm-up question ran through the batch
    start = time.monotonic()
    client.predict(QUESTION, 3, api_name="/ask")
    alone = time.monotonic() - start
    normal = client.submit(QUESTION, 3, api_name="/ask")
    other = Client(url, verbose=False)
    assert _refusal_s("too long", other.predict, question, 3, api_name="/ask") < REFUSAL_S
    assert _refusal_s("the question is too long: .* the limit is 1,000 tokens", qa.ask, question, 3) < REFUSAL_S
    assert _refusal_s("too long", lambda: list(qa.stream_ask(question, 3))) < REFUSAL_S
    assert normal.result(timeout=60)["answer"]
    assert time.monotonic() - start - alone < 2 * alone + 2, "the normal call was slowed down by the refused ones"


def test_cli_refuses_a_huge_question_before_loading_the_model(tmp_path, capsys):
    from specsuite.cli import build_parser, main

    build_parser()  # the commands' modules imported: the refusal itself is what is timed
    for question in (ONE_LETTER, NATURAL):
        start = time.monotonic()
        assert main(["rag", "ask", str(tmp_path / "no-index"), question]) == 1
        assert time.monotonic() - start < REFUSAL_S
        assert "the question is too long" in capsys.readouterr().err


def test_a_request_that_cannot_finish_in_its_budget_is_refused_before_the_model(batched_rag):
    qa, _, _ = batched_rag
    question = "Tell me everything about the water cycle and the plate tectonics. " * 12
    start = time.monotonic()
    with pytest.raises(OverBudgetError, match=r"would take at least [\d.]+ s on this machine .* time budget of 0.01 s"):
        qa.ask(question, 20, time_budget_s=0.01)
    assert time.monotonic() - start < REFUSAL_S


def test_many_concurrent_calls_all_end_within_the_budget(smollm2, batched_rag):
    """48 calls at once on 8 slots, with a short budget: each ends with an answer or the time-budget
    error within the budget and a step's margin, at least 8 are answered (the batch takes only
    what it can finish in time); hostile calls among them are refused at once."""
    from gradio_client import Client

    from specsuite.apps.rag.ui import build_app

    qa, _, _ = batched_rag
    budget = 12.0
    app = build_app(qa, k=3, time_budget_s=budget)
    url = _launch(app)
    calls = [QUESTION if i % 6 else ONE_LETTER for i in range(48)]
    clients = [Client(url, verbose=False) for _ in calls]

    def call(i: int) -> tuple[str, float]:
        start = time.monotonic()
        try:
            clients[i].predict(calls[i], 1, api_name="/ask")  # one passage: short prefills
            return "answered", time.monotonic() - start
        except Exception as e:  # noqa: BLE001 - each outcome is checked below
            kinds = {"would take at least": "over_budget", "time budget": "timed_out", "too long": "refused"}
            return next((k for needle, k in kinds.items() if needle in str(e)), repr(e)), time.monotonic() - start

    try:
        with ThreadPoolExecutor(len(calls)) as pool:
            results = list(pool.map(call, range(len(calls))))
    finally:
        app.close()
    assert {kind for kind, _ in results} <= {"answered", "timed_out", "refused", "over_budget"}, results
    assert sum(kind == "refused" for kind, _ in results) == 8
    # At once: a refusal waits for no model work, so it ends before most answers do, whatever the
    # CPU; its time is what 48 clients arriving together cost the app in this process (seconds on
    # 2 cores), which every other call pays too, on top of its budget and a step's margin.
    answered = sorted(t for kind, t in results if kind == "answered")
    refused = [t for kind, t in results if kind in ("refused", "over_budget")]
    assert len(answered) >= 8 and max(refused) < answered[len(answered) // 2], results
    assert max(t for _, t in results) < budget + max(refused) + 2, results


@pytest.fixture(scope="module")
def batched_gec(smollm2):
    from specsuite.apps.gec.corrector import Corrector
    from specsuite.apps.gec.ui import build_app

    corrector = Corrector.from_loaded(*smollm2, max_new_tokens=24)
    app = build_app(corrector, time_budget_s=60, batch_size=8, warm_up=True)
    url = _launch(app)
    yield corrector, url
    app.close()


def test_gec_app_corrects_concurrent_users_in_one_batch(batched_gec):
    from gradio_client import Client

    from specsuite.apps.gec.corrector import demo_sentences

    _, url = batched_gec
    sentences = demo_sentences()[:8]
    clients = [Client(url, verbose=False) for _ in sentences]
    with ThreadPoolExecutor(len(sentences)) as pool:
        results = list(pool.map(lambda i: clients[i].predict(sentences[i], api_name="/correct"), range(len(sentences))))
    assert [r["source"] for r in results] == sentences and all(r["correction"] for r in results)
    assert all(r["stats"]["estimated_speedup"] is None for r in results)  # shared forwards: no per-call estimate
    with pytest.raises(Exception, match="the text is too long: 200,000 characters"):
        clients[0].predict(ONE_LETTER, api_name="/correct")
