"""Bad and oversized input, and the time budget, on the running apps: the RAG and GEC web apps are
launched in-process on the small model and called with gradio_client, as a program would."""

from __future__ import annotations

import os
import threading
import time

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # before gradio is imported

import pytest
from conftest import REPO, free_port

from specsuite.apps.limits import Deadline, InputError, TimeBudgetExceeded, check_k, check_text
from specsuite.core.model.backend import choose_backend

DEMO_CORPUS = REPO / "demos" / "corpus"
QUESTION = "Who was the commander of Apollo 11?"
SENTENCE = "She go to school yesterday ."
HUGE = ("All work and no play makes Jack a dull boy. " * 5000)[:200_000]  # 200,000 characters
REFUSAL_S = 5.0  # a bad call is refused within this, whatever else the app is doing

# (arguments, what the error message says): each must be refused before any model work.
BAD_QUESTIONS = [
    (("", 3), "the question is empty"),
    (("   \n\t ", 3), "the question is only whitespace"),
    ((HUGE, 3), "the question is too long: 200,000 characters; the limit is"),
    ((123, 3), "the question must be a string, got int"),
    ((None, 3), "the question must be a string, got NoneType"),
    ((["Who?"], 3), "the question must be a string, got list"),
    ((QUESTION, "three"), r"k \(passages to retrieve\) must be a whole number from 1 to 50, got 'three'"),
    ((QUESTION, 2.5), "must be a whole number from 1 to 50, got 2.5"),
    ((QUESTION, 0), "must be from 1 to 50, got 0"),
    ((QUESTION, 10**6), "must be from 1 to 50, got 1,000,000"),
]
BAD_TEXTS = [
    ("", "the text is empty"),
    ("  \n\n ", "the text is only whitespace"),
    (HUGE, "the text is too long: 200,000 characters; the limit is 1,024 tokens"),
    (123, "the text must be a string, got int"),
    (None, "the text must be a string, got NoneType"),
    ({"text": SENTENCE}, "the text must be a string, got dict"),
]


# ---- the checks themselves (no model) ---------------------------------------------------------

def test_text_checks_count_tokens_only_within_a_character_bound():
    counted = []

    def count(text: str) -> int:
        counted.append(len(text))
        return len(text.split())

    assert check_text("two words", "text", count, 2) == "two words"
    with pytest.raises(InputError, match="3 tokens; the limit is 2 tokens"):
        check_text("three words here", "text", count, 2)
    with pytest.raises(InputError, match="200,000 characters; the limit is 2 tokens"):
        check_text(HUGE, "text", count, 2)
    assert max(counted) < 100  # the huge text was refused without being tokenized


def test_k_must_be_a_whole_number_in_range():
    assert check_k(1) == 1 and check_k(50) == 50 and check_k(3.0) == 3  # a UI slider sends floats
    for bad in (0, 51, -1, True, 2.5, float("nan"), "3", None):
        with pytest.raises(InputError, match="k"):
            check_k(bad)


def test_deadline_bounds_the_wait_for_a_busy_model():
    lock = threading.Lock()
    lock.acquire()  # another request is generating
    start = time.monotonic()
    with pytest.raises(TimeBudgetExceeded, match="busy with other requests for the whole time budget of 0.2 s"):
        Deadline(0.2).acquire(lock)
    assert time.monotonic() - start < 2
    deadline = Deadline(0.01)
    time.sleep(0.02)
    with pytest.raises(TimeBudgetExceeded, match="time budget of 0.01 s"):
        deadline.on_step()([1], [False])
    Deadline(None).check()  # no budget, no limit


@pytest.mark.parametrize("question, k, message", [
    ("", "3", "error: the question is empty"),
    (" \t", "3", "error: the question is only whitespace"),
    ("Who?", "51", "error: k (passages to retrieve) must be from 1 to 50, got 51"),
])
def test_cli_ask_refuses_bad_input_before_loading_anything(tmp_path, capsys, question, k, message):
    from specsuite.cli import main

    start = time.monotonic()
    assert main(["rag", "ask", str(tmp_path / "no-index"), question, "-k", k]) == 1
    assert message in capsys.readouterr().err and time.monotonic() - start < REFUSAL_S


