"""Turning a task prompt into the token ids a chat model expects."""

from __future__ import annotations


def chat_prompt_ids(tokenizer, user: str, system: str | None = None) -> list[int]:
    """Token ids of a one-turn chat (system + user) ending with the assistant's generation prompt.
    Falls back to the plain text for tokenizers without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        text = f"{system}\n\n{user}" if system else user
        return tokenizer(text)["input_ids"]
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    return list(ids)
