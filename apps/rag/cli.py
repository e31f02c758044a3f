"""`specsuite rag ...`: index/search/eval-retrieval (from specsuite.retrieval), plus ask, ui and demo.

    specsuite rag demo                                  # index demos/corpus once, ask a sample question
    specsuite rag index demos/corpus --out corpus.idx
    specsuite rag ask corpus.idx "Who commanded Apollo 11?" -k 5
    specsuite rag ui corpus.idx --port 7861

The model and heavy libraries load inside the handlers, so `specsuite --help` stays fast."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specsuite.apps import limits
from specsuite.models import DEFAULT_MODEL, cache_dir
from specsuite.retrieval import cli as retrieval_cli

from . import DEFAULT_MIN_RELEVANCE, DRAFTERS

DEMO_CORPUS = Path(__file__).resolve().parents[2] / "demos" / "corpus"
DEMO_QUESTION = "Who were the crew of Apollo 11, and what did each of them do?"


def demo_index_dir() -> Path:
    return cache_dir() / "rag-demo-index"


def _load_qa(args: argparse.Namespace, index_dir: str | Path):
    from .qa import RagQA

    return RagQA(str(index_dir), model=args.model, drafter=args.drafter,
                 prefix_cache_bytes=0 if getattr(args, "no_prefix_cache", False) else None,
                 max_new_tokens=args.max_new_tokens, max_question_tokens=args.max_question_tokens,
                 batch_size=getattr(args, "serve_batch_size", 1), draft_model=args.draft_model,
                 backend=backend_kind(args), adapter=args.adapter, dtype=args.dtype,
                 min_relevance=args.min_relevance)


def backend_kind(args: argparse.Namespace) -> str:
    """The `choose_backend` kind the model options ask for: --int8, --exact, else "fast" (int8 where
    it runs fast: its prefix cache is lossless, so callers asking about the same passages skip
    their prefill; docs/exactness.md)."""
    from specsuite.core.model.backend import requested_kind

    return requested_kind(getattr(args, "int8", False), getattr(args, "exact", False), "fast")


def _print_answer(answer) -> None:
    print(answer.text)
    print("\nSources:")
    for n, (passage, score) in enumerate(answer.passages, 1):
        cited = "  (cited)" if n in answer.citations else ""
        print(f"  [{n}] score {score:.3f}  {passage.title or passage.doc_id}  "
              f"{passage.url or passage.source} #{passage.id.rsplit('#', 1)[-1]}{cited}")
    s = answer.stats
    print(f"\nStats: {s['new_tokens']} tokens in {s['total_s']:.2f} s ({s['tokens_per_s']} tok/s), "
          f"time to first token {s['ttft_s']:.2f} s, retrieval {s['retrieval_s']:.3f} s, "
          f"{s['tokens_per_step']} tokens per forward pass, {s['acceptance_rate']:.0%} of drafted tokens accepted "
          f"({s['drafter']} drafter), {s['cached_prompt_tokens']}/{s['prompt_tokens']} prompt tokens from the "
          f"prefix cache, finish: {s['finish_reason']}")


def _ask(args: argparse.Namespace) -> int:
    try:
        # What needs no model is checked before loading it; qa.ask checks the rest (the token limit).
        limits.check_text(args.question, "question", max_tokens=args.max_question_tokens or limits.MAX_QUESTION_TOKENS)
        limits.check_k(args.k)
        qa = _load_qa(args, args.index_dir)
        _print_answer(qa.ask(args.question, args.k))
    except retrieval_cli._errors() as e:
        return retrieval_cli._fail(e)
    return 0


def _ui(args: argparse.Namespace) -> int:
    try:
        qa = _load_qa(args, args.index_dir)
    except retrieval_cli._errors() as e:
        return retrieval_cli._fail(e)
    from specsuite.apps.serving.batch_server import UI_THREADS

    from .ui import build_app

    if args.share:
        print(limits.SHARE_WARNING, file=sys.stderr)
    key = limits.api_key(args.api_key)
    if warning := limits.exposure_warning(args.host, key):
        print(warning, file=sys.stderr)
    build_app(qa, time_budget_s=args.time_budget, warm_up=True).launch(
        server_name=args.host, server_port=args.port, share=args.share, max_threads=UI_THREADS,
        auth=limits.gradio_auth(key))
    return 0


def _answer(args: argparse.Namespace) -> int:
    from specsuite.apps.jobs.runner import ResumeError

    from .bulk import answer_file

    if not Path(args.input).is_file():
        return retrieval_cli._fail(FileNotFoundError(f"no such file: {args.input}"))
    try:
        limits.check_k(args.k)
        summary = answer_file(args.input, args.output, lambda: _load_qa(args, args.index), k=args.k,
                              batch_size=args.batch_size, fmt=args.format, field=args.field)
    except (ResumeError, *retrieval_cli._errors()) as e:
        return retrieval_cli._fail(e)
    resumed = f" ({summary.skipped_resumed} from an earlier run)" if summary.skipped_resumed else ""
    print(f"{summary.total} questions{resumed}: {summary.ok} answered, {summary.errors} errors, "
          f"{summary.warnings} truncated")
    return 1 if summary.errors else 0


def ensure_demo_index(rebuild: bool = False) -> Path:
    """The index of demos/corpus in the cache, built on first use."""
    from specsuite.models import DEFAULT_EMBEDDING_MODEL
    from specsuite.retrieval import ChunkSettings, Embedder, PassageIndex, index_exists, load_documents

    folder = demo_index_dir()
    if rebuild or not index_exists(folder):
        if not DEMO_CORPUS.is_dir():
            raise FileNotFoundError(f"no demo corpus at {DEMO_CORPUS} (run from a source checkout)")
        print(f"indexing {DEMO_CORPUS} into {folder}")
        chunking = ChunkSettings(retrieval_cli.DEFAULT_CHUNK_TOKENS, retrieval_cli.DEFAULT_OVERLAP)
        PassageIndex.build(load_documents([DEMO_CORPUS]), Embedder(DEFAULT_EMBEDDING_MODEL), chunking,
                           progress=True).save(folder)
    return folder


def _demo(args: argparse.Namespace) -> int:
    try:
        folder = ensure_demo_index(args.rebuild)
        qa = _load_qa(args, folder)
        print(f"Q: {args.question}\n")
        _print_answer(qa.ask(args.question, args.k))
    except retrieval_cli._errors() as e:
        return retrieval_cli._fail(e)
    print(f"\n(index: {folder}; try `specsuite rag ui {folder}`)")
    return 0


def _relevance(text: str) -> float:
    """argparse type of --min-relevance: a share from 0 to 1."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {text!r}")
    return value


