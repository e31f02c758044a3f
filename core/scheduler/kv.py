"""Where the keys and values of the sequences in flight live, and the one rollback after a step.

The loop (`core/scheduler/engine.py`) runs over a store with four verbs:
- `admit(slot, prompt, max_new, slots=, in_flight=, batch_size=)`: make room for a sequence;
  returns how many of its prompt tokens the store already holds (a shared prefix, a prefix cache
  hit), or None where there is no room now;
- `forward(seqs, drafts, slots)`: one forward over every sequence's [fresh tokens, draft nodes],
  writing their keys and values; returns the logits (rows, vocab);
- `keep(slot, seq, base, path, prefilled)`: after verification, keep the accepted `path`'s KV
  (written from `base` on) at `base`.. (`keep_path`);
- `release(slot)`: the sequence is done.

Two stores: `SlotStore` (a cache preallocated per layer, slots x heads x positions x dim; the batched
engine, Llama-family models) and `CacheStore` (the model's own `DynamicCache`, one sequence: any
architecture, each forward by the model's backend so that rows round as plain decoding's).
"""

from __future__ import annotations

from typing import Iterable, Protocol

import torch
from transformers import DynamicCache

from ..model import forward as packed
from ..model.backend import Backend, choose_backend, plain_backend
from ..speculation.draft import Draft
from .sequence import Sequence

# The shared prefix is computed in a call of at least this many rows (see SlotStore._compute_prefix).
PREFIX_ROWS = 128


def keep_path(tensors: Iterable[torch.Tensor], base: int, path: list[int]) -> None:
    """The one rollback: each tensor holds positions on dim -2, draft node i at `base` + i; move the
    nodes of the accepted `path` to `base`, `base` + 1, ... (a path of the first laid-out nodes is
    already there). Positions after the path are stale: a store crops or overwrites them.
    `tensors` may be a generator: it is read only where something moves."""
    if path == list(range(len(path))):
        return
    tensors = list(tensors)
    device = tensors[0].device if tensors else None
    src = torch.tensor([base + p for p in path], device=device)
    dst = torch.arange(base, base + len(path), device=device)
    for t in tensors:
        t[..., dst, :] = t[..., src, :]


class KVStore(Protocol):
    def admit(self, slot: int, prompt: list[int], max_new: int, *, slots: int, in_flight: int,
              batch_size: int) -> int | None: ...

    def forward(self, seqs: list[Sequence], drafts: list[Draft | None], slots: list[int]) -> torch.Tensor: ...

    def keep(self, slot: int, seq: Sequence, base: int, path: list[int], prefilled: bool) -> None: ...

    def release(self, slot: int) -> None: ...

    def shrink(self) -> None: ...


