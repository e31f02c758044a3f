"""Attention that rounds every draft row exactly as one-token decoding does.

Verifying k draft tokens in one forward is only lossless if each row's logits are the ones plain
decoding would compute. In bf16 they are not quite: a k-row attention call takes other kernel paths
than the one-row calls of `generate()`, and the last-bit differences flip near-ties of the argmax
(docs/architecture-core.md, Measurements: exact attention). So this attention runs the leading
block of rows (the prompt, at prefill) as one causal call, exactly as `generate()`'s prefill
does, and the root and each draft row as a one-row call over exactly the keys it may see,
exactly as a decode step does. In bf16, rows of similar length share one call, batched and
padded where that rounds the same (tested; see `_groups`).

The linear layers need the same care in bf16: see exact_linear.py. The caller (forward.py's
`cache_forward`) says which rows are the block. In fp32 the differences are ~1e-5, and generate() guards near-ties.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
         scaling: float) -> torch.Tensor:
    """A causal decoder's attention by the very calls HF's sdpa attention makes on the CPU (so bit for
    bit its rounding): query (b, heads, q, d), key/value (b, kv_heads, kv, d) -> (b, q, heads, d)."""
    b, heads, rows, dim = query.shape
    groups = heads // key.shape[1]
    gqa = {}
    if groups > 1:
        if mask is None:
            gqa["enable_gqa"] = True
        elif rows == 1:  # one query row: the query heads of each key/value head as its rows
            query = query.reshape(b, heads // groups, groups, dim)
        else:
            key, value = (t[:, :, None].expand(-1, -1, groups, -1, -1).reshape(b, heads, -1, t.shape[-1])
                          for t in (key, value))
    causal = rows > 1 and mask is None
    if causal and key.shape[2] > rows:  # a causal call aligns its mask top-left: only the first rows' keys
        key, value = key[:, :, :rows], value[:, :, :rows]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, is_causal=causal, **gqa)
    return out.reshape(out.shape[0], -1, rows, value.shape[-1]).transpose(1, 2).contiguous()


def exact_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                    block: int, memo: dict, scaling: float) -> torch.Tensor:
    """query (b, heads, q, d), key/value (b, kv_heads, kv, d) -> (b, q, heads, d): the first `block`
    query rows as a prefill's causal call, the others as one-token steps (`memo`: one dict per
    forward, which keeps the row calls for the forward's other layers)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if q_len == 1 or (block >= q_len and block == kv_len):
        return sdpa(query, key, value, attention_mask, scaling)
    past = kv_len - q_len
    out = []
    if block > 1:
        out.append(_prefill_block(query[:, :, :block], key, value, past, scaling))
    else:
        block = 0  # a lone root token is a decode step: a row like the draft rows below
    # The row calls are the same in every layer of this forward: planned once.
    plan_key = ("row calls", q_len, kv_len, block, None if attention_mask is None else attention_mask.data_ptr())
    calls = memo.get(plan_key)
    if calls is None:
        grouped = query.dtype == torch.bfloat16 and _grouping_is_exact(query.shape[1], key.shape[1], query.shape[3])
        calls = memo[plan_key] = _row_calls(attention_mask, block, q_len, past, grouped)
    gqa = query.shape[1] > key.shape[1]
    draft_query = query[:, :, block:]
    draft_out = query.new_empty(query.shape[0], q_len - block, query.shape[1], query.shape[3])
    for call in calls:
        draft_out[:, call.rows] = _run_call(draft_query[:, :, call.rows], key, value, call, scaling, gqa)
    if q_len > block:
        out.append(draft_out)
    return (out[0] if len(out) == 1 else torch.cat(out, dim=1)).contiguous()


def _row_calls(mask: torch.Tensor | None, block: int, q_len: int, past: int, grouped: bool) -> list[RowCall]:
    """The one-row calls (batched where `grouped`, see `_groups`) of query rows block..q_len."""
    if mask is not None and mask.dtype != torch.bool:
        mask = mask == 0  # additive float mask: 0 where visible
    rows = list(range(block, q_len))
    visible = _visible(mask, rows, past)
    lengths = [v if isinstance(v, int) else len(v) for v in visible]
    if grouped:  # prefix rows and gathered rows grouped apart
        prefix = [i for i, v in enumerate(visible) if isinstance(v, int)]
        gathered = [i for i, v in enumerate(visible) if not isinstance(v, int)]
        groups = [[part[j] for j in group] for part in (prefix, gathered)
                  for group in _groups([lengths[i] for i in part])]
    else:
        groups = [[i] for i in range(len(rows))]
    return [call for group in groups for call in _plan_call(group, [visible[i] for i in group], past + q_len)]


