"""`specsuite step-cost`: what one verify forward costs by its number of rows, on this machine.

Speculative decoding pays off when verifying k rows costs less than k one-token steps; how much less
depends on the kernels (bf16 with AMX: smooth growth; fp32 on an AVX2-only CPU: flat up to 4 rows,
then jumps at 8, 16 and 32, which `generate()`'s draft size ladder follows). This measures it: a
prompt of random tokens is prefilled once, then a chain of k-1 draft tokens after one fresh token
runs through `generate()`'s own forward, k rows in all, every row count in turn, `reps` rounds,
and the cache is cropped back after each. The linear layers run as `generate()` runs them
(exact_linear's form for the dtype) and, for comparison, as one plain `F.linear` call.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from specsuite.core import Draft, exact_linear
from specsuite.core.models import DEFAULT_MODEL, load_model

FORMS = ("specsuite", "plain")


def measure_step_costs(model, rows: list[int], context: int = 80, reps: int = 5, seed: int = 0) -> dict:
    """Median seconds of a verify forward of each row count after `context` cached tokens, per
    linear form of the draft rows: {"specsuite": {rows: s}, "plain": {rows: s}}."""
    forward = importlib.import_module("specsuite.core.generate")._forward
    gen = torch.Generator().manual_seed(seed)
    vocab = min(model.config.vocab_size, 32000)
    prompt = torch.randint(0, vocab, (context,), generator=gen).tolist()
    ours = exact_linear.FORWARDS.get(model.dtype)
    plain = lambda layer, x, block: F.linear(x, layer.weight, layer.bias)  # noqa: E731
    fns = {"specsuite": ours or plain, "plain": plain}  # no entry: plain F.linear either way
    times: dict[str, dict[int, list[float]]] = {form: {k: [] for k in rows} for form in FORMS}
    cache = DynamicCache(config=model.config)
    try:
        with torch.inference_mode():
            forward(model, prompt, cache, 0, None)
            for rep in range(reps + 1):  # the first round warms up
                for k in rows:
                    for form in FORMS:
                        exact_linear.FORWARDS[model.dtype] = fns[form]
                        tokens = torch.randint(0, vocab, (k,), generator=gen).tolist()
                        draft = Draft.chain(tokens[1:]) if k > 1 else None
                        start = time.perf_counter()
                        forward(model, tokens[:1], cache, context, draft)
                        if rep:
                            times[form][k].append(time.perf_counter() - start)
                        cache.crop(-k)
    finally:
        if ours is None:
            exact_linear.FORWARDS.pop(model.dtype, None)
        else:
            exact_linear.FORWARDS[model.dtype] = ours
    return {form: {k: statistics.median(v) for k, v in per_rows.items()} for form, per_rows in times.items()}


def format_costs(costs: dict) -> str:
    ours, plain = costs["specsuite"], costs["plain"]
    one = ours[min(ours)]
    lines = [f"{'rows':>5} {'specsuite ms':>13} {'vs 1 row':>9} {'plain F.linear ms':>18}"]
    for k in ours:
        lines.append(f"{k:>5} {ours[k] * 1000:>13.1f} {ours[k] / one:>8.2f}x {plain[k] * 1000:>18.1f}")
    return "\n".join(lines)


def _cmd(args: argparse.Namespace) -> int:
    rows = sorted({int(r) for r in args.rows.split(",")})
    if not rows or rows[0] < 1:
        raise SystemExit("error: --rows takes row counts >= 1, e.g. 1,2,4,8")
    model, _ = load_model(args.model, dtype=args.dtype)
    costs = measure_step_costs(model, rows, args.context, args.reps)
    print(f"verify forward cost · {args.model} ({str(model.dtype).replace('torch.', '')}) · "
          f"{args.context} cached tokens · median of {args.reps} · {torch.get_num_threads()} threads")
    print(format_costs(costs))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("step-cost", help="time one verify forward by its number of rows on this machine")
    p.add_argument("--model", default=DEFAULT_MODEL, help="preset name or local model directory")
    p.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], help="default: bf16 where the CPU supports it")
    p.add_argument("--rows", default="1,2,3,4,5,8,9,16,17,32,33", help="comma-separated row counts")
    p.add_argument("--context", type=int, default=80, help="cached tokens before the verified rows")
    p.add_argument("--reps", type=int, default=5, help="rounds over all row counts (median)")
    p.set_defaults(func=_cmd)