class SlotStore:
    """A KV cache preallocated per layer, one slot per sequence, written at each slot's own
    positions; a rejected draft is simply overwritten by the next step (as gpt-fast does).
    prefix: token ids most prompts start with, whose KV is computed once and copied into each slot.
    kv_budget_bytes: sequences wait for a slot rather than grow the cache beyond this. backend: how
    the forwards are computed (default: `choose_backend(model)`, chosen once here). prefix_cache:
    prompts' KV kept across requests (a `PrefixCache`): a prompt starts from its longest cached
    prefix (the same passages in RAG), and leaves its own KV there once prefilled."""

    name = "batch"  # what `GenerationStats.backend` reports
    plain_steps = False  # no row is computed as plain one-token decoding computes it

    def __init__(self, model, prefix: list[int] | None = None, kv_budget_bytes: int = 4 << 30,
                 backend: Backend | None = None, prefix_cache=None) -> None:
        if not packed.supports(model):
            raise ValueError(f"the batched engine runs Llama-family decoders with full attention, not "
                             f"{model.config.model_type!r} ({model.config._attn_implementation})")
        self.model, self.kv_budget_bytes, self.prefix_cache = model, kv_budget_bytes, prefix_cache
        self.backend = (backend or choose_backend(model)).loaded(model)  # its decoders built once, here at the latest
        decoder = self.backend.decoders(model).engine
        self.layers = decoder.layers
        self.kv_heads, self.head_dim = decoder.kv_heads, decoder.head_dim
        self.token_bytes = 2 * len(self.layers) * self.kv_heads * self.head_dim * model.dtype.itemsize
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.prefix: list[int] = []
        self.prefix_kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        if prefix:
            self._compute_prefix(list(prefix))

    @torch.inference_mode()
    def ensure(self, slots: int, positions: int, most: int = 1) -> None:
        """Grow the cache to at least `slots` slots of `positions` positions (kept contents).
        Both grow by doubling (slots up to `most`, the batch size, and the KV budget): each growth copies
        the whole cache, so growing one slot at a time is costly (docs/architecture-core.md,
        Measurements: KV cache growth)."""
        have_s = self.keys[0].shape[0] if self.keys else 0
        have_p = self.keys[0].shape[2] if self.keys else 0
        if slots <= have_s and positions <= have_p:
            return
        p = have_p if positions <= have_p else max(positions, 2 * have_p, 128)
        fit = self.kv_budget_bytes // (p * self.token_bytes)
        # Longer slots may mean fewer of them within the budget: the ones past `slots` hold no sequence.
        s = max(slots, min(have_s if slots <= have_s else min(2 * have_s, most), fit))
        keep = min(have_s, s)
        shape = (s, self.kv_heads, p, self.head_dim)
        for i in range(len(self.layers)):
            for store in (self.keys, self.values):
                new = torch.zeros(shape, dtype=self.model.dtype, device=self.model.device)
                if i < len(store):
                    new[:keep, :, :have_p] = store[i][:keep]
                    store[i] = new
                else:
                    store.append(new)

    def _compute_prefix(self, prefix: list[int]) -> None:
        # Followed by filler rows up to PREFIX_ROWS: a prefix's KV does not depend on what follows
        # it, but in bf16 its rounding depends on the call's row count, and a short call rounds
        # otherwise than a whole prompt's prefill, moving outputs away from greedy
        # (docs/architecture-core.md, Measurements: shared prefix rows).
        rows = prefix + (prefix * PREFIX_ROWS)[: max(0, PREFIX_ROWS - len(prefix))]
        self.ensure(1, len(rows) + 1)
        packed.forward(self.model, self.backend, self.keys, self.values, [packed.Rows(0, rows)], [None], logits_rows=1)
        self.prefix = prefix
        self.prefix_kv = [(k[0, :, : len(prefix)].clone(), v[0, :, : len(prefix)].clone())
                          for k, v in zip(self.keys, self.values)]

    def admit(self, slot: int, prompt: list[int], max_new: int, *, slots: int, in_flight: int,
              batch_size: int) -> int | None:
        """Make room in cache slot `slot` (of `slots` made so far, at most `batch_size`) and copy the
        shared prefix's KV into it; None where the KV budget has no room now."""
        need = len(prompt) + max_new + 64  # room for the last step's draft rows (as `fits`)
        in_use = max(slots, slot + 1)
        have_p = self.keys[0].shape[2] if self.keys else 0
        if not in_flight and in_use * max(need, have_p) * self.token_bytes > self.kv_budget_bytes:
            self.shrink()  # nothing in flight: the cache is made anew at this sequence's size
            have_p = 0
        if in_use * max(need, have_p) * self.token_bytes > self.kv_budget_bytes:
            if in_flight:
                return None
            raise ValueError(f"a sequence of {need} tokens does not fit the KV budget of {self.kv_budget_bytes} bytes")
        self.ensure(in_use, need, batch_size)
        cached = len(self.prefix) if len(prompt) > len(self.prefix) and prompt[: len(self.prefix)] == self.prefix else 0
        kv = self.prefix_kv if cached else []
        if self.prefix_cache is not None:
            longer, n = self.prefix_cache.longest(prompt)
            if n > cached:
                kv, cached = [(k[0], v[0]) for k, v in longer], n
        for (k, v), keys, values in zip(kv, self.keys, self.values):
            keys[slot, :, :cached] = k
            values[slot, :, :cached] = v
        return cached

    def forward(self, seqs: list[Sequence], drafts: list[Draft | None], slots: list[int]) -> torch.Tensor:
        return packed.forward(self.model, self.backend, self.keys, self.values, seqs, drafts, where=slots)

    def keep(self, slot: int, seq: Sequence, base: int, path: list[int], prefilled: bool) -> None:
        if prefilled and self.prefix_cache is not None and base >= len(seq.prompt):  # the whole prompt's KV is in
            self.prefix_cache.put(seq.prompt, [(k[slot: slot + 1], v[slot: slot + 1]) for k, v in zip(self.keys, self.values)])
        keep_path((layer[slot] for store in (self.keys, self.values) for layer in store), base, path)

    def release(self, slot: int) -> None:
        """Nothing to free: the slot's positions are overwritten by the next sequence."""

    def shrink(self) -> None:
        """With no sequence in flight: give the cache's memory back (the next admission makes it
        anew; the shared prefix's KV is kept)."""
        self.keys, self.values = [], []

    def fits(self, tokens: int) -> bool:
        """Whether a sequence of `tokens` positions (prompt and answer) fits the KV budget alone."""
        return (tokens + 64) * self.token_bytes <= self.kv_budget_bytes


class CacheStore:
    """One sequence in the model's own `DynamicCache`: any architecture. Each forward is the
    model's `backend`'s (a near-tie redone by the plain one); the prompt's longest cached prefix
    comes from `prefix_cache` (an optional `PrefixCache`)."""

    def __init__(self, model, backend: Backend, prefix_cache=None) -> None:
        self.model, self.backend, self.prefix_cache = model, backend, prefix_cache
        self.plain = plain_backend(model.dtype)
        self.name, self.plain_steps = backend.name, backend.plain_steps
        self.cache = DynamicCache(config=model.config)

    def admit(self, slot: int, prompt: list[int], max_new: int, *, slots: int, in_flight: int, batch_size: int) -> int:
        if self.prefix_cache is None:
            return 0
        self.cache, cached = self.prefix_cache.lookup(prompt)
        return cached

    def forward(self, seqs: list[Sequence], drafts: list[Draft | None], slots: list[int]) -> torch.Tensor:
        (seq,), (draft,) = seqs, drafts
        if seq.length == 0 and self.cache.get_seq_length():  # the prefill again, after a near-tie
            self.cache = DynamicCache(config=self.model.config)
        backend = self.plain if seq.redo else self.backend
        return backend.forward(self.model, seq.fresh, self.cache, seq.length, draft,
                               greedy_margin=seq.tie_margin if seq.sampling is None else None)

    def keep(self, slot: int, seq: Sequence, base: int, path: list[int], prefilled: bool) -> None:
        if seq.length == 0:  # the prefill runs again
            return
        if prefilled and self.prefix_cache is not None:
            self.prefix_cache.store(seq.prompt, self.cache)
        keep_path((t for layer in self.cache.layers for t in (layer.keys, layer.values)), base, path)
        # drop the rejected nodes, and after a near-tie the position that runs again
        if (extra := self.cache.get_seq_length() - min(base + len(path), seq.length)) > 0:
            self.cache.crop(-extra)

    def release(self, slot: int) -> None:
        """Nothing to free: the cache goes with the store."""

    def shrink(self) -> None:
        """Nothing kept between sequences."""