@pytest.mark.parametrize("argv", [["gec", "ui", "--time-budget", "-1"], ["gec", "ui", "--max-input-tokens", "0"],
                                  ["rag", "ui", "idx", "--time-budget", "soon"]])
def test_cli_refuses_bad_limits(argv, capsys):
    from specsuite.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and "expected" in capsys.readouterr().err


@pytest.mark.real_model
def test_closing_a_stream_ends_its_generation(smollm2):
    """A consumer that leaves early (time budget, client gone) frees the model at the next step."""
    import functools

    from specsuite.core import generate, stream
    from specsuite.core.scheduler.chat import chat_prompt_ids
    from specsuite.core.scheduler.streaming import StreamClosed

    model, tok = smollm2
    ended = threading.Event()

    def run(on_step):
        try:
            return generate(model, chat_prompt_ids(tok, "Count from one to one hundred."), None,
                            max_new_tokens=200, on_step=on_step)
        except StreamClosed:
            ended.set()
            raise

    items = stream(functools.partial(run), tok)
    next(items)
    items.close()
    assert ended.wait(timeout=30)


# ---- the running apps --------------------------------------------------------------------------

def _launch(app) -> str:
    port = free_port()
    app.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    return f"http://127.0.0.1:{port}/"


@pytest.fixture(scope="module")
def rag_qa(smollm2):
    from specsuite.apps.rag.qa import RagQA
    from specsuite.retrieval import Embedder, PassageIndex, load_documents

    index = PassageIndex.build(load_documents([DEMO_CORPUS]), Embedder("minilm-l6"))
    # No prefix cache: every call prefills its passages, so a call with many of them is slow; every
    # one of the k passages asked for goes into the prompt (min_relevance 0), however off-topic.
    return RagQA.from_loaded(*smollm2, index, max_new_tokens=16, prefix_cache_bytes=0, min_relevance=0)


@pytest.fixture(scope="module")
def rag(rag_qa):
    """A client of the RAG app, and one of an app over the same RagQA with a tiny time budget."""
    from gradio_client import Client

    from specsuite.apps.rag.ui import build_app

    apps = [build_app(rag_qa, k=3), build_app(rag_qa, k=3, time_budget_s=0.05)]
    clients = [Client(_launch(app), verbose=False) for app in apps]
    yield clients
    for app in apps:
        app.close()


@pytest.fixture(scope="module")
def gec(smollm2):
    from gradio_client import Client

    from specsuite.apps.gec.corrector import Corrector
    from specsuite.apps.gec.ui import build_app

    corrector = Corrector.from_loaded(*smollm2)  # the default budget: a correction may be as long as its text
    apps = [build_app(corrector), build_app(corrector, time_budget_s=0.05)]
    clients = [Client(_launch(app.queue()), verbose=False) for app in apps]
    yield clients
    for app in apps:
        app.close()


def _refused(client, args: tuple, message: str, api_name: str) -> float:
    """Seconds until the call was refused with `message`."""
    from gradio_client.exceptions import AppError

    start = time.monotonic()
    with pytest.raises(AppError, match=message):
        client.predict(*args, api_name=api_name)
    return time.monotonic() - start


@pytest.mark.real_model
@pytest.mark.parametrize("args, message", BAD_QUESTIONS, ids=[m[:30] for _, m in BAD_QUESTIONS])
def test_rag_ask_refuses_bad_input_at_once(rag, args, message):
    client, _ = rag
    assert _refused(client, args, message, "/ask") < REFUSAL_S


@pytest.mark.real_model
def test_rag_answers_right_after_bad_calls(rag):
    client, _ = rag
    _refused(client, ("", 3), "empty", "/ask")
    result = client.predict(QUESTION, 3, api_name="/ask")
    assert result["answer"] and result["stats"]["new_tokens"] > 0 and len(result["passages"]) == 3


@pytest.mark.real_model
def test_rag_question_and_passages_must_fit_the_context(smollm2, rag_qa):
    from specsuite.apps.rag.qa import RagQA

    qa = RagQA.from_loaded(*smollm2, rag_qa.index, max_new_tokens=8000, prefix_cache_bytes=0, min_relevance=0)
    assert qa.max_question_tokens == qa.context - 8000  # the default: the context less the answer budget
    with pytest.raises(InputError, match="3 passages take .* tokens; with the answer budget of 8,000 tokens"):
        qa.ask(QUESTION, 3)
    with pytest.raises(InputError, match="limit is 192 tokens"):
        qa.ask("Apollo " * 300, 3)


