"""The draft-then-verify decoding of one sequence, shared by every app.

Each step: the drafter proposes a token tree continuing the sequence; ONE forward pass of the target
over [last token, draft nodes] scores all of it; the longest path the target agrees with is kept,
plus the target's own next token; the KV cache is rolled back past everything else. With greedy
verification the output is token for token that of plain greedy decoding; with speculative sampling
it is distributed as plain sampling.

The loop is the engine's (`BatchEngine.run`, steps in `core/sequence.py`) with one sequence; here
its store is the model's own `DynamicCache`, and each forward is the model's backend's
(`core/backend.py`), so that every row rounds as plain decoding's and any architecture runs.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache

from .backend import Backend, backend_for, plain_backend
from .draft import Draft, Drafter
from .engine import BatchEngine
from .sequence import (Generation, GenerationStats, Request, StepCallback, Sequence as _Sequence, context_length,
                       eos_end, eos_token_ids, turn_end_token)
from .verify import Sampling

__all__ = ["Generation", "GenerationStats", "StepCallback", "context_length", "eos_end", "eos_token_ids",
           "generate", "turn_end_token"]


def _keep_path(cache: DynamicCache, root: int, path: list[int], n: int) -> None:
    """The cache holds tokens up to the root (at index `root`) + n draft nodes: keep the nodes on `path`."""
    if path == list(range(len(path))):  # a prefix of the laid-out nodes: a plain crop
        if n - len(path):
            cache.crop(-(n - len(path)))
        return
    keep = torch.tensor([root + 1 + i for i in path])
    for layer in cache.layers:
        layer.keys = torch.cat([layer.keys[..., : root + 1, :], layer.keys[..., keep, :]], dim=-2)
        layer.values = torch.cat([layer.values[..., : root + 1, :], layer.values[..., keep, :]], dim=-2)


class _OneSequence(BatchEngine):
    """The engine's loop for one sequence, on the model's own cache: forwards by `backend` (a
    near-tie redone by the plain one), the prompt's longest cached prefix from `prefix_cache`."""

    def __init__(self, model, eos_token_id, tokenizer, backend: Backend, prefix_cache) -> None:
        self._start(model, 1, eos_token_id, tokenizer)
        self.backend, self.plain, self.prefix_cache = backend, plain_backend(model.dtype), prefix_cache
        self.backend_name, self.plain_steps = backend.name, backend.plain_steps
        self.cache = DynamicCache(config=model.config)

    def _admit_kv(self, slot: int, prompt: list[int], max_new: int, slots: int) -> int:
        if self.prefix_cache is None:
            return 0
        self.cache, cached = self.prefix_cache.lookup(prompt)
        return cached

    def _forward(self, seqs: list[_Sequence], drafts: list[Draft | None], slots: list[int]) -> torch.Tensor:
        (seq,), (draft,) = seqs, drafts
        if seq.length == 0 and self.cache.get_seq_length():  # the prefill again, after a near-tie
            self.cache = DynamicCache(config=self.model.config)
        backend = self.plain if seq.redo else self.backend
        return backend.forward(self.model, seq.fresh, self.cache, seq.length, draft,
                               greedy_margin=seq.tie_margin if seq.sampling is None else None)

    def _keep(self, slot: int, seq: _Sequence, base: int, path: list[int], prefilled: bool) -> None:
        if seq.length == 0:  # the prefill runs again
            return
        if prefilled and self.prefix_cache is not None:
            self.prefix_cache.store(seq.prompt, self.cache)
        n = self.cache.get_seq_length() - base
        _keep_path(self.cache, base - 1, path, n)
        if self.cache.get_seq_length() > seq.length:  # a near-tie: its position runs again
            self.cache.crop(seq.length - self.cache.get_seq_length())


@torch.inference_mode()
def generate(
    model,
    prompt: Sequence[int] | torch.Tensor,
    drafter: Drafter | None = None,
    *,
    max_new_tokens: int = 256,
    eos_token_id: int | Sequence[int] | None = None,
    sampling: Sampling | None = None,
    generator: torch.Generator | None = None,
    stop_strings: Sequence[str] = (),
    tokenizer=None,
    on_step: StepCallback | None = None,
    prefix_cache=None,
    tie_margin: float | None = None,
    draft_sizes: Sequence[int] | None = None,
    prefill_draft: int | None = None,
) -> Generation:
    """Decode from `prompt` (token ids, or a (1, T) tensor) with draft-then-verify.

    drafter: proposes drafts (None: plain decoding). sampling: None for greedy (exact), else
    lossless speculative sampling with `generator` as the source of randomness. stop_strings need
    `tokenizer`. prefix_cache: an optional `PrefixCache` that reuses the KV of a shared prompt prefix.
    The model's backend (`backend_for`) computes the forwards and sets the defaults of:
    tie_margin (greedy only; rows whose top two logits are closer are recomputed as plain decoding
    does), draft_sizes (a ladder of caps on draft nodes, see `SizeLadder`; () for none; where the
    backend measured its step costs and draft_sizes is not given, drafts are capped by
    `GoodputCap` instead) and prefill_draft (draft nodes verified in the prefill's forward).
    """
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() > 2 or (prompt.dim() == 2 and prompt.shape[0] != 1):
            raise ValueError(f"one prompt at a time: expected (T,) or (1, T) token ids, got {tuple(prompt.shape)}")
        prompt = prompt.reshape(-1).tolist()
    # The prompt and max_new_tokens are checked where the loop admits a request (`BatchEngine._admit`).
    if prefill_draft is not None and prefill_draft < 0:
        raise ValueError(f"prefill_draft must be >= 0, got {prefill_draft}")
    if tie_margin is not None and tie_margin < 0:
        raise ValueError(f"tie_margin must be >= 0, got {tie_margin}")
    if stop_strings and tokenizer is None:
        raise ValueError("stop_strings need the tokenizer")
    backend = backend_for(model)
    request = Request(list(prompt), drafter, max_new_tokens, sampling, generator, on_step, tuple(stop_strings), tokenizer,
                      backend.tie_margin if tie_margin is None else tie_margin,
                      backend.draft_sizes if draft_sizes is None else tuple(draft_sizes),
                      backend.prefill_draft if prefill_draft is None else prefill_draft,
                      backend.draft_cost if draft_sizes is None else None)
    ((_, result),) = _OneSequence(model, eos_token_id, tokenizer, backend, prefix_cache).run([request])
    if isinstance(result, Exception):
        raise result
    return result
