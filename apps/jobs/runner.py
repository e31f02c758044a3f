"""The resumable job over a file of texts, one text a line, for every app (GEC corrections,
RAG answers), on one machine; `ray_jobs.py` runs the same unit of work on a Ray cluster.

An app plugs in a `JobWorker`: how it counts tokens, its longest text, and `process_each`,
which turns texts into results (each with `.text` and `.to_record()`) or exceptions, in order.

Input: `.txt` (one text per line), `.jsonl` (one JSON object per line, the text in
`field`), or an OpenAI Batch file (`.jsonl` whose first line is `{"custom_id", "method": "POST",
"url": "/v1/chat/completions", "body": {...}}`: the text is the body's last user message).
Lines are split on b"\\n" only and decoded one by one, so a bad line cannot stop the job:
invalid UTF-8, malformed JSON, a missing or non-string field, an empty text, a text over the
token limit, or a correction that raises becomes an error record naming the line, and the job
goes on.

Output, chosen by the output path's extension:

- anything but `.txt` (normally `.jsonl`): one JSON record per input line, in order,
  `{"line": N, <the input object's other fields>, <the result's record>}` (GEC: "source",
  "correction", "edits", "stats", "truncated") or `{"line": N, ..., "error": "..."}`. Our keys
  win over input fields of the same name.
- for OpenAI Batch input, OpenAI Batch output (a `.jsonl` path): one line per input line, in order,
  `{"id", "custom_id", "response": {"status_code", "body"}, "error"}`, the body the server's
  (`openai_api.completion`), or its error (400 for a bad line, 500 for a failure). The job decodes
  with the app's own settings: a body's max_tokens, temperature and stop are not applied.
- `.txt`: each result's text, one line per input line (a failed line is written as its
  source, unchanged); error and truncation records go to the JSONL sidecar
  `OUTPUT.errors.jsonl` (`{"line": N, "error": ...}` / `{"line": N, "warning": "truncated"}`).

Resuming: every record is appended, flushed and fsync'ed before the next line starts, so
after a kill at any point (kill -9 included) the output is a prefix of the finished one
plus at most one partial last line. Running again with the same arguments truncates that
partial line, checks the complete records are lines 1..k (JSONL: by their "line" numbers;
`.txt`: by count, and sidecar records past k are dropped, as they are written first), and
continues at line k + 1. The output is locked while a run writes it (POSIX flock), so two
runs cannot interleave. Nothing retries error records: delete the output to redo a job.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

try:
    import fcntl
except ImportError:  # not POSIX: run without the lock
    fcntl = None

from tqdm import tqdm

from specsuite.apps.serving import openai_api as api
from specsuite.apps.limits import InputError


@dataclass(frozen=True)
class JobWorker:
    """What a job needs of an app (`Corrector.job_worker()`, `RagQA.job_worker(...)`).

    process_each: texts (read lazily) -> for each, in order, a result with `.text` (what a `.txt`
    output writes) and `.to_record()` (the fields of its JSONL record), or the exception it raised.
    max_tokens: a longer text is an error record, never given to the model."""

    process_each: Callable[[Iterable[str]], Iterator[Any]]
    count_tokens: Callable[[str], int]
    max_tokens: int


@dataclass(frozen=True)
class BatchSummary:
    """Counts over the whole output (resumed lines included): ok + errors == total when done.

    `warnings` counts ok lines whose correction was truncated (a segment hit max_new_tokens).
    """

    total: int
    ok: int
    errors: int
    skipped_resumed: int
    warnings: int = 0
    seconds: float = 0.0  # this run's correcting time, model load excluded


class ResumeError(RuntimeError):
    """The existing output is not a prefix of this job's output: refuse to append to it."""


