"""`specsuite rag index|search|eval-retrieval`: build, query and evaluate passage indexes.

Heavy modules (faiss, sentence-transformers) are imported inside the handlers so that the
`specsuite` command starts fast whichever subcommand runs."""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from pathlib import Path

from specsuite.models import DEFAULT_EMBEDDING_MODEL

DEFAULT_CHUNK_TOKENS, DEFAULT_OVERLAP = 200, 40


def _errors() -> tuple[type[BaseException], ...]:
    """The failures a user can cause (bad paths, models, options, indexes): reported, not raised."""
    from specsuite.models import ProvisioningError

    from .documents import DocumentError
    from .index import IndexLoadError

    return DocumentError, IndexLoadError, ProvisioningError, ValueError, OSError


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _fail(error: BaseException) -> int:
    print(f"error: {error}", file=sys.stderr)
    return 1


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _wrap(text: str, indent: str = "   ") -> str:
    """Rewrap each paragraph of a passage (source files are often hard-wrapped) under an indent."""
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip()]
    return "\n\n".join(textwrap.fill(p, width=100, initial_indent=indent, subsequent_indent=indent)
                       for p in paragraphs)


def _conflicts(args: argparse.Namespace, index) -> list[str]:
    """Options given with --add that differ from what the existing index was built with."""
    built = {"--index-type": index.settings.index_type, "--chunk-tokens": index.chunking.chunk_tokens,
             "--overlap": index.chunking.overlap}
    given = {"--index-type": args.index_type, "--chunk-tokens": args.chunk_tokens, "--overlap": args.overlap}
    return [f"{opt} {given[opt]} (index has {built[opt]})" for opt in built
            if given[opt] is not None and given[opt] != built[opt]]


def _index(args: argparse.Namespace) -> int:
    try:
        from .chunking import ChunkSettings
        from .documents import load_documents
        from .embedder import Embedder
        from .index import IndexSettings, PassageIndex, index_exists

        docs = load_documents(args.paths, text_field=args.field)
        with PassageIndex.writing(args.out):
            adding = args.add and index_exists(args.out)
            if adding:
                index = PassageIndex.load(args.out, embedding_model=args.embedding_model)
                if conflicts := _conflicts(args, index):
                    return _fail(ValueError(f"{args.out} was built with other settings: {'; '.join(conflicts)}. "
                                            "Drop those options, or rebuild without --add"))
            else:
                chunking = ChunkSettings(args.chunk_tokens or DEFAULT_CHUNK_TOKENS,
                                         DEFAULT_OVERLAP if args.overlap is None else args.overlap)
                index = PassageIndex(Embedder(args.embedding_model or DEFAULT_EMBEDDING_MODEL), chunking,
                                     IndexSettings(index_type=args.index_type or "flat"))
            stats = index.add_documents(docs, progress=True)
            skipped = f", skipped {_count(stats.skipped, 'document')} already indexed" if stats.skipped else ""
            if stats.passages == 0:
                if adding:
                    print(f"no new text to add{skipped}; {args.out} unchanged")
                    return 0
                return _fail(ValueError(f"no text to index in {' '.join(args.paths)}"))
            index.save(args.out)
    except _errors() as e:
        return _fail(e)
    verb = "added" if adding else "indexed"
    print(f"{verb} {_count(stats.documents, 'document')} as {_count(stats.passages, 'passage')}{skipped}")
    print(f"{args.out}: {_count(len(index.document_ids), 'document')}, {_count(len(index), 'passage')} "
          f"({index.settings.index_type} index, {index.chunking.chunk_tokens}-token passages, "
          f"overlap {index.chunking.overlap}, model {index.embedder.name})")
    return 0


def _search(args: argparse.Namespace) -> int:
    try:
        from .index import PassageIndex

        index = PassageIndex.load(args.index_dir, embedding_model=args.embedding_model)
        results = index.search(args.query, args.k)
    except _errors() as e:
        return _fail(e)
    for rank, (passage, score) in enumerate(results, 1):
        print(f"{rank}. score {score:.4f}  {passage.title or passage.doc_id}")
        print(f"   source: {passage.url or passage.source}  (passage {passage.id.rsplit('#', 1)[-1]})")
        print(_wrap(passage.text))
        print()
    return 0


