"""`specsuite bench TASK`: our speculative decoding against HF `generate()` on the same model and prompts.

All methods run in one process on the same prompts, in an order rotated per prompt so that drift
(thermal, other load) spreads over all of them. Each method's output is compared token for token
with HF's plain greedy output.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer

from specsuite.core import Drafter, DraftModelDrafter, PromptLookupDrafter, eos_token_ids, generate, turn_end_token
from specsuite.core.model.backend import KINDS, Backend, choose_backend
from specsuite.core.speculation.draft import FallbackDrafter
from specsuite.core.scheduler.chat import chat_prompt_ids
from specsuite.adapters import describe_adapter
from specsuite.models import DEFAULT_MODEL, load_model
from specsuite.bench import serve_load as bench_serve_load
from specsuite.bench.rounds import rotated
from specsuite.retrieval.cli import _positive_int


@dataclass
class Example:
    prompt_ids: list[int]
    drafters: dict[str, Callable[[], Drafter]]  # app drafters for this prompt, by method suffix
    references: list[str] = field(default_factory=list)  # short answers, where the data has them


@dataclass
class Run:
    tokens: list[int]
    total_s: float
    ttft_s: float
    forwards: int  # target forward passes


# ---- tasks: how each reads its data and which app drafters apply -------------------------------

def _gec_examples(path: Path, n: int, tok, end: list[int]) -> list[Example]:
    from specsuite.apps.gec.drafter import CopyDrafter
    from specsuite.apps.gec.prompt import gec_prompt_ids

    lines = [l.strip() for l in path.read_text(encoding="utf-8").splitlines() if l.strip()][:n]
    return [Example(gec_prompt_ids(tok, line),
                    {"copy": lambda line=line: CopyDrafter.for_text(tok, line, end_tokens=end)})
            for line in lines]


def _read_jsonl(path: Path, n: int) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()][:n]


def _summarize_examples(path: Path, n: int, tok, end: list[int]) -> list[Example]:
    return [Example(chat_prompt_ids(tok, item["turns"][0]), {}) for item in _read_jsonl(path, n)]


def _rag_examples(path: Path, n: int, tok, end: list[int]) -> list[Example]:
    from specsuite.bench.rag_task import rag_example_parts

    out = []
    for item in _read_jsonl(path, n):
        prompt_ids, drafters = rag_example_parts(tok, item)
        refs = [r for group in item.get("reference", []) for r in (group if isinstance(group, list) else [group])]
        out.append(Example(prompt_ids, drafters, refs))
    return out


TASKS = {"gec": _gec_examples, "rag": _rag_examples, "summarize": _summarize_examples}


def _gec_prefix_cache(model, backend: Backend):
    from specsuite.apps.gec.prompt import instruction_cache

    return instruction_cache(model, backend)


# Our methods use the prefix cache the app uses (the same for every prompt of the run); HF's do not
# have one. GEC: the shared instruction. RAG: none in the main runs (every prompt has other passages).
PREFIX_CACHES = {"gec": _gec_prefix_cache}


# ---- timing each method ----------------------------------------------------------------------

class _FirstTokenClock(BaseStreamer):
    """Records when HF's generate emits its first new token (its first `put` is the prompt)."""

    def __init__(self) -> None:
        self.calls, self.first = 0, None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


class _ForwardCounter:
    """Counts forward passes of a model (a forward hook), until `remove()`."""

    def __init__(self, model) -> None:
        self.count = 0
        self._hook = model.register_forward_pre_hook(self._counted)

    def _counted(self, module, args) -> None:
        self.count += 1

    def remove(self) -> None:
        self._hook.remove()


def _hf_run(model, counter, ids: list[int], config: GenerationConfig, assistant=None) -> Run:
    clock, x = _FirstTokenClock(), torch.tensor([ids])
    counter.count = 0
    start = time.perf_counter()
    out = model.generate(x, generation_config=config, streamer=clock,
                         assistant_model=assistant)
    end = time.perf_counter()
    return Run(out[0, len(ids):].tolist(), end - start, (clock.first or end) - start, counter.count)


