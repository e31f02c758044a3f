"""The one grammar-correction prompt, shared by the app, the benchmark and the UI.

An instruction plus a few worked examples of minimal corrections, as earlier chat turns: small
models told only to "change as little as possible" still rewrite fluent-sounding paraphrases; the
examples show what a minimal edit is (and that a correct sentence comes back unchanged). The
examples are the shared start of every prompt, so batches and the prefix cache compute them once.
"""

from __future__ import annotations

from specsuite.core import PrefixCache
from specsuite.core.prefix_cache import lossless_by_default

# The KV of a few recent prompts, whose common start (the instruction and examples, ~260 tokens of
# ~290 for a JFLEG sentence) the next prompt reuses: ~3 MB a prompt for Qwen2.5-0.5B in fp32.
INSTRUCTION_CACHE_BYTES = 64 << 20

SYSTEM = (
    "You are a careful copy editor. Correct the grammar, spelling and punctuation errors of the text the user "
    "sends, with the smallest possible changes: keep every word, word order and phrasing that is already "
    "correct, do not rephrase, and do not make the text more formal. If the text has no errors, return it "
    "unchanged. Reply with the corrected text only: no explanations, no quotes, no preamble."
)

# (learner text, minimal correction): written for this prompt, not taken from any evaluation set.
EXAMPLES = (
    ("She go to school every days by bus .", "She goes to school every day by bus ."),
    ("I am agree with you that the goverment should help poor peoples.",
     "I agree with you that the government should help poor people."),
    ("Yesterday I have seen a very interesting film about the war .",
     "Yesterday I saw a very interesting film about the war ."),
    ("The results were clear and everyone was happy with them.",
     "The results were clear and everyone was happy with them."),
    ("In my opinion , technology make our life more easy but it have some disadvantage too .",
     "In my opinion , technology makes our life easier but it has some disadvantages too ."),
)


def gec_messages(text: str) -> list[dict[str, str]]:
    """The chat: instruction, the worked examples as earlier turns, then `text` to correct."""
    messages = [{"role": "system", "content": SYSTEM}]
    for source, correction in EXAMPLES:
        messages += [{"role": "user", "content": source}, {"role": "assistant", "content": correction}]
    return messages + [{"role": "user", "content": text}]


def gec_prompt_ids(tokenizer, text: str) -> list[int]:
    """Chat prompt ids asking the model to correct `text`; the reply is the corrected text.
    Tokenizers without a chat template get the same turns as plain text."""
    messages = gec_messages(text)
    if not getattr(tokenizer, "chat_template", None):
        turns = [m["content"] if m["role"] != "assistant" else f"Corrected: {m['content']}" for m in messages]
        return tokenizer("\n\n".join(turns) + "\n\nCorrected:")["input_ids"]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    return list(ids)


def instruction_ids(tokenizer) -> list[int]:
    """The ids every GEC prompt starts with (the instruction, the examples and the chat template's
    start): the common prefix of two prompts whose texts differ from their first character."""
    a, b = gec_prompt_ids(tokenizer, "a"), gec_prompt_ids(tokenizer, "1")
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return a[:n]


def instruction_cache(model) -> PrefixCache | None:
    """A prefix cache that lets every prompt after the first skip the shared instruction, or None
    where a cache is not lossless by default (bf16, fp16: see `lossless_by_default`)."""
    return PrefixCache(model.config, max_bytes=INSTRUCTION_CACHE_BYTES) if lossless_by_default(model) else None
