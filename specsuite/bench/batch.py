"""`specsuite bench gec-batch`: throughput of a file of sentences, the batched engine against HF
`generate()` on left-padded batches and against our one-at-a-time copy path, on the same model and
sentences in one process.

Methods: `hf_greedy_bs{B}` (HF `generate()`, greedy, batches of B left-padded prompts; bs1 is the
greedy reference every other method is compared with), `spec_copy` (`generate()` one sentence at a
time with the copy drafter and the instruction's KV reused, as `--exact`), `spec_batch` (the
engine at `Corrector`'s default batch size), `spec_batch_bs{B}`, and `gec_job`: what `specsuite gec
correct FILE -o OUT.jsonl` does after loading the model (the resumable batch job, `Corrector` on the
engine, records written and flushed line by line), on a file of the same sentences. Each method runs
once on a few sentences first (kernel selection, allocation), then on all of them in `rounds`
rounds, the order of the methods rotated each round, so that the drift of a shared machine over
minutes (seen here: 1.3x between two runs of the same method ten minutes apart) falls on every
method alike; a method's time is its mean over the rounds. `hf_greedy_bs1`, the slowest, is the
reference for the outputs and runs in the first round only.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from specsuite.apps.gec.cli import jfleg_tokens
from specsuite.apps.jobs.runner import run_batch
from specsuite.apps.gec.corrector import DEFAULT_BATCH_SIZE, Corrector
from specsuite.apps.gec.drafter import CopyDrafter
from specsuite.apps.gec.gleu import corpus_gleu, read_tokenized, tokenize
from specsuite.apps.gec.prompt import gec_prompt_ids, instruction_cache, instruction_ids
from specsuite.bench.rounds import rotated
from specsuite.core import eos_token_ids, generate, turn_end_token
from specsuite.core.scheduler.engine import BatchEngine, EngineConfig, Request
from specsuite.core.scheduler.sequence import SamplingParams
from specsuite.core.model.backend import choose_backend
from specsuite.models import load_model

WARMUP = 4  # sentences each method decodes before it is timed


def _hf_batches(model, prompts: list[list[int]], batch_size: int, max_new_tokens: int, eos: list[int]) -> list[list[int]]:
    """HF generate() on left-padded batches, greedy; the new tokens of each, cut after the first EOS."""
    outs = []
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i: i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[eos[0]] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos[0], temperature=None, top_p=None, top_k=None)
        for row in out[:, width:].tolist():
            outs.append(row[: next((j + 1 for j, t in enumerate(row) if t in eos), len(row))])
    return outs


def read_sentences(data: Path, n: int) -> list[str]:
    """The first `n` non-blank lines of `data`, stripped; ValueError where there are none."""
    sources = [line.strip() for line in data.read_text(encoding="utf-8").splitlines() if line.strip()][:n]
    if not sources:
        raise ValueError(f"no sentences in {data}")
    return sources


class GecRuns:
    """Our GEC methods on fixed sentences, each a function of sentence indices -> output token ids:
    `one` (`generate()` one at a time with copy drafts and the instruction's prefix cache where it
    is lossless, as `gec correct --exact` runs) and `batched(b)` (the engine with b sequences in
    flight and the instruction's KV shared, as `gec correct` runs)."""

    def __init__(self, model, tok, sources: list[str], max_new_tokens: int, backend) -> None:
        self.model, self.tok, self.sources, self.max_new_tokens, self.backend = model, tok, sources, max_new_tokens, backend
        self.eos = sorted(eos_token_ids(model, tok))
        self.end = [turn_end_token(model, tok)]
        self.prompts = [gec_prompt_ids(tok, s) for s in sources]
        self.engine = BatchEngine(model, EngineConfig(DEFAULT_BATCH_SIZE, prefix=instruction_ids(tok), backend=backend),
                                  eos_token_id=self.eos)
        self.cache = instruction_cache(model, backend)

    def _drafter(self, i: int) -> CopyDrafter:
        return CopyDrafter.for_text(self.tok, self.sources[i], end_tokens=self.end)

    def one(self, idx: list[int]) -> list[list[int]]:
        return [generate(self.model, self.prompts[i], self._drafter(i), max_new_tokens=self.max_new_tokens,
                         eos_token_id=self.eos, prefix_cache=self.cache, backend=self.backend).tokens for i in idx]

    def batched(self, batch_size: int) -> Callable[[list[int]], list[list[int]]]:
        def run(idx: list[int]) -> list[list[int]]:
            self.engine.config = replace(self.engine.config, batch_size=batch_size)
            requests = [Request(self.prompts[i], self._drafter(i), SamplingParams(self.max_new_tokens)) for i in idx]
            out = dict(self.engine.run(requests))
            return [out[k].tokens for k in range(len(idx))]
        return run


def run_gec_batch(model_name: str, data: Path, n: int, batch_sizes: list[int], max_new_tokens: int = 128,
                  dtype: str | None = None, refs: list[Path] | None = None, methods: list[str] | None = None,
                  rounds: int = 1, backend: str = "fast", adapter: str = "auto") -> dict:
    """The report of every method on the first `n` sentences of `data` (see the module docstring),
    every method on the model with the GEC `adapter` merged."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    model, tok = load_model(model_name, dtype=dtype, adapter=adapter, task="gec")
    sources = read_sentences(data, n)
    backend = choose_backend(model, backend)
    ours = GecRuns(model, tok, sources, max_new_tokens, backend)
    prompts, eos, end = ours.prompts, ours.eos, ours.end
    spec_copy, spec_batch = ours.one, ours.batched

    corrector = Corrector.from_loaded(model, tok, max_new_tokens=max_new_tokens, backend=backend)

    def gec_job(idx: list[int]) -> list[list[int]]:
        with tempfile.TemporaryDirectory() as tmp:
            src, out = Path(tmp) / "in.txt", Path(tmp) / "out.jsonl"
            src.write_text("".join(sources[i] + "\n" for i in idx), encoding="utf-8")
            run_batch(src, out, corrector.job_worker, progress=False)
            records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
        # The job writes text: its tokens, for the counts (its identity is checked on the text, below).
        return [tok(r["correction"], add_special_tokens=False)["input_ids"] + end for r in records]

    runners: dict[str, Callable[[list[int]], list[list[int]]]] = {}
    for b in sorted({1, *batch_sizes}):
        runners[f"hf_greedy_bs{b}"] = lambda idx, b=b: _hf_batches(model, [prompts[i] for i in idx], b,
                                                                    max_new_tokens, eos)
    runners["spec_copy"] = spec_copy
    runners["spec_batch"] = spec_batch(DEFAULT_BATCH_SIZE)
    for b in batch_sizes:
        runners[f"spec_batch_bs{b}"] = spec_batch(b)
    runners["gec_job"] = gec_job
    if methods:
        unknown = set(methods) - set(runners)
        if unknown:
            raise ValueError(f"unknown methods {sorted(unknown)}; available: {sorted(runners)}")
        runners = {k: v for k, v in runners.items() if k in methods or k == "hf_greedy_bs1"}

    references = [[tokens for tokens in read_tokenized(path)[: len(sources)]] for path in refs or []]
    src_tokens = [tokenize(s) for s in sources]
    everything = list(range(len(sources)))
    results: dict[str, dict] = {}
    outputs: dict[str, list[list[int]]] = {}
    times: dict[str, list[float]] = {name: [] for name in runners}
    for run in runners.values():
        run(everything[:WARMUP])
    names = list(runners)
    for r in range(rounds):
        for name in rotated(names, r):
            if r and name == "hf_greedy_bs1":
                continue
            start = time.perf_counter()
            outputs[name] = runners[name](everything)
            times[name].append(time.perf_counter() - start)
    for name in names:
        seconds = sum(times[name]) / len(times[name])
        tokens = sum(map(len, outputs[name]))
        results[name] = {"total_s": round(seconds, 3), "round_s": [round(t, 3) for t in times[name]],
                         "new_tokens": tokens, "sentences_per_s": round(len(sources) / seconds, 3),
                         "tokens_per_s": round(tokens / seconds, 2)}
        if references:
            hyps = [jfleg_tokens(tok.decode(t, skip_special_tokens=True).strip()) for t in outputs[name]]
            results[name]["gleu"] = round(corpus_gleu(src_tokens, [list(r) for r in zip(*references)], hyps).mean * 100, 2)
    greedy = outputs["hf_greedy_bs1"]
    best_hf = max((f["sentences_per_s"] for name, f in results.items()
                   if name.startswith("hf_greedy_bs") and name != "hf_greedy_bs1"), default=None)
    text = lambda ids: tok.decode(ids, skip_special_tokens=True).strip()  # noqa: E731
    for name, f in results.items():
        same = (lambda a, b: text(a) == text(b)) if name == "gec_job" else (lambda a, b: a == b)
        f["identical_to_greedy"] = round(sum(same(a, b) for a, b in zip(outputs[name], greedy)) / len(sources), 4)
        f["speedup_vs_best_hf_batch"] = round(f["sentences_per_s"] / best_hf, 3) if best_hf else None
    return {"task": "gec-batch", "model": model_name, "n": len(sources), "max_new_tokens": max_new_tokens,
            "dtype": str(model.dtype).replace("torch.", ""), "torch_threads": torch.get_num_threads(),
            "default_batch_size": DEFAULT_BATCH_SIZE, "rounds": rounds, "methods": results}


def format_batch_table(report: dict) -> str:
    cols = [("method", 18), ("wall s", 8), ("sent/s", 7), ("tok/s", 7), ("vs best HF batch", 17),
            ("identical", 9), ("GLEU", 6)]
    lines = [" ".join(f"{c:>{w}}" if i else f"{c:<{w}}" for i, (c, w) in enumerate(cols))]
    for name, f in report["methods"].items():
        vals = [name, f["total_s"], f["sentences_per_s"], f["tokens_per_s"], f["speedup_vs_best_hf_batch"] or "-",
                f["identical_to_greedy"], f.get("gleu", "-")]
        lines.append(" ".join(f"{v:<{w}}" if i == 0 else f"{v:>{w}}" for i, (v, (_, w)) in enumerate(zip(vals, cols))))
    return "\n".join(lines)


def plot_batch(report: dict, out: Path) -> None:
    """Sentences/s against batch size, HF generate() and the engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for prefix, label in (("hf_greedy_bs", "HF generate(), padded batches"), ("spec_batch_bs", "specsuite engine")):
        points = sorted((int(name[len(prefix):]), f["sentences_per_s"]) for name, f in report["methods"].items()
                        if name.startswith(prefix))
        if points:
            ax.plot(*zip(*points), marker="o", label=label)
    if "spec_copy" in report["methods"]:
        ax.axhline(report["methods"]["spec_copy"]["sentences_per_s"], color="gray", ls="--",
                   label="specsuite one at a time (spec_copy)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("sentences / s")
    ax.set_title(f"gec-batch · {report['model']} ({report['dtype']}) · n={report['n']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