def _spec_run(model, backend: Backend, ids: list[int], drafter: Drafter, max_new_tokens: int, eos: list[int],
              tie_margin: float | None = None, prefix_cache=None) -> Run:
    policy = backend.policy if tie_margin is None else replace(backend.policy, tie_margin=tie_margin)
    g = generate(model, ids, drafter, max_new_tokens=max_new_tokens, eos_token_id=eos, policy=policy,
                 prefix_cache=prefix_cache, backend=backend)
    return Run(g.tokens, g.stats.total_s, g.stats.prefill_s, g.stats.forward_passes)


def _summarize(runs: list[Run], greedy: list[Run], examples: list[Example], tok) -> dict:
    total = sum(r.total_s for r in runs)
    new = sum(len(r.tokens) for r in runs)
    ttft = sum(r.ttft_s for r in runs)
    fwd = sum(r.forwards for r in runs)
    g_total = sum(r.total_s for r in greedy)
    g_decode = sum(r.total_s - r.ttft_s for r in greedy)
    decode = total - ttft
    steps = fwd - len(runs)  # decode forward passes: each yields accepted drafts + 1 token
    figures = {
        "total_s": round(total, 3), "new_tokens": new, "tokens_per_s": round(new / total, 2),
        "speedup_vs_hf_greedy": round(g_total / total, 3), "ttft_s": round(ttft / len(runs), 4),
        "decode_s": round(decode, 3), "decode_speedup_vs_hf_greedy": round(g_decode / decode, 3) if decode > 0 else None,
        "forwards_per_token": round(fwd / new, 4), "mean_accepted_per_step": round((new - fwd) / steps, 3) if steps else 0.0,
        "identical_to_greedy": round(sum(r.tokens == g.tokens for r, g in zip(runs, greedy)) / len(runs), 4),
    }
    if any(e.references for e in examples):  # answer quality: the same for every lossless method
        hits = [any(ref.lower() in tok.decode(r.tokens).lower() for ref in e.references) for r, e in zip(runs, examples)]
        figures["answer_contains_reference"] = round(sum(hits) / len(hits), 4)
    return figures


