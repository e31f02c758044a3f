"""Documents and passages, and loading documents from .txt, .md and .jsonl files."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

SUFFIXES = (".txt", ".md", ".jsonl")


class DocumentError(ValueError):
    """A file could not be read as documents (unknown type, bad JSON, missing text field)."""


@dataclass(frozen=True)
class Document:
    """One source text before chunking. `id` is unique within an index."""

    id: str
    text: str
    title: str | None = None
    url: str | None = None
    source: str = ""  # the file it came from
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Passage:
    """One chunk of a document: the unit that is embedded, indexed and returned by search."""

    id: str  # "<doc_id>#<n>"
    doc_id: str
    text: str
    title: str | None = None
    url: str | None = None
    source: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "Passage":
        return cls(**obj)


def iter_files(paths: Iterable[str | os.PathLike]) -> Iterator[Path]:
    """The given files, and the supported files under the given folders (recursively, sorted)."""
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            # Hidden files and folders are skipped: they are editor swap files, .git and the like.
            yield from sorted(
                p for p in path.rglob("*")
                if p.is_file() and p.suffix.lower() in SUFFIXES
                and not any(part.startswith(".") for part in p.relative_to(path).parts)
            )
        elif path.is_file():
            if path.suffix.lower() not in SUFFIXES:
                raise DocumentError(f"{path}: unsupported file type; use {', '.join(SUFFIXES)}")
            yield path
        else:
            raise DocumentError(f"{path}: no such file or folder")


def _title_of_text(text: str, path: Path) -> str:
    """A Markdown file's first heading, else the file name without suffix."""
    if path.suffix.lower() == ".md":
        for line in text.splitlines():
            if line.startswith("#"):
                return line.lstrip("#").strip()
    return path.stem


def _read_text_file(path: Path) -> Document:
    text = path.read_text(encoding="utf-8", errors="replace")
    source = str(path.resolve())
    return Document(id=source, text=text, title=_title_of_text(text, path), source=source)


def jsonl_records(path: Path, error: type[Exception] = ValueError) -> Iterator[tuple[int, dict]]:
    """(line number, object) of each non-blank line of a JSONL file; a line that is not a JSON
    object is an `error` naming the file and line."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise error(f"{path}:{lineno}: not a JSON object")
            yield lineno, obj


def _read_jsonl(path: Path, text_field: str) -> Iterator[Document]:
    source = str(path.resolve())
    for lineno, obj in jsonl_records(path, DocumentError):
        if not isinstance(obj.get(text_field), str):
            raise DocumentError(f"{path}:{lineno}: no string field {text_field!r} (set the text field name)")
        # Every other field is kept as metadata, so callers can filter or display it later.
        extra = {k: v for k, v in obj.items() if k not in (text_field, "id", "title", "url")}
        yield Document(
            id=str(obj["id"]) if obj.get("id") is not None else f"{source}:{lineno}",
            text=obj[text_field],
            title=None if obj.get("title") is None else str(obj["title"]),
            url=None if obj.get("url") is None else str(obj["url"]),
            source=source,
            metadata=extra,
        )


def load_documents(paths: Iterable[str | os.PathLike], text_field: str = "text") -> list[Document]:
    """Read every document in `paths` (files or folders). A .jsonl line is one document whose
    text is in `text_field`; its `id`, `title` and `url` are kept, other fields go to metadata."""
    docs: list[Document] = []
    for path in iter_files(paths):
        if path.suffix.lower() == ".jsonl":
            docs.extend(_read_jsonl(path, text_field))
        else:
            docs.append(_read_text_file(path))
    return docs
