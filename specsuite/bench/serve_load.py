"""`specsuite bench serve-load`: what a web app does under load, as its users would see it.

It starts the app (`specsuite rag ui` on the bundled demo index, or `specsuite gec ui`) in a
subprocess, waits until it listens (model load and warm-up), then, for each client count C of
`--clients`, sends `--requests` requests from C concurrent `gradio_client` clients to the app's API
endpoint (`ask` or `correct`) and reports, per C: answered, refused by kind, timed out (the
time-budget error), latency p50/p95/max of all calls (send to end), requests/s, and the largest C at
which p95 stays under the time budget. The mix (`--mix mixed`) has normal inputs and, named in
the report, oversized ones (200,000 characters of one letter; a natural text of ~30,000 tokens)
and hostile ones (empty, whitespace only, not a string); `--mix normal` sends only normal ones.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

RAG_QUESTIONS = [
    "Who were the crew of Apollo 11, and what did each of them do?",
    "How long is the Great Wall of China?",
    "What do honeybees use to communicate where food is?",
    "Which prizes did Marie Curie win?",
    "What does photosynthesis produce?",
    "What moves the tectonic plates?",
    "Who invented the printing press with movable type?",
    "What goods were traded along the Silk Road?",
    "Who made the first telephone call?",
    "How does water get from the ocean back to the land?",
]
# Named inputs that must be refused at once, whatever the app is doing.
OVERSIZED = {"one_letter_200k_chars": "x" * 200_000,
             "natural_30k_tokens": ("All work and no play makes Jack a dull boy. " * 3000)}
HOSTILE = {"empty": "", "whitespace": " \n\t ", "not_a_string": 12345}
ENDPOINT = {"rag": "/ask", "gec": "/correct"}


def inputs(app: str, requests: int, mix: str) -> list[tuple[str, object]]:
    """(kind, input) of each request: in the mixed load every 4th is oversized or hostile (the
    kinds in turn), the rest normal."""
    if app == "rag":
        normal = RAG_QUESTIONS
    else:
        from specsuite.apps.gec.corrector import demo_sentences

        normal = demo_sentences()
    bad = [*OVERSIZED.items(), *HOSTILE.items()]
    out = []
    for i in range(requests):
        if mix == "mixed" and i % 4 == 3:
            out.append(bad[(i // 4) % len(bad)])
        else:
            out.append(("normal", normal[i % len(normal)]))
    return out


def outcome(error: Exception | None) -> str:
    """What became of a call: answered, timed_out (the time-budget error) or refused:<kind>."""
    if error is None:
        return "answered"
    message = str(error)
    for needle, kind in (("would take at least", "over_budget"), ("busy with other requests", "timed_out_waiting"),
                         ("time budget", "timed_out"),
                         ("too long", "too_long"), ("empty", "blank"), ("only whitespace", "blank"),
                         ("must be a string", "not_a_string")):
        if needle in message:
            return kind if kind.startswith("timed_out") else f"refused:{kind}"
    return f"error:{type(error).__name__}: {message[:80]}"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def _app_command(app: str, model: str, port: int, budget: float, batch_size: int, dtype: str | None,
                 backend: str | None = None) -> list[str]:
    """The app's command line; backend "int8" or "exact" adds the app's flag, others run its default."""
    cmd = [sys.executable, "-m", "specsuite.cli"]
    if app == "rag":
        from specsuite.apps.rag.cli import ensure_demo_index

        cmd += ["rag", "ui", str(ensure_demo_index())]
    else:
        cmd += ["gec", "ui"]
    cmd += ["--model", model, "--port", str(port), "--time-budget", f"{budget:g}", "--batch-size", str(batch_size)]
    return cmd + (["--dtype", dtype] if dtype else []) + ([f"--{backend}"] if backend in ("int8", "exact") else [])


def _wait_listening(url: str, process: subprocess.Popen, log: Path, timeout_s: float = 900.0) -> None:
    from gradio_client import Client

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if process.poll() is not None:
            raise RuntimeError(f"the app exited with {process.returncode}:\n{log.read_text()[-2000:]}")
        try:
            Client(url, verbose=False)
            return
        except Exception:  # noqa: BLE001 - not listening yet
            time.sleep(1.0)
    raise RuntimeError(f"the app did not listen within {timeout_s:.0f} s:\n{log.read_text()[-2000:]}")


def load_level(url: str, endpoint: str, app: str, calls: list[tuple[str, object]], clients: int) -> dict:
    """Send `calls` from `clients` concurrent clients; the figures of this level."""
    from gradio_client import Client

    local = threading.local()
    pool_clients = [Client(url, verbose=False) for _ in range(clients)]  # connected before the clock
    spare = iter(pool_clients)
    lock = threading.Lock()

    def call(item: tuple[str, object]) -> tuple[str, str, float]:
        if not hasattr(local, "client"):
            with lock:
                local.client = next(spare)
        kind, value = item
        args = (value, 5) if app == "rag" else (value,)
        start = time.monotonic()
        try:
            local.client.predict(*args, api_name=endpoint)
            error = None
        except Exception as e:  # noqa: BLE001 - every outcome is counted
            error = e
        return kind, outcome(error), time.monotonic() - start

    start = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(call, calls))
    wall = time.monotonic() - start
    latencies = [t for _, _, t in results]
    counts: dict[str, int] = {}
    for _, result, _ in results:
        counts[result] = counts.get(result, 0) + 1
    refused_s = [t for _, r, t in results if r.startswith("refused:")]
    waiting = counts.pop("timed_out_waiting", 0)  # its budget ended before it took a slot
    return {"clients": clients, "requests": len(calls), "answered": counts.pop("answered", 0),
            "timed_out": counts.pop("timed_out", 0) + waiting, "timed_out_waiting": waiting,
            "refused": {k.split(":", 1)[1]: v for k, v in counts.items() if k.startswith("refused:")},
            "errors": {k: v for k, v in counts.items() if not k.startswith("refused:")},
            "latency_s": {"p50": round(percentile(latencies, 0.5), 3), "p95": round(percentile(latencies, 0.95), 3),
                          "max": round(max(latencies), 3)},
            "refusal_max_s": round(max(refused_s), 3) if refused_s else None,
            "normal_answered": sum(k == "normal" and r == "answered" for k, r, _ in results),
            "wall_s": round(wall, 3), "requests_per_s": round(len(calls) / wall, 3)}


def run_serve_load(app: str, model: str, clients: list[int], requests: int, budget: float, batch_size: int = 8,
                   mix: str = "mixed", dtype: str | None = None, backend: str | None = None) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/"
    log = Path(tempfile.mkstemp(prefix=f"serve-load-{app}-", suffix=".log")[1])
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False"}
    with open(log, "w") as out:
        process = subprocess.Popen(_app_command(app, model, port, budget, batch_size, dtype, backend), stdout=out,
                                   stderr=subprocess.STDOUT, env=env)
    try:
        started = time.monotonic()
        _wait_listening(url, process, log)
        startup = time.monotonic() - started
        calls = inputs(app, requests, mix)
        levels = [load_level(url, ENDPOINT[app], app, calls, c) for c in clients]
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
    report = {"app": app, "model": model, "backend_flag": backend if backend in ("int8", "exact") else None, "time_budget_s": budget, "batch_size": batch_size, "mix": mix,
              "inputs": sorted({kind for kind, _ in calls}), "startup_s": round(startup, 1),
              "cpu_threads": os.environ.get("OMP_NUM_THREADS"), "levels": levels, "app_log": str(log)}
    under = [lv["clients"] for lv in levels if lv["latency_s"]["p95"] < budget]
    report["largest_clients_p95_under_budget"] = max(under) if under else None
    by_clients = {lv["clients"]: lv["wall_s"] for lv in levels}
    if 1 in by_clients:
        report["wall_vs_sequential"] = {c: round(by_clients[1] / w, 3) for c, w in by_clients.items() if c != 1}
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    """serve-load's options of `specsuite bench`."""
    g = p.add_argument_group("serve-load")
    g.add_argument("--app", choices=sorted(ENDPOINT), default="rag", help="serve-load: the app to start")
    g.add_argument("--clients", default="1,8,24,48", help="serve-load: comma-separated concurrent client counts")
    g.add_argument("--requests", type=int, default=48, help="serve-load: requests per client count")
    g.add_argument("--time-budget", type=float, default=30.0, help="serve-load: the app's --time-budget in seconds")
    g.add_argument("--serve-batch-size", type=int, default=8, help="serve-load: the app's --batch-size")
    g.add_argument("--mix", choices=["mixed", "normal"], default="mixed",
                   help="serve-load: normal inputs with oversized and hostile ones (every 4th), or normal only")


def cmd(args: argparse.Namespace) -> int:
    try:
        clients = sorted({int(c) for c in args.clients.split(",")})
    except ValueError:
        clients = []
    if not clients or clients[0] < 1 or args.requests < 1 or not args.time_budget > 0:
        print("error: --clients takes counts >= 1 (e.g. 1,8,24), --requests >= 1, --time-budget > 0", file=sys.stderr)
        return 2
    report = run_serve_load(args.app, args.model, clients, args.requests, args.time_budget, args.serve_batch_size,
                            args.mix, args.dtype, args.backend)
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0