def run_bench(task: str, model_name: str, data: Path, n: int, max_new_tokens: int = 128,
              draft_model_name: str | None = None, dtype: str | None = None,
              methods: list[str] | None = None, tie_margin: float | None = None,
              prefix_cache: bool = True, backend: str = "fast", adapter: str = "auto") -> dict:
    """Run every applicable method on the first `n` prompts of `data`; returns the JSON report.
    tie_margin: passed to our methods' `generate` (None: its default). prefix_cache: our methods
    reuse the KV of the prompts' shared start as the app does (`PREFIX_CACHES`; False: never).
    backend: how our methods compute forwards (a `core.backend` kind). adapter: the
    task's app adapter merged into the model every method runs (`load_model`; gec and rag)."""
    app = task if task in ("gec", "rag") else None
    model, tok = load_model(model_name, dtype=dtype, adapter=adapter if app else None, task=app)
    backend = choose_backend(model, backend)  # once, for every call of our methods
    draft_model = load_model(draft_model_name, dtype=dtype)[0] if draft_model_name else None
    eos = sorted(eos_token_ids(model, tok))
    examples = TASKS[task](data, n, tok, [turn_end_token(model, tok)])
    if not examples:
        raise ValueError(f"no prompts in {data}")
    base = dict(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos[0],
                temperature=None, top_p=None, top_k=None)
    counter = _ForwardCounter(model)
    prefix_cache = PREFIX_CACHES[task](model, backend) if prefix_cache and task in PREFIX_CACHES else None

    def spec(e: Example, drafter: Drafter) -> Run:
        return _spec_run(model, backend, e.prompt_ids, drafter, max_new_tokens, eos, tie_margin, prefix_cache)

    runners: dict[str, Callable[[Example], Run]] = {
        "hf_greedy": lambda e: _hf_run(model, counter, e.prompt_ids, GenerationConfig(**base)),
        "hf_prompt_lookup": lambda e: _hf_run(model, counter, e.prompt_ids,
                                              GenerationConfig(**base, prompt_lookup_num_tokens=10)),
        "spec_prompt_lookup": lambda e: spec(e, PromptLookupDrafter()),
    }
    if draft_model is not None:
        runners["hf_assisted"] = lambda e: _hf_run(model, counter, e.prompt_ids, GenerationConfig(**base),
                                                   assistant=draft_model)
        runners["spec_draft_model"] = lambda e: spec(e, DraftModelDrafter(draft_model))
    for suffix in examples[0].drafters:
        runners[f"spec_{suffix}"] = lambda e, s=suffix: spec(e, e.drafters[s]())
        if draft_model is not None:  # the input's drafts first, the draft model where they have none
            runners[f"spec_{suffix}+draft_model"] = lambda e, s=suffix: spec(
                e, FallbackDrafter(e.drafters[s](), DraftModelDrafter(draft_model)))
    if methods:
        unknown = set(methods) - set(runners)
        if unknown:
            raise ValueError(f"unknown methods {sorted(unknown)}; available: {sorted(runners)}")
        runners = {k: v for k, v in runners.items() if k in methods or k == "hf_greedy"}

    names = list(runners)
    runs: dict[str, list[Run]] = {name: [] for name in names}
    try:
        for name in names:  # warm-up: first calls pay for kernel selection and allocation
            runners[name](Example(examples[0].prompt_ids, examples[0].drafters))
        for i, example in enumerate(tqdm(examples, desc=f"bench {task}", unit="prompt", disable=None)):
            for name in rotated(names, i):
                runs[name].append(runners[name](example))
    finally:
        counter.remove()
    report = {
        "task": task, "model": model_name, "adapter": describe_adapter(adapter, app, model_name) if app else "none",
        "n": len(examples), "max_new_tokens": max_new_tokens,
        "dtype": str(model.dtype).replace("torch.", ""), "draft_model": draft_model_name,
        "torch_threads": torch.get_num_threads(), "tie_margin": tie_margin, "backend": backend.label,
        "spec_prefix_cache": prefix_cache is not None,  # our methods reuse the KV of a shared prompt start
        "methods": {name: _summarize(runs[name], runs["hf_greedy"], examples, tok) for name in names},
    }
    report["mismatches"] = {name: [i for i, (r, g) in enumerate(zip(runs[name], runs["hf_greedy"]))
                                   if r.tokens != g.tokens] for name in names}
    if task == "rag":  # a follow-up question over the same passages reuses their KV
        from specsuite.bench.rag_task import prefix_cache_ttft

        report["prefix_cache"] = prefix_cache_ttft(model, tok, _read_jsonl(data, n), n=min(10, n))
    return report


def format_table(report: dict) -> str:
    cols = [("method", 20), ("wall s", 8), ("new tok", 8), ("tok/s", 7), ("speedup", 8), ("TTFT s", 7),
            ("decode x", 9), ("fwd/tok", 8), ("acc/step", 9), ("identical", 9)]
    lines = [" ".join(f"{c:>{w}}" if i else f"{c:<{w}}" for i, (c, w) in enumerate(cols))]
    for name, f in report["methods"].items():
        vals = [name, f["total_s"], f["new_tokens"], f["tokens_per_s"], f["speedup_vs_hf_greedy"], f["ttft_s"],
                f["decode_speedup_vs_hf_greedy"], f["forwards_per_token"], f["mean_accepted_per_step"],
                f["identical_to_greedy"]]
        lines.append(" ".join(f"{v:<{w}}" if i == 0 else f"{v:>{w}}" for i, (v, (_, w)) in enumerate(zip(vals, cols))))
    return "\n".join(lines)


