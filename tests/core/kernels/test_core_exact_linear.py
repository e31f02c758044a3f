"""The exact linear forms (core/kernels/exact_linear.py): draft rows round as one-row decode steps in bf16;
the fp32 kernel forms. CPU-specific checks are visible skips."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from specsuite.core import generate
from specsuite.core.kernels import exact_linear
from specsuite.core.model.backend import EXACT_BF16, FP32_CPU, MIN_SHORT_CALL_ROWS, choose_backend
from conftest import QWEN_LINEARS, hf_greedy, prompts, OracleTreeDrafter


QWEN_15B_DOWN = (1536, 8960, False)  # Qwen2.5-1.5B's down projection


def test_linear_rows_round_like_one_row_decode_steps_in_bf16():
    """exact_linear computes draft rows (and one-token steps) in the form `_form` chose; each row
    must come out bit for bit as its own one-row `F.linear`, the call of HF's decode step.
    Qwen2.5-0.5B's shapes and Qwen2.5-1.5B's down projection (plain multi-row calls do not always
    round so: `test_plain_multi_row_calls_round_otherwise_on_the_amx_kernel`)."""
    for out_f, in_f, bias, m, x, weight, b, alone in _bf16_rows_and_one_row_calls():
        assert torch.equal(exact_linear.one_row_rounding(x, weight, b), alone), (out_f, in_f, m)


def _bf16_rows_and_one_row_calls():
    """Random bf16 inputs of Qwen's linear shapes, each with its rows computed one by one."""
    gen = torch.Generator().manual_seed(0)
    for out_f, in_f, bias in QWEN_LINEARS + [QWEN_15B_DOWN]:
        weight = (torch.randn(out_f, in_f, generator=gen) * in_f ** -0.5).bfloat16()
        b = torch.randn(out_f, generator=gen).bfloat16() if bias else None
        for m in (1, 2, 9, 17, 32, 33, 40, 70, 128, 161, 200):
            x = (torch.randn(m, in_f, generator=gen) * 2).bfloat16()
            yield out_f, in_f, bias, m, x, weight, b, torch.cat([torch.nn.functional.linear(x[i: i + 1], weight, b)
                                                                  for i in range(m)])


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return set()


AMX = "amx_bf16" in _cpu_flags()


NOT_AMX = "the forms were found on torch 2.13's AMX bf16 kernel; other CPUs choose other forms"


@pytest.mark.skipif(not AMX, reason=NOT_AMX)
def test_plain_multi_row_calls_round_otherwise_on_the_amx_kernel():
    """Why exact_linear exists there: plain multi-row calls do not always round as one-row calls
    (the down projections' wide inputs), and the forms it chose: no Qwen layer falls back to one
    call per row (exact, but a verify step ~1.5x slower)."""
    assert exact_linear._form(896, 4864, False)[:2] == ("padded", 33)
    assert any(not torch.equal(torch.nn.functional.linear(x, weight, b), alone)
               for *_, x, weight, b, alone in _bf16_rows_and_one_row_calls())
    assert all(exact_linear._form(*shape).kind == "packed" for shape in QWEN_LINEARS if shape != (896, 4864, False))
    assert exact_linear._form(*QWEN_15B_DOWN) == ("padded", 192, 15)


def _one_layer_qwen_15b_mlp():
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=512, hidden_size=1536, intermediate_size=8960, num_hidden_layers=1,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16).eval()
    return model


