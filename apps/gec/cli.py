"""`specsuite gec ...`: correct a file, score on JFLEG, run the demo sentences, launch the UI."""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
import time
from pathlib import Path

from tqdm import tqdm

from specsuite.apps import limits
from specsuite.models import DEFAULT_MODEL

from specsuite.adapters import describe_adapter
from specsuite.apps.jobs.runner import ResumeError, run_batch
from specsuite.core.model.backend import requested_kind
from .corrector import DEFAULT_BATCH_SIZE, DRAFTERS, Corrector, combine_stats, correction_worker, demo_sentences

from .gleu import corpus_gleu, read_tokenized, tokenize
from .overedit import over_edit_rate

ADAPTER_HELP = ("auto: the GEC adapter shipped for the preset, if any (default); none: the base model; or a "
                "folder written by `specsuite train gec`")
SERVE_BATCH_SIZE = 8  # `gec ui`: concurrent users' corrections decoded together in one running batch


def _settings(args: argparse.Namespace) -> dict:
    """The `Corrector` arguments the model options ask for. --exact: one text at a time, on the
    exact forms too (`auto` verifies with plain multi-row bf16 calls where the exact ones cost over
    15% more, e.g. on an AMD Zen 5 CPU, which are greedy's only up to rounding)."""
    exact, int8 = getattr(args, "exact", False), getattr(args, "int8", False)
    return {"model": args.model, "drafter": args.drafter, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
            "batch_size": 1 if exact else getattr(args, "batch_size", DEFAULT_BATCH_SIZE),
            "backend": requested_kind(int8, exact, "fast"), "style": getattr(args, "style", "minimal"),
            "adapter": args.adapter}


def _corrector(args: argparse.Namespace) -> Corrector:
    return Corrector(**_settings(args))


def _missing(*paths: str) -> str | None:
    """An error message for the first path that is not a file, else None."""
    for path in paths:
        if not Path(path).is_file():
            return f"no such file: {path}"
    return None


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _speed_line(stats: dict) -> str:
    speedup = stats.get("estimated_speedup")
    return (f"{stats['tokens_per_step']:.2f} tokens/step, {stats['acceptance_rate']:.0%} of drafted tokens accepted, "
            f"{stats['forward_passes']} forward passes for {stats['new_tokens']} tokens, {stats['total_s']:.2f} s"
            + (f", ~{speedup:.2f}x vs plain decoding (estimate)" if speedup else ""))


# ---- correct ---------------------------------------------------------------------------------

def _correct(args: argparse.Namespace) -> int:
    if message := _missing(args.input):
        return _fail(message)
    try:
        if args.ray:
            summary = _correct_on_ray(args)
        else:
            summary = run_batch(args.input, args.output, lambda: _corrector(args).job_worker(), fmt=args.format,
                                field=args.field)
    except (OSError, ValueError, ResumeError, RuntimeError) as e:  # RuntimeError: the lock, model provisioning
        return _fail(str(e))
    resumed = f" ({summary.skipped_resumed} from an earlier run)" if summary.skipped_resumed else ""
    done = summary.total - summary.skipped_resumed
    speed = f" in {summary.seconds:.1f} s ({done / summary.seconds:.2f} lines/s, model load excluded)" if summary.seconds else ""
    print(f"{summary.total} lines{resumed}: {summary.ok} corrected, {summary.errors} errors, "
          f"{summary.warnings} truncated{speed}")
    if summary.errors or summary.warnings:
        where = args.output + ".errors.jsonl" if args.output.endswith(".txt") else args.output
        print(f"error and truncation records: {where}")
    return 1 if summary.errors else 0


def _correct_on_ray(args: argparse.Namespace):
    """The same job on a Ray cluster (apps/jobs/ray_jobs.py); BlockFailedError is a RuntimeError."""
    from specsuite.apps.jobs.ray_jobs import run_ray_batch

    settings = _settings(args)
    factory = functools.partial(correction_worker, **settings)  # pickled to every actor, which loads the model once
    return run_ray_batch(args.input, args.output, factory, address=args.ray, workers=args.workers,
                         threads_per_worker=args.threads_per_worker, fmt=args.format, field=args.field,
                         block_lines=args.block_lines, job_info=settings)


