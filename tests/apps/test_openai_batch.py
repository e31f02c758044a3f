"""Batch jobs over OpenAI Batch files: one output line per request keyed by custom_id, in order,
errors in place, resumable after kill -9; driven by the rule-based corrector of test_jobs.py, and
by the real apps."""

import json
from pathlib import Path

import pytest

from specsuite.apps.jobs.runner import input_format, run_batch
from conftest import REPO
from test_jobs import FakeCorrector, fake_job, fix, kill_9_after, read_jsonl

DEMO_CORPUS = REPO / "demos" / "corpus"


def request(custom_id: str, text: str, model: str = "specsuite-gec", **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": model, "messages": [{"role": "system", "content": "be nice"},
                                                             {"role": "user", "content": text}], **body}})


# line number (1-based) -> (the bad line, its status, a word of its message)
MALFORMED = {
    7: ("{not json", 400, "JSON"),
    19: (json.dumps({"custom_id": "r19", "method": "POST", "url": "/v1/embeddings", "body": {}}), 400, "only POST"),
    33: (request("r33", "   "), 400, "empty"),
    48: (json.dumps({"custom_id": "r48", "method": "POST", "url": "/v1/chat/completions",
                     "body": {"model": "specsuite-gec", "messages": "hi"}}), 400, "messages"),
    61: (request("r61", "stream me", stream=True), 400, "stream"),
    77: (request("r77", "BOOM goes the model"), 500, "model exploded"),
    90: (request("r90", " ".join(["word"] * 50)), 400, "too long"),
}


def batch_file(path: Path, n: int = 100) -> tuple[Path, list[str]]:
    """`n` requests, the MALFORMED ones among them; the texts of the good ones by line."""
    lines, texts = [], []
    for i in range(1, n + 1):
        if i in MALFORMED:
            lines.append(MALFORMED[i][0])
            texts.append(None)
        else:
            texts.append(f"sentence {i} is here.")
            lines.append(request(f"r{i}", texts[-1], max_tokens=64))
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path, texts


def check_output(out: Path, texts: list) -> None:
    records = read_jsonl(out)
    assert len(records) == len(texts)
    for i, (record, text) in enumerate(zip(records, texts), 1):
        assert set(record) == {"id", "custom_id", "response", "error"}
        if text is None:
            _, status, word = MALFORMED[i]
            assert record["response"]["status_code"] == status and word in record["error"]["message"]
            assert record["response"]["body"]["error"]["message"] == record["error"]["message"]
            assert record["custom_id"] == (None if i == 7 else f"r{i}")
        else:
            assert record["custom_id"] == f"r{i}" and record["error"] is None
            body = record["response"]["body"]
            assert record["response"]["status_code"] == 200 and body["object"] == "chat.completion"
            assert body["model"] == "specsuite-gec" and body["choices"][0]["message"]["content"] == fix(text)
            assert "edits" in body and "usage" in body and "speculation" in body


def test_openai_batch_input_is_detected_by_its_shape(tmp_path):
    inp, _ = batch_file(tmp_path / "in.jsonl", 3)
    assert input_format(inp) == "openai"
    (tmp_path / "plain.jsonl").write_text('{"text": "a"}\n')
    assert input_format(tmp_path / "plain.jsonl") == "jsonl"
    with pytest.raises(ValueError, match="jsonl"):
        run_batch(inp, tmp_path / "out.txt", FakeCorrector.worker, progress=False)


def test_a_hundred_mixed_requests_give_a_hundred_lines_keyed_by_custom_id(tmp_path):
    inp, texts = batch_file(tmp_path / "in.jsonl")
    summary = run_batch(inp, tmp_path / "out.jsonl", FakeCorrector.worker, progress=False)
    assert (summary.total, summary.ok, summary.errors) == (100, 100 - len(MALFORMED), len(MALFORMED))
    check_output(tmp_path / "out.jsonl", texts)
    again = run_batch(inp, tmp_path / "out.jsonl", FakeCorrector.worker, progress=False)
    assert again.skipped_resumed == 100 and again.errors == len(MALFORMED)


def test_openai_batch_resumes_after_kill_9(tmp_path):
    inp, texts = batch_file(tmp_path / "in.jsonl")
    out = tmp_path / "out.jsonl"
    kill_9_after(fake_job(inp, out), out, lines=10, within_s=60)
    written = out.read_bytes().count(b"\n")
    assert 10 <= written < 100
    summary = run_batch(inp, out, FakeCorrector.worker, progress=False)
    assert summary.skipped_resumed == written and summary.ok + summary.errors == 100
    check_output(out, texts)


def test_gec_correct_and_rag_answer_on_openai_batch_files(smollm2_fp32, tmp_path, monkeypatch):
    """The real apps: `specsuite gec correct` writes what Corrector.correct returns as each body's
    content; RagQA's job answers with citations and passages, as the server does."""
    from specsuite.apps.gec import cli as gec_cli
    from specsuite.apps.gec.corrector import Corrector
    from specsuite.apps.rag.qa import RagQA
    from specsuite.cli import main
    from specsuite.retrieval import Embedder, PassageIndex, load_documents

    texts = ["She go to school yesterday.", "He have two cat."]
    inp = tmp_path / "gec.jsonl"
    inp.write_text("".join(request(f"g{i}", t) + "\n" for i, t in enumerate(texts)) + request("bad", "") + "\n")
    model, tok = smollm2_fp32
    monkeypatch.setattr(gec_cli, "_corrector", lambda args: Corrector.from_loaded(model, tok, batch_size=2))
    assert main(["gec", "correct", str(inp), "-o", str(tmp_path / "gec.out.jsonl")]) == 1  # 1: a line failed
    records = read_jsonl(tmp_path / "gec.out.jsonl")
    exact = Corrector.from_loaded(model, tok)
    assert [r["response"]["body"]["choices"][0]["message"]["content"] for r in records[:2]] == \
        [exact.correct(t).text for t in texts]
    assert records[2]["custom_id"] == "bad" and records[2]["response"]["status_code"] == 400

    index = PassageIndex.build(load_documents([DEMO_CORPUS]), Embedder("minilm-l6"))
    questions = tmp_path / "rag.jsonl"
    questions.write_text(request("q1", "Who commanded Apollo 11?", model="specsuite-rag") + "\n")
    qa = RagQA.from_loaded(model, tok, index, max_new_tokens=24)
    run_batch(questions, tmp_path / "rag.out.jsonl", lambda: qa.job_worker(k=2, batch_size=2), progress=False)
    [record] = read_jsonl(tmp_path / "rag.out.jsonl")
    body = record["response"]["body"]
    expected = qa.ask("Who commanded Apollo 11?", 2)
    assert body["choices"][0]["message"]["content"] == expected.text and body["citations"] == expected.citations
    assert len(body["passages"]) == 2 and body["model"] == "specsuite-rag"