def test_exact_bf16_drafts_fit_the_short_calls_of_a_wide_down_projection():
    """A one-layer model with Qwen2.5-1.5B's MLP shapes: where its down projection rounds as
    one-row calls column-major only up to `short` rows, drafts are capped to fit (the padded calls
    beyond cost ~1.3x a forward); every row still rounds as a decode step, so the output is greedy's."""
    model = _one_layer_qwen_15b_mlp()
    rows = exact_linear.short_call_rows(model)
    assert 2 <= rows <= exact_linear.PLAIN_ROWS
    exact = choose_backend(model, "exact")
    cap = exact.draft_sizes
    assert cap == ((rows - 1,) if MIN_SHORT_CALL_ROWS <= rows < exact_linear.PLAIN_ROWS else (31,))
    for i, p in enumerate(prompts(3, seed=21, vocab=512, lengths=(5, 40))):
        truth = hf_greedy(model, p, 40)
        out = generate(model, p, OracleTreeDrafter(p, truth, seed=i, vocab=512, depth=(4, 24)), max_new_tokens=30,
                       eos_token_id=[], backend=exact)
        assert out.tokens == truth[:30], f"prompt {i}"
        assert max(out.stats.drafted) <= cap[0]


@pytest.mark.skipif(not AMX, reason=NOT_AMX)
def test_the_amx_kernel_caps_drafts_at_the_short_calls_of_qwen_15b_down_projection():
    """Where this was found: Qwen2.5-1.5B's down projection rounds as one-row calls column-major up
    to 15 rows, so exact-bf16 drafts are capped at 14 nodes."""
    model = _one_layer_qwen_15b_mlp()
    assert exact_linear.short_call_rows(model) == 15 and choose_backend(model, "exact").draft_sizes == (14,)


def test_split_sums_finds_where_a_matmul_sums_its_input_apart():
    """`_split_sums` on matmuls whose order of summation is known: one running sum over the input
    (blocks of 32 in turn), and two halves summed apart then added, as a kernel's threads may."""

    def blocks(x: torch.Tensor, weight: torch.Tensor, start: int, end: int) -> torch.Tensor:
        acc = torch.zeros(x.shape[0], weight.shape[0])
        for k in range(start, end, 32):  # each block holds at most one nonzero product per output
            acc = acc + x[:, k: k + 32].float() @ weight[:, k: k + 32].float().T
        return acc

    one_sum = lambda x, w, b: blocks(x, w, 0, x.shape[1]).bfloat16()  # noqa: E731
    halves = lambda x, w, b: (blocks(x, w, 0, 320) + blocks(x, w, 320, x.shape[1])).bfloat16()  # noqa: E731
    assert exact_linear._split_sums(one_sum, 64, 640, [1, 2]) == [[], []]
    assert exact_linear._split_sums(halves, 64, 640, [1, 2]) == [[320], [320]]


def test_exact_linear_does_without_packed_calls_where_onednn_refuses_them(monkeypatch):
    """On a CPU without avx512 torch refuses bf16 oneDNN calls on packed weights: the forms then
    do without them, and rows still round as one-row calls."""
    def refused(x, weight, bias, packed=None):
        raise RuntimeError("mkldnn_linear: bf16 path needs the cpu support avx_ne_convert or avx512bw")

    monkeypatch.setattr(exact_linear, "_packed_call", refused)
    for cached in (exact_linear.packed_bf16_runs, exact_linear._form):
        cached.cache_clear()
    try:
        assert not exact_linear.packed_bf16_runs()
        gen = torch.Generator().manual_seed(4)
        weight = (torch.randn(128, 896, generator=gen) * 896 ** -0.5).bfloat16()
        x = torch.randn(9, 896, generator=gen).bfloat16()
        assert exact_linear._form(128, 896, False).kind != "packed"
        alone = torch.cat([torch.nn.functional.linear(x[i: i + 1], weight) for i in range(9)])
        assert torch.equal(exact_linear.one_row_rounding(x, weight, None), alone)
    finally:  # the forms of this machine again for the other tests
        monkeypatch.undo()
        for cached in (exact_linear.packed_bf16_runs, exact_linear._form):
            cached.cache_clear()