def run_batch(
    input_path: str | Path,
    output_path: str | Path,
    worker_factory: Callable[[], JobWorker],
    fmt: str | None = None,
    field: str = "text",
    progress: bool = True,
    max_tokens: int | None = None,
) -> BatchSummary:
    """Process every line of `input_path` into `output_path`, resuming a previous run.

    `fmt` is "txt" or "jsonl" (default: from the input's extension). A text with more than
    `max_tokens` tokens (default: the worker's `max_tokens`) is an error record: in a
    line-per-text file that is almost always a missing line break or garbage, and it would
    tie up the model for minutes. `worker_factory` (loads the model) is called only if lines are left.
    """
    input_path, output_path = Path(input_path), Path(output_path)
    fmt = input_format(input_path, fmt)
    if fmt == "openai" and output_path.suffix == ".txt":
        raise ValueError("an OpenAI Batch input gives OpenAI Batch output: write it to a .jsonl path")
    if output_path.exists() and output_path.resolve() == input_path.resolve():
        raise ValueError("the output path is the input path")
    total = count_lines(input_path)
    writer = TextWriter(output_path) if output_path.suffix == ".txt" else JsonlWriter(output_path)
    with writer:
        done = writer.resume()
        if done.lines > total:
            raise ResumeError(f"{output_path} has {done.lines} records but {input_path} only {total} lines")
        same_input(input_path, output_path, resuming=done.lines > 0)
        ok, errors, warnings = done.lines - done.errors, done.errors, done.warnings
        if done.lines == total:
            return BatchSummary(total, ok, errors, done.lines, warnings)
        worker = worker_factory()
        limit = max_tokens if max_tokens is not None else worker.max_tokens
        rate_sum, rate_count = 0.0, 0
        start = time.perf_counter()
        with tqdm(total=total, initial=done.lines, unit="sent", disable=not progress, dynamic_ncols=True) as bar:
            for record, line in process_lines(_lines(input_path, skip=done.lines), fmt, field, worker, limit):
                writer.write(record, line)
                if record.get("error") is not None:
                    errors += 1
                else:
                    ok += 1
                    warnings += bool(record.get("truncated"))
                    rate = record.get("stats", {}).get("acceptance_rate")
                    if isinstance(rate, (int, float)) and math.isfinite(rate):
                        rate_sum, rate_count = rate_sum + rate, rate_count + 1
                postfix = {"errors": errors}
                if rate_count:  # mean over the texts of this run
                    postfix["accept"] = f"{rate_sum / rate_count:.0%}"
                bar.set_postfix(postfix, refresh=False)
                bar.update(1)
    return BatchSummary(total, ok, errors, done.lines, warnings, time.perf_counter() - start)