# ---- eval ------------------------------------------------------------------------------------

_CLITIC = re.compile(r"(?<=\w)(n't|'s|'re|'ve|'ll|'d|'m)\b", re.IGNORECASE)
_OPENERS, _CLOSERS = "([{$\"", ".,!?;:%)]}\""


def jfleg_tokens(text: str) -> list[str]:
    """Tokenize a model's correction as JFLEG's references are ("do n't", "word ."), so GLEU
    compares words and not punctuation attached to them. Inverts `drafter.as_written` on 98.5% of
    the JFLEG dev sources."""
    tokens: list[str] = []
    for word in _CLITIC.sub(r" \1", text).split():
        lead, trail = [], []
        while len(word) > 1 and word[0] in _OPENERS:
            lead.append(word[0])
            word = word[1:]
        while len(word) > 1 and word[-1] in _CLOSERS:
            if word.endswith("...") and len(word) > 3:  # an ellipsis is one token
                trail.append("...")
                word = word[:-3]
            else:
                trail.append(word[-1])
                word = word[:-1]
        tokens += lead + [word] + trail[::-1]
    return tokens


def _read_corrections(path: str) -> list[str | None]:
    """The corrections of a `gec correct` .jsonl output in line order (None: an error record)."""
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r.get("correction") for r in sorted(records, key=lambda r: r["line"])]


def _eval(args: argparse.Namespace) -> int:
    if message := _missing(args.data, *args.refs, *([args.corrections] if args.corrections else [])):
        return _fail(message)
    with open(args.data, encoding="utf-8", newline="\n") as f:  # lines as read_tokenized reads them
        sources = [line.rstrip("\n") for line in f][: args.n]
    texts, corrections, wall = None, [], 0.0
    if args.corrections:  # the (possibly partial) output of `gec correct` on the same lines: no model
        texts = _read_corrections(args.corrections)[: len(sources)]
        sources = sources[: len(texts)]
    references = [read_tokenized(path)[: len(sources)] for path in args.refs]
    for path, refs in zip(args.refs, references):
        if len(refs) != len(sources):
            return _fail(f"{path} has {len(refs)} lines, {args.data} {len(sources)}")
    if texts is None:
        try:
            corrector = _corrector(args)
        except (ValueError, RuntimeError) as e:
            return _fail(str(e))
        start = time.perf_counter()
        results = list(tqdm(corrector.correct_each(sources), total=len(sources), unit="sent", dynamic_ncols=True))
        wall = time.perf_counter() - start
        corrections = [c for c in results if not isinstance(c, Exception)]
        for number, c in enumerate(results, 1):
            if isinstance(c, Exception):  # e.g. a blank line: scored as the source, left unchanged
                print(f"line {number}: not corrected: {c}", file=sys.stderr)
        texts = [None if isinstance(c, Exception) else c.text for c in results]
    hypotheses = [jfleg_tokens(s if t is None else t) for s, t in zip(sources, texts)]
    if args.out:
        Path(args.out).write_text("".join(" ".join(h) + "\n" for h in hypotheses), encoding="utf-8")
    src_tokens = [tokenize(s) for s in sources]
    refs_per_sentence = [list(r) for r in zip(*references)]
    if not args.corrections:
        print(f"{args.model}, adapter {describe_adapter(args.adapter, 'gec', args.model)}, "
              f"backend {corrector.backend.label}")
    print(f"GLEU on {len(sources)} sentences, {len(args.refs)} references each")
    for name, hyps in (("corrections", hypotheses), ("source (no edits)", src_tokens)):
        g = corpus_gleu(src_tokens, refs_per_sentence, hyps)
        print(f"  {name:18} {g.mean:.4f}  std {g.std:.4f}  95% CI ({g.ci[0]:.4f}, {g.ci[1]:.4f})")
    over = over_edit_rate(src_tokens, refs_per_sentence, hypotheses)
    print(f"rewritten beyond their errors (more words changed than by any reference): {over:.1%}")
    if not corrections:
        return 0
    stats = combine_stats(c.stats for c in corrections)
    if corrector.batch_size > 1:  # sequences shared each forward: their times overlap, no estimate
        print(f"speed: {len(sources)} sentences in {wall:.1f} s ({len(sources) / wall:.2f} sentences/s, batch size "
              f"{corrector.batch_size}), {stats['tokens_per_step']:.2f} tokens per sequence step, "
              f"{stats['acceptance_rate']:.0%} of drafted tokens accepted")
    else:
        print(f"speed: {_speed_line(stats)}; {len(sources) / wall:.2f} sentences/s")
    if truncated := sum(c.truncated for c in corrections):
        print(f"{truncated} corrections were cut at max_new_tokens")
    return 0