# A block after a reused prefix runs with at least this many query rows (see `_prefill_block`).
MIN_BLOCK_ROWS = 64


def _prefill_block(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, past: int,
                   scaling: float) -> torch.Tensor:
    """The causal attention of a block of `block` plain rows after `past` cached keys, rounded as
    in one causal prefill of all past + block rows (what plain decoding does without a prefix cache).

    query (b, heads, block, d), key/value (b, kv_heads, >= past + block, d) -> (b, block, heads, d).
    The CPU kernel rounds a row alike whether it runs in a causal call over the whole prompt or under
    a mask in a call of at least MIN_BLOCK_ROWS query rows; with fewer rows some round otherwise,
    and cached answers then differ from uncached ones. So a short block is padded with dummy
    queries for the last cached rows; the kernel's rule is checked once per shape by
    `_short_block_is_exact`, else the block is padded to the whole prompt (exact, but far dearer;
    docs/architecture-core.md, Measurements: prefill blocks after a reused prefix)."""
    block, end = query.shape[2], past + query.shape[2]
    start = 0
    if past and _short_block_is_exact(query.shape[1], key.shape[1], query.shape[3], query.dtype):
        start = max(end - max(block, MIN_BLOCK_ROWS), 0)
    return _causal_rows(query, key, value, start, past, scaling)


def _causal_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, start: int, past: int,
                 scaling: float) -> torch.Tensor:
    """Rows past.. of a causal call over keys :past + q, run as query rows start.. only (dummy
    queries for start..past). query (b, heads, q, d) -> (b, q, heads, d)."""
    end = past + query.shape[2]
    if past > start:
        query = torch.cat([query.new_zeros(*query.shape[:2], past - start, query.shape[3]), query], dim=2)
    mask = None  # None: the causal call over all rows
    if start:
        mask = torch.ones(end - start, end, dtype=torch.bool).tril(diagonal=start)[None, None]
    return sdpa(query, key[:, :, :end], value[:, :, :end], mask, scaling)[:, past - start:]


@functools.cache
def _short_block_is_exact(heads: int, kv_heads: int, dim: int, dtype: torch.dtype) -> bool:
    """Whether `_prefill_block` rounds as a causal call over the whole prompt when it runs only the
    last MIN_BLOCK_ROWS rows; checked once per attention shape on random rows (tens of ms)."""
    gen = torch.Generator().manual_seed(0)
    for end, block in ((300, 17), (793, 25), (520, 1 + MIN_BLOCK_ROWS), (1100, 40)):
        q = torch.randn(1, heads, end, dim, generator=gen).to(dtype)
        k, v = (torch.randn(1, kv_heads, end, dim, generator=gen).to(dtype) for _ in range(2))
        whole = sdpa(q, k, v, None, dim ** -0.5)
        short = _causal_rows(q[:, :, end - block:], k, v, max(end - max(block, MIN_BLOCK_ROWS), 0),
                             end - block, dim ** -0.5)
        if not torch.equal(short, whole[:, end - block:]):
            return False
    return True


def _visible(mask: torch.Tensor | None, rows: list[int], past: int) -> list[int | torch.Tensor]:
    """The keys each query row may see: their count where they are a prefix of the keys (a chain,
    or a tree's first branch), else their indices (the cache, the root and the node's ancestors)."""
    if mask is None or not rows:  # causal
        return [past + row + 1 for row in rows]
    m = mask[0, 0, rows[0]: rows[-1] + 1]  # (rows, kv) bool
    counts = m.sum(-1)
    last = m.shape[-1] - 1 - m.flip(-1).to(torch.uint8).argmax(-1)  # index of the last visible key
    return [int(n) if is_prefix else m[i].nonzero().squeeze(-1)
            for i, (n, is_prefix) in enumerate(zip(counts.tolist(), (counts == last + 1).tolist()))]


