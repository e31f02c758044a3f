"""`specsuite step-cost`: what one verify forward costs by its number of rows, on this machine.

Speculative decoding pays off when verifying k rows costs less than k one-token steps; how much less
depends on the kernels (bf16 with AMX: smooth growth; fp32 on an AVX2-only CPU: flat up to 4 rows,
then jumps at 8, 16 and 32, which `generate()`'s draft size ladder follows). This measures it: a
prompt of random tokens is prefilled once, then a chain of k-1 draft tokens after one fresh token
runs through each backend's forward (`core.backend`), k rows in all, every row count in turn,
`reps` rounds (the one timing loop, `core.calibration`), the cache cropped back after each: the model's exact form for its dtype,
the plain multi-row forward and, where oneDNN's int8 kernel sums exactly, the int8 backend. It also says which backend `generate()` runs for this model here.
"""

from __future__ import annotations

import argparse

import torch

from specsuite.core.backend import EXACT_BF16, FP32_CPU, choose_backend, plain_backend, plain_forms
from specsuite.core.calibration import measure_forward_costs
from specsuite.core.draft_budget import costs_dir, forget_costs
from specsuite.core.int8_linear import int8_runs
from specsuite.core import forward as llama
from specsuite.models import DEFAULT_MODEL, load_model


def measure_step_costs(model, rows: list[int], context: int = 80, reps: int = 5) -> dict[str, dict[int, float]]:
    """Median seconds of a verify forward of each row count after `context` cached tokens, per
    backend that can run this model: {name: {rows: s}}."""
    backends = [plain_backend(model.dtype)]
    if llama.supports(model) and model.device.type == "cpu":
        exact = choose_backend(model, "exact")  # fp32: with the kernel forms measured for this model
        backends = ([exact] if exact.name in (EXACT_BF16.name, FP32_CPU.name) else []) + [
            b.owned() for b in plain_forms(model.dtype)]
        if int8_runs():
            backends.append(choose_backend(model, "int8"))
    return measure_forward_costs(model, backends, rows, context, reps)


def format_costs(costs: dict[str, dict[int, float]]) -> str:
    names = list(costs)
    first = costs[names[0]]
    one = first[min(first)]
    lines = [f"{'rows':>5} " + " ".join(f"{name + ' ms':>14}" for name in names) + f" {names[0] + ' vs 1 row':>20}"]
    for k in first:
        lines.append(f"{k:>5} " + " ".join(f"{costs[name][k] * 1000:>14.1f}" for name in names)
                     + f" {first[k] / one:>19.2f}x")
    return "\n".join(lines)


def _cmd(args: argparse.Namespace) -> int:
    rows = sorted({int(r) for r in args.rows.split(",")})
    if not rows or rows[0] < 1:
        raise SystemExit("error: --rows takes row counts >= 1, e.g. 1,2,4,8")
    if args.recalibrate:
        print(f"removed {forget_costs()} kept step-cost curves from {costs_dir()}: each is timed again at its next use")
    model, _ = load_model(args.model, dtype=args.dtype)
    costs = measure_step_costs(model, rows, args.context, args.reps)
    print(f"verify forward cost · {args.model} ({str(model.dtype).replace('torch.', '')}) · "
          f"{args.context} cached tokens · median of {args.reps} · {torch.get_num_threads()} threads")
    print(format_costs(costs))
    print(f"the apps run the {choose_backend(model).label!r} backend for this model here (choose_backend)")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("step-cost", help="time one verify forward by its number of rows on this machine")
    p.add_argument("--model", default=DEFAULT_MODEL, help="preset name or local model directory")
    p.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], help="default: bf16 where the CPU supports it")
    p.add_argument("--rows", default="1,2,3,4,5,8,9,16,17,32,33", help="comma-separated row counts")
    p.add_argument("--context", type=int, default=80, help="cached tokens before the verified rows")
    p.add_argument("--reps", type=int, default=5, help="rounds over all row counts (median)")
    p.add_argument("--recalibrate", action="store_true",
                   help="forget every kept step-cost curve (the backend choice's and the batched engine's draft "
                        "budget's) first, so they are timed again on this machine as it is now")
    p.set_defaults(func=_cmd)