# ---- demo ------------------------------------------------------------------------------------

def _describe(edit) -> str:
    if edit.kind == "insert":
        return f"+ {edit.tgt!r}"
    if edit.kind == "delete":
        return f"- {edit.src!r}"
    return f"{edit.src!r} -> {edit.tgt!r}"


def _demo(args: argparse.Namespace) -> int:
    try:
        corrector = _corrector(args)
    except (ValueError, RuntimeError) as e:
        return _fail(str(e))
    batched = corrector.batch_size > 1
    if batched:  # a fresh machine times its step costs once (seconds): not a part of the batch's time
        limits.step_cost(corrector.model, corrector.backend)
    start, plain = time.perf_counter(), 0.0
    for i, correction in enumerate(corrector.correct_many(demo_sentences()), 1):
        print(f"[{i}] {correction.source}\n  → {correction.text}")
        print("    edits: " + ("; ".join(_describe(e) for e in correction.edits) or "none"))
        s = correction.stats
        # In a batch the sentences share forwards: a per-sentence "x vs plain" estimate is wrong.
        speed = _speed_line({**s, "estimated_speedup": None}) if batched else _speed_line(s)
        print(f"    {speed}" + (" [truncated]" if correction.truncated else ""))
        plain += limits.estimate_s(corrector.model, s["prompt_tokens"] - s["cached_prompt_tokens"],
                                   corrector.backend, s["new_tokens"]) or 0.0
    wall = time.perf_counter() - start
    if batched and plain:
        print(f"\nthe batch (size {corrector.batch_size}): {i} sentences in {wall:.2f} s; plain decoding one after "
              f"another: ~{plain:.2f} s (estimate from this machine's step cost), ~{plain / wall:.2f}x")
    return 0


# ---- ui --------------------------------------------------------------------------------------

def _ui(args: argparse.Namespace) -> int:
    if args.share:
        print(limits.SHARE_WARNING, file=sys.stderr)
    key = limits.api_key(args.api_key)
    if warning := limits.exposure_warning(args.host, key):
        print(warning, file=sys.stderr)
    try:
        corrector = _corrector(args)
    except (ValueError, RuntimeError) as e:
        return _fail(str(e))
    corrector.max_input_tokens = args.max_input_tokens  # None: the corrector's context_limit (gec/limits.py)
    from .ui import launch  # gradio takes seconds to import: only for this command

    launch(corrector, host=args.host, port=args.port, share=args.share, time_budget_s=args.time_budget,
           batch_size=1 if args.exact else args.batch_size, auth=limits.gradio_auth(key))
    return 0


# ---- registration ----------------------------------------------------------------------------

