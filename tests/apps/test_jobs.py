"""The resumable batch job, driven by a rule-based corrector (no model), and once by the real one."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specsuite.apps.gec.corrector import Correction
from specsuite.apps.gec.edits import word_diff
from specsuite.apps.jobs.runner import JobWorker, JsonlWriter, ResumeError, run_batch


class FakeCorrector:
    """Capitalises the first letter; "BOOM" raises, "TRUNC" comes back truncated."""

    context_limit = 20

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.calls = 0

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def correct(self, text: str) -> Correction:
        self.calls += 1
        time.sleep(self.delay)
        if "BOOM" in text:
            raise RuntimeError("model exploded")
        fixed = fix(text)
        return Correction(text, fixed, word_diff(text, fixed), {"acceptance_rate": 0.75}, "TRUNC" in text)

    def process_each(self, texts):
        for text in texts:
            try:
                yield self.correct(text)
            except Exception as e:  # noqa: BLE001 - reported per text, as Corrector.correct_each does
                yield e

    @classmethod
    def worker(cls, **options) -> JobWorker:
        corrector = cls(**options)
        return JobWorker(corrector.process_each, corrector.count_tokens, corrector.context_limit)


def fix(text: str) -> str:
    return text[:1].upper() + text[1:]


def never() -> JobWorker:
    raise AssertionError("the corrector was loaded for a finished job")


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


INPUT = [f"sentence number {i} is here." for i in range(1, 121)]


def check_complete(out: Path, lines: list[str]) -> None:
    """Every input line exactly once, in order, corrected."""
    if out.suffix == ".txt":
        assert out.read_text(encoding="utf-8") == "".join(fix(s) + "\n" for s in lines)
    else:
        records = read_jsonl(out)
        assert [r["line"] for r in records] == list(range(1, len(lines) + 1))
        assert [r["source"] for r in records] == lines
        assert [r["correction"] for r in records] == [fix(s) for s in lines]


# ---- the basic job ----------------------------------------------------------------------

def test_txt_input_to_jsonl_records(tmp_path):
    inp = write_lines(tmp_path / "in.txt", ["he go home.", "TRUNC she run"])
    summary = run_batch(inp, tmp_path / "out.jsonl", FakeCorrector.worker, progress=False)
    assert summary.total == 2 and summary.ok == 2 and summary.errors == 0
    assert summary.skipped_resumed == 0 and summary.warnings == 1
    first, second = read_jsonl(tmp_path / "out.jsonl")
    assert first == {
        "line": 1, "source": "he go home.", "correction": "He go home.",
        "edits": [{"src_start": 0, "src_end": 2, "tgt_start": 0, "tgt_end": 2, "src": "he", "tgt": "He",
                   "kind": "replace"}],
        "stats": {"acceptance_rate": 0.75}, "truncated": False,
    }
    assert second["truncated"] is True


def test_jsonl_fields_pass_through(tmp_path):
    inp = tmp_path / "in.jsonl"
    write_lines(inp, [json.dumps({"id": 7, "body": "ok then.", "meta": {"tags": ["x"]}})])
    run_batch(inp, tmp_path / "out.jsonl", FakeCorrector.worker, field="body", progress=False)
    (record,) = read_jsonl(tmp_path / "out.jsonl")
    assert record["id"] == 7 and record["meta"] == {"tags": ["x"]} and "body" not in record
    assert (record["line"], record["source"], record["correction"]) == (1, "ok then.", "Ok then.")


def test_bad_lines_become_error_records_and_the_job_goes_on(tmp_path):
    inp = tmp_path / "in.jsonl"
    lines = [
        json.dumps({"text": "fine."}),
        "{not json",
        json.dumps({"other": "x", "id": 3}),
        json.dumps({"text": 42}),
        json.dumps({"text": "  "}),
        json.dumps({"text": " ".join(["w"] * 21)}),  # over context_limit = 20 tokens
        json.dumps({"text": "BOOM goes the model"}),
        json.dumps(["a", "list"]),
        "",
        json.dumps({"text": "also fine."}),
    ]
    write_lines(inp, lines)
    summary = run_batch(inp, tmp_path / "out.jsonl", FakeCorrector.worker, progress=False)
    records = read_jsonl(tmp_path / "out.jsonl")
    assert [r["line"] for r in records] == list(range(1, 11))
    errors = {r["line"]: r["error"] for r in records if "error" in r}
    assert sorted(errors) == [2, 3, 4, 5, 6, 7, 8, 9]
    assert errors[2].startswith("malformed JSON") and records[1]["input"] == "{not json"
    assert errors[3] == "missing field 'text'" and records[2]["id"] == 3
    assert errors[4] == "field 'text' is int, not a string"
    assert errors[5] == "empty text"
    assert errors[6] == "too long: 21 tokens > limit 20"
    assert errors[7] == "failed: RuntimeError: model exploded"
    assert errors[8] == "not a JSON object but list"
    assert records[9]["correction"] == "Also fine."
    assert (summary.total, summary.ok, summary.errors) == (10, 2, 8)


def test_max_tokens_overrides_the_context_limit(tmp_path):
    inp = write_lines(tmp_path / "in.txt", ["one two three", "one two"])
    summary = run_batch(inp, tmp_path / "out.jsonl", FakeCorrector.worker, progress=False, max_tokens=2)
    assert summary.errors == 1 and "too long" in read_jsonl(tmp_path / "out.jsonl")[0]["error"]


def test_txt_output_with_invalid_utf8_crlf_and_bom(tmp_path):
    inp = tmp_path / "in.txt"
    inp.write_bytes(b"\xef\xbb\xbfhello there.\r\nbad \xff byte\r\n\r\nTRUNC it\r\nlast one")
    summary = run_batch(inp, tmp_path / "out.txt", FakeCorrector.worker, progress=False)
    assert (summary.total, summary.ok, summary.errors, summary.warnings) == (5, 3, 2, 1)
    # Failed lines are written as they came, so line numbers still match.
    assert (tmp_path / "out.txt").read_bytes() == b"Hello there.\nbad \xff byte\n\nTRUNC it\nLast one\n"
    sidecar = read_jsonl(tmp_path / "out.txt.errors.jsonl")
    assert [(r["line"], r.get("error") or r.get("warning")) for r in sidecar] == [
        (2, "invalid UTF-8 at byte 4"), (3, "empty text"), (4, "truncated"),
    ]
    assert sidecar[0]["input"] == "bad \\xff byte"


def test_txt_output_keeps_one_line_per_input_line(tmp_path):
    class Multiline(FakeCorrector):
        def correct(self, text):
            return Correction(text, "two\nlines\r\nhere", [], {}, False)

    inp = write_lines(tmp_path / "in.txt", ["a", "b"])
    run_batch(inp, tmp_path / "out.txt", Multiline.worker, progress=False)
    assert (tmp_path / "out.txt").read_text() == "two lines here\ntwo lines here\n"
    assert not (tmp_path / "out.txt.errors.jsonl").exists()


def test_unknown_input_extension_needs_fmt(tmp_path):
    inp = write_lines(tmp_path / "in.data", ["x y"])
    with pytest.raises(ValueError):
        run_batch(inp, tmp_path / "out.jsonl", FakeCorrector.worker, progress=False)
    assert run_batch(inp, tmp_path / "out.jsonl", FakeCorrector.worker, fmt="txt", progress=False).ok == 1


def test_progress_bar_runs(tmp_path, capsys):
    inp = write_lines(tmp_path / "in.txt", ["a b", "c d"])
    run_batch(inp, tmp_path / "out.jsonl", FakeCorrector.worker, progress=True)
    err = capsys.readouterr().err
    assert "2/2" in err and "accept=75%" in err


# ---- resuming ---------------------------------------------------------------------------

@pytest.mark.parametrize("suffix", [".jsonl", ".txt"])
def test_resuming_a_finished_job_does_not_load_the_corrector(tmp_path, suffix):
    inp = write_lines(tmp_path / "in.txt", ["a b", "BOOM", "TRUNC x"])
    out = tmp_path / f"out{suffix}"
    first = run_batch(inp, out, FakeCorrector.worker, progress=False)
    again = run_batch(inp, out, never, progress=False)
    assert (again.total, again.ok, again.errors, again.warnings) == (first.total, first.ok, first.errors, first.warnings)
    assert again.skipped_resumed == 3 and again.errors == 1 and again.warnings == 1


@pytest.mark.parametrize("suffix", [".jsonl", ".txt"])
def test_a_job_refuses_to_resume_on_a_changed_input(tmp_path, suffix):
    inp = write_lines(tmp_path / "in.txt", ["a b", "c d", "e f"])
    out = tmp_path / f"out{suffix}"
    run_batch(inp, out, FakeCorrector.worker, progress=False)
    write_lines(inp, ["a b", "c X", "e f", "g h"])  # edited, and a line more to do
    with pytest.raises(ResumeError, match="changed since"):
        run_batch(inp, out, never, progress=False)
    write_lines(inp, ["a b", "c d", "e f", "g h"])
    with pytest.raises(ResumeError, match="changed since"):  # appended to: still another file than the one started
        run_batch(inp, out, never, progress=False)
    fresh = run_batch(inp, tmp_path / f"new{suffix}", FakeCorrector.worker, progress=False)
    assert fresh.ok + fresh.errors == 4


def kill_9_after(child: subprocess.Popen, out: Path, lines: int, within_s: float) -> None:
    """SIGKILL `child` as soon as `out` holds `lines` lines."""
    try:
        deadline = time.monotonic() + within_s
        while not (out.exists() and out.read_bytes().count(b"\n") >= lines):
            assert child.poll() is None, "the child ended before it was killed"
            assert time.monotonic() < deadline, "the child wrote nothing"
            time.sleep(0.01)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()


def fake_job(inp: Path, out: Path) -> subprocess.Popen:
    """A subprocess running the job over `inp` into `out` with the rule-based corrector, 0.05 s a line."""
    script = (
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_jobs import FakeCorrector\n"
        "from specsuite.apps.jobs.runner import run_batch\n"
        f"run_batch({str(inp)!r}, {str(out)!r}, lambda: FakeCorrector.worker(delay=0.05), progress=False)\n"
    )
    return subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("suffix", [".jsonl", ".txt"])
def test_resume_after_kill_9(tmp_path, suffix):
    inp = write_lines(tmp_path / "in.txt", INPUT)
    out = tmp_path / f"out{suffix}"
    kill_9_after(fake_job(inp, out), out, lines=10, within_s=60)
    written = out.read_bytes().count(b"\n")
    assert 10 <= written < len(INPUT)
    summary = run_batch(inp, out, FakeCorrector.worker, progress=False)
    assert summary.skipped_resumed == written and summary.ok == len(INPUT)
    check_complete(out, INPUT)


def forget_input(out: Path) -> None:
    """Make `out` a partial output of the longer input the test goes on with: drop the record of the
    shorter file it was written from (outputs without one resume unchecked, as before inputs were recorded)."""
    out.with_name(out.name + ".input.json").unlink()


@pytest.mark.parametrize("tail", [b'{"line": 4, "source": "senten', b"\x00\x00\x00\n", b'{"line": 4}\n{"li'])
def test_partial_or_garbled_last_jsonl_line_is_repaired(tmp_path, tail):
    inp = write_lines(tmp_path / "in.txt", INPUT[:6])
    out = tmp_path / "out.jsonl"
    run_batch(write_lines(tmp_path / "head.txt", INPUT[:3]), out, FakeCorrector.worker, progress=False)
    forget_input(out)
    with open(out, "ab") as f:
        f.write(tail)
    summary = run_batch(inp, out, FakeCorrector.worker, progress=False)
    if tail.startswith(b'{"line": 4}\n'):  # a complete (if odd) record 4 counts as done
        assert summary.skipped_resumed == 4
        assert [r["line"] for r in read_jsonl(out)] == [1, 2, 3, 4, 5, 6]
    else:
        assert summary.skipped_resumed == 3
        check_complete(out, INPUT[:6])


def test_partial_txt_line_and_early_sidecar_record_are_repaired(tmp_path):
    inp = write_lines(tmp_path / "in.txt", ["one.", "two.", "BOOM three.", "four."])
    out = tmp_path / "out.txt"
    run_batch(write_lines(tmp_path / "head.txt", ["one.", "two."]), out, FakeCorrector.worker, progress=False)
    forget_input(out)
    # A crash after the sidecar record of line 3 and half of its text line:
    with open(out, "ab") as f:
        f.write(b"BOOM th")
    (tmp_path / "out.txt.errors.jsonl").write_text(json.dumps({"line": 3, "error": "old"}) + "\n")
    summary = run_batch(inp, out, FakeCorrector.worker, progress=False)
    assert summary.skipped_resumed == 2 and summary.errors == 1
    assert out.read_text() == "One.\nTwo.\nBOOM three.\nFour.\n"
    (record,) = read_jsonl(tmp_path / "out.txt.errors.jsonl")
    assert record["line"] == 3 and record["error"].startswith("failed: ")


def test_foreign_or_damaged_output_is_refused(tmp_path):
    inp = write_lines(tmp_path / "in.txt", INPUT[:3])
    out = tmp_path / "out.jsonl"
    write_lines(out, [json.dumps({"line": 1}), json.dumps({"line": 3})])
    with pytest.raises(ResumeError):
        run_batch(inp, out, never, progress=False)
    write_lines(out, [json.dumps({"line": 1}), "garbage", json.dumps({"line": 3})])
    with pytest.raises(ResumeError):
        run_batch(inp, out, never, progress=False)
    write_lines(out, [json.dumps({"line": k}) for k in range(1, 5)])
    with pytest.raises(ResumeError):
        run_batch(inp, out, never, progress=False)


def test_two_runs_cannot_write_one_output(tmp_path):
    inp = write_lines(tmp_path / "in.txt", ["a b"])
    out = tmp_path / "out.jsonl"
    with JsonlWriter(out):
        with pytest.raises(RuntimeError, match="another run"):
            run_batch(inp, out, FakeCorrector.worker, progress=False)
    assert run_batch(inp, out, FakeCorrector.worker, progress=False).ok == 1


@pytest.mark.real_model
def test_resume_after_kill_9_with_a_batch_in_flight(tmp_path, smollm2_fp32):
    """The real corrector with the batched engine (8 sentences in flight): killed after its first
    records, rerun, the output equals an uninterrupted run's, every line once and in order. On the
    `auto` backend: fp32 rows with a tie guard decode alike in both processes; with the default
    `fast` (int8) a batch's near-ties may fall otherwise when the draft budget differs between
    processes (docs/exactness.md), which is not what this test is about."""
    from specsuite.apps.gec.corrector import Corrector

    lines = [f"This are sentence number {i} and it have some error ." for i in range(1, 25)]
    inp = write_lines(tmp_path / "in.txt", lines)
    out = tmp_path / "out.jsonl"
    script = (
        "from specsuite.apps.jobs.runner import run_batch\n"
        "from specsuite.apps.gec.corrector import Corrector\n"
        f"run_batch({str(inp)!r}, {str(out)!r}, lambda: Corrector('smollm2-135m', dtype='fp32', max_new_tokens=24, "
        "batch_size=8, backend='auto').job_worker(), progress=False)\n"
    )
    kill_9_after(subprocess.Popen([sys.executable, "-c", script]), out, lines=1, within_s=300)
    written = out.read_bytes().count(b"\n")
    assert 1 <= written < len(lines)
    model, tok = smollm2_fp32
    factory = lambda: Corrector.from_loaded(model, tok, max_new_tokens=24, batch_size=8, backend="auto").job_worker()  # noqa: E731
    summary = run_batch(inp, out, factory, progress=False)
    assert summary.skipped_resumed == written and summary.ok == len(lines)
    whole = tmp_path / "whole.jsonl"
    run_batch(inp, whole, factory, progress=False)
    strip = lambda r: {k: v for k, v in r.items() if k != "stats"}  # noqa: E731 - timings differ
    assert [strip(r) for r in read_jsonl(out)] == [strip(r) for r in read_jsonl(whole)]
    assert [r["line"] for r in read_jsonl(out)] == list(range(1, len(lines) + 1))
