"""Greedy's logits screened by a bf16 copy of the output layer (core/kernels/logit_screen.py): the argmax
and the near-tie test stay those of the fp32 logits, and generate() stays greedy's with it."""

from __future__ import annotations

from dataclasses import replace

import torch

from specsuite.core import generate
from specsuite.core.model.backend import LOGIT_SCREEN_COSTS, choose_backend
from specsuite.core.speculation.draft_budget import StepCost, cost_file
from specsuite.core.kernels.exact_linear import FP32_ROW_BUCKETS, packed_bf16_runs
from specsuite.core.kernels.logit_screen import LogitScreen
from specsuite.core.speculation.verify import top_two
from conftest import OracleTreeDrafter, hf_greedy, prompts, tiny_model

MARGIN = 1e-3


def test_screened_logits_keep_the_fp32_argmax_and_near_ties():
    """Random rows, and rows made to end on a near-tie (top two 5e-4 apart) or just clear of one
    (5e-3): the screened argmax and near-tie test are the fp32 ones; the tokens it computed in
    fp32 are fp32 dot products, and every other score is more than the margin below the best."""
    gen = torch.Generator().manual_seed(0)
    vocab, dim = 4096, 256
    weight = torch.randn(vocab, dim, generator=gen) * 0.05
    hidden = torch.randn(24, dim, generator=gen) * 4
    full = torch.nn.functional.linear(hidden, weight)
    # rows 0-7: the best token gets a twin 5e-4 below it; rows 8-15: 5e-3 below
    for row in range(16):
        best, twin = int(full[row].argmax()), (int(full[row].argmax()) + 1 + row) % vocab
        gap = 5e-4 if row < 8 else 5e-3
        h = hidden[row]
        weight[twin] = weight[best] - gap * h / h.dot(h)
    full = torch.nn.functional.linear(hidden, weight)
    screen = LogitScreen(weight)
    screened = screen(hidden, MARGIN)
    best_full, first_full, second_full = top_two(full)
    best, first, second = top_two(screened)
    assert torch.equal(best, best_full)
    near = (first - second) < MARGIN
    assert torch.equal(near, (first_full - second_full) < MARGIN)
    assert near[:8].all() and not near[8:16].any()
    torch.testing.assert_close(first, first_full, rtol=0, atol=1e-4)
    computed = screened != screen.bf16_scores(hidden).float()
    rows, tokens = computed.nonzero(as_tuple=True)
    torch.testing.assert_close(screened[rows, tokens], (hidden[rows] * weight[tokens]).sum(1))
    others = ~computed
    assert (screened[others] < (first[:, None].expand_as(screened)[others] - MARGIN)).all()


def test_generate_with_the_logit_screen_is_greedy(tmp_path, monkeypatch):
    """The screen is kept where the measured forwards cost less with it (and bf16 runs in
    hardware), and drafts are capped on those forwards' costs; forced on, generate()'s output is
    greedy's, trees and near-tie guard included."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("SPECSUITE_NO_COST_CACHE", raising=False)
    model = tiny_model("qwen2", max_positions=512)
    plain = choose_backend(model, "auto")
    rows = list(FP32_ROW_BUCKETS)
    StepCost(dict.fromkeys(rows, 1.0)).save(cost_file(model, measure=f"{LOGIT_SCREEN_COSTS}:{plain.name}"))
    screened_costs = {r: 0.5 + 0.01 * r for r in rows}
    StepCost(screened_costs).save(cost_file(model, measure=f"{LOGIT_SCREEN_COSTS}:{plain.name}+logit-screen"))
    chosen = choose_backend(model, "auto")
    assert (chosen.screen is not None) == packed_bf16_runs() and chosen.name == plain.name
    if chosen.screen is not None:  # its drafts are capped on the costs of the screened forwards
        assert chosen.draft_cost.secs == list(screened_costs.values())
    # forced on where it would not be chosen, so that every CPU checks what it computes
    screened = replace(plain, screen=LogitScreen(model.lm_head.weight))
    assert screened.label == "fp32-cpu + logit screen"
    for i, p in enumerate(prompts(6, seed=31, lengths=(3, 120))):
        truth = hf_greedy(model, p, 40)
        out = generate(model, p, OracleTreeDrafter(p, truth, seed=i), max_new_tokens=30, eos_token_id=[],
                       backend=screened)
        assert out.tokens == truth[:30], i


def test_the_screen_follows_in_place_changes_of_the_weight():
    """A screen is a bf16 copy of the weight: changed in place, the weight gets a new one."""
    gen = torch.Generator().manual_seed(2)
    layer = torch.nn.Linear(64, 500, bias=False)
    hidden = torch.randn(3, 64, generator=gen)
    screen = LogitScreen(layer.weight)
    screen(hidden, MARGIN)
    with torch.no_grad():
        layer.weight.mul_(-1)
    screened = screen(hidden, MARGIN)
    assert torch.equal(top_two(screened)[0], top_two(torch.nn.functional.linear(hidden, layer.weight))[0])
