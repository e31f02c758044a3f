"""`specsuite bench rag-serve`: N concurrent calls of the RAG web app's `ask` endpoint against the
same N calls one after the other, on Spec-Bench RAG questions over their pooled passages.

Two apps run in this process, on the same model: one answering one request at a time (`RagQA`
batch size 1, the exact path: concurrent requests take turns) and one whose concurrent requests
join one running batch (`BatchServer`, batch size N). Each is called through `gradio_client`, as a
program would call it: the N questions sequentially, then all N at once.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from specsuite.core.models import DEFAULT_EMBEDDING_MODEL, load_model


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
                  dtype: str | None = None) -> dict:
    from specsuite.apps.rag.qa import RagQA
    from specsuite.retrieval import Embedder, PassageIndex
    from specsuite.retrieval.evaluate import pool_specbench
    from specsuite.retrieval.specbench import load_specbench_rag

    passages, questions, _ = pool_specbench(load_specbench_rag(data), source=str(data))
    questions = questions[:n]
    index = PassageIndex(Embedder(DEFAULT_EMBEDDING_MODEL))
    index.add_passages(passages)
    model, tok = load_model(model_name, dtype=dtype)
    apps = {"one_at_a_time": RagQA.from_loaded(model, tok, index, max_new_tokens=max_new_tokens, prefix_cache_bytes=0),
            "batched": RagQA.from_loaded(model, tok, index, max_new_tokens=max_new_tokens, batch_size=n)}
    report: dict = {"task": "rag-serve", "model": model_name, "n": n, "k": k, "max_new_tokens": max_new_tokens,
                    "dtype": str(model.dtype).replace("torch.", ""), "torch_threads": torch.get_num_threads(),
                    "apps": {}}
    answers: dict[str, list[str]] = {}
    for name, qa in apps.items():
        app, client = _serve(qa, k)
        try:
            ask = lambda q: client.predict(q, k, api_name="/ask")  # noqa: E731
            ask(questions[0])  # warm-up: kernels, the engine's step cost (measured once, then cached)
            start = time.perf_counter()
            sequential = [ask(q) for q in questions]
            sequential_s = time.perf_counter() - start
            start = time.perf_counter()
            with ThreadPoolExecutor(n) as pool:
                concurrent = list(pool.map(ask, questions))
            concurrent_s = time.perf_counter() - start
        finally:
            app.close()
        answers[f"{name}_sequential"] = [a["answer"] for a in sequential]
        answers[f"{name}_concurrent"] = [a["answer"] for a in concurrent]
        report["apps"][name] = {"sequential_s": round(sequential_s, 3), "concurrent_s": round(concurrent_s, 3),
                                "concurrent_speedup": round(sequential_s / concurrent_s, 3),
                                "new_tokens": sum(a["stats"]["new_tokens"] for a in concurrent)}
    base = answers["one_at_a_time_sequential"]
    report["identical_to_one_at_a_time"] = {key: round(sum(a == b for a, b in zip(v, base)) / n, 4)
                                            for key, v in answers.items()}
    report["batched_concurrent_vs_sequential"] = round(
        report["apps"]["one_at_a_time"]["sequential_s"] / report["apps"]["batched"]["concurrent_s"], 3)
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
