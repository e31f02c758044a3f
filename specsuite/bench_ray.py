"""`specsuite bench-ray`: lines/s of the GEC batch job on a local Ray cluster against the one-machine job.

Runs, on the first N lines of a file (JFLEG dev), the one-machine job (`run_batch`, 2 torch
threads) and the Ray job (`run_ray_batch` on a local 2-CPU cluster on 127.0.0.1) with 1 and 2
actors of 1 thread, and 1 actor of 2 threads (the Ray path's overhead: the same CPUs as the
one-machine job). Each time is end to end, model loading included; the cluster is started once,
after the one-machine job, and its start is reported apart (`--ray local` pays it, joining a
running cluster does not). Every output must be byte for byte the one-machine job's.
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from pathlib import Path

from specsuite.core.models import DEFAULT_MODEL

CONFIGS = {"ray1x1": (1, 1), "ray2x1": (2, 1), "ray1x2": (1, 2)}  # name: (actors, threads each)
LOCAL_THREADS = 2


def _same_output(a: Path, b: Path) -> bool:
    sidecar = lambda p: p.with_name(p.name + ".errors.jsonl")  # noqa: E731
    return a.read_bytes() == b.read_bytes() and (
        sidecar(a).read_bytes() == sidecar(b).read_bytes() if sidecar(a).exists() else not sidecar(b).exists())


def _bench(args: argparse.Namespace) -> int:
    import ray
    import torch

    from specsuite.apps.gec.batch import run_batch
    from specsuite.apps.gec.corrector import Corrector
    from specsuite.apps.gec.distributed import run_ray_batch

    configs = [c for c in args.configs.split(",") if c]
    if unknown := [c for c in configs if c not in CONFIGS]:
        raise SystemExit(f"error: unknown configs {unknown}; use {', '.join(CONFIGS)}")
    settings = {"model": args.model, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens}
    factory = functools.partial(Corrector, **settings)
    rows: list[tuple[str, str, float, bool]] = []
    with tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp:
        # The first N lines, in a temporary file the job can read (removed at the end).
        lines = Path(args.data).read_bytes().split(b"\n")[: args.n]
        source = Path(tmp) / "input.txt"
        source.write_bytes(b"".join(line + b"\n" for line in lines))
        n = len(lines)

        torch.set_num_threads(LOCAL_THREADS)
        reference = Path(tmp) / "local.txt"
        start = time.perf_counter()
        run_batch(source, reference, factory)
        rows.append(("one machine", f"1 process x {LOCAL_THREADS} threads", time.perf_counter() - start, True))

        start = time.perf_counter()
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1")
        cluster_s = time.perf_counter() - start
        try:
            for name in configs:
                workers, threads = CONFIGS[name]
                out = Path(tmp) / f"{name}.txt"
                start = time.perf_counter()
                run_ray_batch(source, out, factory, workers=workers, threads_per_worker=threads, job_info=settings)
                rows.append((f"Ray, {workers} actor{'s' * (workers > 1)}", f"{workers} x {threads} thread"
                             + "s" * (threads > 1), time.perf_counter() - start, _same_output(out, reference)))
        finally:
            ray.shutdown()

    local_s = rows[0][2]
    print(f"\n{n} lines of {args.data}, model {args.model}, dtype {args.dtype or 'default'}, "
          f"torch {torch.get_num_threads()} threads in the one-machine job")
    print(f"local Ray cluster start (2 CPUs): {cluster_s:.1f} s, not included below\n")
    print("| job | processes x threads | wall s | lines/s | time vs one machine | output identical |")
    print("|---|---|---|---|---|---|")
    for job, shape, wall, same in rows:
        print(f"| {job} | {shape} | {wall:.1f} | {n / wall:.2f} | {wall / local_s:.2f}x | {'yes' if same else 'NO'} |")
    return 0 if all(same for *_, same in rows) else 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench-ray", help="lines/s of the GEC batch job on a local Ray cluster vs one machine "
                       "(needs the ray extra)")
    p.add_argument("--data", required=True, help="a text a line, e.g. ../shared/data/jfleg/dev.src")
    p.add_argument("--n", type=int, default=200, help="the first N lines (default 200)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"preset or model directory (default {DEFAULT_MODEL})")
    p.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], help="default: bf16 where the CPU supports it")
    p.add_argument("--max-new-tokens", type=int, help="per segment (default 2 x its tokens + 16)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"Ray runs, of {', '.join(CONFIGS)} (default all)")
    p.set_defaults(func=_bench)
