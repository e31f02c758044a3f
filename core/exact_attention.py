"""Attention that rounds every draft row exactly as one-token decoding does.

Verifying k draft tokens in one forward is only lossless if each row's logits are the ones plain
decoding would compute. In bf16 they are not quite: a k-row attention call takes other kernel paths
than the one-row calls of `generate()`, and the last-bit differences flip near-ties of the argmax
(measured here on Qwen2.5-0.5B: 3 of 20 JFLEG corrections diverged from greedy; 0 of 20 with this
attention). So this attention runs the leading block of rows (the prompt, at prefill) as one
causal call, exactly as `generate()`'s prefill does, and the root and each draft row as its own
one-row call over exactly the keys it may see, exactly as a decode step does.

What remains: the linear layers are row-independent only up to the last bit (a one-row matmul
takes another kernel than a multi-row one), which can still flip an exact tie of bf16 logits now
and then; the tie guard in generate.py catches most. In fp32 the differences are ~1e-5.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "specsuite_exact"

# How many leading query rows of the current forward are plain (prompt/fresh) tokens.
_block_rows: contextvars.ContextVar[int | None] = contextvars.ContextVar("specsuite_block_rows", default=None)


@contextlib.contextmanager
def block_rows(n: int):
    """Within this context, forwards compute their first `n` query rows as one causal block."""
    token = _block_rows.set(n)
    try:
        yield
    finally:
        _block_rows.reset(token)


def exact_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """query (b, heads, q, d), key/value (b, kv_heads, kv, d) -> ((b, q, heads, d), None)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    block = _block_rows.get()
    if q_len == 1 or block is None or (block >= q_len and block == kv_len):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    past = kv_len - q_len
    out = []
    if block > 1:
        # The block runs as the causal prefill of plain decoding does. After a reused prefix (prefix
        # cache) its rows are padded with dummy queries for the prefix, so that the kernel splits
        # them as in a prefill of the whole prompt; the padding rows are dropped.
        # (Measured on Spec-Bench RAG follow-ups in bf16: 2 of 3 identical to uncached with the
        # padding, 0 of 3 running the rows alone under a mask; time to first token 24% vs 14%.)
        q_block = query[:, :, :block]
        if past:
            q_block = torch.cat([q_block.new_zeros(*q_block.shape[:2], past, q_block.shape[3]), q_block], dim=2)
        out.append(sdpa_attention_forward(module, q_block, key[:, :, : past + block],
                                          value[:, :, : past + block], None, **kwargs)[0][:, past:])
    else:
        block = 0  # a lone root token is a decode step: a row like the draft rows below
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask == 0  # additive float mask: 0 where visible
    # Draft rows: the very call a one-token decode step makes in HF's sdpa_attention_forward (no
    # mask, GQA in the kernel), made directly: the wrapper's checks cost more than the kernel here.
    scaling, gqa = kwargs.get("scaling"), getattr(module, "num_key_value_groups", 1) > 1
    rows = []
    for row in range(block, q_len):
        if attention_mask is None:  # causal: a contiguous prefix of the keys
            k, v = key[:, :, : past + row + 1], value[:, :, : past + row + 1]
        else:  # a token tree: the cache, the root and this node's ancestors, in order
            visible = attention_mask[0, 0, row].nonzero().squeeze(-1)
            k, v = key[:, :, visible], value[:, :, visible]
        rows.append(torch.nn.functional.scaled_dot_product_attention(
            query[:, :, row: row + 1], k, v, dropout_p=0.0, scale=scaling, enable_gqa=gqa))
    if rows:
        out.append(torch.cat(rows, dim=2).transpose(1, 2))
    return torch.cat(out, dim=1).contiguous(), None


AttentionInterface.register(NAME, exact_attention)
# Masks are built as for sdpa, so that HF's own generate() sees exactly what it would with sdpa.
AttentionMaskInterface.register(NAME, sdpa_mask)