def _groups(lengths: list[int]) -> list[list[int]]:
    """Rows (by index) whose one-row calls may run as one batched call, padded to a common length.

    A one-row call of the bf16 CPU kernel rounds the same over keys padded with masked zeros as long
    as the padding stays within the same 16-key vector and the padded length is odd (its sums run
    16 lanes wide, its bf16 products in pairs). Found by experiment on torch's CPU kernel
    (docs/architecture-core.md, Measurements: grouped attention rows), checked on each machine by
    `_grouping_is_exact` and tested in tests/core/scheduler/test_core_generate.py. A row whose length ends a
    vector cannot be padded: it runs alone."""
    by_vector: dict[int, list[int]] = {}
    alone: list[list[int]] = []
    for i, n in enumerate(lengths):
        if n % 16 == 0:
            alone.append([i])
        else:
            by_vector.setdefault((n - 1) // 16, []).append(i)
    return list(by_vector.values()) + alone


@functools.cache
def _grouping_is_exact(heads: int, kv_heads: int, dim: int) -> bool:
    """Whether grouped rows (`_groups`) round as one-row calls do, on this machine's kernel.

    The rule was found on one torch build's CPU kernel; another build or CPU may round otherwise. So it
    is checked once per attention shape on random rows (milliseconds), and rows run one per call if not."""
    gen = torch.Generator().manual_seed(0)
    for past in (100, 131, 700):
        n = 16
        q = torch.randn(1, heads, n, dim, generator=gen).bfloat16()
        k, v = (torch.randn(1, kv_heads, past + n, dim, generator=gen).bfloat16() for _ in range(2))
        lengths = [past + j + 1 for j in range(n)]
        for group in _groups(lengths):
            together = _one_row_calls(q[:, :, group], k, v, [lengths[i] for i in group], None, heads > kv_heads)
            for col, i in enumerate(group):
                alone = _one_row_calls(q[:, :, i: i + 1], k, v, [lengths[i]], None, heads > kv_heads)
                if not torch.equal(together[:, col], alone[:, 0]):
                    return False
    return True


@dataclasses.dataclass
class RowCall:
    """One kernel call for g query rows, each as its own one-row decode step (in the batch dimension).

    rows: the rows' indices among the rows planned together, a slice where they are consecutive (a
    view of the queries and outputs, no gather); width: keys per row, padded;
    index: (g, width) the key indices of each row, or None where they are a prefix of the cache;
    mask: (g, 1, 1, width) bool, the padding masked out, or None."""

    rows: torch.Tensor | slice
    width: int
    index: torch.Tensor | None
    mask: torch.Tensor | None


def _plan_call(rows: list[int], visible: list[int | torch.Tensor], kv_len: int) -> list[RowCall]:
    """The call(s) for rows that may share one (`_groups`); visible[i]: the key indices row i sees,
    or their count for a prefix of the keys."""
    g = len(rows)
    lengths = [v if isinstance(v, int) else len(v) for v in visible]
    width = max(lengths)
    if g > 1 and width % 2 == 0:
        width += 1  # an odd padded length (see _groups)
    prefixes = all(isinstance(v, int) for v in visible)
    if prefixes and width > kv_len:  # no key to pad with: the longest row goes alone
        return _plan_call(rows[:-1], visible[:-1], kv_len) + _plan_call(rows[-1:], visible[-1:], kv_len)
    index = None
    if not prefixes:  # gather each row's keys, in order, padded with key 0 (masked out)
        index = torch.zeros(g, width, dtype=torch.long)
        for i, vis in enumerate(visible):
            index[i, : lengths[i]] = torch.arange(vis) if isinstance(vis, int) else vis
    mask = None
    if min(lengths) < width:
        mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]
    consecutive = rows == list(range(rows[0], rows[0] + g))
    return [RowCall(slice(rows[0], rows[0] + g) if consecutive else torch.tensor(rows), width, index, mask)]


def _run_call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, call: RowCall,
              scaling: float | None, gqa: bool) -> torch.Tensor:
    """query (1, heads, g, d), key/value (1, kv_heads, kv, d) -> (1, g, heads, d). For one row this
    is the very call a one-token decode step makes in `sdpa` (as HF's sdpa attention: GQA in the
    kernel), made directly: the wrapper's checks cost more than the kernel here."""
    g = query.shape[2]
    if call.index is None:  # prefixes of the cache: no copy
        k = key[:, :, : call.width].expand(g, -1, -1, -1)
        v = value[:, :, : call.width].expand(g, -1, -1, -1)
    else:
        k, v = key[0][:, call.index].transpose(0, 1), value[0][:, call.index].transpose(0, 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query[0].transpose(0, 1).unsqueeze(2), k, v, attn_mask=call.mask, dropout_p=0.0, scale=scaling, enable_gqa=gqa)
    return out[:, :, 0].unsqueeze(0)  # (g, heads, 1, d) -> (1, g, heads, d)


def _one_row_calls(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   visible: list[int | torch.Tensor], scaling: float | None, gqa: bool) -> torch.Tensor:
    """The decode-step attention of g rows that may share a call (`_groups`): query (1, heads, g, d),
    visible[i] as in `_plan_call` -> (1, g, heads, d)."""
    calls = _plan_call(list(range(len(visible))), visible, key.shape[2])
    return torch.cat([_run_call(query[:, :, call.rows], key, value, call, scaling, gqa) for call in calls], dim=1)

