"""`specsuite eval gec|rag`: the quality of each app on its evaluation data.

    specsuite eval gec --data ../shared/data/jfleg/dev.src --refs ../shared/data/jfleg/dev.ref{0,1,2,3} --n 300
    specsuite eval rag --data ../shared/data/specbench/rag_dev.jsonl --n 20

`eval gec` is `gec eval` (GLEU, share of sentences rewritten beyond their errors); `eval rag`
answers Spec-Bench RAG items from their own passages (docs/quality.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specsuite.adapters import describe_adapter
from specsuite.apps.gec import cli as gec_cli
from specsuite.apps.rag import cli as rag_cli


def _eval_rag(args: argparse.Namespace) -> int:
    if not Path(args.data).is_file():
        print(f"error: no such file: {args.data}", file=sys.stderr)
        return 2
    from tqdm import tqdm

    from specsuite.retrieval.specbench import load_specbench_rag

    from .rag.evaluate import evaluate_rag
    from .rag.qa import RagQA

    items = load_specbench_rag(args.data)[: args.n]
    qa = RagQA(model=args.model, drafter=args.drafter, max_new_tokens=args.max_new_tokens, draft_model=args.draft_model,
               backend=rag_cli.backend_kind(args), adapter=args.adapter, dtype=args.dtype)
    bar = tqdm(total=len(items), unit="item", dynamic_ncols=True)
    result = evaluate_rag(qa, items, progress=lambda r: bar.update(1))
    bar.close()
    if args.out:
        Path(args.out).write_text("".join(json.dumps(row) + "\n" for row in result.rows), encoding="utf-8")
    print(f"{args.model}, adapter {describe_adapter(args.adapter, 'rag', args.model)}, backend {qa.backend.label}, "
          f"{result.items} Spec-Bench RAG items, passages given")
    print(result.summary())
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `eval` command group."""
    p = subparsers.add_parser("eval", help="answer quality of the apps on evaluation data")
    sub = p.add_subparsers(dest="eval_command", required=True)
    gec_cli.eval_args(sub.add_parser("gec", help=gec_cli.EVAL_HELP))
    r = sub.add_parser("rag", help="RAG answers on Spec-Bench RAG items: reference contained, citation coverage")
    r.add_argument("--data", required=True, help="a Spec-Bench RAG .jsonl (e.g. ../shared/data/specbench/rag_dev.jsonl)")
    r.add_argument("--n", type=int, help="only the first N items")
    r.add_argument("--out", help="write each answer, its references and claims here (.jsonl)")
    rag_cli._model_options(r)
    r.set_defaults(func=_eval_rag)