def same_input(input_path: Path, output_path: Path, resuming: bool) -> None:
    """Record the input's size and sha256 beside the output (OUT.input.json); on resume, refuse
    an input that changed since: its records would be appended after another file's."""
    stamp_path = output_path.with_name(output_path.name + ".input.json")
    digest = hashlib.sha256()
    with open(input_path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    stamp = {"input": str(input_path), "bytes": input_path.stat().st_size, "sha256": digest.hexdigest()}
    if resuming and stamp_path.exists():
        before = json.loads(stamp_path.read_text(encoding="utf-8"))
        if (before.get("bytes"), before.get("sha256")) != (stamp["bytes"], stamp["sha256"]):
            raise ResumeError(f"{input_path} changed since {output_path} was started from it ({before.get('bytes')} -> "
                              f"{stamp['bytes']} bytes, another sha256): write to a new output, or delete "
                              f"{output_path} to start over")
        return
    tmp = stamp_path.with_name(stamp_path.name + ".tmp")
    tmp.write_text(json.dumps(stamp), encoding="utf-8")
    os.replace(tmp, stamp_path)


# ---- reading the input -------------------------------------------------------------------

def input_format(path: Path, fmt: str | None = None) -> str:
    """"txt", "jsonl" or "openai": `fmt`, or else the input's extension, a `.jsonl` whose first
    line is an OpenAI Batch request being "openai"."""
    fmt = fmt or path.suffix.lower().lstrip(".")
    if fmt not in ("txt", "jsonl", "openai"):
        raise ValueError(f"cannot tell the format of {path} from its extension: pass fmt='txt' or 'jsonl'")
    if fmt == "jsonl":
        with open(path, "rb") as f:
            first = f.readline()
        try:
            fmt = "openai" if api.is_batch_line(json.loads(strip_line(1, first.rstrip(b"\n")))) else fmt
        except (json.JSONDecodeError, UnicodeDecodeError):
            pass
    return fmt


def count_lines(path: Path) -> int:
    """Lines as `_lines` (and the Ray job's `read_block`) yield them: a last line without "\\n" counts, an empty tail does not."""
    count, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            count += chunk.count(b"\n")
            last = chunk[-1:]
    return count + (last != b"\n")


def _lines(path: Path, skip: int) -> Iterator[tuple[int, bytes]]:
    """(1-based number, raw bytes without the line break) of the lines after the first `skip`."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if number > skip:
                yield number, strip_line(number, raw[:-1] if raw.endswith(b"\n") else raw)


def strip_line(number: int, raw: bytes) -> bytes:
    """A line as the job reads it: without a CRLF file's "\r", nor the first line's UTF-8 BOM (Windows editors)."""
    raw = raw[:-1] if raw.endswith(b"\r") else raw
    return raw[3:] if number == 1 and raw.startswith(b"\xef\xbb\xbf") else raw


def process_lines(
    lines: Iterable[tuple[int, bytes]], fmt: str, field: str, worker: JobWorker, limit: int
) -> Iterator[tuple[dict, str | bytes]]:
    """(record, what a `.txt` output writes for it) of each (number, raw line), in input order.
    The unit of work of a job, on one machine or per block on a cluster. Lines are read lazily,
    so the worker (the batched engine) gets the texts of many lines at once."""
    parsed: deque[tuple[dict, str | bytes, str | None]] = deque()  # read, not yet written

    def texts() -> Iterator[str]:
        for number, raw in lines:
            parsed.append(_parse(number, raw, fmt, field, worker, limit))
            if parsed[-1][2] is not None:
                yield parsed[-1][2]

    def errors_first() -> Iterator[tuple[dict, str | bytes]]:
        while parsed and parsed[0][2] is None:
            record, fallback, _ = parsed.popleft()
            yield record, fallback

    for result in worker.process_each(texts()):
        yield from errors_first()
        record, fallback, text = parsed.popleft()
        yield _batch_processed(record, result) if fmt == "openai" else _processed(record, fallback, text, result)
    yield from errors_first()


def _parse(
    number: int, raw: bytes, fmt: str, field: str, worker: JobWorker, limit: int
) -> tuple[dict, str | bytes, str | None]:
    """(record so far, what a `.txt` output writes if it is an error, the text to process): the
    record is an error record, and the text None, if the line cannot be processed."""
    if fmt == "openai":
        return _parse_batch_line(number, raw, worker, limit)
    fields: dict[str, Any] = {}
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return _error(number, fields, f"invalid UTF-8 at byte {e.start}", input=_show(raw)), raw, None
    if fmt == "txt":
        text: Any = line
    else:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            return _error(number, fields, f"malformed JSON: {e}", input=line), b"", None
        if not isinstance(obj, dict):
            return _error(number, fields, f"not a JSON object but {type(obj).__name__}", input=line), b"", None
        fields = {k: v for k, v in obj.items() if k != field}
        if field not in obj:
            return _error(number, fields, f"missing field {field!r}"), b"", None
        text = obj[field]
        if not isinstance(text, str):
            return _error(number, fields, f"field {field!r} is {type(text).__name__}, not a string"), b"", None
    fallback = text.encode("utf-8")
    if not text.strip():
        return _error(number, fields, "empty text", source=text), fallback, None
    try:
        n_tokens = worker.count_tokens(text)
    except Exception as e:  # a failure on one text must not end the job
        return _error(number, fields, f"failed: {type(e).__name__}: {e}", source=text), fallback, None
    if n_tokens > limit:
        return _error(number, fields, f"too long: {n_tokens} tokens > limit {limit}", source=text), fallback, None
    return {"line": number, **fields}, fallback, text


def _processed(record: dict, fallback: str | bytes, text: str, result: Any) -> tuple[dict, str | bytes]:
    """The record of a parsed line (`record`: its number and fields) and its `.txt` line, from its
    result, or the exception its processing raised (the `.txt` line is then the source, unchanged)."""
    if isinstance(result, Exception):
        return {**record, "source": text, "error": f"failed: {type(result).__name__}: {result}"}, fallback
    return {**record, **result.to_record()}, result.text


def _parse_batch_line(number: int, raw: bytes, worker: JobWorker, limit: int) -> tuple[dict, bytes, str | None]:
    """As `_parse`, for a line of an OpenAI Batch file: an error is its final output line; a line
    to process gives {"custom_id", "model"}, which `_batch_processed` answers."""
    custom_id = None
    try:
        obj = json.loads(raw.decode("utf-8"))
        if not isinstance(obj, dict):
            raise InputError(f"not a JSON object but {type(obj).__name__}")
        custom_id = obj["custom_id"] if isinstance(obj.get("custom_id"), str) else None  # for the error record
        custom_id, request = api.batch_request(obj)
        text = request.last_user_text
        if not text.strip():
            raise InputError("the last user message is empty")
        if (n := worker.count_tokens(text)) > limit:
            raise InputError(f"the last user message is too long: {n} tokens > limit {limit}")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return _batch_error(custom_id, 400, f"line {number}: not a JSON request: {e}"), b"", None
    except InputError as e:
        return _batch_error(custom_id, 400, f"line {number}: {e}"), b"", None
    except Exception as e:  # noqa: BLE001 - a failure on one line must not end the job
        return _batch_error(custom_id, 500, f"line {number}: {type(e).__name__}: {e}"), b"", None
    return {"custom_id": custom_id, "model": request.model}, b"", text


def _batch_processed(pending: dict, result: Any) -> tuple[dict, bytes]:
    """The OpenAI Batch output line of a processed request: the same body as the server's."""
    if isinstance(result, Exception):
        status = 400 if isinstance(result, InputError) else 500
        return _batch_error(pending["custom_id"], status, f"{type(result).__name__}: {result}"), b""
    body = api.completion(api.reply_of(result), pending["model"])
    return api.batch_output(pending["custom_id"], 200, body), b""


def _batch_error(custom_id: str | None, status: int, message: str) -> dict:
    return api.batch_output(custom_id, status, api.error(status, message))


def _error(number: int, fields: dict, message: str, **extra: Any) -> dict:
    return {"line": number, **fields, **extra, "error": message}


def _show(raw: bytes) -> str:
    return raw.decode("utf-8", "backslashreplace")


# ---- writing and resuming the output ---------------------------------------------------

@dataclass(frozen=True)
class Done:
    """What a previous run left: complete records, and how many were errors / warnings."""

    lines: int = 0
    errors: int = 0
    warnings: int = 0


def _dumps(record: dict) -> bytes:
    try:
        return (json.dumps(record, ensure_ascii=False, default=str) + "\n").encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a tokenizer: fall back to \\u escapes
        return (json.dumps(record, default=str) + "\n").encode("utf-8")


def _append(f: BinaryIO, data: bytes) -> None:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())  # durable before the next line starts, so a crash loses at most this one


