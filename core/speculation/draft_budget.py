"""How many draft rows a step should verify: the measured cost of a step by its row count
(`StepCost`) and the cap that gives the most expected tokens per second, for a batch
(`DraftBudget`) or one sequence (`GoodputCap`)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .draft import Draft


@dataclass(frozen=True)
class DraftPolicy:
    """How one sequence's drafts are sized and its near-ties guarded. `generate()` runs its
    backend's (`Backend.policy`); the batched engine none (its `DraftBudget` sizes every draft).

    tie_margin (greedy only): a root row computed otherwise than plain decoding's whose top two
    logits are closer is redone as plain decoding computes it. draft_sizes: a ladder of caps on
    draft nodes (`SizeLadder`; () for none). prefill_draft: a cap on the draft verified with the
    prompt (None: the drafter's whole draft). draft_cost: the step cost by row count; with it
    drafts are capped by `GoodputCap`, not a ladder."""

    tie_margin: float = 0.0
    draft_sizes: tuple[int, ...] = ()
    prefill_draft: int | None = None
    draft_cost: "StepCost | None" = None

    def __post_init__(self) -> None:
        if self.tie_margin < 0:
            raise ValueError(f"tie_margin must be >= 0, got {self.tie_margin}")
        if self.prefill_draft is not None and self.prefill_draft < 0:
            raise ValueError(f"prefill_draft must be >= 0, got {self.prefill_draft}")


class StepCost:
    """Seconds of one engine forward by its number of rows (piecewise linear between measured
    points, linear beyond the last one). Measured once per machine, model and dtype and kept on
    disk (`calibration.slot_step_cost`), so the draft budget follows this machine's kernels,
    not constants."""

    def __init__(self, points: dict[int, float]) -> None:
        if not points or min(points) < 1:
            raise ValueError("StepCost needs costs for row counts >= 1")
        self.rows = sorted(points)
        self.secs = [points[r] for r in self.rows]

    def __eq__(self, other: object) -> bool:  # two backends chosen alike compare equal
        return isinstance(other, StepCost) and (self.rows, self.secs) == (other.rows, other.secs)

    __hash__ = None

    def __call__(self, rows: int) -> float:
        r, s = self.rows, self.secs
        if rows <= r[0] or len(r) == 1:
            return s[0] * max(rows, 1) / r[0] if rows > r[0] else s[0]
        for i in range(1, len(r)):
            if rows <= r[i]:
                return s[i - 1] + (s[i] - s[i - 1]) * (rows - r[i - 1]) / (r[i] - r[i - 1])
        return s[-1] + max(0.0, s[-1] - s[-2]) * (rows - r[-1]) / (r[-1] - r[-2])  # never less than the last

    @classmethod
    def load(cls, path: Path | None, rows: list[int]) -> "StepCost | None":
        """The cost kept at `path` if it has every row count of `rows` and is a plausible curve
        (`curve_problem`), else None."""
        if path is None or not path.exists():
            return None
        try:
            saved = {int(k): float(v) for k, v in json.loads(path.read_text())["seconds"].items()}
        except (ValueError, KeyError, TypeError, OSError):
            return None  # unreadable: measure again
        if not set(rows) <= set(saved) or curve_problem(kept := {r: saved[r] for r in rows}) is not None:
            return None
        return cls(kept)

    def save(self, path: Path | None) -> None:
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")  # two processes timing at once: whole files only
            tmp.write_text(json.dumps({"seconds": dict(zip(map(str, self.rows), self.secs))}))
            tmp.replace(path)


# A forward of more rows may cost a little less than one of fewer (kernel forms differ by shape),
# never under CHEAPER_MORE of it; and one of r2 > r1 rows at most JUMP times r2/r1 one of r1 rows
# (one call of k rows is never dearer than k calls of one row). A curve that breaks either was
# timed while something else ran (docs/architecture-core.md, Measurements: step-cost curves that
# cannot be right).
CHEAPER_MORE = 0.8
JUMP = 1.5


def curve_problem(points: dict[int, float]) -> str | None:
    """Why a measured cost curve {rows: seconds} cannot be right (None: it can)."""
    rows = sorted(points)
    if any(points[r] <= 0 for r in rows):
        return "a forward timed at 0 s"
    for i, r1 in enumerate(rows):
        for r2 in rows[i + 1:]:
            if points[r2] < CHEAPER_MORE * points[r1]:
                return f"{r2} rows timed at {points[r2] * 1e3:.1f} ms, under {r1} rows' {points[r1] * 1e3:.1f} ms"
            if points[r2] > JUMP * points[r1] * r2 / r1:
                return f"{r2} rows timed at {points[r2] * 1e3:.1f} ms, over {r2 / r1:g}x {r1} rows' {points[r1] * 1e3:.1f} ms"
    return None


def cache_root() -> Path:
    """specsuite's cache (as `specsuite.models.cache_dir`): $SPECSUITE_CACHE, else XDG's."""
    root = os.environ.get("SPECSUITE_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specsuite"
    return Path(root).expanduser()


def costs_dir() -> Path:
    """Where measured costs are kept."""
    return cache_root() / "step_cost"


def forget_costs() -> int:
    """Remove every kept cost (of any model): the next use times them again. Returns how many."""
    kept = list(costs_dir().glob("*.json"))
    for path in kept:
        path.unlink(missing_ok=True)
    return len(kept)


def cost_file(model, cache_dir: str | Path | None = None, measure: str = "engine") -> Path | None:
    """Where a measured cost (`measure`: what was timed, with its backend) of this model, dtype,
    CPU model, core count, thread count and torch version is kept (None: nowhere, with
    SPECSUITE_NO_COST_CACHE set)."""
    if cache_dir is None:
        if os.environ.get("SPECSUITE_NO_COST_CACHE"):
            return None
        cache_dir = costs_dir()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        cpu = ""
    name = getattr(model.config, "_name_or_path", "") or model.config.model_type
    key = f"v3|{measure}|{name}|{model.dtype}|{model.device}|{cpu}|{os.cpu_count()}|{torch.get_num_threads()}|{torch.__version__}"
    return Path(cache_dir) / (hashlib.sha1(key.encode()).hexdigest()[:16] + ".json")


class DraftBudget:
    """How many draft nodes each slot may verify in the next step: the cap that maximises the
    expected new tokens per second of the whole step (goodput, as in SmartSpec).

    A slot whose drafts were accepted at rate `a` so far expects sum(a^i, i = 1..c) extra tokens
    from c nodes; the step costs `cost(rows)`. Few sequences in flight: long drafts are nearly
    free. A full batch: the extra rows cost more than they bring, and the cap drops to 0."""

    CAPS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32)

    def __init__(self, cost: StepCost, prior: float = 0.7) -> None:
        self.cost, self.prior = cost, prior

    def cap(self, fresh_rows: int, drafts: list[Draft | None], rates: list[float]) -> int:
        return self.best_cap(fresh_rows, [len(d) if d is not None else 0 for d in drafts], rates)

    def best_cap(self, fresh_rows: int, sizes: list[int], rates: list[float], caps: tuple[int, ...] = CAPS) -> int:
        """The cap of `caps` for drafts of `sizes` nodes (0: none) whose step gives the most
        expected tokens per second."""
        best, best_rate = caps[0], -1.0
        for c in caps:
            rows = fresh_rows
            gain = float(len(sizes))
            for size, a in zip(sizes, rates):
                k = min(c, size)
                rows += k
                gain += a * (1 - a ** k) / (1 - a) if a < 1 else k
            rate = gain / self.cost(rows)
            if rate > best_rate * 1.0001:  # ties: the smaller cap
                best, best_rate = c, rate
            if all(size <= c for size in sizes):
                break
        return best

    def rate(self, accepted: int, offered: int) -> float:
        """Acceptance rate of a sequence's drafts so far (`accepted` of `offered` tokens), starting
        from the prior, clamped below 1."""
        return min(0.98, (accepted + 4 * self.prior) / (offered + 4))


class GoodputCap:
    """A cap on one sequence's draft nodes, as `DraftBudget` picks it for a lone sequence: its
    drafts' nodes pass verification at the rate `a` seen so far (counted over the nodes tried up
    to the first rejection: a geometric model of acceptance), a cap of c nodes gains
    sum(a^i, i = 1..c) tokens and costs `cost(1 + c)`. An alternative to `draft.SizeLadder`, with
    the same interface, for kernels whose measured cost per row is known (the replays and A/B
    runs behind it and its prior: docs/architecture-core.md, Measurements: `GoodputCap` and its
    prior)."""

    def __init__(self, cost: StepCost, prior: float = 0.95) -> None:
        self.budget = DraftBudget(cost, prior)
        self.accepted = self.tried = 0

    @property
    def value(self) -> int:
        caps = DraftBudget.CAPS[1:]  # at least one node: a sequence that stops drafting learns nothing
        rate = self.budget.rate(self.accepted, self.tried)
        return self.budget.best_cap(1, [caps[-1]], [rate], caps)

    def update(self, accepted: int, deepest: int) -> None:
        """The last draft, `deepest` nodes deep, had `accepted` tokens verified."""
        self.accepted += accepted
        self.tried += min(deepest, accepted + 1)
