"""`specsuite rag answer`: answers to a file of questions, resumable, decoded in the batched engine.

The apps' batch job (apps/jobs/runner.py) with `RagQA.job_worker` as its worker: input `.txt` (a question
a line) or `.jsonl` (the question in `field`), output `.jsonl`, one record per line in order:
`{"line": N, <the input's other fields>, <Answer.to_record()>}` or `{"line": N, ..., "error": "..."}`.
A bad line (empty, over the question limit, not JSON) is an error record; a kill at any point loses
at most the record being written, and the same command resumes after the last complete one.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from specsuite.apps.jobs.runner import BatchSummary, run_batch

from .qa import RagQA


def answer_file(input_path: str | Path, output_path: str | Path, qa_factory: Callable[[], RagQA], k: int = 5,
                batch_size: int = 16, fmt: str | None = None, field: str = "question",
                progress: bool = True) -> BatchSummary:
    """Answer every question of `input_path` into `output_path` (.jsonl), resuming a previous run.
    `qa_factory` is called only if questions are left."""
    if Path(output_path).suffix != ".jsonl":
        raise ValueError(f"the output must be a .jsonl file, got {output_path}")
    return run_batch(input_path, output_path, lambda: qa_factory().job_worker(k, batch_size), fmt=fmt, field=field,
                     progress=progress)
