"""The one RAG prompt, shared by the app, the benchmark and the UI.

The passages come first and the question last, so that a follow-up question over the same
passages shares the whole prompt prefix up to the question (the prefix KV cache reuses it)."""

from __future__ import annotations

from typing import Sequence

from specsuite.core.scheduler.chat import chat_prompt_ids

# Short answers that quote: the app attributes every copied run of words to its passage
# (`Answer.claims`), so quoting is what makes an answer checkable, with or without the model's [n].
SYSTEM = (
    "You answer questions from the numbered passages the user gives you. Answer in one or two short "
    "sentences that quote the exact words of the passage that answers the question, and end each sentence "
    "with the number of its passage in brackets, like [2]. Use only what the passages say; if they do not "
    "contain the answer, say so."
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
