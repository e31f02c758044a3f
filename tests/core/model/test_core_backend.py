"""One backend per model: how its forwards are computed and the policy that follows (core/model/backend.py).

Every kind is exercised explicitly on tiny models (so every CPU runs every path it can), and the
choice of "auto" in bf16 is checked against cost files written here, not against this CPU's speed.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specsuite.core import EngineConfig, generate, PromptLookupDrafter, SamplingParams
from specsuite.core.model.backend import (
    AFFORDABILITY_ROWS, EXACT_BF16, EXACT_VS_PLAIN, FP32_CPU, PLAIN, choose_backend, exact_is_affordable,
    fp32_forms,
)
from specsuite.core.kernels.exact_linear import FP32_FORMS, FP32_ROW_BUCKETS, packed_bf16_runs, packed_rows
from specsuite.core.speculation.draft_budget import StepCost, cost_file
from specsuite.core.scheduler.engine import BatchEngine, Request
from conftest import OracleTreeDrafter, hf_greedy, prompts, tiny_model


def timed(measure, capsys):
    """`measure()`, which must time real forwards (`calibration.calibrated` says so on stderr). Whether
    it keeps the curves depends on how quiet the machine is (a busy CI machine keeps nothing, as
    meant), so that is not asserted here: keeping and refusing are tested on a simulated machine in
    test_core_calibration.py."""
    capsys.readouterr()
    result = measure()
    assert "forwards of this model on this machine" in capsys.readouterr().err
    return result


def test_each_dtype_and_attention_gets_its_kind():
    fp32 = tiny_model("llama")
    assert choose_backend(fp32).name == choose_backend(fp32, "exact").name == FP32_CPU.name
    assert choose_backend(fp32, "exact") == choose_backend(fp32, "exact")  # chosen alike: equal (fp32 forms, costs)
    plain = choose_backend(fp32, "plain")
    assert plain.name == "plain" and plain.tie_margin == 1e-3 and plain.lossless_prefix_cache
    assert choose_backend(tiny_model("llama", "eager")).name == "plain"  # not forward.py's: the model's own forward
    bf16 = tiny_model("llama").to(torch.bfloat16)
    exact = choose_backend(bf16, "exact")
    assert replace(exact, engine_linear=None) == EXACT_BF16 and EXACT_BF16.tie_margin == 0
    assert choose_backend(bf16, "plain").tie_margin == PLAIN.tie_margin == 0  # a redo inherits drifted KV
    assert not choose_backend(bf16, "plain").lossless_prefix_cache
    assert choose_backend(tiny_model("llama").to(torch.float16)).name == "plain"
    with pytest.raises(ValueError, match="unknown backend"):
        choose_backend(fp32, "turbo")


def test_auto_in_bf16_keeps_the_exact_forms_only_where_affordable(tmp_path, monkeypatch, capsys):
    """The forms are timed, and the costs kept on disk are what "auto" reads: it takes the exact
    forms while they cost at most 15% more than plain forwards, else the cheaper plain form
    (`plain-packed` only where oneDNN runs bf16 calls on packed weights)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("SPECSUITE_NO_COST_CACHE", raising=False)
    model = tiny_model("qwen2").to(torch.bfloat16)
    names = ["exact-bf16", "plain"] + (["plain-packed"] if packed_bf16_runs() else [])
    paths = {name: cost_file(model, measure=f"{EXACT_VS_PLAIN}:{name}") for name in names}
    assert not any(path.exists() for path in paths.values())
    rows = list(AFFORDABILITY_ROWS)
    timed(lambda: exact_is_affordable(model), capsys)  # every form, alternating
    for exact_s, packed_s, expected in ((1.10, 0.5, "exact-bf16"), (2.0, 1.5, "plain"), (2.0, 0.5, "plain-packed")):
        for name, secs in zip(names, (exact_s, 1.0, packed_s)):
            StepCost(dict.fromkeys(rows, secs)).save(paths[name])
        chosen = choose_backend(model)
        assert chosen.name == (expected if expected in names else "plain")
        assert replace(chosen, engine_linear=None) == EXACT_BF16 if expected == "exact-bf16" else chosen.tie_margin == 0
        assert chosen.engine_linear is (packed_rows if packed_bf16_runs() else None)  # batches: packed, any kind


