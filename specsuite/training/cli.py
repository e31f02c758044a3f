"""`specsuite train gec|rag`: fine-tune a preset for an app (LoRA) on your corrections or QA data.

    specsuite train gec --data my.m2 --out my-gec-adapter --max-minutes 60
    specsuite train gec --data sources.txt --targets corrected.txt --out my-gec-adapter
    specsuite train rag --data qa.jsonl --out my-rag-adapter
    specsuite gec correct essays.txt -o out.jsonl --adapter my-gec-adapter
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from specsuite.models import DEFAULT_MODEL

GEC_HELP = "fine-tune for grammar correction: .m2 files, .jsonl {source, target}, or parallel text (--targets)"
RAG_HELP = "fine-tune for RAG answers: .jsonl {question, passages, answer}, or QED .jsonlines (--qed)"


def _examples(args: argparse.Namespace) -> list:
    from .data import mix_gec, read_gec, read_qed, read_rag_jsonl

    if args.task == "gec":
        examples = mix_gec(read_gec(args.data, args.targets), args.unchanged_share, args.detokenized_share, args.seed)
    else:
        excluded = []
        for path in args.exclude_questions:
            from specsuite.retrieval.specbench import load_specbench_rag, parse_specbench_rag

            excluded += [parse_specbench_rag(item)[1] for item in load_specbench_rag(path)]
        examples = [e for p in args.data for e in read_rag_jsonl(Path(p))]
        if args.qed:
            examples += read_qed(args.qed, excluded, seed=args.seed)
        random.Random(args.seed).shuffle(examples)
    return examples[:args.max_examples] if args.max_examples else examples


def _run(args: argparse.Namespace) -> int:
    from .data import DataError

    try:
        examples = _examples(args)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not examples:
        print("error: no training examples", file=sys.stderr)
        return 2
    from .lora import TrainConfig, TrainError, train

    out = args.out or f"adapter-{args.task}-{Path(args.model).name}"
    config = TrainConfig(task=args.task, model=args.model, out=out, rank=args.rank, alpha=args.alpha, lr=args.lr,
                         batch_size=args.batch_size, epochs=args.epochs, max_minutes=args.max_minutes,
                         checkpoint_minutes=args.checkpoint_minutes, dev_examples=args.dev, max_tokens=args.max_tokens,
                         seed=args.seed, dtype=args.dtype, top_layers=args.top_layers,
                         data=[str(p) for p in [*args.data, *args.targets, *getattr(args, "qed", [])]])
    try:
        figures = train(config, examples, log=lambda s: print(s, file=sys.stderr))
    except TrainError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(figures, indent=2))
    print(f"adapter written to {out}; use it with --adapter {out}", file=sys.stderr)
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", nargs="*", default=[], help="training files")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"the base: a preset or model directory (default {DEFAULT_MODEL})")
    p.add_argument("--out", help="the adapter's folder; a run with the same folder resumes from its checkpoint "
                                 "(default adapter-TASK-MODEL)")
    p.add_argument("--max-minutes", type=float, help="stop after this much training and write the adapter")
    p.add_argument("--epochs", type=float, default=1.0, help="passes over the data (default 1)")
    p.add_argument("--max-examples", type=int, help="use only the first N examples (after shuffling)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8)")
    p.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha (default 16)")
    p.add_argument("--top-layers", type=int, metavar="N",
                   help="LoRA on the last N blocks only: faster steps (the blocks below run forward only); default all")
    p.add_argument("--lr", type=float, default=2e-4, help="peak learning rate (default 2e-4)")
    p.add_argument("--batch-size", type=int, default=8, help="examples a step (default 8)")
    p.add_argument("--checkpoint-minutes", type=float, default=5.0, help="checkpoint interval (default 5)")
    p.add_argument("--dev", type=int, default=64, help="examples held back and scored at the end (default 64)")
    p.add_argument("--max-tokens", type=int, default=1024, help="drop longer examples (default 1024)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], help="default: bf16 autocast where the CPU computes bf16")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_run)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("train", help="fine-tune a preset for an app (LoRA adapter)", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="task", required=True)
    g = sub.add_parser("gec", help=GEC_HELP)
    _common(g)
    g.add_argument("--targets", nargs="*", default=[], help="corrected text, one file per plain --data file, line-aligned")
    g.add_argument("--unchanged-share", type=float, default=0.2,
                   help="share of unchanged (already correct) sentences kept (default 0.2)")
    g.add_argument("--detokenized-share", type=float, default=0.0,
                   help="share of pairs turned from tokenized (M2/JFLEG) into plain text (default 0)")
    r = sub.add_parser("rag", help=RAG_HELP)
    _common(r)
    r.set_defaults(targets=[])
    r.add_argument("--qed", nargs="*", default=[], help="QED nq-train-*.jsonlines: gold paragraph among distractors")
    r.add_argument("--exclude-questions", nargs="*", default=[], metavar="SPECBENCH_JSONL",
                   help="drop QED questions that appear in these Spec-Bench RAG files (evaluation sets)")
