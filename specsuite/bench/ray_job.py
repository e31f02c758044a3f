"""`specsuite bench-ray`: lines/s of the GEC batch job on a local Ray cluster against the one-machine job.

Times the real commands end to end (a fresh process each: imports, model loading, the job), on the
first N lines of a file (JFLEG dev): `specsuite gec correct` on one machine with 2 torch threads,
and the same command with `--ray ADDRESS` joining a local one-node 2-CPU cluster, with 1 and 2
actors of 1 thread, and 1 actor of 2 threads (the Ray path's overhead: the same CPUs as the
one-machine job). The cluster is started once, after the one-machine job, and its start is
reported apart (`--ray local` pays it, joining a running cluster does not). Both use the batched
engine (`--batch-size`; on Ray a block of lines is one batch) or, with `--exact`, one text at a
time; the table counts the lines identical to the one-machine job's (all of them with `--exact`;
with the batched engine a near-tie can differ).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specsuite.apps.gec.corrector import DEFAULT_BATCH_SIZE
from specsuite.models import DEFAULT_MODEL

CONFIGS = {"ray1x1": (1, 1), "ray2x1": (2, 1), "ray1x2": (1, 2)}  # name: (actors, threads each)
LOCAL_THREADS = 2


def _identical_lines(a: Path, b: Path) -> int:
    return sum(x == y for x, y in zip(a.read_bytes().split(b"\n")[:-1], b.read_bytes().split(b"\n")))


def _timed(command: list[str]) -> float:
    """Seconds the command took; its progress bar goes to this process's stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": str(LOCAL_THREADS)}  # the one-machine job's torch threads
    start = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, env=env)
    seconds = time.perf_counter() - start
    if done.returncode not in (0, 1):  # 1: some lines are error records
        raise SystemExit(f"error: {' '.join(command)} exited with {done.returncode}")
    return seconds


def _bench(args: argparse.Namespace) -> int:
    import ray

    configs = [c for c in args.configs.split(",") if c]
    if unknown := [c for c in configs if c not in CONFIGS]:
        raise SystemExit(f"error: unknown configs {unknown}; use {', '.join(CONFIGS)}")
    model_args = ["--model", args.model] + (["--dtype", args.dtype] if args.dtype else []) + (
        ["--max-new-tokens", str(args.max_new_tokens)] if args.max_new_tokens else []) + (
        ["--exact"] if args.exact else ["--batch-size", str(args.batch_size)])
    rows: list[tuple[str, str, float, int]] = []
    with tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp:
        # The first N lines, in a temporary file the job can read (removed at the end).
        lines = Path(args.data).read_bytes().split(b"\n")[: args.n]
        source = Path(tmp) / "input.txt"
        source.write_bytes(b"".join(line + b"\n" for line in lines))
        n = len(lines)
        correct = [sys.executable, "-m", "specsuite.cli", "gec", "correct", str(source), *model_args, "-o"]

        reference = Path(tmp) / "local.txt"
        rows.append(("one machine", f"1 process x {LOCAL_THREADS} threads", _timed(correct + [str(reference)]), n))
        start = time.perf_counter()
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        cluster_s = time.perf_counter() - start
        try:
            address = ray.get_runtime_context().gcs_address
            for name in configs:
                workers, threads = CONFIGS[name]
                out = Path(tmp) / f"{name}.txt"
                seconds = _timed(correct + [str(out), "--ray", address, "--workers", str(workers),
                                            "--threads-per-worker", str(threads)])
                rows.append((f"Ray, {workers} actor{'s' * (workers > 1)}", f"{workers} x {threads} thread"
                             + "s" * (threads > 1), seconds, _identical_lines(out, reference)))
        finally:
            ray.shutdown()

    local_s = rows[0][2]
    print(f"\n{n} lines of {args.data}, {' '.join(model_args)}")
    print(f"local Ray cluster start (2 CPUs): {cluster_s:.1f} s, not included below\n")
    print("| job | processes x threads | wall s | lines/s | time vs one machine | lines identical to one machine |")
    print("|---|---|---|---|---|---|")
    for job, shape, wall, same in rows:
        print(f"| {job} | {shape} | {wall:.1f} | {n / wall:.2f} | {wall / local_s:.2f}x | {same}/{n} |")
    return 0 if not args.exact or all(same == n for *_, same in rows) else 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench-ray", help="lines/s of the GEC batch job on a local Ray cluster vs one machine "
                       "(needs the ray extra)")
    p.add_argument("--data", required=True, help="a text a line, e.g. ../shared/data/jfleg/dev.src")
    p.add_argument("--n", type=int, default=200, help="the first N lines (default 200)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"preset or model directory (default {DEFAULT_MODEL})")
    p.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], help="default: bf16 where the CPU supports it")
    p.add_argument("--max-new-tokens", type=int, help="per segment (default 2 x its tokens + 16)")
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE,
                   help=f"texts decoded together by the batched engine (default {DEFAULT_BATCH_SIZE})")
    p.add_argument("--exact", action="store_true", help="one text at a time: every output must be identical")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"Ray runs, of {', '.join(CONFIGS)} (default all)")
    p.set_defaults(func=_bench)
