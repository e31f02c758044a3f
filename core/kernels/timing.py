"""The one timing loop: alternated rounds of calls, timed one by one (used by the step-cost
measurements of model/calibration.py and by the int8 kernel's speed check)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def timed_seconds(prepare: Callable[[str, int], Callable[[], object]], names: list[str], rows: list[int],
                  reps: int, clock: Callable[[], float] = time.perf_counter) -> dict[str, dict[int, list[float]]]:
    """Seconds of `reps` rounds (after one that warms up) over every row count, each of `names` in
    turn (alternating, so a slower minute of a loaded machine hits all alike): {name: {rows: [s]}}.
    `prepare(name, rows)` sets up one forward and returns it; only that call is timed."""
    times: dict[str, dict[int, list[float]]] = {name: {k: [] for k in rows} for name in names}
    with torch.inference_mode():
        for rep in range(reps + 1):
            for k in rows:
                for name in names:
                    run = prepare(name, k)
                    start = clock()
                    run()
                    if rep:
                        times[name][k].append(clock() - start)
    return times
