"""Token-aware chunking: passages of at most `chunk_tokens` tokens that overlap by at most
`overlap` tokens, cut at paragraph, then sentence, then word boundaries where possible."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .documents import Document, Passage

# Cut ranks: how good a place "just before token i" is to end one passage and start the next.
INSIDE_WORD, WORD, SENTENCE, PARAGRAPH = 0, 1, 2, 3
_SENTENCE_END = ".!?"
_CLOSERS = "\"')]”’»"
_ITEM = re.compile(r"[-*•>|#]|\d+[.)]\s")  # Markdown list items, quotes, tables, headings


@dataclass(frozen=True)
class ChunkSettings:
    chunk_tokens: int = 200
    overlap: int = 40

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be at least 1, not {self.chunk_tokens}")
        if not 0 <= self.overlap < self.chunk_tokens:
            raise ValueError(f"overlap must be in [0, chunk_tokens), not {self.overlap}")


class Chunker:
    """Splits text with a Hugging Face fast tokenizer (the embedding model's, so counts match
    what the model sees). Counts exclude special tokens such as [CLS] and [SEP].

    Cuts fall on word starts, so re-tokenizing a passage gives the same count for WordPiece
    tokenizers; only a single word longer than half a passage is cut inside the word."""

    def __init__(self, tokenizer: Any, settings: ChunkSettings = ChunkSettings()):
        self.tokenizer = tokenizer
        self.settings = settings

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])

    def split(self, text: str) -> list[str]:
        """The passages of `text`, in order; [] for blank text."""
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        offsets: list[tuple[int, int]] = enc["offset_mapping"]
        n = len(offsets)
        size, overlap = self.settings.chunk_tokens, self.settings.overlap
        if n <= size:
            return [text.strip()] if n else []
        ranks = _cut_ranks(text, offsets, enc.word_ids())
        # A passage shorter than half the limit is allowed only at the end of the text; it must
        # also be longer than the overlap so that every step moves forward.
        min_len = max(overlap + 1, size // 2)
        chunks, start = [], 0
        while True:
            end = n if start + size >= n else _best_cut(ranks, start + min_len, start + size)
            chunks.append(text[offsets[start][0]:offsets[end - 1][1]].strip())
            if end == n:
                return chunks
            start = _overlap_start(ranks, max(start + 1, end - overlap), end) if overlap else end


def _cut_ranks(text: str, offsets: list[tuple[int, int]], word_ids: list[int | None]) -> list[int]:
    """ranks[i]: the kind of boundary between token i-1 and token i (ranks[0] is unused)."""
    ranks = [PARAGRAPH]
    for i in range(1, len(offsets)):
        prev_end, start = offsets[i - 1][1], offsets[i][0]
        gap = text[prev_end:start]
        tail = text[max(0, prev_end - 4):prev_end].rstrip(_CLOSERS)
        if gap.count("\n") >= 2:
            ranks.append(PARAGRAPH)
        elif (gap and tail.endswith(tuple(_SENTENCE_END))) or ("\n" in gap and _starts_item(text, prev_end, start)):
            ranks.append(SENTENCE)
        elif word_ids[i] != word_ids[i - 1]:
            ranks.append(WORD)
        else:
            ranks.append(INSIDE_WORD)
    return ranks


def _starts_item(text: str, prev_end: int, start: int) -> bool:
    """Whether a single line break ends a heading or starts a list item. Other line breaks are
    hard wraps inside a sentence, as common in plain text, and rank as word boundaries."""
    prev_line = text[text.rfind("\n", 0, prev_end) + 1:prev_end].lstrip()
    return prev_line.startswith("#") or _ITEM.match(text, start) is not None


def _best_cut(ranks: list[int], lo: int, hi: int) -> int:
    """The end of a passage in [lo, hi]: the best-ranked boundary, the latest among equals."""
    return max(range(lo, hi + 1), key=lambda i: (ranks[i], i))


def _overlap_start(ranks: list[int], lo: int, end: int) -> int:
    """The start of the next passage in [lo, end): the earliest sentence start if any (whole
    sentences of overlap), else the earliest word start, else `lo`."""
    return max(range(lo, end), key=lambda i: (min(ranks[i], SENTENCE), -i))


def chunk_document(doc: Document, chunker: Chunker) -> list[Passage]:
    """The passages of one document, with ids "<doc id>#<n>" and the document's metadata."""
    return [
        Passage(id=f"{doc.id}#{i}", doc_id=doc.id, text=text, title=doc.title, url=doc.url,
                source=doc.source, metadata=dict(doc.metadata))
        for i, text in enumerate(chunker.split(doc.text))
    ]