def _read_records(path: Path) -> tuple[list[dict], int]:
    """The JSONL records of `path` and the byte length they span.

    A partial last line (no "\\n") is left out, and so is a last line that does not parse:
    it can only be the write a crash interrupted. A bad line before the last is an error.
    """
    records: list[dict] = []
    good_end = offset = 0
    bad: int | None = None
    with open(path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            if bad is not None:
                raise ResumeError(f"{path}: line {bad} is not a JSON record; not a file this job wrote?")
            offset += len(raw)
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                record = None
            if not isinstance(record, dict) or not (isinstance(record.get("line"), int) or "custom_id" in record):
                bad = len(records) + 1
                continue
            records.append(record)
            good_end = offset
    return records, good_end


def _truncate(path: Path, size: int) -> None:
    if path.stat().st_size != size:
        os.truncate(path, size)


class _Writer:
    """Holds the output open for appending, under an exclusive lock."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file: BinaryIO | None = None

    def __enter__(self) -> _Writer:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "ab")
        if fcntl is not None:
            try:
                fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.file.close()
                raise RuntimeError(f"another run is writing {self.path}") from None
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()  # closing releases the lock


class JsonlWriter(_Writer):
    """One JSON record per input line."""

    def resume(self) -> Done:
        records, size = _read_records(self.path)
        for expected, record in enumerate(records, 1):
            if record.get("line", expected) != expected:  # OpenAI Batch lines have no number: by count
                raise ResumeError(f"{self.path}: record {expected} is for line {record['line']}")
        _truncate(self.path, size)
        return Done(
            len(records),
            sum(r.get("error") is not None for r in records),
            sum(bool(r.get("truncated")) and r.get("error") is None for r in records),
        )

    def write(self, record: dict, line: str | bytes) -> None:
        _append(self.file, _dumps(record))


class TextWriter(_Writer):
    """Each result's text, one line per input line; errors and warnings in a JSONL sidecar."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.sidecar = path.with_name(path.name + ".errors.jsonl")
        self.sidecar_file: BinaryIO | None = None

    def resume(self) -> Done:
        with open(self.path, "rb") as f:
            data = f.read()
        size = data.rfind(b"\n") + 1  # everything after the last line break is a partial line
        lines = data.count(b"\n", 0, size)
        _truncate(self.path, size)
        records: list[dict] = []
        if self.sidecar.exists():
            records, sidecar_size = _read_records(self.sidecar)
            kept = [r for r in records if r["line"] <= lines]
            # Sidecar records are written before their line, so ones past `lines` are dropped.
            if len(kept) < len(records):
                tmp = self.sidecar.with_name(self.sidecar.name + ".tmp")
                tmp.write_bytes(b"".join(_dumps(r) for r in kept))
                os.replace(tmp, self.sidecar)
            else:
                _truncate(self.sidecar, sidecar_size)
            records = kept
        return Done(
            lines, sum("error" in r for r in records), sum("warning" in r for r in records)
        )

    def write(self, record: dict, line: str | bytes) -> None:
        """`line`: the result's text, or for an error record the source as read."""
        if "error" in record:
            self._note(record)
        elif record.get("truncated"):
            self._note({"line": record["line"], "warning": "truncated"})
        data = line.encode("utf-8") if isinstance(line, str) else line
        # One input line must stay one output line, whatever the model returned.
        _append(self.file, data.replace(b"\r\n", b" ").replace(b"\n", b" ") + b"\n")

    def _note(self, record: dict) -> None:
        if self.sidecar_file is None:  # opened on first use: a clean job leaves no sidecar
            self.sidecar_file = open(self.sidecar, "ab")
        _append(self.sidecar_file, _dumps(record))

    def __exit__(self, *exc: object) -> None:
        if self.sidecar_file is not None:
            self.sidecar_file.close()
        super().__exit__(*exc)
