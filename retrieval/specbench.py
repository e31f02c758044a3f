"""Reading Spec-Bench RAG items: each prompt is its passages, one per line, then the question."""

from __future__ import annotations

import json
import os
from typing import Any


def parse_specbench_rag(item: dict[str, Any] | str) -> tuple[list[str], str]:
    """(passages, question) of a Spec-Bench RAG item (or of its first-turn prompt text).

    The prompt is newline-separated: every line but the last is a retrieved passage and the
    last line is the question. Blank lines are ignored."""
    prompt = item if isinstance(item, str) else item["turns"][0]
    lines = [line.strip() for line in prompt.split("\n") if line.strip()]
    if len(lines) < 2:
        raise ValueError("a Spec-Bench RAG prompt needs at least one passage line and a question line")
    return lines[:-1], lines[-1]


def load_specbench_rag(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The items of a Spec-Bench jsonl file (e.g. rag_dev.jsonl)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
