"""The integer linear layers and their backends: `int8` (core/kernels/int8_linear.py: int8 weights and
activations) and `weight-int8` (core/kernels/weight_int8.py: int8 weights, fp32 activations). Every
row of a call of any row count comes out bit for bit as its one-row call; `generate()` and the
batched engine are token for token the backend's own one-token greedy decoding. Where a kernel is
not exact the backend is refused, and these are visible skips. The whole module runs again with
oneDNN capped at AVX2, as on a CPU without VNNI (`test_an_avx2_only_cpu_...`)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from specsuite.core import EngineConfig, generate, SamplingParams
from specsuite.core.model.backend import choose_backend
from specsuite.core.speculation.draft_budget import StepCost
from specsuite.core.scheduler.engine import BatchEngine, Request
from specsuite.core.scheduler.prefix_cache import PrefixCache
from specsuite.core.kernels.int8_linear import (REDUCED_WEIGHT_MAX, Int8Kernel, Int8Weights, int8_rows, int8_runs,
                                                quantize_rows)
from specsuite.core.kernels.weight_int8 import WeightInt8Store, weight_int8_rows, weight_int8_runs
from conftest import QWEN_LINEARS, REPO, OracleTreeDrafter, prompts, tiny_model

needs_int8 = pytest.mark.skipif(not int8_runs(), reason="oneDNN's int8 kernel does not give exact sums on this CPU")
needs_weight_int8 = pytest.mark.skipif(not weight_int8_runs(),
                                       reason="ATen's _weight_int8pack_mm does not compute rows alike here")
# Each integer backend kind, skipped where its kernel is not exact.
INTEGER_KINDS = [pytest.param("int8", marks=needs_int8), pytest.param("weight-int8", marks=needs_weight_int8)]
# Each integer linear form with its weight store and its distance from the float layer.
INTEGER_FORMS = [pytest.param(int8_rows, Int8Weights, 0.05, marks=needs_int8, id="int8"),
                 pytest.param(weight_int8_rows, WeightInt8Store, 0.02, marks=needs_weight_int8, id="weight-int8")]

@pytest.mark.parametrize("rows_form, store, tolerance", INTEGER_FORMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_row_of_an_integer_call_is_its_one_row_call(dtype, rows_form, store, tolerance):
    """A verify forward, a prefill and a batched step compute their rows in calls of any row count:
    each row must be bit for bit what a one-token step computes for it, and near the float layer."""
    gen = torch.Generator().manual_seed(0)
    for out_f, in_f, bias in QWEN_LINEARS:
        layer = torch.nn.Linear(in_f, out_f, bias=bias).to(dtype)
        weights = store()
        for m in (1, 2, 3, 5, 9, 17, 32, 33, 70, 161):
            x = torch.randn(1, m, in_f, generator=gen)
            x[..., 7] *= 4  # an outlier channel, as real activations have (it coarsens the row's scale)
            x = x.to(dtype)
            with torch.inference_mode():
                rows = rows_form(layer, x, m, weights)
                alone = torch.cat([rows_form(layer, x[:, i: i + 1], 1, weights) for i in range(m)], dim=1)
                assert rows.dtype == dtype and torch.equal(rows, alone), (out_f, in_f, m)
                exact = torch.nn.functional.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
                assert (rows.float() - exact).norm() < tolerance * exact.norm(), (out_f, in_f, m)


def test_rows_are_quantized_each_by_its_own_scale():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 64, generator=gen) * torch.tensor([1.0, 10.0, 0.1, 100.0, 1e-3])[:, None]
    q, scale = quantize_rows(x)
    assert q.dtype == torch.int8 and q.abs().amax(dim=1).eq(127).all()
    for i in range(5):
        qi, si = quantize_rows(x[i: i + 1])
        assert torch.equal(qi, q[i: i + 1]) and torch.equal(si, scale[i: i + 1])
    torch.testing.assert_close(q.float() * scale, x, rtol=0, atol=float(scale.max()) / 2 + 1e-6)


@pytest.mark.parametrize("rows_form, store, tolerance", INTEGER_FORMS)
def test_integer_weights_follow_in_place_changes_and_reuse_a_converted_input(rows_form, store, tolerance):
    gen = torch.Generator().manual_seed(2)
    layer = torch.nn.Linear(256, 64, bias=True)
    weights = store()
    x = torch.randn(1, 3, 256, generator=gen)
    w0, x0 = layer.weight.detach().clone(), x.clone()
    before = rows_form(layer, x, 3, weights)
    assert torch.equal(layer.weight, w0) and torch.equal(x, x0)  # fp32: quantizing copies, never scales in place
    leaves = lambda rows: rows if isinstance(rows, tuple) else (rows,)  # noqa: E731 (int8: rows and scales)
    assert len(weights) == 1 and all(a is b for a, b in zip(leaves(weights.rows(x)), leaves(weights.rows(x))))
    with torch.no_grad():  # q, k and v convert their input once (above); a changed weight is converted again
        layer.weight.mul_(2)
    after = rows_form(layer, x, 3, weights)
    torch.testing.assert_close(after - layer.bias, 2 * (before - layer.bias), rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(after, layer(x).detach(), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("backend_kind", INTEGER_KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_integer_generate_and_engine_are_the_backends_greedy_token_for_token(kind, dtype, backend_kind):
    """Drafted trees verified in int8 (or weight-int8) give the tokens of one-token greedy decoding
    in the same numerics (the backend's stated baseline), one sequence at a time and in the batched
    engine (whose batched attention rounds otherwise in bf16, as for every backend: checked where
    the tiny model has no near-ties, llama's)."""
    model = tiny_model(kind, max_positions=512).to(dtype)
    backend = choose_backend(model, backend_kind)
    assert backend.name == backend_kind and backend.policy.draft_cost is not None  # drafts capped on its measured costs
    ps = prompts(6, seed=31, lengths=(3, 120))
    truths = [generate(model, p, None, max_new_tokens=30, eos_token_id=[], backend=backend).tokens for p in ps]
    assert all(len(t) == 30 for t in truths)
    for i, (p, truth) in enumerate(zip(ps, truths)):
        out = generate(model, p, OracleTreeDrafter(p, truth, seed=i), max_new_tokens=30, eos_token_id=[], backend=backend)
        assert out.tokens == truth, i
        assert out.stats.forward_passes < 30 and out.stats.backend == backend_kind
    if kind == "llama" or dtype == torch.float32:
        engine = BatchEngine(model, EngineConfig(3, backend=backend), eos_token_id=[], cost=StepCost({1: 1.0, 512: 1.0}))
        requests = [Request(p, OracleTreeDrafter(p, t, seed=i), SamplingParams(max_new_tokens=30)) for i, (p, t) in enumerate(zip(ps, truths))]
        assert [g.tokens for _, g in sorted(engine.run(requests), key=lambda r: r[0])] == truths


@pytest.mark.parametrize("backend_kind", INTEGER_KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_integer_with_a_prefix_cache_decodes_as_without(dtype, backend_kind):
    """Prompts after a cached shared prefix (GEC's instruction) run only their own rows: with
    row-independent linear rows and the attention of `_prefill_block`, their tokens are those of
    the whole prompt's prefill, so the backend keeps a prefix cache (`lossless_prefix_cache`)."""
    model = tiny_model("qwen2", max_positions=512).to(dtype)
    backend = choose_backend(model, backend_kind)
    assert backend.lossless_prefix_cache
    shared = prompts(1, seed=5, lengths=(90, 90))[0]
    cache = PrefixCache(model.config)
    for i, tail in enumerate(prompts(6, seed=6, lengths=(2, 40))):
        p = shared + tail
        plain = generate(model, p, None, max_new_tokens=20, eos_token_id=[], backend=backend)
        cached = generate(model, p, OracleTreeDrafter(p, plain.tokens, seed=i), max_new_tokens=20, eos_token_id=[],
                          backend=backend, prefix_cache=cache)
        assert cached.tokens == plain.tokens, i
        assert (cached.stats.cached_prompt_tokens > 0) == (i > 0)

@pytest.mark.parametrize("backend_kind", INTEGER_KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_integer_mlp_in_row_blocks_computes_as_in_one(dtype, backend_kind):
    """A long prefill's MLP runs in blocks of `mlp_rows` rows (its intermediates then stay in the
    CPU's caches): int8's rows compute alike in any call, so the logits are bit for bit those of
    the MLP in one block."""
    from dataclasses import replace

    from transformers import DynamicCache

    from specsuite.core.model.forward import cache_forward

    model = tiny_model("qwen2", max_positions=512).to(dtype)
    ids = torch.tensor([prompts(1, seed=8, lengths=(120, 120))[0]])
    n = ids.shape[1]
    base = choose_backend(model, backend_kind)
    assert base.mlp_rows and base.mlp_rows < 1024  # the backend runs long prefills in blocks

    def logits(mlp_rows):
        decoder = replace(base, mlp_rows=mlp_rows).loaded(model).decoders(model).one
        with torch.inference_mode():
            return cache_forward(decoder, ids, DynamicCache(config=model.config), torch.arange(n)[None], None, n, n,
                                 exact=True)

    assert torch.equal(logits(16), logits(None)) and torch.equal(logits(50), logits(None))


def test_int8_is_refused_where_it_cannot_run_as_stated():
    model = tiny_model("llama", attn="eager")  # not a forward of core/model/forward.py
    with pytest.raises(ValueError, match="int8 backend needs"):
        choose_backend(model, "int8")


def test_fast_is_int8_where_it_runs_else_weight_int8_where_it_pays_else_the_models_own_numerics(monkeypatch):
    """The apps' default kind: int8 where this CPU's int8 kernel sums exactly, is fast, and the model
    is one of forward.py's in bf16/fp32; else, for an fp32 model, weight-int8 where its verify
    forwards of 1, 2 and 4 rows cost less than fp32-cpu's; otherwise what "auto" chooses (checked on
    every side by pretending the kernel checks and the timings came out otherwise, so the test
    means the same on every CPU)."""
    from specsuite.core.model import backend as backend_module

    fp32, eager = tiny_model("llama"), tiny_model("llama", attn="eager")
    assert choose_backend(eager, "fast").name == choose_backend(eager, "auto").name == "plain"
    if backend_module.int8_runs() and backend_module.int8_pays():
        assert choose_backend(fp32, "fast").name == "int8"
    monkeypatch.setattr(backend_module, "int8_pays", lambda: False)  # exact, but slow here (an AVX2-only EPYC)
    monkeypatch.setattr(backend_module, "weight_int8_runs", lambda: True)
    fp32_costs = StepCost({1: 0.40, 2: 0.44, 4: 0.51, 8: 0.68, 16: 1.04, 32: 1.9})
    monkeypatch.setattr(backend_module, "fp32_step_cost", lambda model: fp32_costs)
    for ours, chosen in [({1: 0.17, 2: 0.22, 4: 0.33, 8: 0.61, 16: 1.18, 32: 2.3}, "weight-int8"),
                         ({1: 0.17, 2: 0.22, 4: 0.52, 8: 0.61, 16: 1.18, 32: 2.3}, "fp32-cpu")]:
        monkeypatch.setattr(backend_module, "integer_step_cost", lambda model, backend: StepCost(ours))
        fast = choose_backend(fp32, "fast")
        assert fast.name == chosen and (chosen == "fp32-cpu" or fast.draft_cost == StepCost(ours))
    assert choose_backend(fp32, "auto").name == "fp32-cpu"
    bf16 = tiny_model("llama").to(torch.bfloat16)  # on a CPU with bf16 kernels: never weight-int8
    assert choose_backend(bf16, "fast").name == choose_backend(bf16, "auto").name != "weight-int8"
    monkeypatch.setattr(backend_module, "weight_int8_runs", lambda: False)
    assert choose_backend(fp32, "fast").name == "fp32-cpu"
    monkeypatch.setattr(backend_module, "int8_pays", lambda: True)
    monkeypatch.setattr(backend_module, "int8_runs", lambda: False)
    assert choose_backend(fp32, "fast").name == choose_backend(fp32, "auto").name
    with pytest.raises(ValueError, match="int8 backend needs"):
        choose_backend(fp32, "int8")
    monkeypatch.setattr(backend_module, "weight_int8_runs", lambda: False)
    with pytest.raises(ValueError, match="weight-int8 backend needs"):
        choose_backend(fp32, "weight-int8")


# What a CPU with AVX2 and no VNNI computes, on any x86 CPU: oneDNN (and with it ATen's `_int_mm`),
# ATen and MKL dispatch no kernel beyond AVX2.
AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="AVX2 is an x86 instruction set")
def test_an_avx2_only_cpu_gets_7_bit_weights_and_passes_this_module():
    """Without VNNI, 8-bit weights saturate oneDNN's 16-bit pair sums; weights of -64..64 cannot, so
    int8 runs there with them, and every test above holds for it (run in a process capped at AVX2)."""
    probe = ("from specsuite.core.kernels.int8_linear import CANDIDATES, REDUCED_WEIGHT_MAX, Int8Kernel, _sums_exactly\n"
             "print(_sums_exactly(CANDIDATES[0]), _sums_exactly(Int8Kernel('onednn', REDUCED_WEIGHT_MAX)))")
    env = {**os.environ, **AVX2_ONLY}
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=REPO, capture_output=True, text=True, check=True)
    # oneDNN's kernel: wrong sums with 8-bit weights there, exact ones with 7-bit weights. (Which
    # kernel a process takes also depends on `_pays`: on a real AVX2-only EPYC none pays, and
    # ATen's `_int_mm`, exact there with 8-bit weights by a slow path, serves `--int8`.)
    assert out.stdout.split() == ["False", "True"], out.stdout + out.stderr[-2000:]
    assert "no VNNI" in Int8Kernel("onednn", REDUCED_WEIGHT_MAX).label  # reports name the reduced weights
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "not avx2_only"],
                         env=env, cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0 and " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-3000:]

