"""What a forward costs on this machine, by its number of rows: the one timing loop.

Two things are timed, both through `median_seconds`, and kept on disk as a `StepCost` per machine,
model, dtype and thread count (`draft_budget.cost_file`):
- `measure_forward_costs`: one sequence's verify forward (a root token and a chain draft after a
  prefilled context) in each of some backends, alternating; the backend choice (`core.backend`)
  and `specsuite step-cost` read it;
- `slot_step_cost`: a batched engine's step over its slots (`kv.SlotStore`), which its draft
  budget (`DraftBudget`) reads.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from transformers import DynamicCache

from ..kernels.timing import timed_seconds
from ..speculation.draft import Draft
from ..speculation.draft_budget import StepCost, cost_file, curve_problem
from .forward import Rows


def medians(times: dict[str, dict[int, list[float]]]) -> dict[str, dict[int, float]]:
    return {name: {k: statistics.median(v) for k, v in per_rows.items()} for name, per_rows in times.items()}


def median_seconds(prepare: Callable[[str, int], Callable[[], object]], names: list[str], rows: list[int],
                   reps: int) -> dict[str, dict[int, float]]:
    """The median of each of `timed_seconds`' lists."""
    return medians(timed_seconds(prepare, names, rows, reps))


# Repeat timings of one forward whose upper median is more than SPREAD times their fastest (most
# of them slowed: one late repeat of three happens on quiet machines too, docs/architecture-core.md,
# Measurements: quiet repeats; of two repeats, the slower), or a kept curve that a fresh check
# finds off by more than DRIFT, say the machine was busy (or has changed): such a curve is timed
# again, at most TRIES times, and kept on disk only when the first try is consistent.
SPREAD = 1.5
DRIFT = 1.3
TRIES = 3
# The kept curves checked (or timed) in this process: once each, so engines made later (another
# thread's, whose forwards may time differently) read them as they are rather than re-time them.
_CHECKED: set[Path | None] = set()
# The curves timed in this process but not kept (the machine was busy): held for the process, so
# that a second engine of the same model and backend (`gec demo`: the estimate's, then the
# corrector's) uses them rather than timing again, minutes on a loaded machine; a new process
# times again.
_USED: dict[Path, StepCost] = {}


def timing_problem(times: dict[str, dict[int, list[float]]]) -> str | None:
    """Why a measurement ({name: {rows: [s]}}) cannot be kept (None: it can): repeats that
    disagree, or a curve that cannot be right (`curve_problem`)."""
    for name, per_rows in times.items():
        for k, secs in per_rows.items():
            if len(secs) > 1 and (most := statistics.median_high(secs)) > SPREAD * min(secs):
                return (f"{name}: repeat timings of {k} rows from {min(secs) * 1e3:.1f} to {max(secs) * 1e3:.1f} ms, "
                        f"upper median {most * 1e3:.1f}")
        if (why := curve_problem({k: statistics.median(v) for k, v in per_rows.items()})) is not None:
            return f"{name}: {why}"
    return None


