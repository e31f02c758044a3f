"""Retrieval for the RAG app: load documents, chunk them by tokens, embed them with a local
sentence-transformers model, index them with FAISS, and persist the index atomically.

    from specsuite.retrieval import PassageIndex, load_documents
    index = PassageIndex.build(load_documents(["demos/corpus"]))
    index.save("corpus.idx")
    for passage, score in PassageIndex.load("corpus.idx").search("who built it?", k=5): ...

Names are imported on first use, so `import specsuite.retrieval` stays cheap (faiss and
sentence-transformers load only when an index or embedder is used).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Document": "documents", "Passage": "documents", "DocumentError": "documents", "load_documents": "documents",
    "ChunkSettings": "chunking", "Chunker": "chunking", "chunk_document": "chunking",
    "Embedder": "embedder",
    "PassageIndex": "index", "IndexSettings": "index", "AddStats": "index", "IndexLoadError": "index",
    "CorruptIndexError": "index", "EmbeddingModelMismatchError": "index", "index_exists": "index", "relevant": "index",
    "parse_specbench_rag": "specbench", "load_specbench_rag": "specbench",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
