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
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from transformers import DynamicCache

from .draft import Draft
from .draft_budget import StepCost, cost_file
from .forward import Rows


def median_seconds(prepare: Callable[[str, int], Callable[[], object]], names: list[str], rows: list[int],
                   reps: int) -> dict[str, dict[int, float]]:
    """Median seconds of `reps` rounds (after one that warms up) over every row count, each of
    `names` in turn (alternating, so a slower minute of a loaded machine hits all alike).
    `prepare(name, rows)` sets up one forward and returns it; only that call is timed."""
    times: dict[str, dict[int, list[float]]] = {name: {k: [] for k in rows} for name in names}
    with torch.inference_mode():
        for rep in range(reps + 1):
            for k in rows:
                for name in names:
                    run = prepare(name, k)
                    start = time.perf_counter()
                    run()
                    if rep:
                        times[name][k].append(time.perf_counter() - start)
    return {name: {k: statistics.median(v) for k, v in per_rows.items()} for name, per_rows in times.items()}


def measure_forward_costs(model, backends: list, rows: list[int], context: int = 80, reps: int = 5,
                          seed: int = 0) -> dict[str, dict[int, float]]:
    """Median seconds of a verify forward of each row count (a root token and a chain draft) after
    `context` cached tokens, per backend (a `core.backend.Backend`), alternating: {name: {rows: s}}."""
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

    return median_seconds(prepare, list(by_name), rows, reps)


def slot_step_cost(store, batch_size: int, rows: Iterable[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256),
                   reps: int = 3, cache_dir: str | Path | None = None) -> StepCost:
    """Seconds of a batched step of each row count as a batch runs them (up to 32 slots of `store`,
    a `kv.SlotStore`, each a root token and a chain draft, every row's logits, after 64 cached
    tokens; median of `reps`), or an earlier measurement of the same machine, model, dtype and
    backend read from disk."""
    rows = sorted(set(rows))
    # "v2" since batches in bf16 run on packed weights (`Backend.engine_linear`): cheaper steps
    path = cost_file(store.model, cache_dir, measure=f"engine v2:{store.backend.name}")
    if (kept := StepCost.load(path, rows)) is not None:
        return kept
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

    cost = StepCost(median_seconds(prepare, ["engine"], rows, reps)["engine"])
    cost.save(path)
    return cost