def _retrieval_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--min-relevance", type=_relevance, default=DEFAULT_MIN_RELEVANCE, metavar="R",
                   help="of the k retrieved passages, answer from those scoring at least R times the best one's "
                   f"(default {DEFAULT_MIN_RELEVANCE:g}: off-topic passages cost prefill time; 0: all k)")


def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"preset or local model folder (default {DEFAULT_MODEL})")
    p.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], help="default: bf16 where the CPU supports it")
    p.add_argument("--adapter", default="auto", help="auto: the RAG adapter shipped for the preset, if any (default); "
                   "none: the base model; or a folder written by `specsuite train rag`")
    p.add_argument("--drafter", choices=DRAFTERS, default="reference",
                   help="reference: copy from the passages (default); none: plain decoding")
    p.add_argument("--draft-model", metavar="PRESET", help="a small model with the same tokenizer that drafts where "
                   "the passages have nothing to copy, e.g. qwen2.5-0.5b for --model qwen2.5-1.5b")
    p.add_argument("--max-new-tokens", type=retrieval_cli._positive_int, default=256, metavar="N")
    p.add_argument("--int8", action="store_true", help="every linear layer in int8 (weights per channel, activations "
                   "per row), refused where this CPU's int8 kernel cannot sum exactly; the default already runs it "
                   "where it is fast (answers are int8 greedy decoding's, docs/exactness.md)")
    p.add_argument("--exact", action="store_true", help="the exact forms of the model's own numerics, whatever "
                   "they cost here: answers token for token its greedy decoding")
    p.add_argument("--max-question-tokens", type=limits.token_limit_arg, metavar="N",
                   help=f"longest question accepted (default {limits.MAX_QUESTION_TOKENS:,}: a question is not a "
                   "book; less where the model's context less --max-new-tokens is smaller)")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `rag` command group."""
    rag = subparsers.add_parser("rag", help="retrieval-augmented question answering over your documents")
    rag_sub = rag.add_subparsers(dest="rag_command", required=True)
    retrieval_cli.register(rag_sub)

    a = rag_sub.add_parser("ask", help="answer a question from an index's passages")
    a.add_argument("index_dir", metavar="INDEX_DIR")
    a.add_argument("question")
    a.add_argument("-k", type=retrieval_cli._positive_int, default=5, help="passages to retrieve (default 5)")
    _model_options(a)
    _retrieval_options(a)
    a.add_argument("--no-prefix-cache", action="store_true", help="do not reuse prompt KV across calls")
    a.set_defaults(func=_ask)

    u = rag_sub.add_parser("ui", help="the question-answering web app (Gradio)")
    u.add_argument("index_dir", metavar="INDEX_DIR")
    u.add_argument("--host", default="127.0.0.1")
    u.add_argument("--port", type=int, default=7861)
    u.add_argument("--api-key", help=limits.API_KEY_HELP)
    u.add_argument("--share", action="store_true", help="also open a public Gradio share link (the app becomes public)")
    u.add_argument("--time-budget", type=limits.time_budget_arg, default=limits.DEFAULT_TIME_BUDGET_S, metavar="S",
                   help="seconds a request may take, waiting included (default 180; 0: no limit)")
    _model_options(u)
    _retrieval_options(u)
    u.add_argument("--no-prefix-cache", action="store_true", help="do not reuse prompt KV across questions")
    u.add_argument("--batch-size", dest="serve_batch_size", type=retrieval_cli._positive_int, default=8,
                   help="concurrent requests decoded together in one batch (default 8; 1: one at a time, "
                   "token for token greedy)")
    u.set_defaults(func=_ui)

    b = rag_sub.add_parser("answer", help="answer a file of questions (.txt a line, or .jsonl), resumably, "
                           "many at once in the batched engine")
    b.add_argument("input", metavar="QUESTIONS")
    b.add_argument("-o", "--output", required=True, help="a .jsonl file: one record per question, in order")
    b.add_argument("--index", required=True, help="the passage index (from `specsuite rag index`)")
    b.add_argument("-k", type=retrieval_cli._positive_int, default=5, help="passages per question (default 5)")
    b.add_argument("--field", default="question", help="the question's field in .jsonl input (default question)")
    b.add_argument("--format", choices=["txt", "jsonl"], help="input format (default: from its extension)")
    b.add_argument("--batch-size", type=retrieval_cli._positive_int, default=16,
                   help="questions decoded together (default 16)")
    _model_options(b)
    _retrieval_options(b)
    b.set_defaults(func=_answer)

    d = rag_sub.add_parser("demo", help="index demos/corpus (once) and answer a sample question")
    d.add_argument("question", nargs="?", default=DEMO_QUESTION)
    d.add_argument("-k", type=retrieval_cli._positive_int, default=3, help="passages to retrieve (default 3)")
    _model_options(d)
    _retrieval_options(d)
    d.add_argument("--rebuild", action="store_true", help="re-index the demo corpus")
    d.set_defaults(func=_demo)
