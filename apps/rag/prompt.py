"""The one RAG prompt, shared by the app, the benchmark and the UI.

The passages come first and the question last, so that a follow-up question over the same
passages shares the whole prompt prefix up to the question (the prefix KV cache reuses it)."""

from __future__ import annotations

from typing import Sequence

from specsuite.core.chat import chat_prompt_ids

SYSTEM = (
    "You answer questions from the numbered passages the user gives you. Use only what the passages "
    "say, quote their wording where you can, and cite the passages you use as [1], [2] and so on. "
    "If the passages do not contain the answer, say so."
)


def passage_text(text: str) -> str:
    """A passage as the prompt shows it: one line (source files are often hard-wrapped)."""
    return " ".join(text.split())


def rag_user_message(question: str, passages: Sequence[str]) -> str:
    """The user turn: numbered passages, then the question."""
    numbered = "\n\n".join(f"[{i}] {passage_text(p)}" for i, p in enumerate(passages, 1))
    return f"Passages:\n\n{numbered}\n\nQuestion: {question.strip()}"


def rag_prompt_ids(tokenizer, question: str, passages: Sequence[str]) -> list[int]:
    """Chat prompt ids asking the model to answer `question` from `passages` (plain strings)."""
    return chat_prompt_ids(tokenizer, rag_user_message(question, passages), SYSTEM)
