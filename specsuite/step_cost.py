"""`specsuite step-cost`: what one verify forward costs by its number of rows, on this machine.

Speculative decoding pays off when verifying k rows costs less than k one-token steps; how much less
depends on the kernels (bf16 with AMX: smooth growth; fp32 on an AVX2-only CPU: flat up to 4 rows,
then jumps at 8, 16 and 32, which `generate()`'s draft size ladder follows). This measures it: a
prompt of random tokens is prefilled once, then a chain of k-1 draft tokens after one fresh token
runs through each backend's forward (`core.backend`), k rows in all, every row count in turn,
`reps` rounds (the one timing loop, `core.calibration`), the cache cropped back after each: the model's exact form for its dtype,
the plain multi-row forward, where oneDNN's int8 kernel sums exactly and is fast the int8 backend, and where its kernel is exact the weight-int8 backend. It also says which backend `generate()` runs for this model here,
and how many bytes a one-row step reads and at what rate, against the machine's copy bandwidth
(a decode step reads every weight once: memory bandwidth is its roof).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specsuite.core.model.backend import EXACT_BF16, FP32_CPU, choose_backend, plain_backend, plain_forms
from specsuite.core.model.calibration import measure_forward_costs
from specsuite.core.speculation.draft_budget import costs_dir, forget_costs
from specsuite.core.kernels.int8_linear import int8_pays, int8_runs
from specsuite.core.kernels.weight_int8 import weight_int8_runs
from specsuite.core.model import forward as llama
from specsuite.models import DEFAULT_MODEL, load_model


def measure_step_costs(model, rows: list[int], context: int = 80, reps: int = 5) -> dict[str, dict[int, float]]:
    """Median seconds of a verify forward of each row count after `context` cached tokens, per
    backend that can run this model: {name: {rows: s}}."""
    backends = [plain_backend(model.dtype)]
    if llama.supports(model) and model.device.type == "cpu":
        exact = choose_backend(model, "exact")  # fp32: with the kernel forms measured for this model
        backends = ([exact] if exact.name in (EXACT_BF16.name, FP32_CPU.name) else []) + [
            b.loaded(model) for b in plain_forms(model.dtype)]
        if int8_pays() and int8_runs():  # a slow int8 kernel (an AVX2-only EPYC) would take minutes here
            backends.append(choose_backend(model, "int8"))
        if weight_int8_runs():
            backends.append(choose_backend(model, "weight-int8"))
    return measure_forward_costs(model, backends, rows, context, reps)


def step_bytes(model, backend: str, context: int) -> int:
    """Bytes a one-row decode step reads: every linear layer's weight, the output layer's too, at
    the backend's element size (int8: 1), and the keys and values of `context` tokens."""
    size = 1 if "int8" in backend else model.dtype.itemsize
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    cfg = model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv = 2 * cfg.num_hidden_layers * getattr(cfg, "num_key_value_heads", heads) * head_dim * model.dtype.itemsize
    return weights * size + kv * context


def copy_bandwidth(megabytes: int = 512, reps: int = 5) -> float:
    """Bytes a second this machine moves in a large tensor copy (read + write): the roof that
    a decode step, which reads every weight once, can at best approach."""
    src = torch.ones(megabytes << 18)  # fp32: 4 bytes an element
    dst = torch.empty_like(src)
    dst.copy_(src)  # pages touched once before timing
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * src.nbytes / statistics.median(times)


def format_bandwidth(model, costs: dict[str, dict[int, float]], context: int, roof: float) -> str:
    """Per backend: the bytes a one-row step reads, the rate its measured time gives, and that
    rate against the copy bandwidth."""
    lines = [f"one-row step, against this machine's copy bandwidth of {roof / 1e9:.1f} GB/s (read + write):"]
    for name, cost in costs.items():
        one = cost[min(cost)]
        moved = step_bytes(model, name, context)
        lines.append(f"  {name:<14} {moved / 1e6:>9.1f} MB  {moved / one / 1e9:>6.1f} GB/s  "
                     f"{moved / one / roof:>5.0%} of the roof")
    return "\n".join(lines)


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
    if 1 in rows:
        print(format_bandwidth(model, costs, args.context, copy_bandwidth()))
    print(f"backends for this model here (choose_backend): {choose_backend(model, 'fast').label!r} by default, "
          f"{choose_backend(model, 'auto').label!r} with --exact")
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