def calibrated(paths: dict[str, Path | None], rows: list[int],
               measure: Callable[[list[int], int], dict[str, dict[int, list[float]]]], reps: int,
               check: bool = False,
               log: Callable[[str], None] = lambda line: print(f"specsuite: {line}", file=sys.stderr)) -> dict[str, StepCost]:
    """The cost curve of each name of `paths` over `rows`: the one kept on disk at its path (with
    `check`: if a quick timing of two row counts, two rounds, once per process, finds it within
    DRIFT of now); else
    timed by `measure(rows, reps)` -> {name: {rows: [s]}} until consistent (`timing_problem`, at
    most TRIES times), kept if the first try was. A machine busy for every try: the kept curve if there is one (a
    quiet moment's), else the last timing made monotone, and nothing is kept. A timing used but not
    kept is held for the process: a later call for the same paths reads it, not the machine, while
    none of them has a kept curve (one kept since, by another process, is read instead)."""
    kept = {name: StepCost.load(path, rows) for name, path in paths.items()}
    if all(cost is None for cost in kept.values()) and all(path in _USED for path in paths.values()):
        return {name: _USED[path] for name, path in paths.items()}
    if all(cost is not None for cost in kept.values()):
        if not check or all(path in _CHECKED for path in paths.values()):
            return kept
        _CHECKED.update(paths.values())
        probe = sorted({rows[0], rows[len(rows) // 2]})
        now = medians(measure(probe, 2))
        drift = max(max(now[name][k], kept[name](k)) / min(now[name][k], kept[name](k))
                    for name in now for k in probe)
        if drift <= DRIFT:
            return kept
        log(f"the kept step costs are off by {drift:.2f}x now; timing again")
    where = next(iter(paths.values()))
    log(f"timing {', '.join(paths)} forwards of this model on this machine"
        + (f" (kept in {where.parent})" if where is not None else ""))
    times = None
    for attempt in range(TRIES):
        times = measure(rows, reps)
        if (why := timing_problem(times)) is None:
            costs = {name: StepCost(per_rows) for name, per_rows in medians(times).items()}
            if attempt:  # right after a busy timing: a neighbour's steady load times consistently too
                log("this timing is used but not kept (the machine was busy a moment ago)")
                return _used(paths, costs)
            for name, cost in costs.items():
                cost.save(paths[name])
            _CHECKED.update(paths.values())
            return costs
        log(f"the machine was busy while timing ({why}); " + ("timing again" if attempt + 1 < TRIES else
            "the timing is used but not kept"))
    if all(cost is not None for cost in kept.values()):
        return kept
    return _used(paths, {name: StepCost(_monotone(per_rows)) for name, per_rows in medians(times).items()})


def _used(paths: dict[str, Path | None], costs: dict[str, StepCost]) -> dict[str, StepCost]:
    """`costs`, held for this process under their paths (those that have one)."""
    _USED.update((path, costs[name]) for name, path in paths.items() if path is not None)
    return costs


def _monotone(points: dict[int, float]) -> dict[int, float]:
    """`points` with each cost raised to the highest of fewer rows'."""
    out, high = {}, 0.0
    for k in sorted(points):
        out[k] = high = max(high, points[k])
    return out


def measure_forward_costs(model, backends: list, rows: list[int], context: int = 80, reps: int = 5,
                          seed: int = 0) -> dict[str, dict[int, float]]:
    """Median seconds of `forward_times`: {name: {rows: s}}."""
    return medians(forward_times(model, backends, rows, context, reps, seed))


def forward_times(model, backends: list, rows: list[int], context: int = 80, reps: int = 5,
                  seed: int = 0) -> dict[str, dict[int, list[float]]]:
    """Seconds of a verify forward of each row count (a root token and a chain draft) after
    `context` cached tokens, per backend (a `core.backend.Backend`), alternating: {name: {rows: [s]}}."""
    gen = torch.Generator().manual_seed(seed)
    vocab = min(model.config.vocab_size, 32000)
    prompt = torch.randint(0, vocab, (context,), generator=gen).tolist()
    by_name = {b.name: b for b in backends}
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        backends[0].forward(model, prompt, cache, 0, None)

    def prepare(name: str, k: int):
        if (extra := cache.get_seq_length() - context) > 0:  # the last forward's rows
            cache.crop(-extra)
        backend = by_name[name]
        tokens = torch.randint(0, vocab, (k,), generator=gen).tolist()
        draft = Draft.chain(tokens[1:]) if k > 1 else None
        return lambda: backend.forward(model, tokens[:1], cache, context, draft, greedy_margin=backend.tie_margin)

    return timed_seconds(prepare, list(by_name), rows, reps)


def slot_step_cost(store, batch_size: int, rows: Iterable[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256),
                   reps: int = 3, cache_dir: str | Path | None = None) -> StepCost:
    """Seconds of a batched step of each row count as a batch runs them (up to 32 slots of `store`,
    a `kv.SlotStore`, each a root token and a chain draft, every row's logits, after 64 cached
    tokens; median of `reps`), or an earlier measurement of the same machine, model, dtype and
    backend read from disk and checked against a quick timing now (`calibrated`)."""
    rows = sorted(set(rows))
    # Versioned, so that a change to how batches compute makes older curves stale
    # (docs/architecture-core.md, Measurements: cost file versions).
    path = cost_file(store.model, cache_dir, measure=f"engine v2:{store.backend.cost_key}")
    vocab = min(store.model.config.vocab_size, 32000)
    gen = torch.Generator().manual_seed(0)
    context, most = 64, 32
    store.ensure(min(max(rows), most), context + max(rows), batch_size)

    def prepare(_, r: int):
        count = min(r, most)
        slots, drafts = [], []
        for k in range(count):
            per = r // count + (k < r % count)  # rows of this slot
            ids = torch.randint(0, vocab, (context + per,), generator=gen).tolist()
            slots.append(Rows(context, ids[context:context + 1]))
            drafts.append(Draft.chain(ids[context + 1:]) if per > 1 else None)
        return lambda: store.forward(slots, drafts, list(range(count)))

    return calibrated({"engine": path}, rows, lambda rows, reps: timed_seconds(prepare, ["engine"], rows, reps),
                      reps, check=True)["engine"]
