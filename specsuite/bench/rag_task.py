"""The RAG task of `specsuite bench`: Spec-Bench RAG prompts, the reference drafter, and the
time to first token of a follow-up question with the prefix KV cache."""

from __future__ import annotations

from statistics import mean
from typing import Any, Callable, Sequence

from specsuite.core import Drafter, PrefixCache, eos_token_ids, generate
from specsuite.core.model.backend import choose_backend
from specsuite.retrieval.specbench import parse_specbench_rag

from specsuite.apps.rag.drafter import ReferenceDrafter
from specsuite.apps.rag.prompt import rag_prompt_ids

# When the items give no other question to ask over the same passages.
FOLLOW_UP = "Which of the passages is the most relevant to the question, and why?"


def rag_example_parts(tokenizer, item: dict[str, Any]) -> tuple[list[int], dict[str, Callable[[], Drafter]]]:
    """(prompt ids, {"reference": drafter factory}) of a Spec-Bench RAG item."""
    passages, question = parse_specbench_rag(item)
    # Tokenized once here, like the prompt; each run builds a fresh drafter over these ids.
    references = ReferenceDrafter.for_passages(tokenizer, passages).references
    return rag_prompt_ids(tokenizer, question, passages), {"reference": lambda: ReferenceDrafter(references)}


def prefix_cache_ttft(model, tokenizer, items: Sequence[dict[str, Any]], n: int = 3, max_new_tokens: int = 32,
                      max_bytes: int = 1 << 30) -> dict[str, Any]:
    """TTFT of a first question over an item's passages vs a follow-up question over the same
    passages with a PrefixCache (the next item's question), and whether the follow-up's output is
    identical with and without the cache. Uses the first `n` items; each starts with an empty cache."""
    items = list(items)[:n]
    if not items:
        raise ValueError("no items")
    eos = sorted(eos_token_ids(model, tokenizer))
    backend = choose_backend(model)
    parsed = [parse_specbench_rag(item) for item in items]

    def run(question: str, passages: list[str], cache: PrefixCache | None):
        prompt = rag_prompt_ids(tokenizer, question, passages)
        return generate(model, prompt, ReferenceDrafter.for_passages(tokenizer, passages),
                        max_new_tokens=max_new_tokens, eos_token_id=eos, prefix_cache=cache, backend=backend)

    run(parsed[0][1], parsed[0][0], None)  # warm-up: the first call pays for kernel selection
    rows = []
    for i, (passages, question) in enumerate(parsed):
        follow_up = parsed[(i + 1) % len(parsed)][1]
        if follow_up == question:
            follow_up = FOLLOW_UP
        cache = PrefixCache(model.config, max_bytes=max_bytes)
        first = run(question, passages, cache)
        cached = run(follow_up, passages, cache)
        uncached = run(follow_up, passages, None)
        rows.append({
            "prompt_tokens": cached.stats.prompt_tokens, "cached_prompt_tokens": cached.stats.cached_prompt_tokens,
            "ttft_first_s": first.stats.prefill_s, "ttft_followup_s": cached.stats.prefill_s,
            "ttft_followup_uncached_s": uncached.stats.prefill_s, "identical": cached.tokens == uncached.tokens,
        })
    first_s, follow_s = mean(r["ttft_first_s"] for r in rows), mean(r["ttft_followup_s"] for r in rows)
    uncached_s = mean(r["ttft_followup_uncached_s"] for r in rows)
    return {
        "n": len(rows),
        "prompt_tokens": round(mean(r["prompt_tokens"] for r in rows), 1),
        "cached_prompt_tokens": round(mean(r["cached_prompt_tokens"] for r in rows), 1),
        "ttft_first_s": round(first_s, 4),
        "ttft_followup_s": round(follow_s, 4),
        "ttft_followup_uncached_s": round(uncached_s, 4),
        "followup_vs_first": round(follow_s / first_s, 3),  # < 1: the follow-up starts faster
        "speedup_vs_uncached": round(uncached_s / follow_s, 3),
        "identical": sum(r["identical"] for r in rows) / len(rows),  # share of follow-ups identical with the cache
    }
