"""`specsuite bench-openai`: the same chat requests against any OpenAI-compatible server (ours, or
`llama-server`, vLLM, ...), one after the other and from C concurrent clients; throughput and
latency as JSON.

    specsuite bench-openai --base-url http://127.0.0.1:8000/v1 --model specsuite-gec \
        --prompts ../shared/data/jfleg/dev.src -n 8 --concurrency 1,8

With `--model specsuite-gec` the server builds the GEC prompt itself; for another server pass
`--gec-system` to send the same instruction as the system message of each request (the text of
`apps/gec/prompt.py`), so both decode the same prompts."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def read_prompts(path: str | Path, n: int) -> list[str]:
    with open(path, encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.strip()]
    if len(lines) < n:
        raise ValueError(f"{path} has {len(lines)} prompts, fewer than {n}")
    return lines[:n]


def chat(client, model: str, text: str, system: str | None, max_tokens: int) -> dict:
    """One non-streamed chat completion; its latency, completion tokens and our `speculation`."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    start = time.perf_counter()
    response = client.post("/chat/completions", json={"model": model, "messages": messages, "max_tokens": max_tokens,
                                                      "temperature": 0})
    latency = time.perf_counter() - start
    response.raise_for_status()
    body = response.json()
    return {"latency_s": latency, "completion_tokens": body.get("usage", {}).get("completion_tokens", 0),
            "content": body["choices"][0]["message"]["content"], "speculation": body.get("speculation")}


def run(base_url: str, model: str, prompts: list[str], concurrency: list[int], system: str | None = None,
        max_tokens: int = 128, api_key: str = "none") -> dict:
    import httpx

    report: dict = {"base_url": base_url, "model": model, "n": len(prompts), "max_tokens": max_tokens, "runs": []}
    with httpx.Client(base_url=base_url, timeout=600, headers={"Authorization": f"Bearer {api_key}"},
                      limits=httpx.Limits(max_connections=max(concurrency))) as client:
        chat(client, model, prompts[0], system, max_tokens)  # warm-up: first-call costs are not the server's pace
        for c in concurrency:
            start = time.perf_counter()
            with ThreadPoolExecutor(c) as pool:
                results = list(pool.map(lambda p: chat(client, model, p, system, max_tokens), prompts))
            wall = time.perf_counter() - start
            latencies = sorted(r["latency_s"] for r in results)
            tokens = sum(r["completion_tokens"] for r in results)
            report["runs"].append({
                "concurrency": c, "wall_s": round(wall, 3), "requests_per_s": round(len(prompts) / wall, 3),
                "completion_tokens": tokens, "tokens_per_s": round(tokens / wall, 2),
                "latency_mean_s": round(statistics.fmean(latencies), 3),
                "latency_p50_s": round(latencies[len(latencies) // 2], 3), "latency_max_s": round(latencies[-1], 3),
                "contents": [r["content"] for r in results],
            })
    return report


def _bench(args: argparse.Namespace) -> int:
    system = None
    if args.gec_system:
        from specsuite.apps.gec.prompt import SYSTEM

        system = SYSTEM
    concurrency = [int(c) for c in args.concurrency.split(",")]
    report = run(args.base_url, args.model, read_prompts(args.prompts, args.n), concurrency, system, args.max_tokens,
                 args.api_key)
    for r in report["runs"]:
        if not args.contents:
            del r["contents"]
    print(json.dumps(report, ensure_ascii=False))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench-openai", help="throughput and latency of chat requests against an OpenAI-compatible server")
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="specsuite-gec")
    p.add_argument("--prompts", required=True, help="a text file, one prompt (user message) a line")
    p.add_argument("-n", type=int, default=8, help="requests (the first N prompts; default 8)")
    p.add_argument("--concurrency", default="1,8", help="concurrent clients per run, comma-separated (default 1,8)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--gec-system", action="store_true", help="send GEC's instruction as the system message")
    p.add_argument("--api-key", default="none")
    p.add_argument("--contents", action="store_true", help="include the replies in the report")
    p.set_defaults(func=_bench)