def test_fp32_takes_the_fastest_measured_kernel_form_per_row_count(tmp_path, monkeypatch, capsys):
    """The fp32 forms are timed (every form, alternating), their costs kept on disk; each row count
    then takes the form that was fastest for its bucket, and every form gives greedy's output."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("SPECSUITE_NO_COST_CACHE", raising=False)
    model = tiny_model("qwen2", max_positions=512)
    paths = {form: cost_file(model, measure=f"fp32-forms:{form}") for form in FP32_FORMS}
    rows = list(FP32_ROW_BUCKETS)
    assert len(timed(lambda: fp32_forms(model), capsys)) == len(rows)
    fastest = {1: "plain", 2: "plain", 4: "columns", 8: "packed", 16: "packed", 32: "plain"}

    def write_fastest() -> None:
        for form, path in paths.items():
            # 15% less: a plausible curve (`curve_problem`), which a kept one must be
            StepCost({r: 0.85 if fastest[r] == form else 1.0 for r in FP32_ROW_BUCKETS}).save(path)

    write_fastest()
    assert fp32_forms(model) == tuple(fastest[r] for r in FP32_ROW_BUCKETS)
    StepCost({1: 1.0}).save(paths["plain"])  # other row counts
    assert len(timed(lambda: fp32_forms(model), capsys)) == len(rows)  # a curve of other row counts: timed again
    write_fastest()
    backend = choose_backend(model, "auto")
    assert backend.name == "fp32-cpu" and backend.linear.forms == fp32_forms(model)
    for i, p in enumerate(prompts(4, seed=23, lengths=(3, 100))):
        truth = hf_greedy(model, p, 40)
        out = generate(model, p, OracleTreeDrafter(p, truth, seed=i), max_new_tokens=30, eos_token_id=[], backend=backend)
        assert out.tokens == truth[:30]


def test_the_backend_is_the_callers_and_the_model_stays_as_it_was(tmp_path, monkeypatch):
    """Choosing a backend changes nothing on the model; each backend owns its packed weights, which
    its forwards make and reuse (a decode step packs each weight once); generate() runs the one it
    is given."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = tiny_model("llama").to(torch.bfloat16)
    before = dict(vars(model))
    exact, again = choose_backend(model, "exact"), choose_backend(model, "exact")
    assert vars(model).keys() == before.keys() and all(vars(model)[k] is v for k, v in before.items())
    assert exact == again and exact.packed is not again.packed and len(exact.packed) == 0
    p = prompts(1, seed=2, lengths=(5, 20))[0]
    out = generate(model, p, max_new_tokens=4, eos_token_id=[], backend=exact)
    assert out.stats.backend == "exact-bf16" and out.tokens == hf_greedy(model, p, 4)
    if packed_bf16_runs():  # the packed form runs here: the weights were packed once, for this backend alone
        kept = len(exact.packed)
        assert kept > 0 and len(again.packed) == 0
        generate(model, p, max_new_tokens=4, eos_token_id=[], backend=exact)
        assert len(exact.packed) == kept
    plain = generate(model, p, max_new_tokens=4, eos_token_id=[], backend=choose_backend(model, "plain"))
    assert plain.stats.backend == "plain" and plain.tokens == out.tokens


