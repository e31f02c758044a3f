"""`specsuite rag answer`: answers to a file of questions, resumable, decoded in the batched engine.

The GEC batch job's machinery (apps/jobs.py) with an answerer in place of the corrector:
input `.txt` (a question a line) or `.jsonl` (the question in `field`), output `.jsonl`, one record
per line in order: `{"line": N, <the input's other fields>, "question", "answer", "citations",
"passages", "spans", "stats", "truncated"}` or `{"line": N, ..., "error": "..."}`. A bad line (empty,
over the question limit, not JSON) is an error record; a kill at any point loses at most the record
being written, and the same command resumes after the last complete one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from specsuite.apps.jobs import BatchSummary, run_batch

from .qa import Answer, RagQA


class Answerer:
    """What the batch job asks of a corrector (`CorrectorLike`), answering questions instead."""

    def __init__(self, qa: RagQA, k: int = 5, batch_size: int = 16) -> None:
        self.qa, self.k, self.batch_size = qa, k, batch_size
        self.context_limit = qa.max_question_tokens

    def count_tokens(self, text: str) -> int:
        return self.qa.count_tokens(text)

    def correct(self, text: str) -> Answer:
        return self.qa.ask(text, self.k)

    def correct_each(self, texts: Iterable[str]) -> Iterator[Answer | Exception]:
        return self.qa.answer_each(texts, self.k, self.batch_size)


def answer_file(input_path: str | Path, output_path: str | Path, qa_factory: Callable[[], RagQA], k: int = 5,
                batch_size: int = 16, fmt: str | None = None, field: str = "question",
                progress: bool = True) -> BatchSummary:
    """Answer every question of `input_path` into `output_path` (.jsonl), resuming a previous run.
    `qa_factory` is called only if questions are left."""
    if Path(output_path).suffix != ".jsonl":
        raise ValueError(f"the output must be a .jsonl file, got {output_path}")
    return run_batch(input_path, output_path, lambda: Answerer(qa_factory(), k, batch_size), fmt=fmt, field=field,
                     progress=progress)
