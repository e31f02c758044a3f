"""The one timing loop (core/calibration.py) and `specsuite step-cost` over it."""

from __future__ import annotations

from conftest import model_for
from specsuite.core.int8_linear import int8_runs


def test_step_cost_times_every_row_count_in_each_backend():
    """`specsuite step-cost` times verify forwards by row count in the model's exact form and the
    plain one (and int8 where its kernel sums exactly), and leaves the model as it was."""
    from specsuite.step_cost import format_costs, measure_step_costs

    model = model_for("qwen2")
    before = dict(vars(model))
    costs = measure_step_costs(model, [1, 3, 6], context=10, reps=2)
    assert set(costs) == {"fp32-cpu", "plain"} | ({"int8"} if int8_runs() else set())
    assert all(set(c) == {1, 3, 6} and min(c.values()) > 0 for c in costs.values())
    assert vars(model).keys() == before.keys() and all(vars(model)[k] is v for k, v in before.items())
    assert len(format_costs(costs).splitlines()) == 4
