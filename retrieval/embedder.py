"""A thin wrapper over a local sentence-transformers model: normalized float32 embeddings."""

from __future__ import annotations

import hashlib
import os
from functools import cached_property
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from tqdm.auto import tqdm

from specsuite.models import DEFAULT_EMBEDDING_MODEL, embedding_model_path

# Files that say nothing about the embeddings a model computes.
_IGNORED_FILES = {"README.md", ".gitattributes", "specsuite-preset.json"}


def model_fingerprint(path: str | os.PathLike) -> str:
    """A cheap identity for a model folder: the sha256 of its small config files' contents and
    of every other file's name and size (hashing the weights would cost a second per load)."""
    root = Path(path)
    digest = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file() and p.name not in _IGNORED_FILES):
        rel = f.relative_to(root).as_posix()
        digest.update(rel.encode() + b"\0")
        if f.suffix == ".json" and f.stat().st_size < 1 << 20:
            digest.update(f.read_bytes())
        else:
            digest.update(str(f.stat().st_size).encode())
        digest.update(b"\0")
    return digest.hexdigest()


class Embedder:
    """Embeds text with a sentence-transformers model given as a preset name (`minilm-l6`) or a
    local folder. Nothing is fetched from the Hugging Face Hub; the model loads on first use."""

    def __init__(self, model: str | os.PathLike = DEFAULT_EMBEDDING_MODEL, device: str | None = None,
                 batch_size: int = 64):
        self.name = str(model)
        self.path = embedding_model_path(model)
        self.device = device
        self.batch_size = batch_size

    @cached_property
    def model(self) -> Any:
        # Imported here: sentence-transformers pulls in torch and transformers (seconds).
        from sentence_transformers import SentenceTransformer

        return SentenceTransformer(str(self.path), device=self.device, local_files_only=True)

    @cached_property
    def fingerprint(self) -> str:
        return model_fingerprint(self.path)

    @property
    def tokenizer(self) -> Any:
        return self.model.tokenizer

    @property
    def dimension(self) -> int:
        model = self.model  # sentence-transformers 5.2 renamed the method; 3.x-5.1 have the old name
        get = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        return int(get())

    @property
    def max_tokens(self) -> int:
        """The most content tokens one input may have before the model truncates it."""
        return int(self.model.max_seq_length) - self.tokenizer.num_special_tokens_to_add()

    def identity(self) -> dict[str, Any]:
        """What the index manifest records about the model."""
        return {"name": self.name, "path": str(self.path), "fingerprint": self.fingerprint,
                "dimension": self.dimension, "max_seq_length": int(self.model.max_seq_length)}

    def encode(self, texts: Sequence[str], progress: bool = False, desc: str = "embedding") -> np.ndarray:
        """An (n, dimension) float32 array of unit-length rows."""
        out = np.empty((len(texts), self.dimension), dtype=np.float32)
        # Outer steps of several batches: sentence-transformers sorts each call's texts by length,
        # so larger calls pad less, while the bar still moves often.
        step = self.batch_size * 4
        with tqdm(total=len(texts), desc=desc, unit="passage", disable=None if progress else True) as bar:
            for i in range(0, len(texts), step):
                batch = list(texts[i:i + step])
                out[i:i + len(batch)] = self.model.encode(
                    batch, batch_size=self.batch_size, normalize_embeddings=True, convert_to_numpy=True,
                    show_progress_bar=False)
                bar.update(len(batch))
        return out
