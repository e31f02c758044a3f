"""The one grammar-correction prompt, shared by the app, the benchmark and the UI."""

from __future__ import annotations

from specsuite.core import PrefixCache
from specsuite.core.chat import chat_prompt_ids
from specsuite.core.prefix_cache import lossless_by_default

# The KV of a few recent prompts, whose common start (the instruction, ~55 tokens of ~85 for a
# JFLEG sentence) the next prompt reuses: ~2 MB a prompt for Qwen2.5-0.5B in fp32.
INSTRUCTION_CACHE_BYTES = 32 << 20

SYSTEM = (
    "You are a careful copy editor. Correct the grammar, spelling and punctuation of the text the user "
    "sends. Change as little as possible and keep the meaning. Reply with the corrected text only: "
    "no explanations, no quotes, no preamble."
)


def gec_prompt_ids(tokenizer, text: str) -> list[int]:
    """Chat prompt ids asking the model to correct `text`; the reply is the corrected text."""
    return chat_prompt_ids(tokenizer, text, SYSTEM)


def instruction_ids(tokenizer) -> list[int]:
    """The ids every GEC prompt starts with (the instruction and the chat template's start): the
    common prefix of two prompts whose texts differ from their first character."""
    a, b = gec_prompt_ids(tokenizer, "a"), gec_prompt_ids(tokenizer, "1")
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return a[:n]


def instruction_cache(model) -> PrefixCache | None:
    """A prefix cache that lets every prompt after the first skip the shared instruction, or None
    where a cache is not lossless by default (bf16, fp16: see `lossless_by_default`)."""
    return PrefixCache(model.config, max_bytes=INSTRUCTION_CACHE_BYTES) if lossless_by_default(model) else None
