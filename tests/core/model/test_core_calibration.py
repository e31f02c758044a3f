"""The one timing loop (core/model/calibration.py) and `specsuite step-cost` over it."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import model_for
from specsuite.core.model import calibration
from specsuite.core.model.calibration import calibrated, timed_seconds, timing_problem
from specsuite.core.speculation.draft_budget import StepCost
from specsuite.core.kernels.int8_linear import int8_pays, int8_runs
from specsuite.core.kernels.weight_int8 import weight_int8_runs


def test_step_cost_times_every_row_count_in_each_backend():
    """`specsuite step-cost` times verify forwards by row count in the model's exact form and the
    plain one (int8 where its kernel sums exactly and is fast, weight-int8 where its kernel is
    exact), and leaves the model as it was."""
    from specsuite.step_cost import format_costs, measure_step_costs

    model = model_for("qwen2")
    before = dict(vars(model))
    costs = measure_step_costs(model, [1, 3, 6], context=10, reps=2)
    integer = ({"int8"} if int8_pays() and int8_runs() else set()) | ({"weight-int8"} if weight_int8_runs() else set())
    assert set(costs) == {"fp32-cpu", "plain"} | integer
    assert all(set(c) == {1, 3, 6} and min(c.values()) > 0 for c in costs.values())
    assert vars(model).keys() == before.keys() and all(vars(model)[k] is v for k, v in before.items())
    assert len(format_costs(costs).splitlines()) == 4


def test_step_bytes_count_the_weights_at_the_backends_size_and_the_kv_read():
    from specsuite.step_cost import copy_bandwidth, format_bandwidth, step_bytes

    model = model_for("qwen2")  # fp32
    cfg = model.config
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    assert step_bytes(model, "plain", 10) == 4 * linear + 10 * kv
    assert step_bytes(model, "int8", 0) == step_bytes(model, "weight-int8", 0) == linear
    roof = copy_bandwidth(megabytes=16, reps=2)
    assert 1e8 < roof < 1e13  # between 0.1 and 10,000 GB/s
    text = format_bandwidth(model, {"plain": {1: 0.001, 2: 0.002}}, 10, roof)
    assert f"{step_bytes(model, 'plain', 10) / 1e6:.1f} MB" in text and f"{(4 * linear + 10 * kv) / 0.001 / 1e9:.1f} GB/s" in text


class Machine:
    """A fake clock: a forward of r rows takes 10 ms + 1 ms a row, times `slower` while another
    process shares the cores (`busy`: from the call after `busy_from` to `busy_until`, every third
    call is 3x slower, as a neighbour's bursts are)."""

    def __init__(self, slower: float = 1.0) -> None:
        self.now, self.calls, self.slower, self.busy_from, self.busy_until = 0.0, 0, slower, None, float("inf")

    def forward(self, rows: int) -> None:
        self.calls += 1
        loaded = self.busy_from is not None and self.busy_from < self.calls <= self.busy_until and self.calls % 3 == 0
        self.now += (0.010 + 0.001 * rows) * self.slower * (3.0 if loaded else 1.0)

    def measure(self, rows: list[int], reps: int) -> dict:
        return timed_seconds(lambda _, r: lambda: self.forward(r), ["engine"], rows, reps, clock=lambda: self.now)


ROWS = [1, 2, 4, 8, 16, 32]


def new_process() -> None:
    """Forget what this process checked or timed (the curves on disk stay)."""
    calibration._CHECKED.clear()
    calibration._USED.clear()


def quiet_curve(slower: float = 1.0) -> list[float]:
    return pytest.approx([(0.010 + 0.001 * r) * slower for r in ROWS])


def test_a_curve_timed_on_a_quiet_machine_is_kept_and_checked_cheaply_later(tmp_path):
    path, lines = tmp_path / "cost.json", []
    cost = calibrated({"engine": path}, ROWS, Machine().measure, 3, check=True, log=lines.append)["engine"]
    assert cost.secs == quiet_curve() and StepCost.load(path, ROWS).secs == quiet_curve()
    new_process()
    later = Machine()
    assert calibrated({"engine": path}, ROWS, later.measure, 3, check=True, log=lines.append)["engine"].secs == quiet_curve()
    assert later.calls == 3 * 2  # the check: two row counts, a warm-up round and two timed ones
    assert calibrated({"engine": path}, ROWS, later.measure, 3, check=True)["engine"].secs == quiet_curve()
    assert later.calls == 3 * 2  # checked once per process


def test_a_curve_timed_on_a_loaded_machine_is_never_kept(tmp_path):
    """A neighbour's bursts make repeat timings disagree: timed TRIES times, used (made monotone)
    but not kept; the next start times it again."""
    path, lines = tmp_path / "cost.json", []
    busy = Machine()
    busy.busy_from = 0
    cost = calibrated({"engine": path}, ROWS, busy.measure, 3, check=True, log=lines.append)["engine"]
    assert not path.exists() and cost.secs == sorted(cost.secs) and cost.secs[0] >= 0.011
    assert sum("busy while timing" in line for line in lines) == 3 and "not kept" in lines[-1]
    calls = busy.calls  # another engine of the same model and backend in this process: no timing again
    assert calibrated({"engine": path}, ROWS, busy.measure, 3, check=True)["engine"].secs == cost.secs
    assert busy.calls == calls
    StepCost(dict(zip(ROWS, quiet_curve().expected))).save(path)  # kept meanwhile by another process: read instead
    assert calibrated({"engine": path}, ROWS, busy.measure, 3)["engine"].secs == quiet_curve()
    path.unlink()
    new_process()  # the next start times it again (and keeps it, the machine now quiet)
    assert calibrated({"engine": path}, ROWS, Machine().measure, 3, check=True)["engine"].secs == quiet_curve()
    assert StepCost.load(path, ROWS).secs == quiet_curve()


def test_a_timing_right_after_a_busy_one_is_used_but_not_kept(tmp_path):
    """A neighbour that bursts, then works steadily, times consistently at its own pace: a curve
    timed right after a busy try is used, not kept; the next start times the machine again."""
    path, lines = tmp_path / "cost.json", []
    one_try = Machine()
    one_try.measure(ROWS, 3)
    machine = Machine(slower=2.0)  # steadily slower once its bursts end
    machine.busy_from, machine.busy_until = 0, one_try.calls  # the first try is disturbed
    cost = calibrated({"engine": path}, ROWS, machine.measure, 3, check=True, log=lines.append)["engine"]
    assert cost.secs == quiet_curve(2.0) and not path.exists()
    assert "busy while timing" in lines[1] and "used but not kept" in lines[2] and len(lines) == 3
    calls = machine.calls  # held for the process: a second engine reads it, not the machine
    assert calibrated({"engine": path}, ROWS, machine.measure, 3, check=True)["engine"].secs == quiet_curve(2.0)
    assert machine.calls == calls


def test_a_kept_curve_survives_a_busy_start_and_follows_a_changed_machine(tmp_path):
    path = tmp_path / "cost.json"
    calibrated({"engine": path}, ROWS, Machine().measure, 3, log=print)
    new_process()
    busy = Machine(slower=2.0)  # the check finds it off; every timing again is disturbed
    busy.busy_from = 0
    assert calibrated({"engine": path}, ROWS, busy.measure, 3, check=True, log=print)["engine"].secs == quiet_curve()
    assert StepCost.load(path, ROWS).secs == quiet_curve()  # the quiet curve stays
    new_process()
    slower = Machine(slower=2.0)  # steadily 2x slower (another CPU model, a throttled host): re-timed and kept
    assert calibrated({"engine": path}, ROWS, slower.measure, 3, check=True, log=print)["engine"].secs == quiet_curve(2.0)
    assert StepCost.load(path, ROWS).secs == quiet_curve(2.0)


def test_a_kept_curve_that_cannot_be_right_is_not_read():
    """As a loaded machine wrote them: more rows far cheaper than fewer, or far dearer than that many
    one-row forwards (`curve_problem`); or repeats that disagree (`timing_problem`)."""
    import tempfile
    from pathlib import Path

    poisoned = {1: 0.233, 2: 0.092, 4: 0.253, 8: 0.096, 16: 0.249, 32: 2.95}
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "cost.json"
        path.write_text(json.dumps({"seconds": {str(k): v for k, v in poisoned.items()}}))
        assert StepCost.load(path, list(poisoned)) is None
        StepCost({1: 0.063, 2: 0.060, 4: 0.072, 32: 0.15}).save(path)  # a little cheaper at 2 rows: kernel forms
        assert StepCost.load(path, [1, 2, 4, 32]) is not None
    assert "under 1 rows'" in timing_problem({"plain": {1: [1.0, 1.1], 2: [1.1, 1.0], 4: [0.7, 0.7]}})
    assert "over 4x 1 rows'" in timing_problem({"plain": {1: [0.1], 4: [0.9]}})
    assert "repeat timings of 2 rows" in timing_problem({"plain": {1: [0.1, 0.1], 2: [0.1, 0.2]}})
    assert "repeat timings of 2 rows" in timing_problem({"plain": {1: [0.1, 0.1], 2: [0.1, 0.2, 0.17]}})
    # one late repeat of three, as a quiet machine gave the 0.5B's engine steps (54, 55, 86 ms): kept
    assert timing_problem({"engine": {1: [0.054, 0.086, 0.055], 16: [0.0644, 0.0998, 0.065]}}) is None
    assert timing_problem({"exact-bf16": {1: [0.21], 9: [0.23], 17: [0.30]}, "plain": {1: [0.26], 9: [0.25]}}) is None
    assert StepCost({1: 1.0, 2: 0.9})(64) == 0.9  # never extrapolated below the last point


def test_recalibrate_forgets_the_kept_curves_under_the_cache_the_user_set(tmp_path, monkeypatch):
    from specsuite.core.speculation.draft_budget import cost_file, forget_costs

    monkeypatch.setenv("SPECSUITE_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECSUITE_NO_COST_CACHE", raising=False)
    path = cost_file(model_for("qwen2"), measure="engine v2:plain")
    assert path.parent == tmp_path / "step_cost"
    StepCost({1: 0.1, 2: 0.11}).save(path)
    assert forget_costs() == 1 and not path.exists() and forget_costs() == 0