@pytest.mark.real_model
def test_rag_refuses_while_a_long_call_runs_and_answers_both(rag):
    """Nothing waits behind a bad call, and a bad call waits behind nothing."""
    from gradio_client.utils import Status

    client, _ = rag
    # 20 passages: a prefill of thousands of tokens, seconds even on a fast CPU.
    slow = client.submit("Tell me about the plate tectonics and the water cycle.", 20, api_name="/ask")
    while slow.status().code != Status.PROCESSING:  # taken from the queue, generating
        time.sleep(0.05)
    assert _refused(client, (HUGE, 3), "too long", "/ask") < REFUSAL_S
    assert _refused(client, ("  ", 3), "only whitespace", "/ask") < REFUSAL_S
    assert not slow.done(), "the refusals came after the running call, not beside it"
    result = client.predict(QUESTION, 3, api_name="/ask")  # waits for the model's turn, then answers
    assert result["answer"] and len(slow.result(timeout=300)["passages"]) == 20


@pytest.mark.real_model
def test_rag_time_budget_ends_the_call_and_frees_the_model(rag):
    client, tight = rag
    start = time.monotonic()
    _refused(tight, (QUESTION, 3), "time budget of 0.05 s", "/ask")
    assert time.monotonic() - start < 30
    assert client.predict(QUESTION, 3, api_name="/ask")["answer"]  # the stopped call left the model free


@pytest.mark.real_model
@pytest.mark.parametrize("text, message", BAD_TEXTS, ids=[m[:30] for _, m in BAD_TEXTS])
def test_gec_correct_refuses_bad_input_at_once(gec, text, message):
    client, _ = gec
    assert _refused(client, (text,), message, "/correct") < REFUSAL_S


@pytest.mark.real_model
def test_gec_correct_endpoint_answers_right_after_bad_calls(gec):
    client, _ = gec
    _refused(client, (HUGE,), "limit is 1,024 tokens", "/correct")
    result = client.predict(SENTENCE, api_name="/correct")
    assert result["source"] == SENTENCE and result["correction"] and isinstance(result["truncated"], bool)
    assert result["stats"]["new_tokens"] > 0 and all("kind" in e for e in result["edits"])


@pytest.mark.real_model
def test_gec_refuses_while_a_long_call_runs(gec):
    from gradio_client.utils import Status

    client, _ = gec
    # Two lines of four sentences: two segments of ~50 tokens, corrected one after the other.
    long_text = "\n".join([" ".join([SENTENCE, "We was late and he dont care ."] * 2)] * 2)
    slow = client.submit(long_text, api_name="/correct")
    while slow.status().code != Status.PROCESSING:
        time.sleep(0.05)
    assert _refused(client, (HUGE,), "too long", "/correct") < REFUSAL_S
    assert not slow.done(), "the refusal came after the running call, not beside it"
    assert slow.result(timeout=300)["correction"] and client.predict(SENTENCE, api_name="/correct")["correction"]


@pytest.mark.real_model
def test_gec_time_budget_ends_the_call_and_frees_the_model(gec):
    client, tight = gec
    _refused(tight, (" ".join([SENTENCE] * 6),), "time budget of 0.05 s", "/correct")
    assert client.predict(SENTENCE, api_name="/correct")["correction"]


def test_callers_at_once_wait_for_one_step_cost_measurement(smollm2_fp32, monkeypatch):
    """A server's first burst asks for the step cost from many threads: one engine measures it."""
    from concurrent.futures import ThreadPoolExecutor

    from specsuite.apps import limits
    from specsuite.core.scheduler import engine

    made = []

    class Counted(engine.BatchEngine):
        def __init__(self, *args, **kwargs):
            made.append(1)
            time.sleep(0.2)  # the others arrive while it measures
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(engine, "BatchEngine", Counted)
    limits._step_cost.cache_clear()
    with ThreadPoolExecutor(8) as pool:
        backend = choose_backend(smollm2_fp32[0])
        costs = list(pool.map(lambda _: limits.step_cost(smollm2_fp32[0], backend), range(8)))
    limits._step_cost.cache_clear()
    assert len(made) == 1 and costs[0] is not None and all(c is costs[0] for c in costs)
