"""Reusing the KV cache of prompt prefixes across calls (same passages, a follow-up question).

Lossless in exact arithmetic: a prefix's keys and values do not depend on what follows it. Entries
are whole prompts' KV; a new prompt reuses the longest common prefix with any entry (at least
`min_tokens`). Memory is bounded by an LRU budget in bytes.

Rounding: in fp32 the output is identical with and without the cache (tested), though not bit for
bit on every CPU (on an AVX2-only one the cached rows' logits differ in the last bits), so a
near-tie of the first token is decided by a whole-prompt prefill (`generate()`). In bf16 on CPU the
matmuls of the few fresh rows round differently from those of a whole-prompt prefill, which can
flip exact ties of the argmax later on (docs/architecture-core.md, Measurements: prefix cache in
bf16); `specsuite bench rag` reports the rate for the model at hand.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch
from transformers import DynamicCache


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """LRU cache of prompt KV, keyed by token ids. `max_bytes=0` turns it off."""

    def __init__(self, model_config, max_bytes: int = 1 << 30, min_tokens: int = 16, fresh_tokens: int = 8) -> None:
        self.config, self.max_bytes, self.min_tokens = model_config, max_bytes, min_tokens
        # At least this many prompt tokens always run: a lone row would take the one-row matmul
        # kernels, further from the multi-row prefill of plain decoding than a block of rows.
        self.fresh_tokens = fresh_tokens
        self.entries: OrderedDict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0
        self._lock = threading.Lock()

    @staticmethod
    def _size(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)

    def lookup(self, prompt: list[int]) -> tuple[DynamicCache, int]:
        """A cache holding the KV of the longest cached prefix of `prompt` (never all of it: the
        last prompt token must run to give logits), and that prefix's length."""
        cache = DynamicCache(config=self.config)
        kv, n = self.longest(prompt)
        for layer, (k, v) in enumerate(kv):
            cache.update(k, v, layer)
        return cache, n

    def _best(self, prompt: list[int]) -> tuple[tuple[int, ...] | None, int]:
        """The entry sharing the longest usable prefix with `prompt`, and that length (None, 0 where
        none reaches `min_tokens`). The caller holds the lock."""
        best, best_len = None, 0
        for key in self.entries:
            n = min(common_prefix(list(key), prompt), len(prompt) - self.fresh_tokens)
            if n > best_len:
                best, best_len = key, n
        return (best, best_len) if best is not None and best_len >= self.min_tokens else (None, 0)

    def cached_length(self, prompt: list[int]) -> int:
        """How many of `prompt`'s tokens `longest` would give now (no hit or miss counted)."""
        with self._lock:
            return self._best(prompt)[1]

    def longest(self, prompt: list[int]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
        """The keys and values, per layer (1, heads, n, dim), of the longest cached prefix of
        `prompt` (views of the entry), and its length n (0 and [] where none is long enough)."""
        with self._lock:
            best, best_len = self._best(prompt)
            if best is None:
                self.misses += 1
                return [], 0
            self.entries.move_to_end(best)
            self.hits += 1
            kv = self.entries[best]
        return [(k[..., :best_len, :], v[..., :best_len, :]) for k, v in kv], best_len

    def store(self, prompt: list[int], cache: DynamicCache) -> None:
        """Keep the KV of `prompt` (the first len(prompt) positions of `cache`)."""
        self.put(prompt, [(layer.keys, layer.values) for layer in cache.layers])

    def put(self, prompt: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep the KV of `prompt`: the first len(prompt) positions of each layer's (1, heads, >= n, dim) keys and values."""
        if self.max_bytes <= 0:
            return
        n = len(prompt)
        # Copies, so that the entry owns exactly what it counts (a view would pin the whole tensor).
        kv = [(k[..., :n, :].clone(), v[..., :n, :].clone()) for k, v in kv]
        size = self._size(kv)
        if size > self.max_bytes:
            return
        with self._lock:
            key = tuple(prompt)
            if key in self.entries:
                self.bytes -= self._size(self.entries.pop(key))
            self.entries[key] = kv
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, old = self.entries.popitem(last=False)
                self.bytes -= self._size(old)

    def clear(self) -> None:
        with self._lock:
            self.entries.clear()
            self.bytes = 0
