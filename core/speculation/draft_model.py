"""Drafting with an independent small language model that shares the target's tokenizer."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from .draft import AdaptiveLength, Draft, Drafter
from .verify import Sampling, warp


class DraftModelDrafter(Drafter):
    """Runs a small model autoregressively for a few tokens per step (its own KV cache, rolled back
    to what the target accepted). Greedy drafts when the target decodes greedily; sampled drafts,
    with their probabilities, for speculative sampling. Stops drafting early when the small model
    is unsure (top probability below `confidence`), as HF's assisted generation does."""

    name = "draft_model"

    def __init__(self, model, max_tokens: int = 16, initial_tokens: int = 5, confidence: float = 0.4,
                 generator: torch.Generator | None = None) -> None:
        self.model = model
        self.length = AdaptiveLength(initial_tokens, 1, max_tokens)
        self.confidence = confidence
        self.generator = generator
        self.cache: DynamicCache | None = None
        self.cached: list[int] = []  # tokens whose KV is in self.cache
        self.sampling: Sampling | None = None

    def reset(self, prompt: list[int], sampling: Sampling | None = None) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.cached = []
        self.sampling = sampling
        self.length.reset()

    def _feed(self, tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor([tokens], device=self.model.device)
        logits = self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=1).logits[0, -1]
        self.cached += tokens
        return logits

    @torch.inference_mode()
    def propose(self, tokens: list[int], max_depth: int) -> Draft | None:
        # Roll the cache back to the longest prefix it shares with the sequence, then catch up.
        common = 0
        limit = min(len(self.cached), len(tokens))
        while common < limit and self.cached[common] == tokens[common]:
            common += 1
        if common == len(tokens):  # keep at least the last token to feed
            common -= 1
        if len(self.cached) > common:
            self.cache.crop(-(len(self.cached) - common))
            del self.cached[common:]
        logits = self._feed(tokens[common:])
        draft: list[int] = []
        probs: list[torch.Tensor] = []
        for i in range(min(self.length.value, max_depth)):
            if self.sampling is None:
                p = logits.float().softmax(-1)
                t = int(p.argmax())
            else:
                p = warp(logits[None], self.sampling)[0]
                t = int(torch.multinomial(p, 1, generator=self.generator))
            if draft and p[t] < self.confidence and self.sampling is None:
                break
            draft.append(t)
            probs.append(p)
            if i + 1 < min(self.length.value, max_depth):
                logits = self._feed([t])
        if not draft:
            return None
        return Draft.chain(draft, torch.stack(probs) if self.sampling is not None else None)

    def update(self, draft: Draft | None, path: list[int]) -> None:
        self.length.update(len(path), len(draft) if draft else 0)