def test_fp32_rows_are_the_linear_layer_in_padded_column_calls():
    """`fp32_rows` (2-4-row calls in fp32): `weight @ x.T` in calls of 2, 4, 8, 16 or 32 zero-padded
    columns, `F.linear`'s values up to fp32 rounding, as contiguous rows."""
    gen = torch.Generator().manual_seed(2)
    for out_f, in_f, bias in QWEN_LINEARS:
        weight = torch.randn(out_f, in_f, generator=gen) * in_f ** -0.5
        b = torch.randn(out_f, generator=gen) if bias else None
        for m in (1, 2, 3, 5, 9, 17, 32, 40):
            x = torch.randn(m, in_f, generator=gen)
            out = exact_linear.fp32_rows(x, weight, b)
            assert out.shape == (m, out_f) and out.is_contiguous()
            torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_padded_calls_run_inside_and_outside_inference_mode_in_either_order():
    """The padding buffer kept per thread: one made under inference mode (a generate call) is an
    inference tensor, so a later call outside it (a backend's check at load) needs its own (the
    CI failure of 2026-12-06: "Inplace update to inference tensor outside InferenceMode")."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(64, 96, generator=gen)
    for first_inside in (True, False):
        exact_linear._pads.__dict__.pop("buffers", None)
        for inside in (first_inside, not first_inside, first_inside):
            for m in (3, 2):  # 3 rows then 2: the buffer's third row is zeroed again in place
                x = torch.randn(m, 96, generator=gen)
                with torch.inference_mode(inside):
                    out = exact_linear.fp32_rows(x, weight, None)
                torch.testing.assert_close(out, x @ weight.T, rtol=1e-5, atol=1e-5)


def test_fp32_forwards_take_the_fast_kernels_and_plain_calls_stay_plain():
    """In fp32 forwards' linear modules: 2-4 rows as `fp32_rows`, other counts (a one-token step, a
    prefill, long drafts) on oneDNN with packed weights, all `F.linear`'s values up to rounding.
    The packed weights (the backend's own) follow in-place changes of the weight and stay out of
    copies of the model."""
    gen = torch.Generator().manual_seed(3)
    layer = torch.nn.Linear(896, 128)
    model = torch.nn.Sequential(layer)
    backend = FP32_CPU.owned()
    module = backend.module(layer)  # shares the layer's weight
    for rows, block in ((1, 1), (3, 1), (4, 4), (9, 4), (40, 40)):
        x = torch.randn(1, rows, 896, generator=gen)
        out = module(x, block)
        plain = torch.nn.functional.linear(x, layer.weight, layer.bias)
        torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-5)
        if 2 <= rows <= 4:
            assert torch.equal(out[0], exact_linear.fp32_rows(x[0], layer.weight, layer.bias))
        elif exact_linear.ONEDNN:
            packed = backend.packed(layer.weight)
            assert torch.equal(out, torch.ops.mkldnn._linear_pointwise(x, packed, layer.bias, "none", [], ""))
    x = torch.randn(1, 9, 896, generator=gen)
    with torch.no_grad():
        layer.weight.mul_(2)
    torch.testing.assert_close(module(x, 9),
                               torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    twin = copy.deepcopy(model)
    assert torch.equal(twin[0].weight, layer.weight)


def test_exact_linear_splits_block_rows_from_draft_rows():
    """In a forward of (n block, total) rows: the n block rows as one call of their own (a prefill),
    every other row as a one-row call; an lm_head that sees only the last rows is called with its
    block counted from the end (as forward.py does)."""
    gen = torch.Generator().manual_seed(1)
    layer = torch.nn.Linear(896, 4864, bias=False).bfloat16()
    x = torch.randn(1, 50, 896, generator=gen).bfloat16()
    alone = torch.cat([torch.nn.functional.linear(x[:, i: i + 1], layer.weight) for i in range(50)], dim=1)
    module = EXACT_BF16.module(layer)
    out = module(x, 40)
    tail = module(x[:, -11:], 40 - (50 - 11))  # logits_to_keep=11: the last block row and the draft rows
    assert torch.equal(out[:, :40], torch.nn.functional.linear(x[:, :40], layer.weight))
    assert torch.equal(out[:, 40:], alone[:, 40:])
    assert torch.equal(tail, alone[:, -11:])
