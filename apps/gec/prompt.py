"""The one grammar-correction prompt, shared by the app, the benchmark and the UI."""

from __future__ import annotations

from specsuite.core.chat import chat_prompt_ids

SYSTEM = (
    "You are a careful copy editor. Correct the grammar, spelling and punctuation of the text the user "
    "sends. Change as little as possible and keep the meaning. Reply with the corrected text only: "
    "no explanations, no quotes, no preamble."
)


def gec_prompt_ids(tokenizer, text: str) -> list[int]:
    """Chat prompt ids asking the model to correct `text`; the reply is the corrected text."""
    return chat_prompt_ids(tokenizer, text, SYSTEM)
