"""The exact attention (core/kernels/exact_attention.py): draft rows and a block after a cached prefix round
as plain decoding computes them."""

from __future__ import annotations

import pytest
import torch



def test_grouped_draft_rows_round_like_one_row_decode_steps_in_bf16():
    """exact_attention runs draft rows of similar length as one batched call over keys padded with
    masked zeros (see `_groups`); each row must come out bit for bit as its own one-row call, the
    call of a decode step. Qwen2.5-0.5B's attention shapes; chains (prefixes) and trees (gathered keys).
    The grouping rule is torch 2.13's AMX kernel's; where the self-check finds that this machine's
    kernel rounds otherwise (seen on an AVX2-only CPU), rows run one per call, and that must hold too."""
    from specsuite.core.kernels.exact_attention import _grouping_is_exact, _groups, _one_row_calls

    grouped = _grouping_is_exact(14, 2, 64)
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for trial in range(80):
        past, n = int(torch.randint(1, 1100, (), generator=gen)), int(torch.randint(2, 24, (), generator=gen))
        q = torch.randn(1, 14, n, 64, generator=gen).bfloat16()
        k, v = (torch.randn(1, 2, past + n, 64, generator=gen).bfloat16() for _ in range(2))
        if trial % 2:  # a chain: row j sees a prefix
            visible = [past + j + 1 for j in range(n)]
        else:  # a tree: the cache plus a random subset of the draft rows before it
            visible = [torch.cat([torch.arange(past + 1), past + 1 + torch.nonzero(
                torch.rand(j, generator=gen) < 0.5).squeeze(-1)]) for j in range(n)]
        lengths = [v_ if isinstance(v_, int) else len(v_) for v_ in visible]
        groups = _groups(lengths) if grouped else [[i] for i in range(n)]
        assert sorted(i for g in groups for i in g) == list(range(n))
        for group in groups:
            out = _one_row_calls(q[:, :, group], k, v, [visible[i] for i in group], 0.125, True)
            for col, i in enumerate(group):
                keys = torch.arange(visible[i]) if isinstance(visible[i], int) else visible[i]
                one = torch.nn.functional.scaled_dot_product_attention(
                    q[:, :, i: i + 1], k[:, :, keys], v[:, :, keys], scale=0.125, enable_gqa=True)
                assert torch.equal(out[0, col], one[0, :, 0]), (trial, past, i)
                checked += 1
    assert checked > 800


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_block_after_a_cached_prefix_rounds_like_the_whole_prompts_prefill(dtype):
    """With a prefix cache, the new prompt rows run after the cached keys; their attention must come
    out bit for bit as in one causal prefill of the whole prompt (what runs without the cache).
    Qwen2.5-0.5B's attention shapes, random prompt lengths and numbers of new rows."""
    import types

    from specsuite.core.kernels.exact_attention import _prefill_block
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = types.SimpleNamespace(is_causal=True, training=False, num_key_value_groups=7)
    gen = torch.Generator().manual_seed(1)
    for trial in range(30):
        end = int(torch.randint(100, 1300, (), generator=gen))
        block = int(torch.randint(2, 90, (), generator=gen))
        q = torch.randn(1, 14, end, 64, generator=gen).to(dtype)
        k, v = (torch.randn(1, 2, end, 64, generator=gen).to(dtype) for _ in range(2))
        whole = sdpa_attention_forward(module, q, k, v, None, scaling=0.125)[0]
        block_out = _prefill_block(q[:, :, end - block:], k, v, end - block, 0.125)
        assert torch.equal(block_out, whole[:, end - block:]), (trial, end, block)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv_heads", [2, 14])
def test_sdpa_is_hfs_sdpa_attention(dtype, kv_heads):
    """`sdpa` (the owned decoder's attention) makes the calls HF's sdpa attention makes: bit for bit
    its output at a prefill, a one-token step (with and without a mask) and rows under a mask."""
    import types

    from specsuite.core.kernels.exact_attention import sdpa
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = types.SimpleNamespace(is_causal=True, training=False, num_key_value_groups=14 // kv_heads)
    gen = torch.Generator().manual_seed(2)
    for rows, past, masked in ((40, 0, False), (1, 70, False), (1, 70, True), (9, 70, True)):
        q = torch.randn(1, 14, rows, 64, generator=gen).to(dtype)
        k, v = (torch.randn(1, kv_heads, past + rows, 64, generator=gen).to(dtype) for _ in range(2))
        mask = torch.rand(1, 1, rows, past + rows, generator=gen) < 0.7 if masked else None
        if mask is not None:
            mask[..., 0] = True
        theirs = sdpa_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=0.125)[0]
        assert torch.equal(sdpa(q, k, v, mask, 0.125), theirs), (rows, past, masked)
