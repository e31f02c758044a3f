"""The RAG app: reference drafting (lossless against HF greedy), the prefix KV cache, RagQA over
a small index, citations and copied spans, the bench task and the CLI.

Model tests use the smollm2-135m preset and short answers; exactness tests run it in fp32
(`smollm2_fp32`, see conftest)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from specsuite.bench.rag_task import prefix_cache_ttft, rag_example_parts
from specsuite.apps.rag.drafter import ReferenceDrafter
from specsuite.apps.rag.prompt import rag_prompt_ids, rag_user_message
from specsuite.apps.rag.evaluate import contains_reference, evaluate_rag, references
from specsuite.apps.rag.qa import Answer, RagQA, copied_spans, find_claims, parse_citations
from specsuite.core.model.backend import choose_backend
from specsuite.core.kernels.int8_linear import int8_pays, int8_runs
from specsuite.core import PrefixCache, eos_token_ids, generate
from specsuite.retrieval import PassageIndex, parse_specbench_rag
from conftest import REPO

RAG_DEV = REPO.parent / "shared/data/specbench/rag_dev.jsonl"
DEMO_CORPUS = REPO / "demos" / "corpus"


@pytest.fixture(scope="module")
def items() -> list[dict]:
    if not RAG_DEV.exists():
        pytest.skip(f"no Spec-Bench RAG data at {RAG_DEV}")
    with open(RAG_DEV, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def demo_index():
    from specsuite.retrieval import Embedder, load_documents

    return PassageIndex.build(load_documents([DEMO_CORPUS]), Embedder("minilm-l6"))


def run_drafter(drafter: ReferenceDrafter, prompt: list[int], output: list[int], max_depth: int = 16) -> list:
    """Drive `drafter` as the decoding loop would, with the target writing `output`; returns the drafts."""
    drafter.reset(prompt)
    tokens, drafts = list(prompt), []
    while len(tokens) < len(prompt) + len(output):
        draft = drafter.propose(tokens, max_depth)
        drafts.append(draft)
        want = output[len(tokens) - len(prompt):]
        path, node = [], -1
        while draft is not None:  # walk the tree along the target's tokens
            child = next((i for i, (t, p) in enumerate(zip(draft.tokens, draft.parents))
                          if p == node and len(path) < len(want) and t == want[len(path)]), None)
            if child is None:
                break
            path.append(child)
            node = child
        drafter.update(draft, path)
        tokens += want[: len(path) + 1]
    return drafts


# ---- the drafter, without a model ---------------------------------------------------------

def test_drafts_the_passage_continuation_of_the_longest_suffix():
    drafter = ReferenceDrafter([[1, 2, 3, 4, 5, 6, 7, 8]], branches=1)
    drafter.reset([90, 91])
    draft = drafter.propose([90, 91, 2, 3], 16)
    assert draft.is_chain and draft.tokens[:5] == [4, 5, 6, 7, 8]


def test_no_match_proposes_nothing():
    drafter = ReferenceDrafter([[1, 2, 3]])
    drafter.reset([90, 91])
    assert drafter.propose([90, 91, 50], 16) is None


def test_the_prompt_is_a_reference_too():
    drafter = ReferenceDrafter([])
    drafter.reset([10, 11, 12, 13, 14, 15])
    assert drafter.propose([10, 11, 12, 13, 14, 15, 12], 16).tokens[:3] == [13, 14, 15]


def test_follows_the_passage_it_copies_from():
    # Both passages hold "5 6 7 8"; the answer copies passage 2, so after it comes 30, not 20.
    p1, p2 = [5, 6, 7, 8, 20, 21], [1, 5, 6, 7, 8, 30]
    drafts = run_drafter(ReferenceDrafter([p1, p2], branches=1), [99], [1, 5, 6, 7, 8, 30], max_depth=3)
    assert [d and d.tokens for d in drafts] == [None, [5, 6, 7], [30]]


def test_distinct_continuations_form_a_bounded_tree():
    refs = [[7, 8, 10 + i, 11 + i, 12 + i, 13 + i, 14 + i, 15 + i, 16 + i] for i in range(0, 50, 10)]
    drafter = ReferenceDrafter(refs, branches=3, max_nodes=12)
    drafter.reset([99])
    draft = drafter.propose([99, 7, 8], 16)
    assert not draft.is_chain and len(draft) <= 12
    assert sorted(t for t, p in zip(draft.tokens, draft.parents) if p == -1) == [10, 20, 30]


def test_drafts_stay_short_when_nothing_is_accepted():
    refs = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
    drafter = ReferenceDrafter(refs, branches=1)
    drafts = run_drafter(drafter, [99], [1, 50, 2, 51, 3, 52, 4, 53, 5, 54, 6, 55])
    assert all(d is None or len(d) <= 3 for d in drafts[4:])


# ---- prompt, citations, copied spans ------------------------------------------------------

def test_passages_come_first_and_the_question_last():
    a, b = rag_user_message("First?", ["one\ntwo", "three"]), rag_user_message("Second?", ["one\ntwo", "three"])
    assert a.index("[1] one two") < a.index("[2] three") < a.index("First?")
    prefix = len(a) - len("First?")
    assert a[:prefix] == b[:prefix]


def test_parse_citations():
    assert parse_citations("As [2] says, and [1, 3]; also [2] and [9].", 3) == [2, 1, 3]
    assert parse_citations("no citations", 3) == []


def test_copied_spans_find_verbatim_runs():
    passages = ["The lunar module, called Eagle, touched down in the Sea of Tranquility.", "Bees make honey."]
    text = "It says the lunar module called Eagle touched down [1]. Bees make honey too."
    claims = copied_spans(text, passages)
    assert [(text[c.start:c.end], c.passage, c.how) for c in claims] == [
        ("the lunar module called Eagle touched down", 1, "copied")]
    c = claims[0]
    assert passages[0][c.passage_start:c.passage_end] == "The lunar module, called Eagle, touched down"


PASSAGES = ["Apollo 11 landed on the Moon in 1969. The lunar module Eagle touched down in the Sea of Tranquility.",
            "Neil Armstrong was the commander. Buzz Aldrin piloted the lunar module."]


def test_claims_merge_copies_with_the_models_citations():
    text = ("The lunar module Eagle touched down in the Sea of Tranquility. Armstrong commanded the mission [2].\n"
            "It landed in 1969 [1][3]. Buzz Aldrin piloted the lunar module [2].")
    claims = find_claims(text, PASSAGES)
    got = [(text[c.start:c.end], c.passage, PASSAGES[c.passage - 1][c.passage_start:c.passage_end], c.how)
           for c in claims]
    assert got == [
        # copied without any [n]: cited all the same, with the passage range it copies
        ("The lunar module Eagle touched down in the Sea of Tranquility", 1,
         "The lunar module Eagle touched down in the Sea of Tranquility", "copied"),
        # [n] on a sentence that copies nothing: the passage sentence sharing the most words
        ("Armstrong commanded the mission [2].", 2, "Neil Armstrong was the commander.", "cited"),
        ("It landed in 1969 [1][3].", 1, "Apollo 11 landed on the Moon in 1969.", "cited"),  # [3]: no such passage
        # copied and cited as [2]: one claim, the copied one
        ("Buzz Aldrin piloted the lunar module", 2, "Buzz Aldrin piloted the lunar module", "copied"),
    ]
    answer = Answer(text, [(p, None) for p in PASSAGES], claims, {})
    assert answer.citations == [1, 2] and len(answer.spans) == 2
    assert json.loads(json.dumps(answer.to_json()))["claims"][1] == {
        "start": claims[1].start, "end": claims[1].end, "passage": 2, "passage_start": 0, "passage_end": 33,
        "how": "cited"}


def test_reference_contained_ignores_case_punctuation_and_spacing():
    item = {"reference": [["914 mbar ( hPa )", "W. Edwards Deming"]]}
    assert references(item) == ["914 mbar ( hPa )", "W. Edwards Deming"]
    assert contains_reference("The pressure was 914 mbar (hPa) [2].", references(item))
    assert contains_reference("It was w edwards deming.", references(item))
    assert not contains_reference("It was 9140 mbar hPa, said Edwards.", references(item))


# ---- with the model -----------------------------------------------------------------------

def test_reference_drafter_equals_hf_greedy(smollm2_fp32, items):
    model, tok = smollm2_fp32
    eos = sorted(eos_token_ids(model, tok))
    accepted = 0
    for item in items[:4]:  # fp32 on a CPU: a few answers keep the test under a minute
        ids, drafters = rag_example_parts(tok, item)
        hf = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=48, eos_token_id=eos,
                            pad_token_id=eos[0])[0, len(ids):].tolist()
        g = generate(model, ids, drafters["reference"](), max_new_tokens=48, eos_token_id=eos)
        assert g.tokens == hf, f"question {item['question_id']}: {tok.decode(g.tokens)!r} != {tok.decode(hf)!r}"
        accepted += sum(g.stats.accepted)
    assert accepted > 0  # the drafts were used, not only verified away


def test_prefix_cache_is_on_by_default_only_in_fp32(smollm2_fp32):
    """Lossless by default: the cache is on in fp32 and off in bf16, where a cached prompt's rows
    can round otherwise than a whole prefill; an explicit budget turns it on anyway."""
    model, tok = smollm2_fp32
    assert RagQA.from_loaded(model, tok).prefix_cache.max_bytes == 1 << 30
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    exact = choose_backend(bf16, "exact")
    assert RagQA.from_loaded(bf16, tok, backend=exact).prefix_cache is None
    assert RagQA.from_loaded(bf16, tok, prefix_cache_bytes=1 << 20, backend=exact).prefix_cache.max_bytes == 1 << 20


def test_prefix_cache_is_lossless_for_repeated_and_follow_up_questions(smollm2_fp32, items):
    model, tok = smollm2_fp32
    passages, question = parse_specbench_rag(items[0])
    follow_up = "What is a forest?"
    cached = RagQA.from_loaded(model, tok, max_new_tokens=16)
    plain = RagQA.from_loaded(model, tok, max_new_tokens=16, prefix_cache_bytes=0)
    assert plain.prefix_cache is None
    first, again, follow = (cached.answer(q, passages) for q in (question, question, follow_up))
    assert first.stats["cached_prompt_tokens"] == 0  # nothing cached yet: `first` is the plain answer
    assert again.stats["cached_prompt_tokens"] > 0 and follow.stats["cached_prompt_tokens"] > 0
    assert again.text == first.text
    reference = plain.answer(follow_up, passages)
    assert reference.stats["cached_prompt_tokens"] == 0 and follow.text == reference.text
    # The follow-up reused everything up to its question.
    prompt = rag_prompt_ids(tok, follow_up, passages)
    assert follow.stats["cached_prompt_tokens"] >= len(prompt) - len(tok(follow_up)["input_ids"]) - 12


def test_prefix_cache_lru_byte_bound_and_off(smollm2):
    model, _ = smollm2
    prompts = [[100 + i] + list(range(1000, 1040)) + [2000 + i] * 8 for i in range(3)]
    probe = PrefixCache(model.config)
    generate(model, prompts[0], max_new_tokens=1, eos_token_id=0, prefix_cache=probe)
    size = probe.bytes
    assert size > 0
    cache = PrefixCache(model.config, max_bytes=int(size * 2.5))
    for p in prompts:
        generate(model, p, max_new_tokens=1, eos_token_id=0, prefix_cache=cache)
        assert cache.bytes <= cache.max_bytes
    assert [key[0] for key in cache.entries] == [101, 102]  # the oldest was evicted
    off = PrefixCache(model.config, max_bytes=0)
    for _ in range(2):
        g = generate(model, prompts[0], max_new_tokens=1, eos_token_id=0, prefix_cache=off)
    assert g.stats.cached_prompt_tokens == 0 and not off.entries and off.bytes == 0


def test_rag_qa_over_a_demo_index(smollm2, demo_index):
    model, tok = smollm2
    qa = RagQA.from_loaded(model, tok, demo_index, max_new_tokens=24)
    answer = qa.ask("Who was the commander of Apollo 11?", k=3)
    assert isinstance(answer, Answer) and answer.text
    assert answer.passages[0][0].doc_id.endswith("apollo-11.md")
    every = RagQA.from_loaded(model, tok, demo_index, min_relevance=0).retrieve("Who was the commander of Apollo 11?", 3)
    # the off-topic ones (under half the best score) are left out of the prompt
    assert len(every) == 3 and answer.passages == [(p, s) for p, s in every if s >= 0.5 * every[0][1]] != every
    assert all(isinstance(score, float) for _, score in answer.passages)
    assert answer.stats["new_tokens"] > 0 and "retrieval_s" in answer.stats
    for c in answer.claims:  # every claim slices the answer and its passage
        body = answer.passages[c.passage - 1][0].text
        assert 0 <= c.start < c.end <= len(answer.text) and 0 <= c.passage_start < c.passage_end <= len(body)
        if c.how == "copied":
            assert answer.text[c.start:c.end].lower().split() == body[c.passage_start:c.passage_end].lower().split()
    assert answer.citations == list(dict.fromkeys(c.passage for c in answer.claims))
    pieces = list(qa.stream_ask("Who was the commander of Apollo 11?", k=3))
    assert isinstance(pieces[-1], Answer) and pieces[-1].text == answer.text
    assert "".join(p.text for p in pieces[:-1]).strip() == answer.text
    json.dumps(answer.to_json())  # serializable as is


def test_answer_with_given_passages(smollm2):
    model, tok = smollm2
    qa = RagQA.from_loaded(model, tok, drafter="none", max_new_tokens=8)
    answer = qa.answer("What colour is the sky?", ["The sky is blue on a clear day."])
    assert answer.passages == [("The sky is blue on a clear day.", None)] and answer.text
    with pytest.raises(ValueError, match="no passage index"):
        qa.ask("anything")


def test_prefix_cache_ttft_report(smollm2_fp32, items):
    model, tok = smollm2_fp32
    report = prefix_cache_ttft(model, tok, items, n=1, max_new_tokens=4)
    assert report["n"] == 1 and report["identical"] == 1.0
    assert 0 < report["cached_prompt_tokens"] < report["prompt_tokens"]
    assert report["ttft_followup_s"] > 0 and report["followup_vs_first"] > 0


def test_cli_ask(smollm2, demo_index, tmp_path, monkeypatch, capsys):
    from specsuite.apps.rag import qa as qa_module
    from specsuite.cli import main

    demo_index.save(tmp_path / "idx")
    model, tok = smollm2

    def loaded_rag_qa(index_dir: str, model: str, adapter: str, dtype: str | None, **options) -> RagQA:  # the fixture, not a fresh load
        assert adapter == "auto"
        return RagQA.from_loaded(smollm2[0], tok, PassageIndex.load(index_dir), **options)

    monkeypatch.setattr(qa_module, "RagQA", loaded_rag_qa)
    assert main(["rag", "ask", str(tmp_path / "idx"), "Who built the Great Wall?", "-k", "2",
                 "--max-new-tokens", "8", "--min-relevance", "0"]) == 0  # 0: both passages, however off-topic
    out = capsys.readouterr().out
    assert "Sources:" in out and "[2] score" in out and "Stats:" in out
    assert main(["rag", "ask", str(tmp_path / "missing"), "q"]) == 1


@pytest.mark.skipif(not (int8_pays() and int8_runs()), reason="oneDNN's int8 kernel is slow or inexact on this CPU")
def test_cli_ask_int8_answers_on_the_int8_backend(smollm2, demo_index, tmp_path, monkeypatch, capsys):
    from specsuite.apps.rag import qa as qa_module
    from specsuite.cli import main

    demo_index.save(tmp_path / "idx")
    made = []

    def loaded_rag_qa(index_dir: str, model: str, adapter: str, dtype: str | None, **options) -> RagQA:  # the fixture, not a fresh load
        assert adapter == "auto"
        made.append(RagQA.from_loaded(smollm2[0], smollm2[1], PassageIndex.load(index_dir), **options))
        return made[-1]

    monkeypatch.setattr(qa_module, "RagQA", loaded_rag_qa)
    assert main(["rag", "ask", str(tmp_path / "idx"), "Who built the Great Wall?", "--int8", "--max-new-tokens", "8"]) == 0
    assert [qa.backend.name for qa in made] == ["int8"] and "Sources:" in capsys.readouterr().out


def test_prefix_cache_hit_without_a_draft(smollm2):
    # Plain decoding (no drafter) over a cached prefix: the prefill has no draft rows. The cache is
    # asked for: by default it is on only where it is lossless (fp32), and this test runs in either dtype.
    qa = RagQA.from_loaded(*smollm2, drafter="none", max_new_tokens=2, prefix_cache_bytes=1 << 26)
    passages = ["The sky looks blue because air scatters blue light more than red light. " * 3]
    qa.answer("Why is the sky blue?", passages)
    assert qa.answer("Why is the sky blue?", passages).stats["cached_prompt_tokens"] > 0


QUESTIONS = ["Who built the Great Wall?", "What do honeybees make?", "Who commanded Apollo 11?",
             "Where is the Great Wall?"]


@pytest.mark.real_model
def test_answer_each_decodes_questions_together_as_one_at_a_time(smollm2_fp32, demo_index):
    """In fp32 the batched answers equal the one-at-a-time (exact) answers, in order; a bad
    question gives its error in its place and the others go on."""
    qa = RagQA.from_loaded(*smollm2_fp32, demo_index, max_new_tokens=16, prefix_cache_bytes=0)
    alone = [qa.ask(q, 2).text for q in QUESTIONS]
    out = list(qa.answer_each([QUESTIONS[0], "  ", *QUESTIONS[1:]], k=2, batch_size=3))
    assert isinstance(out[1], ValueError) and "whitespace" in str(out[1])
    assert [a.text for a in out[:1] + out[2:]] == alone
    assert all(a.stats["new_tokens"] > 0 and a.passages for a in out[:1] + out[2:])


@pytest.mark.real_model
def test_concurrent_calls_join_one_batch(smollm2_fp32, demo_index):
    from concurrent.futures import ThreadPoolExecutor

    exact = RagQA.from_loaded(*smollm2_fp32, demo_index, max_new_tokens=16, prefix_cache_bytes=0)
    alone = [exact.ask(q, 2).text for q in QUESTIONS]
    served = RagQA.from_loaded(*smollm2_fp32, demo_index, max_new_tokens=16, batch_size=4)
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda q: served.ask(q, 2), QUESTIONS))
    assert [a.text for a in answers] == alone
    engine = served._batch_server().engine
    assert engine.forward_passes < sum(a.stats["forward_passes"] for a in answers)  # forwards were shared
    streamed = list(served.stream_ask(QUESTIONS[0], 2))  # streaming through the batch
    assert "".join(p.text for p in streamed[:-1]).strip() == streamed[-1].text == alone[0]


@pytest.mark.real_model
def test_cli_answer_a_file_of_questions_resumably(smollm2, demo_index, tmp_path, monkeypatch, capsys):
    from specsuite.apps.rag import qa as qa_module
    from specsuite.cli import main

    demo_index.save(tmp_path / "idx")

    def loaded_rag_qa(index_dir: str, model: str, adapter: str, dtype: str | None, **options) -> RagQA:  # the fixture, not a fresh load
        assert adapter == "auto"
        return RagQA.from_loaded(smollm2[0], smollm2[1], PassageIndex.load(index_dir), **options)

    monkeypatch.setattr(qa_module, "RagQA", loaded_rag_qa)
    inp = tmp_path / "questions.jsonl"
    rows = [{"id": "a", "question": QUESTIONS[0]}, {"id": "b", "question": ""}, {"id": "c", "question": QUESTIONS[1]}]
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n")
    out = tmp_path / "answers.jsonl"
    args = ["rag", "answer", str(inp), "-o", str(out), "--index", str(tmp_path / "idx"), "-k", "2",
            "--max-new-tokens", "8", "--batch-size", "2", "--min-relevance", "0"]
    assert main(args) == 1  # errors were recorded
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["line"] for r in records] == [1, 2, 3, 4]
    assert records[0]["id"] == "a" and records[0]["question"] == QUESTIONS[0] and records[0]["answer"]
    assert len(records[0]["passages"]) == 2 and "stats" in records[0]
    assert records[1]["id"] == "b" and "empty" in records[1]["error"]
    assert "answer" in records[2] and "malformed JSON" in records[3]["error"]
    assert "4 questions: 2 answered, 2 errors" in capsys.readouterr().out
    assert main(args) == 1 and "(4 from an earlier run)" in capsys.readouterr().out  # nothing left to do
    assert main([*args[:4], str(tmp_path / "out.txt"), *args[5:]]) == 1  # only .jsonl output


@pytest.mark.real_model
def test_eval_rag_scores_answers_and_their_citations(smollm2, items, tmp_path, capsys):
    from specsuite.cli import main

    result = evaluate_rag(RagQA.from_loaded(*smollm2, max_new_tokens=24), items[:2])
    assert result.items == 2 and len(result.rows) == 2 and result.copying_cited == result.copying
    assert result.correct == sum(row["correct"] for row in result.rows)
    assert main(["eval", "rag", "--data", str(RAG_DEV), "--n", "1", "--model", "smollm2-135m",
                 "--max-new-tokens", "16", "--out", str(tmp_path / "rows.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "1 Spec-Bench RAG items" in out and "reference contained in the answer: " in out
    row = json.loads((tmp_path / "rows.jsonl").read_text())
    assert row["references"] == references(items[0]) and isinstance(row["claims"], list)
    assert main(["eval", "rag", "--data", str(tmp_path / "missing.jsonl")]) == 2
