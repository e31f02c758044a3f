"""Draft caps from measured step costs (core/speculation/draft_budget.py): `GoodputCap` for one sequence."""

from __future__ import annotations

import torch

from specsuite.core import generate
from specsuite.core.model.backend import choose_backend
from specsuite.core.speculation.draft_budget import DraftBudget, GoodputCap, StepCost
from specsuite.core.kernels.exact_linear import FP32_ROW_BUCKETS
from conftest import tiny_model, model_for, hf_greedy, policy, prompts, OracleTreeDrafter


def test_fp32_drafts_are_capped_by_their_expected_goodput():
    """In fp32 on the CPU, drafts are capped by `GoodputCap` on the step costs measured for the
    model: the output stays greedy's. Given draft_sizes, they climb that ladder instead (3 nodes,
    then 7, 15, 31 while accepted whole); draft_sizes=() verifies every node the drafter proposes."""
    model = model_for("llama")
    backend = choose_backend(model)
    assert isinstance(backend.draft_cost, StepCost) and backend.draft_cost.rows == list(FP32_ROW_BUCKETS)
    p = prompts(1, seed=3)[0]
    truth = hf_greedy(model, p, 60)
    out = generate(model, p, OracleTreeDrafter(p, truth, seed=0), max_new_tokens=50, eos_token_id=[],
                   policy=policy(model, prefill_draft=0))
    assert out.tokens == truth[:50] and max(out.stats.drafted) <= DraftBudget.CAPS[-1]
    laddered = generate(model, p, OracleTreeDrafter(p, truth, seed=0), max_new_tokens=50, eos_token_id=[],
                        policy=policy(model, prefill_draft=0, draft_sizes=(3, 7, 15, 31)))
    assert laddered.tokens == truth[:50]
    assert laddered.stats.drafted[1] <= 3 and max(laddered.stats.drafted) <= 31
    uncapped = generate(model, p, OracleTreeDrafter(p, truth, seed=0), max_new_tokens=50, eos_token_id=[],
                        policy=policy(model, draft_sizes=(), prefill_draft=0))
    assert uncapped.tokens == truth[:50] and uncapped.stats.drafted[1] > 3
    bf16 = tiny_model("llama").to(torch.bfloat16)
    # exact bf16: one rung, what its forms verify in one call per layer; plain: no cap
    assert choose_backend(bf16, "exact").draft_sizes == (31,) and choose_backend(bf16, "plain").draft_sizes == ()
    assert choose_backend(bf16, "exact").draft_cost is None


def test_goodput_cap_follows_the_step_cost_and_the_acceptance_seen():
    """A cap of c nodes gains sum(a^i, i = 1..c) tokens at acceptance rate a and costs cost(1 + c):
    where every row costs a step, one node; where rows are free, the most; in between, fewer
    nodes once drafts keep failing at their first node than while they pass whole."""
    assert GoodputCap(StepCost({1: 0.1, 2: 0.2})).value == 1
    assert GoodputCap(StepCost({1: 0.1, 64: 0.1})).value == DraftBudget.CAPS[-1]
    sloped = StepCost({1: 0.10, 8: 0.13, 32: 0.25})
    passing, failing = GoodputCap(sloped), GoodputCap(sloped)
    for _ in range(10):
        passing.update(accepted=passing.value, deepest=passing.value)
        failing.update(accepted=0, deepest=failing.value)
    assert failing.value < sloped.rows[1] < passing.value
    assert failing.tried == 10 and passing.accepted == passing.tried


def test_step_costs_are_kept_under_the_cache_the_user_set(monkeypatch, tmp_path):
    from conftest import model_for

    from specsuite.core.speculation.draft_budget import cost_file
    from specsuite.models import cache_dir

    monkeypatch.delenv("SPECSUITE_NO_COST_CACHE", raising=False)
    monkeypatch.setenv("SPECSUITE_CACHE", str(tmp_path / "mine"))
    assert cost_file(model_for("llama")).parent == tmp_path / "mine" / "step_cost" == cache_dir() / "step_cost"
    monkeypatch.delenv("SPECSUITE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cost_file(model_for("llama")).parent == tmp_path / "xdg" / "specsuite" / "step_cost" == cache_dir() / "step_cost"