def plot(report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["methods"])
    e2e = [report["methods"][n]["speedup_vs_hf_greedy"] for n in names]
    dec = [report["methods"][n]["decode_speedup_vs_hf_greedy"] or 0 for n in names]
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], e2e, 0.4, label="end to end")
    ax.bar([x + 0.2 for x in xs], dec, 0.4, label="decode phase")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(list(xs), names, rotation=20, ha="right")
    ax.set_ylabel("speedup vs HF greedy")
    ax.set_title(f"{report['task']} · {report['model']} · n={report['n']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def _cmd(args: argparse.Namespace) -> int:
    try:
        return _run_cmd(args)
    except ValueError as e:  # bad input found once the data or model is read: unknown methods, no prompts
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run_cmd(args: argparse.Namespace) -> int:
    if args.task == "serve-load":
        return bench_serve_load.cmd(args)
    if args.data is None:
        print(f"error: bench {args.task} needs --data", file=sys.stderr)
        return 2
    data = Path(args.data)
    if not data.exists():
        print(f"error: no such data file: {data}", file=sys.stderr)
        return 1
    if args.task == "gec-batch":
        return _cmd_gec_batch(args, data)
    if args.task == "peers":
        from specsuite.bench.peers import format_peers, run_peers

        if not args.anchors:
            print("error: bench peers needs the peers' scripts: --anchors DIR or SPECSUITE_ANCHORS "
                  "(e.g. ../shared/anchors; its README sets the peers up)", file=sys.stderr)
            return 1

        report = run_peers(args.model, data, args.n, Path(args.anchors), args.max_new_tokens,
                           sorted({int(p) for p in args.peer_parallel.split(",")}), args.dtype,
                           args.rounds or 1, args.deciding_only, args.backend)
        return _show(args, report, format_peers(report),
                     f"peers · {args.model} · n={report['n']} · max_new_tokens={args.max_new_tokens} · "
                     f"{report['torch_threads']} threads · one engine at a time, {len(report['rounds'])} round(s)")
    if args.task == "rag-serve":
        from specsuite.bench.serve import format_serve, run_rag_serve

        report = run_rag_serve(args.model, data, args.n, max_new_tokens=args.max_new_tokens, dtype=args.dtype,
                               rounds=args.rounds or 3)
        return _show(args, report, format_serve(report),
                     f"rag-serve · {args.model} ({report['dtype']}) · {report['n']} questions · k={report['k']} · "
                     f"max_new_tokens={args.max_new_tokens} · mean of {report['rounds']} alternated round(s)")
    report = run_bench(args.task, args.model, data, args.n, args.max_new_tokens, args.draft_model, args.dtype,
                       args.methods.split(",") if args.methods else None, args.tie_margin,
                       not args.no_prefix_cache, args.backend, args.adapter)
    cached = " · our methods reuse the shared instruction's KV" if report["spec_prefix_cache"] else ""
    print(f"\n{args.task} · {args.model} + adapter {report['adapter']} ({report['dtype']}, our forwards: {report['backend']} backend) · "
          f"n={report['n']} · max_new_tokens={args.max_new_tokens}{cached}")
    print(format_table(report))
    for name, bad in report["mismatches"].items():
        if bad:
            print(f"{name}: output differs from HF greedy on prompts {bad}")
    if "prefix_cache" in report:
        pc = report["prefix_cache"]
        print(f"prefix KV cache, follow-up question over the same passages (n={pc['n']}): TTFT "
              f"{pc['ttft_followup_s']:.3f} s vs {pc['ttft_first_s']:.3f} s for the first question "
              f"({pc['followup_vs_first']:.0%}); {pc['cached_prompt_tokens']:.0f} of {pc['prompt_tokens']:.0f} "
              f"prompt tokens reused; identical to uncached: {pc['identical']:.0%}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.plot:
        plot(report, Path(args.plot))
    return 0


def _show(args: argparse.Namespace, report: dict, table: str, title: str) -> int:
    """Print a report's title and table; write it as JSON where --json asks."""
    print(f"\n{title}")
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def _cmd_gec_batch(args: argparse.Namespace, data: Path) -> int:
    from specsuite.bench.batch import format_batch_table, plot_batch, run_gec_batch

    try:
        sizes = sorted({int(b) for b in args.batch_sizes.split(",")})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        print("error: --batch-sizes takes sizes >= 1, e.g. 1,8,16,32", file=sys.stderr)
        return 2
    report = run_gec_batch(args.model, data, args.n, sizes, args.max_new_tokens, args.dtype,
                           [Path(r) for r in args.refs or []], args.methods.split(",") if args.methods else None,
                           args.rounds or 3, args.backend, args.adapter)
    print(f"\ngec-batch · {args.model} ({report['dtype']}) · n={report['n']} · max_new_tokens={args.max_new_tokens} · "
          f"{report['torch_threads']} threads · spec_batch = batch size {report['default_batch_size']} · "
          f"mean of {report['rounds']} alternated round(s)")
    print(format_batch_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.plot:
        plot_batch(report, Path(args.plot))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark our drafters against HF generate() on one model and data set")
    p.add_argument("task", choices=sorted([*TASKS, "gec-batch", "peers", "rag-serve", "serve-load"]),
                   help="gec-batch: sentences/s of a file, the batched engine vs HF generate() on padded batches; "
                   "peers: our GEC engine vs llama-server and OpenVINO GenAI where installed (specsuite/bench/peers.py); "
                   "rag-serve: N concurrent calls of the RAG app's ask endpoint vs N sequential ones; "
                   "serve-load: a web app under load from concurrent clients (specsuite/bench/serve_load.py)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="preset name or local model directory")
    p.add_argument("--data", help="(all but serve-load) gec: a text file, one sentence a line; rag/summarize: Spec-Bench jsonl")
    p.add_argument("--n", type=_positive_int, default=10, help="number of prompts (default 10)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--draft-model", help="a small model with the same tokenizer: adds hf_assisted and spec_draft_model")
    p.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], help="default: bf16 where the CPU supports it")
    p.add_argument("--adapter", default="auto", help="gec, gec-batch, rag: the app's adapter merged into the model "
                   "every method runs (auto: the one shipped for the preset; none; or a folder). peers and "
                   "summarize run the base model, as the peers do")
    p.add_argument("--methods", help="comma-separated subset of methods (hf_greedy always runs)")
    p.add_argument("--tie-margin", type=float, help="our methods: recompute rows whose top two logits are "
                   "closer than this (default: per dtype; 0 in bf16 with exact attention)")
    p.add_argument("--backend", choices=KINDS, default="fast",
                   help="how our methods compute verify forwards: fast (the apps' default: int8 where this CPU's "
                   "int8 kernel sums exactly and is fast, else weight-int8 for an fp32 model where it is faster, else "
                   "auto), exact forms, plain multi-row calls with a tie "
                   "guard, auto (exact where they cost at most 15%% more; see `specsuite step-cost`), int8 (every "
                   "linear layer in int8: greedy is int8 greedy's; peers compare every row with it), or weight-int8 "
                   "(int8 weights, fp32 activations: greedy is its own greedy's); serve-load: int8 and exact start "
                   "the app with --int8/--exact, the others with its default")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="gec: our methods compute the shared instruction for every sentence, as HF's do")
    p.add_argument("--batch-sizes", default="1,8,16,32", help="gec-batch: the batch sizes of HF generate() and of "
                   "the engine (default 1,8,16,32)")
    p.add_argument("--rounds", type=_positive_int, help="gec-batch, rag-serve (default 3): rounds over all methods, their "
                   "order rotated each round; a method's time is its mean (gec-batch's reference hf_greedy_bs1 runs "
                   "once); peers (default 1): our engine then each peer, again, each round its own table")
    p.add_argument("--refs", nargs="+", help="gec-batch: reference files line-aligned with --data, for GLEU")
    p.add_argument("--peer-parallel", default="1,64", help="peers: requests in flight: 1 (one at a time) and "
                   "our batch sizes = the peers' parallel slots (default 1,64)")
    p.add_argument("--deciding-only", action="store_true", help="peers: only each peer's configurations our ratios "
                   "are taken against (its speculation one at a time, its plain batches)")
    p.add_argument("--anchors", default=os.environ.get("SPECSUITE_ANCHORS"),
                   help="peers: the folder of the peers' scripts (default: $SPECSUITE_ANCHORS)")
    p.add_argument("--json", help="write the report as JSON here")
    p.add_argument("--plot", help="write a chart here (needs matplotlib): speedups; gec-batch: sentences/s by batch size")
    bench_serve_load.add_arguments(p)
    p.set_defaults(func=_cmd)
