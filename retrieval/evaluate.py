"""Retrieval quality and speed: recall on the pooled Spec-Bench RAG passages, and index/query
timings on that corpus and on a synthetic index of random unit vectors."""

from __future__ import annotations

import os
from dataclasses import replace
from time import perf_counter
from typing import Any, Sequence

import numpy as np

from .documents import Passage
from .embedder import Embedder
from .index import IndexSettings, PassageIndex, make_faiss_index
from .specbench import load_specbench_rag, parse_specbench_rag


def _latency_ms(seconds: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(seconds) * 1000
    return {"query_p50_ms": float(np.percentile(ms, 50)), "query_p95_ms": float(np.percentile(ms, 95))}


def pool_specbench(items: Sequence[dict[str, Any]], source: str = "") -> tuple[list[Passage], list[str], list[set[str]]]:
    """One corpus of every item's passages (one line = one passage, identical lines kept once),
    the questions, and for each question the ids of its own passages."""
    passages: list[Passage] = []
    id_of_text: dict[str, str] = {}
    questions, gold = [], []
    for n, item in enumerate(items):
        texts, question = parse_specbench_rag(item)
        qid = str(item.get("question_id", n))
        for j, text in enumerate(texts):
            if text not in id_of_text:
                id_of_text[text] = f"{qid}#{j}"
                passages.append(Passage(id=f"{qid}#{j}", doc_id=qid, text=text, source=source))
        questions.append(question)
        gold.append({id_of_text[t] for t in texts})
    return passages, questions, gold


def evaluate_specbench(path: str | os.PathLike, embedder: Embedder | None = None, k: int = 5,
                       settings: IndexSettings = IndexSettings(), progress: bool = False) -> dict[str, Any]:
    """Index the pooled passages of a Spec-Bench RAG file and ask every question once.

    recall_at_k: the fraction of a question's own passages in its top k, averaged; hit_at_k: the
    fraction of questions with at least one. Throughput includes embedding; latency is one
    query at a time, embedding included."""
    passages, questions, gold = pool_specbench(load_specbench_rag(path), source=str(path))
    index = PassageIndex(embedder, settings=settings)
    index.embedder.encode(["warm-up"])  # load the model before the clock starts
    start = perf_counter()
    index.add_passages(passages, progress=progress)
    build_s = perf_counter() - start
    recalls, hits, seconds = [], [], []
    for question, own in zip(questions, gold):
        start = perf_counter()
        found = {p.id for p, _ in index.search(question, k)} & own
        seconds.append(perf_counter() - start)
        recalls.append(len(found) / len(own))
        hits.append(bool(found))
    return {"corpus": "specbench-rag", "index_type": settings.index_type, "items": len(passages),
            "questions": len(questions), "k": k, "recall_at_k": float(np.mean(recalls)),
            "hit_at_k": float(np.mean(hits)), "add_per_s": len(passages) / build_s,
            **_latency_ms(seconds)}


def _unit_rows(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def benchmark_synthetic(n: int = 100_000, dim: int = 384, index_types: Sequence[str] = ("flat", "hnsw"),
                        queries: int = 200, k: int = 5, seed: int = 0, settings: IndexSettings = IndexSettings(),
                        hnsw_ef_search: Sequence[int] = (64, 128, 256)) -> list[dict[str, Any]]:
    """FAISS alone on `n` random unit vectors, with the same index settings as PassageIndex; an
    HNSW graph is built once and searched with each `hnsw_ef_search` (the speed/recall knob).

    Queries are stored vectors plus noise, so each has a true nearest neighbour as real queries
    do. recall_at_k: the share of the exact top k found; hit_at_k: the share of queries whose
    source vector is in the top k. Throughput excludes embedding; latency is one query at a time.
    Random vectors are a worst case for HNSW: real embeddings have far more structure."""
    rng = np.random.default_rng(seed)
    vectors = _unit_rows(rng.standard_normal((n, dim), dtype=np.float32))
    picks = rng.integers(0, n, queries)
    qs = _unit_rows(vectors[picks] + rng.standard_normal((queries, dim), dtype=np.float32) / np.sqrt(dim))
    exact = np.argpartition(-(qs @ vectors.T), k, axis=1)[:, :k]  # the exact top k, unordered
    corpus = f"synthetic-{n // 1000}k" if n >= 1000 and n % 1000 == 0 else f"synthetic-{n}"
    results = []
    for index_type in index_types:
        start = perf_counter()
        index = make_faiss_index(replace(settings, index_type=index_type), dim, vectors)
        index.add(vectors)
        add_per_s = n / (perf_counter() - start)
        for ef in hnsw_ef_search if index_type == "hnsw" else [None]:
            if ef is not None:
                index.hnsw.efSearch = ef
            seconds = []
            for q in qs:
                start = perf_counter()
                index.search(q[None, :], k)
                seconds.append(perf_counter() - start)
            _, ids = index.search(qs, k)
            results.append({
                "corpus": corpus, "index_type": index_type if ef is None else f"hnsw ef={ef}", "items": n,
                "questions": queries, "k": k, "add_per_s": add_per_s,
                "recall_at_k": float(np.mean([len(set(a) & set(b)) / k for a, b in zip(ids, exact)])),
                "hit_at_k": float(np.mean([src in row for src, row in zip(picks, ids)])),
                **_latency_ms(seconds)})
    return results


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """A plain-text table of evaluation rows."""
    k = rows[0]["k"] if rows else 5
    header = ["corpus", "index", "items", "add/s", "p50 ms", "p95 ms", f"recall@{k}", f"hit@{k}"]
    lines = [[r["corpus"], r["index_type"], str(r["items"]), f"{r['add_per_s']:,.0f}",
              f"{r['query_p50_ms']:.2f}", f"{r['query_p95_ms']:.2f}", f"{r['recall_at_k']:.3f}",
              "-" if r["hit_at_k"] is None else f"{r['hit_at_k']:.3f}"] for r in rows]
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *lines])