def _eval(args: argparse.Namespace) -> int:
    try:
        from .embedder import Embedder
        from .evaluate import benchmark_synthetic, evaluate_specbench, format_table
        from .index import IndexSettings

        rows = [evaluate_specbench(args.data, Embedder(args.embedding_model), k=args.k,
                                   settings=IndexSettings(index_type=args.index_type), progress=True)]
        if args.synthetic_size > 0:
            rows += benchmark_synthetic(n=args.synthetic_size, k=args.k)
    except _errors() as e:
        return _fail(e)
    print(format_table(rows))
    print(f"specbench-rag: recall@{args.k} = share of each question's own passages in its top {args.k}, "
          f"hit@{args.k} = at least one; add/s and latency include embedding.\n"
          f"synthetic: random unit vectors, FAISS only; queries are noisy copies of stored vectors; "
          f"recall@{args.k} = share of the exact top {args.k} found, hit@{args.k} = source vector found.")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


def register(rag_subparsers: argparse._SubParsersAction) -> None:
    """Add `index`, `search` and `eval-retrieval` to the `rag` command group."""
    p = rag_subparsers.add_parser("index", help="chunk, embed and index .txt/.md/.jsonl documents",
                                  description="Build a passage index from files and folders, or add to one.")
    p.add_argument("paths", nargs="+", metavar="PATH", help="files or folders (.txt, .md, .jsonl)")
    p.add_argument("--out", required=True, metavar="INDEX_DIR", help="the index folder to write")
    p.add_argument("--index-type", choices=["flat", "hnsw", "ivf"], default=None,
                   help="flat: exact (default); hnsw/ivf: approximate, for large corpora")
    p.add_argument("--chunk-tokens", type=_positive_int, default=None, metavar="N",
                   help=f"passage size in embedding-model tokens (default {DEFAULT_CHUNK_TOKENS})")
    p.add_argument("--overlap", type=int, default=None, metavar="N",
                   help=f"tokens shared by consecutive passages (default {DEFAULT_OVERLAP})")
    p.add_argument("--field", default="text", help="the text field of .jsonl records (default: text)")
    p.add_argument("--embedding-model", default=None, metavar="NAME_OR_PATH",
                   help=f"preset or local sentence-transformers folder (default {DEFAULT_EMBEDDING_MODEL}; "
                        "with --add, the index's own)")
    p.add_argument("--add", action="store_true", help="add to the index in INDEX_DIR instead of replacing it")
    p.set_defaults(func=_index)

    s = rag_subparsers.add_parser("search", help="search a passage index")
    s.add_argument("index_dir", metavar="INDEX_DIR")
    s.add_argument("query")
    s.add_argument("-k", type=_positive_int, default=5, help="number of passages (default 5)")
    s.add_argument("--embedding-model", default=None, metavar="NAME_OR_PATH",
                   help="must be the model the index was built with (default: that model)")
    s.set_defaults(func=_search)

    e = rag_subparsers.add_parser("eval-retrieval", help="retrieval recall and speed on Spec-Bench RAG passages",
                                  description="Pool the passages of all Spec-Bench RAG prompts into one corpus, "
                                              "and report recall, throughput and latency, plus a synthetic index.")
    e.add_argument("--data", required=True, help="Spec-Bench RAG jsonl (e.g. ../shared/data/specbench/rag_dev.jsonl)")
    e.add_argument("-k", type=_positive_int, default=5, help="passages retrieved per question (default 5)")
    e.add_argument("--index-type", choices=["flat", "hnsw", "ivf"], default="flat",
                   help="index for the Spec-Bench corpus (default flat)")
    e.add_argument("--embedding-model", default=DEFAULT_EMBEDDING_MODEL, metavar="NAME_OR_PATH")
    e.add_argument("--synthetic-size", type=int, default=100_000, metavar="N",
                   help="vectors in the synthetic flat/hnsw benchmark (0 skips it; default 100000)")
    e.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    e.set_defaults(func=_eval)
