"""`specsuite bench rag-serve`: N concurrent calls of the RAG web app's `ask` endpoint against the
same N calls one after the other, on Spec-Bench RAG questions over their pooled passages.

Two apps run in this process, on the same model: one answering one request at a time (`RagQA`
batch size 1, the exact path: concurrent requests take turns) and one whose concurrent requests
join one running batch (`BatchServer`, batch size N). Each is called through `gradio_client`, as a
program would call it: the N questions sequentially, and all N at once. Both apps serve at once;
the four runs (each app, sequential and concurrent) alternate in `rounds` rounds, their order
rotated each round, and each figure is the mean of its rounds, so that the drift of a shared
machine falls on all of them alike.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from specsuite.bench.rounds import rotated
from specsuite.core.model.backend import choose_backend
from specsuite.models import DEFAULT_EMBEDDING_MODEL, load_model


def _serve(qa, k: int):
    """The RAG app on a free loopback port, and a client of it."""
    import socket

    from gradio_client import Client

    from specsuite.apps.rag.ui import build_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = build_app(qa, k=k, time_budget_s=None)
    app.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    return app, Client(f"http://127.0.0.1:{port}/", verbose=False)


def run_rag_serve(model_name: str, data: Path, n: int = 4, k: int = 5, max_new_tokens: int = 128,
                  dtype: str | None = None, rounds: int = 1) -> dict:
    from specsuite.apps.rag.qa import RagQA
    from specsuite.retrieval import Embedder, PassageIndex
    from specsuite.retrieval.evaluate import pool_specbench
    from specsuite.retrieval.specbench import load_specbench_rag

    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    passages, questions, _ = pool_specbench(load_specbench_rag(data), source=str(data))
    questions = questions[:n]
    index = PassageIndex(Embedder(DEFAULT_EMBEDDING_MODEL))
    index.add_passages(passages)
    model, tok = load_model(model_name, dtype=dtype)
    backend = choose_backend(model)
    apps = {"one_at_a_time": RagQA.from_loaded(model, tok, index, max_new_tokens=max_new_tokens, prefix_cache_bytes=0,
                                               backend=backend),
            "batched": RagQA.from_loaded(model, tok, index, max_new_tokens=max_new_tokens, batch_size=n, backend=backend)}
    report: dict = {"task": "rag-serve", "model": model_name, "n": n, "k": k, "max_new_tokens": max_new_tokens,
                    "dtype": str(model.dtype).replace("torch.", ""), "torch_threads": torch.get_num_threads(),
                    "rounds": rounds, "apps": {}}
    runs = [(name, mode) for name in apps for mode in ("sequential", "concurrent")]
    times: dict[tuple[str, str], list[float]] = {run: [] for run in runs}
    answers: dict[str, list[str]] = {}
    tokens: dict[str, int] = {}
    served = [_serve(qa, k) for qa in apps.values()]
    try:
        asks = {name: (lambda q, c=client: c.predict(q, k, api_name="/ask")) for name, (_, client) in zip(apps, served)}
        for ask in asks.values():
            ask(questions[0])  # warm-up: kernels, the engine's step cost (measured once, then cached)
        for r in range(rounds):
            for name, mode in rotated(runs, r):
                start = time.perf_counter()
                if mode == "sequential":
                    out = [asks[name](q) for q in questions]
                else:
                    with ThreadPoolExecutor(n) as pool:
                        out = list(pool.map(asks[name], questions))
                times[(name, mode)].append(time.perf_counter() - start)
                answers.setdefault(f"{name}_{mode}", []).extend(a["answer"] for a in out)  # every round's
                tokens[name] = sum(a["stats"]["new_tokens"] for a in out)
    finally:
        for app, _ in served:
            app.close()
    mean = {run: sum(t) / len(t) for run, t in times.items()}
    for name in apps:
        seq, conc = mean[(name, "sequential")], mean[(name, "concurrent")]
        report["apps"][name] = {"sequential_s": round(seq, 3), "concurrent_s": round(conc, 3),
                                "concurrent_speedup": round(seq / conc, 3), "new_tokens": tokens[name],
                                "round_s": {mode: [round(t, 3) for t in times[(name, mode)]]
                                            for mode in ("sequential", "concurrent")}}
    base = answers["one_at_a_time_sequential"][:n]  # the first round's, which every answer is compared with
    report["identical_to_one_at_a_time"] = {key: round(sum(a == b for a, b in zip(v, base * rounds)) / len(v), 4)
                                            for key, v in answers.items()}
    report["batched_concurrent_vs_sequential"] = round(
        mean[("one_at_a_time", "sequential")] / mean[("batched", "concurrent")], 3)
    return report


def format_serve(report: dict) -> str:
    lines = [f"{'app':<16} {'sequential s':>13} {'concurrent s':>13} {'speedup':>8}"]
    for name, f in report["apps"].items():
        lines.append(f"{name:<16} {f['sequential_s']:>13} {f['concurrent_s']:>13} {f['concurrent_speedup']:>8}")
    lines.append(f"{report['n']} concurrent calls on the batched app vs {report['n']} sequential calls one at a time: "
                 f"{report['batched_concurrent_vs_sequential']}x")
    lines.append("answers identical to one-at-a-time sequential: " + ", ".join(
        f"{k} {v:.0%}" for k, v in report["identical_to_one_at_a_time"].items()))
    return "\n".join(lines)
