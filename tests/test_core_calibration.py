"""The one timing loop (core/calibration.py) and `specsuite step-cost` over it."""

from __future__ import annotations

from specsuite.core.backend import FP32_CPU, backend_for
from conftest import model_for


def test_step_cost_times_every_row_count_in_each_backend():
    """`specsuite step-cost` times verify forwards by row count in the model's exact form and the
    plain one, and leaves the model's backend as it was."""
    from specsuite.step_cost import format_costs, measure_step_costs

    model = model_for("qwen2")
    costs = measure_step_costs(model, [1, 3, 6], context=10, reps=2)
    assert set(costs) == {"fp32-cpu", "plain"}
    assert all(set(c) == {1, 3, 6} and min(c.values()) > 0 for c in costs.values())
    assert backend_for(model).name == FP32_CPU.name
    assert len(format_costs(costs).splitlines()) == 4
