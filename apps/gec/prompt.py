"""The grammar-correction prompt, shared by the app, the benchmark and the UI, in two styles.

"minimal" (the default): one instruction that says what a minimal edit is (keep what is correct,
do not rephrase, return a correct text unchanged). "fluent": fix the errors and rephrase what a
native speaker would not write (JFLEG's references are such fluency edits; docs/quality.md has
both styles' GLEU and over-editing). Worked examples of minimal corrections as earlier chat turns were tried
and dropped: on JFLEG dev they made both presets under-correct and lowered GLEU by 4-5 points
(docs/quality.md has the figures and the command).
"""

from __future__ import annotations

from specsuite.core import PrefixCache
from specsuite.core.model.backend import Backend

# The KV of a few recent prompts, whose common start (the instruction, ~80 tokens of ~110 for a
# JFLEG sentence) the next prompt reuses: ~2 MB a prompt for Qwen2.5-0.5B in fp32.
INSTRUCTION_CACHE_BYTES = 32 << 20

SYSTEM = (
    "You are a careful copy editor. Correct the grammar, spelling and punctuation errors of the text the user "
    "sends, with the smallest possible changes: keep every word, word order and phrasing that is already "
    "correct, do not rephrase, and do not make the text more formal. If the text has no errors, return it "
    "unchanged. Reply with the corrected text only: no explanations, no quotes, no preamble."
)
FLUENT = (
    "You are a careful copy editor. Rewrite the text the user sends as correct, fluent English: fix its "
    "grammar, spelling, punctuation and word choice, and rephrase what a native speaker would not write, "
    "keeping its meaning and its tone. Reply with the corrected text only: no explanations, no quotes, no preamble."
)
STYLES = {"minimal": SYSTEM, "fluent": FLUENT}


def check_style(style: str) -> str:
    if style not in STYLES:
        raise ValueError(f"unknown style {style!r}; use one of {', '.join(STYLES)}")
    return style


def gec_messages(text: str, style: str = "minimal") -> list[dict[str, str]]:
    """The chat: the instruction of `style` ("minimal" or "fluent"), then `text` to correct."""
    return [{"role": "system", "content": STYLES[check_style(style)]}, {"role": "user", "content": text}]


def gec_prompt_ids(tokenizer, text: str, style: str = "minimal") -> list[int]:
    """Chat prompt ids asking the model to correct `text` in `style`; the reply is the corrected
    text. Tokenizers without a chat template get the same turns as plain text."""
    messages = gec_messages(text, style)
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer("\n\n".join(m["content"] for m in messages) + "\n\nCorrected:")["input_ids"]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    return list(ids)


def instruction_ids(tokenizer, style: str = "minimal") -> list[int]:
    """The ids every GEC prompt of `style` starts with (the instruction and the chat template's
    start): the common prefix of two prompts whose texts differ from their first character."""
    a, b = gec_prompt_ids(tokenizer, "a", style), gec_prompt_ids(tokenizer, "1", style)
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return a[:n]


def instruction_cache(model, backend: Backend) -> PrefixCache | None:
    """A prefix cache that lets every prompt after the first skip the shared instruction, or None
    where the model's backend does not keep a cache lossless (bf16, fp16: `lossless_prefix_cache`)."""
    return PrefixCache(model.config, max_bytes=INSTRUCTION_CACHE_BYTES) if backend.lossless_prefix_cache else None