def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"preset name or local model directory (default {DEFAULT_MODEL})")
    p.add_argument("--adapter", default="auto", help=ADAPTER_HELP)
    p.add_argument("--drafter", choices=DRAFTERS, default="copy", help="how drafts are made (default copy)")
    p.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], help="default: bf16 where the CPU supports it")
    p.add_argument("--max-new-tokens", type=int, help="per segment (default 2 x its tokens + 16)")
    p.add_argument("--style", choices=["minimal", "fluent"], default="minimal",
                   help="minimal: fix the errors, change nothing else (default); fluent: also rephrase what "
                   "a native speaker would not write (docs/quality.md)")
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE,
                   help=f"texts decoded together by the batched engine (default {DEFAULT_BATCH_SIZE}; ui: "
                   f"concurrent users' corrections, default {SERVE_BATCH_SIZE}; 1: one at a time, streamed)")
    p.add_argument("--exact", action="store_true", help="one text at a time on the model's own numerics (backend "
                   "exact), token for token what its plain greedy decoding writes; the default runs the fast "
                   "backend (int8 linear layers where this CPU has a fast int8 kernel that sums exactly, else the "
                   "model's own)")
    p.add_argument("--int8", action="store_true", help="every linear layer in int8 (weights per channel, activations "
                   "per row), refused where this CPU's int8 kernel cannot sum exactly; the default already runs it "
                   "where it is fast; with --exact one text at a time (docs/exactness.md)")


EVAL_HELP = "GLEU and over-editing on a source file and its references (e.g. JFLEG dev)"


def eval_args(e: argparse.ArgumentParser) -> None:
    """`gec eval`, also `specsuite eval gec` (apps/eval_cli.py)."""
    e.add_argument("--data", required=True, help="source sentences, one a line")
    e.add_argument("--refs", nargs="+", required=True, help="reference files, line-aligned with --data")
    e.add_argument("--n", type=int, help="only the first N sentences")
    e.add_argument("--out", help="write the tokenized hypotheses here (input for JFLEG's gleu.py)")
    e.add_argument("--corrections", metavar="JSONL", help="score the records of a `gec correct` run on --data "
                   "instead of running the model (as many lines as it has done)")
    _model_args(e)
    e.set_defaults(func=_eval)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gec", help="grammatical error correction with the copy drafter")
    gsub = p.add_subparsers(dest="gec_command", required=True)

    c = gsub.add_parser("correct", help="correct a .txt (a text a line) or .jsonl file, resumably")
    c.add_argument("input")
    c.add_argument("-o", "--output", required=True, help=".jsonl: a record per line; .txt: corrected lines "
                   "(errors in OUTPUT.errors.jsonl)")
    c.add_argument("--field", default="text", help="the text's field in .jsonl input (default text)")
    c.add_argument("--format", choices=["txt", "jsonl"], help="input format (default: from its extension)")
    r = c.add_argument_group("on a Ray cluster (pip install -e '.[ray]'; INPUT must be readable at the same "
                             "path on every node)")
    r.add_argument("--ray", metavar="ADDRESS", help="'local' starts a cluster in this process; 'auto' or HOST:PORT "
                   "joins one started with `ray start`")
    r.add_argument("--workers", type=int, default=2, help="actors, each with its own model (default 2)")
    r.add_argument("--threads-per-worker", type=int, default=1, help="CPUs (torch threads) per actor (default 1)")
    r.add_argument("--block-lines", type=int, help="lines per block, the unit of retry and resume, one "
                   "continuous batch (default: up to 4 equal blocks per worker, 64-256 lines; kept on resume)")
    _model_args(c)
    c.set_defaults(func=_correct)

    eval_args(gsub.add_parser("eval", help=EVAL_HELP))

    d = gsub.add_parser("demo", help="correct the bundled example sentences, with edits and speed")
    _model_args(d)
    d.set_defaults(func=_demo)

    u = gsub.add_parser("ui", help="launch the Gradio web UI")
    u.add_argument("--host", default="127.0.0.1")
    u.add_argument("--port", type=int, default=7860)
    u.add_argument("--api-key", help=limits.API_KEY_HELP)
    u.add_argument("--share", action="store_true", help="also open a public Gradio share link (the app becomes public)")
    u.add_argument("--max-input-tokens", type=limits.token_limit_arg, metavar="N",
                   help="longest text accepted (default: the segment limit, 1024 tokens for the presets)")
    u.add_argument("--time-budget", type=limits.time_budget_arg, default=limits.DEFAULT_TIME_BUDGET_S, metavar="S",
                   help="seconds a request may take, waiting included (default 180; 0: no limit)")
    _model_args(u)
    u.set_defaults(func=_ui, batch_size=SERVE_BATCH_SIZE)
