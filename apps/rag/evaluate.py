"""Answer quality on Spec-Bench RAG items (passages given): accuracy and citation coverage.

- accuracy: the share of answers that contain one of the item's reference answers (compared
  case-insensitively, punctuation and spacing ignored: "914 mbar ( hPa )" matches "914 mbar (hPa)").
- citation coverage: of the answers that copy at least 4 words from a passage, the share whose
  every copied passage has a claim with its character ranges (`Answer.claims`).
- model citations: the share of answers in which the model itself wrote a valid [n].
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from specsuite.retrieval.specbench import parse_specbench_rag

from .qa import Answer, RagQA, parse_citations

_NON_WORD = re.compile(r"\W+")


def normalize(text: str) -> str:
    return " ".join(_NON_WORD.sub(" ", text.lower()).split())


def references(item: dict[str, Any]) -> list[str]:
    """The short answers of an item: `reference` is a list (per turn) of lists of strings."""
    refs = item.get("reference") or []
    flat = [r for turn in refs for r in (turn if isinstance(turn, list) else [turn])]
    return [r for r in flat if isinstance(r, str) and normalize(r)]


def contains_reference(answer: str, refs: Sequence[str]) -> bool:
    text = f" {normalize(answer)} "
    return any(f" {normalize(r)} " in text for r in refs)


def cites_its_copies(answer: Answer) -> bool:
    """Whether every passage the answer copies from carries a claim with character ranges."""
    copied = {n for _, _, n in answer.spans}
    ranged = {c.passage for c in answer.claims if 0 <= c.passage_start < c.passage_end}
    return copied <= ranged


@dataclass
class RagEvaluation:
    items: int = 0
    correct: int = 0
    copying: int = 0  # answers that copy >= 4 words from a passage
    copying_cited: int = 0  # ... of which every copied passage has a ranged claim
    model_cited: int = 0  # answers with a [n] written by the model
    rows: list[dict[str, Any]] = field(default_factory=list)

    def add(self, answer: Answer, refs: Sequence[str]) -> None:
        correct = contains_reference(answer.text, refs)
        self.items += 1
        self.correct += correct
        if answer.spans:
            self.copying += 1
            self.copying_cited += cites_its_copies(answer)
        self.model_cited += bool(parse_citations(answer.text, len(answer.passages)))
        self.rows.append({"question": answer.question, "answer": answer.text, "references": list(refs),
                          "correct": correct, "claims": [c.to_json() for c in answer.claims]})

    def summary(self) -> str:
        def share(k: int, n: int) -> str:
            return f"{k}/{n} ({k / n:.0%})" if n else "0/0"

        return (f"reference contained in the answer: {share(self.correct, self.items)}\n"
                f"answers copying >= 4 words that cite every copied passage with character ranges: "
                f"{share(self.copying_cited, self.copying)}\n"
                f"answers with a [n] written by the model: {share(self.model_cited, self.items)}")


def evaluate_rag(qa: RagQA, items: Iterable[dict[str, Any]], progress=None) -> RagEvaluation:
    """Answer each item's question from its own passages and score the answers."""
    result = RagEvaluation()
    for item in items:
        passages, question = parse_specbench_rag(item)
        result.add(qa.answer(question, passages), references(item))
        if progress is not None:
            progress(result)
    return result
