"""PassageIndex: embed passages, index them with FAISS, search, and persist them atomically.

On disk an index is one folder holding `index.faiss`, `passages.jsonl` and `manifest.json`
(format version, embedding model identity, chunking and index settings, counts, and the
sha256 of the other two files). A save writes a complete new folder next to the old one and
swaps it in with renames, so a crash at any point leaves a loadable index behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Sequence

import faiss
import numpy as np

from .chunking import Chunker, ChunkSettings, chunk_document
from .documents import Document, Passage
from .embedder import Embedder

FORMAT = "specsuite-passage-index"
FORMAT_VERSION = 1
INDEX_FILE, PASSAGES_FILE, MANIFEST_FILE = "index.faiss", "passages.jsonl", "manifest.json"
INDEX_TYPES = ("flat", "hnsw", "ivf")


def relevant(hits: Sequence[tuple[Passage, float]], min_relevance: float) -> list[tuple[Passage, float]]:
    """The hits (passage, score) scoring at least `min_relevance` times the best one's score, in
    their order; all of them when `min_relevance` is 0 or the best does not score above 0 (then
    no passage stands out). A question about one topic of a mixed corpus retrieves its own
    passages and k - 2 off-topic ones: dropped, they cost no prefill (an answer's main cost on a
    CPU) and cannot distract the model."""
    best = max((score for _, score in hits), default=0.0)
    if min_relevance <= 0 or best <= 0:
        return list(hits)
    return [(p, score) for p, score in hits if score >= min_relevance * best]


class IndexLoadError(RuntimeError):
    """A folder cannot be loaded as a passage index."""


class CorruptIndexError(IndexLoadError):
    """An index file is missing, truncated or altered (its checksum does not match)."""


class EmbeddingModelMismatchError(IndexLoadError):
    """The index was built with another embedding model than the one asked for."""


@dataclass(frozen=True)
class IndexSettings:
    """Which FAISS index to build. All use inner product on unit vectors, i.e. cosine."""

    index_type: str = "flat"  # "flat" (exact), "hnsw" or "ivf" (approximate, faster on large corpora)
    hnsw_m: int = 16
    hnsw_ef_construction: int = 40
    hnsw_ef_search: int = 128  # search breadth: higher finds more true neighbours, slower
    ivf_nlist: int | None = None  # None: about 4*sqrt(n) lists for the n vectors of the first build
    ivf_nprobe: int = 8

    def __post_init__(self) -> None:
        if self.index_type not in INDEX_TYPES:
            raise ValueError(f"unknown index type {self.index_type!r}; use one of {', '.join(INDEX_TYPES)}")


@dataclass(frozen=True)
class AddStats:
    documents: int  # documents added
    passages: int  # passages added
    skipped: int  # documents skipped because their id is already indexed


def auto_nlist(n: int) -> int:
    # FAISS wants about 39 training vectors per list; 4*sqrt(n) is its usual rule for the count.
    return max(1, min(round(4 * math.sqrt(n)), n // 39))


def make_faiss_index(settings: IndexSettings, dim: int, train: np.ndarray | None = None) -> faiss.Index:
    """An empty FAISS index for `settings`; IVF is trained on `train` (the first vectors added)."""
    if settings.index_type == "flat":
        return faiss.IndexFlatIP(dim)
    if settings.index_type == "hnsw":
        index = faiss.IndexHNSWFlat(dim, settings.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = settings.hnsw_ef_construction
        index.hnsw.efSearch = settings.hnsw_ef_search
        return index
    n = 0 if train is None else len(train)
    nlist = settings.ivf_nlist or auto_nlist(n)
    if n < nlist:
        raise ValueError(f"an IVF index with {nlist} lists needs at least {nlist} passages to train; got {n}")
    # index_factory makes the index own its coarse quantizer (no dangling SWIG reference).
    index = faiss.index_factory(dim, f"IVF{nlist},Flat", faiss.METRIC_INNER_PRODUCT)
    if n < 39 * nlist:  # a tiny corpus: train anyway, without FAISS's warning about it
        index.cp.min_points_per_centroid = 1
    index.train(train)
    index.nprobe = min(settings.ivf_nprobe, nlist)
    return index


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


class PassageIndex:
    """Passages and their embeddings in a FAISS index; row i of the index is `passages[i]`."""

    def __init__(self, embedder: Embedder | None = None, chunking: ChunkSettings = ChunkSettings(),
                 settings: IndexSettings = IndexSettings()):
        self.embedder = embedder or Embedder()
        self.chunking = chunking
        self.settings = settings
        self.passages: list[Passage] = []
        self.faiss_index: faiss.Index | None = None
        self.created: str | None = None

    # -- building -----------------------------------------------------------------------------

    @classmethod
    def build(cls, documents: Iterable[Document], embedder: Embedder | None = None,
              chunking: ChunkSettings = ChunkSettings(), settings: IndexSettings = IndexSettings(),
              progress: bool = False) -> "PassageIndex":
        """Chunk, embed and index `documents`."""
        index = cls(embedder, chunking, settings)
        index.add_documents(documents, progress=progress)
        return index

    def __len__(self) -> int:
        return len(self.passages)

    @property
    def document_ids(self) -> set[str]:
        return {p.doc_id for p in self.passages}

    def add_documents(self, documents: Iterable[Document], progress: bool = False) -> AddStats:
        """Chunk, embed and append documents; a document whose id is already indexed is skipped."""
        if self.chunking.chunk_tokens > self.embedder.max_tokens:
            raise ValueError(f"passages of {self.chunking.chunk_tokens} tokens would be truncated by "
                             f"{self.embedder.name} (at most {self.embedder.max_tokens}); lower chunk_tokens")
        seen = self.document_ids
        chunker = Chunker(self.embedder.tokenizer, self.chunking)
        new: list[Passage] = []
        added = skipped = 0
        for doc in documents:
            if doc.id in seen:
                skipped += 1
                continue
            seen.add(doc.id)
            added += 1
            new.extend(chunk_document(doc, chunker))
        self.add_passages(new, progress=progress)
        return AddStats(added, len(new), skipped)

    def add_passages(self, passages: Sequence[Passage], progress: bool = False) -> None:
        """Embed and append passages as they are (no chunking); their ids must be new."""
        known = {p.id for p in self.passages}
        dupes = [p.id for p in passages if p.id in known]
        if dupes or len({p.id for p in passages}) != len(passages):
            raise ValueError(f"passage ids must be unique; repeated: {dupes[:3] or 'within the new passages'}")
        if not passages:
            return
        vectors = self.embedder.encode([p.text for p in passages], progress=progress)
        if self.faiss_index is None:
            self.faiss_index = make_faiss_index(self.settings, vectors.shape[1], vectors)
        # IVF and HNSW take new vectors without retraining or rebuilding: IVF assigns them to
        # the lists trained at first build, HNSW links them into the graph.
        self.faiss_index.add(vectors)
        self.passages.extend(passages)

    # -- searching ----------------------------------------------------------------------------

    def search(self, query: str, k: int = 5) -> list[tuple[Passage, float]]:
        """The `k` passages most similar to `query`, best first, with cosine similarity."""
        return self.search_batch([query], k)[0]

    def search_batch(self, queries: Sequence[str], k: int = 5) -> list[list[tuple[Passage, float]]]:
        return self.search_vectors(self.embedder.encode(queries), k)

    def search_vectors(self, vectors: np.ndarray, k: int = 5) -> list[list[tuple[Passage, float]]]:
        """Search with query embeddings (unit rows), one result list per row."""
        if self.faiss_index is None or not self.passages:
            return [[] for _ in range(len(vectors))]
        scores, ids = self.faiss_index.search(np.ascontiguousarray(vectors, dtype=np.float32),
                                              min(k, len(self.passages)))
        # Approximate indexes mark missing results with id -1.
        return [[(self.passages[i], float(s)) for i, s in zip(row_ids, row_scores) if i >= 0]
                for row_ids, row_scores in zip(ids, scores)]

    # -- persistence --------------------------------------------------------------------------

    def manifest(self, files: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
        now = datetime.now(timezone.utc).isoformat(timespec="seconds")
        index_info: dict[str, Any] = {"settings": asdict(self.settings), "metric": "inner_product"}
        if isinstance(self.faiss_index, faiss.IndexIVF):
            index_info["ivf_nlist"] = int(self.faiss_index.nlist)
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "embedding_model": self.embedder.identity(),
            "chunking": asdict(self.chunking),
            "index": index_info,
            "counts": {"documents": len(self.document_ids), "passages": len(self.passages)},
            "files": files or {},
            "created": self.created or now,
            "updated": now,
        }

    @staticmethod
    @contextlib.contextmanager
    def writing(directory: str | os.PathLike):
        """Hold the index at `directory` for one writer (load, add, save) at a time: two `rag index
        --add` at once would each save what they loaded plus their own documents, and the one that
        saves last would drop the other's. A lock file beside the folder (the folder is swapped)."""
        final = Path(directory).expanduser().absolute()
        final.parent.mkdir(parents=True, exist_ok=True)
        with open(final.parent / f".{final.name}.lock", "a") as lock:
            try:
                import fcntl
            except ImportError:  # not POSIX: no lock
                yield
                return
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def save(self, directory: str | os.PathLike) -> Path:
        """Write the index to `directory`, replacing any index there in one atomic swap."""
        if self.faiss_index is None or not self.passages:
            raise ValueError("the index has no passages; nothing to save")
        final = Path(directory).expanduser().absolute()
        _recover_interrupted_swap(final)
        if final.exists() and not _is_replaceable(final):
            raise FileExistsError(f"{final} exists and is not a passage index; refusing to replace it")
        final.parent.mkdir(parents=True, exist_ok=True)
        # Not tempfile.mkdtemp: its 0700 mode would stick to the index folder after the swap.
        tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            self._write_files(tmp)
            _swap_in(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def _write_files(self, folder: Path) -> None:
        with open(folder / PASSAGES_FILE, "w", encoding="utf-8") as f:
            for p in self.passages:
                f.write(json.dumps(p.to_json(), ensure_ascii=False) + "\n")
        faiss.write_index(self.faiss_index, str(folder / INDEX_FILE))
        files = {}
        for name in (INDEX_FILE, PASSAGES_FILE):
            _fsync(folder / name)
            files[name] = {"sha256": sha256_file(folder / name), "bytes": (folder / name).stat().st_size}
        manifest = self.manifest(files)
        self.created = manifest["created"]
        (folder / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        _fsync(folder / MANIFEST_FILE)

    @classmethod
    def load(cls, directory: str | os.PathLike, embedding_model: str | os.PathLike | Embedder | None = None,
             device: str | None = None) -> "PassageIndex":
        """Load an index saved by `save`.

        `embedding_model` (a preset name, folder or Embedder) is the model the caller will query
        with; it must be the one the index was built with. None: the manifest's model.
        Raises CorruptIndexError when a file fails its checksum, EmbeddingModelMismatchError on
        another model, IndexLoadError when the folder is not an index."""
        folder = Path(directory).expanduser().absolute()
        _recover_interrupted_swap(folder)
        manifest = read_manifest(folder)
        for name in (INDEX_FILE, PASSAGES_FILE):
            _verify_file(folder / name, manifest["files"].get(name))
        embedder = _embedder_for(manifest, embedding_model, device, folder)
        index = cls(embedder, ChunkSettings(**manifest["chunking"]), IndexSettings(**manifest["index"]["settings"]))
        index.created = manifest.get("created")
        with open(folder / PASSAGES_FILE, encoding="utf-8") as f:
            index.passages = [Passage.from_json(json.loads(line)) for line in f if line.strip()]
        index.faiss_index = faiss.read_index(str(folder / INDEX_FILE))
        count, dim = manifest["counts"]["passages"], manifest["embedding_model"]["dimension"]
        if not (index.faiss_index.ntotal == len(index.passages) == count) or index.faiss_index.d != dim:
            raise CorruptIndexError(
                f"{folder}: the manifest says {count} passages of dimension {dim}, but {INDEX_FILE} has "
                f"{index.faiss_index.ntotal} of dimension {index.faiss_index.d} and {PASSAGES_FILE} has "
                f"{len(index.passages)}; rebuild the index")
        return index


# -- on-disk helpers ---------------------------------------------------------------------------

def index_exists(directory: str | os.PathLike) -> bool:
    """Whether `directory` holds a saved index (restoring one a crashed save left aside)."""
    folder = Path(directory).expanduser().absolute()
    _recover_interrupted_swap(folder)
    return (folder / MANIFEST_FILE).is_file()


def read_manifest(folder: Path) -> dict[str, Any]:
    """The parsed manifest.json of an index folder, checked for the fields `load` needs."""
    path = folder / MANIFEST_FILE
    if not path.is_file():
        raise IndexLoadError(f"{folder} is not a passage index (no {MANIFEST_FILE})")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        fields = (manifest["format"], manifest["format_version"], manifest["files"], manifest["counts"]["passages"],
                  manifest["embedding_model"]["fingerprint"], manifest["chunking"], manifest["index"]["settings"])
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptIndexError(f"{path} is unreadable or incomplete ({e!r}); rebuild the index") from None
    if fields[0] != FORMAT:
        raise IndexLoadError(f"{path} describes a {fields[0]!r}, not a {FORMAT!r}")
    if fields[1] > FORMAT_VERSION:
        raise IndexLoadError(f"{folder} has index format version {fields[1]}; this specsuite reads up to "
                             f"{FORMAT_VERSION}. Upgrade specsuite or rebuild the index")
    return manifest


def _verify_file(path: Path, expected: dict[str, Any] | None) -> None:
    if expected is None:
        raise CorruptIndexError(f"the manifest has no checksum for {path.name}; rebuild the index")
    if not path.is_file():
        raise CorruptIndexError(f"{path} is missing; rebuild the index")
    size = path.stat().st_size
    if size != expected["bytes"]:
        raise CorruptIndexError(f"{path} has {size} bytes, the manifest says {expected['bytes']}: "
                                f"the file is truncated or corrupted; rebuild the index")
    digest = sha256_file(path)
    if digest != expected["sha256"]:
        raise CorruptIndexError(f"{path} has sha256 {digest}, the manifest says {expected['sha256']}: "
                                f"the file is corrupted; rebuild the index")


def _embedder_for(manifest: dict[str, Any], requested: str | os.PathLike | Embedder | None,
                  device: str | None, folder: Path) -> Embedder:
    built = manifest["embedding_model"]
    if isinstance(requested, Embedder):
        embedder = requested
    elif requested is not None:
        embedder = Embedder(requested, device=device)
    else:
        # The folder it was built from, or (on another machine) the preset of the same name.
        path = Path(built.get("path", ""))
        embedder = Embedder(path if path.is_dir() else built["name"], device=device)
    if embedder.fingerprint != built["fingerprint"]:
        raise EmbeddingModelMismatchError(
            f"{folder} was built with embedding model {_describe(built['name'], built.get('path'))}, but "
            f"{_describe(embedder.name, embedder.path)} is a different model; query with the model the "
            f"index was built with, or rebuild the index with {embedder.name!r}")
    return embedder


def _describe(name: str, path: str | os.PathLike | None) -> str:
    return f"{name!r}" if path is None or str(path) == name else f"{name!r} ({path})"


def _is_replaceable(folder: Path) -> bool:
    """Only an empty folder or an earlier index may be swapped out (and then deleted)."""
    return folder.is_dir() and (not any(folder.iterdir()) or (folder / MANIFEST_FILE).is_file())


def _backups(final: Path) -> list[Path]:
    return sorted(final.parent.glob(f".{final.name}.old-*"), key=lambda p: p.stat().st_mtime)


def _swap_in(new: Path, final: Path) -> None:
    """Make `new` the folder at `final`. Two renames cannot be one atomic step, so between them
    the old index waits as a backup that `_recover_interrupted_swap` restores."""
    if final.exists():
        os.replace(final, final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}")
    os.replace(new, final)
    _fsync_dir(final.parent)
    for backup in _backups(final):  # this one, and any a crash left behind after its swap
        shutil.rmtree(backup, ignore_errors=True)


def _recover_interrupted_swap(final: Path) -> None:
    """If a save died between its two renames, put the previous index back."""
    if not final.exists() and (backups := _backups(final)):
        os.replace(backups[-1], final)


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