def test_exact_bf16_batches_run_on_the_packed_weights(tmp_path, monkeypatch):
    """Batched rows round as no one-token step does anyway: where oneDNN runs on packed weights, the
    engine of an `exact-bf16` backend runs every row on them (a plain call repacks the weights every
    time), each weight packed once; each sequence is still greedy's on tiny models."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = tiny_model("llama", max_positions=512).to(torch.bfloat16)
    backend = choose_backend(model, "exact")
    assert backend.engine_linear is (packed_rows if packed_bf16_runs() else None)
    ps = prompts(6, seed=26, lengths=(3, 120))
    truths = [hf_greedy(model, p, 30) for p in ps]
    engine = BatchEngine(model, EngineConfig(3, backend=backend), eos_token_id=[], cost=StepCost({1: 1.0, 512: 1.0}))
    requests = [Request(p, OracleTreeDrafter(p, t, seed=i), SamplingParams(max_new_tokens=30)) for i, (p, t) in enumerate(zip(ps, truths))]
    assert [g.tokens for _, g in sorted(engine.run(requests), key=lambda r: r[0])] == truths
    weights = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert len(backend.packed) == (len(weights) if packed_bf16_runs() else 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_backend_verifies_multi_row_and_guards_ties(dtype):
    """The plain backend verifies drafts with the model's own multi-row forward (as HF's prompt
    lookup does; in fp32 it redoes near-ties): on tiny models the output is greedy's, with trees too."""
    model = tiny_model("llama", max_positions=512).to(dtype)
    plain = choose_backend(model, "plain")
    for i, p in enumerate(prompts(6, seed=21, lengths=(3, 120))):
        truth = hf_greedy(model, p, 40)
        out = generate(model, p, OracleTreeDrafter(p, truth, seed=i), max_new_tokens=30, eos_token_id=[], backend=plain)
        assert out.tokens == truth[:30], i
        assert out.stats.forward_passes < 30
        assert generate(model, p, PromptLookupDrafter(), max_new_tokens=30, eos_token_id=[],
                        backend=plain).tokens == truth[:30]


def test_plain_packed_verifies_on_packed_weights_and_steps_as_plain_decoding(tmp_path, monkeypatch):
    """Where auto takes `plain-packed` (bf16, oneDNN runs packed calls, cheaper than plain ones):
    drafts verify on packed weights, the output is greedy's on tiny models, with trees too; a
    prefill is the plain call and a one-token step rounds bit for bit as plain decoding's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("SPECSUITE_NO_COST_CACHE", raising=False)
    model = tiny_model("llama", max_positions=512).to(torch.bfloat16)
    names = ["exact-bf16", "plain"] + (["plain-packed"] if packed_bf16_runs() else [])
    for name, secs in zip(names, (3.0, 1.0, 0.5)):
        StepCost(dict.fromkeys(AFFORDABILITY_ROWS, secs)).save(cost_file(model, measure=f"{EXACT_VS_PLAIN}:{name}"))
    backend = choose_backend(model, "auto")
    assert backend.name == names[-1]
    ps = prompts(6, seed=25, lengths=(3, 120))
    truths = [hf_greedy(model, p, 30) for p in ps]
    for i, (p, truth) in enumerate(zip(ps, truths)):
        out = generate(model, p, OracleTreeDrafter(p, truth, seed=i), max_new_tokens=30, eos_token_id=[], backend=backend)
        assert out.tokens == truth, i
        assert out.stats.forward_passes < 30 and out.stats.backend == names[-1]
    # the batched engine runs all its rows on the packed weights there, each sequence still greedy's here
    engine = BatchEngine(model, EngineConfig(3, backend=backend), eos_token_id=[], cost=StepCost({1: 1.0, 512: 1.0}))
    requests = [Request(p, OracleTreeDrafter(p, t, seed=i), SamplingParams(max_new_tokens=30)) for i, (p, t) in enumerate(zip(ps, truths))]
    assert [g.tokens for _, g in sorted(engine.run(requests), key=lambda r: r[0])] == truths
    gen = torch.Generator().manual_seed(5)
    layer = torch.nn.Linear(896, 128).bfloat16()
    x = torch.randn(1, 9, 896, generator=gen).bfloat16()
    with torch.inference_mode():
        assert torch.equal(packed_rows(layer, x, 9), layer(x))  # a prefill: one plain call
        for row in x[0]:
            assert torch.equal(packed_rows(layer, row[None, None], 1), layer(row[None, None]))  # a decode step
        if packed_bf16_runs():  # the only CPUs where a backend runs draft rows on packed weights
            torch.testing.assert_close(packed_rows(layer, x, 1), layer(x), rtol=2e-2, atol=2e-2)  # a root and 8 draft rows
