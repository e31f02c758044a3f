"""Cut a long text into segments that fit a token budget, and put it back together.

Each segment is a run of whole sentences from one line. Line breaks and the whitespace
around and between segments stay outside the text given to the model, so the layout of
the input (paragraphs, blank lines, indentation, trailing newline) survives correction
exactly: `join_segments(segs, [s.text for s in segs]) == text` for every text.

Every line break is a boundary (not only blank lines): the model is asked for one
corrected line at a time, and a newline it drops or adds can then never shift the layout.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# The characters str.splitlines() breaks on.
_LINE = re.compile(r"[^\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]+")
_CONTENT = re.compile(r"\S(?:.*\S)?", re.DOTALL)
_WORD = re.compile(r"\S+")
# A sentence ends at .!? (plus closing quotes/brackets) before whitespace and a capital,
# possibly behind an opening quote or bracket.
_END = re.compile(r"[.!?]+[\"'\u201d\u2019)\]]*(?=\s+[\"'\u201c\u2018(\[]*[A-Z])")
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st vs no fig gen gov sen rep rev col lt sgt capt mt approx dept cf".split()
)
_INITIALS = re.compile(r"(?:[a-z]\.)+")  # "J.", "e.g.", "i.e.", "u.s.", "a.m."


@dataclass(frozen=True)
class Segment:
    """`lead + text + trail` is this segment's exact slice of the input.

    `text` (what goes to the model) has no surrounding whitespace and no line break;
    `lead` is non-empty only for the first segment (the text's leading whitespace);
    `trail` is everything up to the next segment's text. `paragraph` is the index of the
    line the segment comes from, counting only lines with text.
    """

    lead: str
    text: str
    trail: str
    paragraph: int


def split_sentences(text: str) -> list[tuple[int, int]]:
    """(start, end) spans of the sentences of one line; whitespace between them is in no span."""
    spans, start = [], 0
    for m in _END.finditer(text):
        if m.group().startswith(".") and len(m.group()) == 1 and _is_abbreviation(text, m.start()):
            continue
        spans.append((start, m.end()))
        start = m.end() + (len(text[m.end():]) - len(text[m.end():].lstrip()))
    if start < len(text):
        spans.append((start, len(text)))
    return spans


def _is_abbreviation(text: str, dot: int) -> bool:
    word = text[:dot + 1].rsplit(None, 1)[-1].lstrip("\"'\u201c\u2018([").lower()
    return word[:-1] in _ABBREVIATIONS or _INITIALS.fullmatch(word) is not None


def split_segments(text: str, count_tokens: Callable[[str], int], max_tokens: int) -> list[Segment]:
    """Segments of `text` whose `text` has at most `max_tokens` tokens each.

    Consecutive sentences of a line are grouped greedily; a sentence over the budget is cut
    at word boundaries, and a single word over it at characters. A text without any
    non-whitespace gives one segment with empty `text` (nothing to send to the model).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    spans: list[tuple[int, int, int]] = []  # (start, end, paragraph)
    paragraph = 0
    for line in _LINE.finditer(text):
        content = _CONTENT.search(line.group())
        if content is None:
            continue
        lo = line.start() + content.start()
        for start, end in _chunk_line(text, lo, line.start() + content.end(), count_tokens, max_tokens):
            spans.append((start, end, paragraph))
        paragraph += 1
    if not spans:
        return [Segment(lead=text, text="", trail="", paragraph=0)]
    segments = []
    for k, (start, end, par) in enumerate(spans):
        lead = text[:start] if k == 0 else ""
        next_start = spans[k + 1][0] if k + 1 < len(spans) else len(text)
        segments.append(Segment(lead, text[start:end], text[end:next_start], par))
    return segments


def join_segments(segments: Sequence[Segment], corrected_texts: Sequence[str]) -> str:
    """The whole text again, each segment's `text` replaced by its correction."""
    if len(segments) != len(corrected_texts):
        raise ValueError(f"{len(segments)} segments but {len(corrected_texts)} corrected texts")
    return "".join(s.lead + t + s.trail for s, t in zip(segments, corrected_texts))


def _chunk_line(
    text: str, lo: int, hi: int, count_tokens: Callable[[str], int], max_tokens: int
) -> list[tuple[int, int]]:
    """Spans covering the sentences of text[lo:hi], each within the budget."""
    if count_tokens(text[lo:hi]) <= max_tokens:  # the common case: one call per line
        return [(lo, hi)]
    sentences = [(lo + s, lo + e) for s, e in split_sentences(text[lo:hi])]
    return _pack(text, sentences, count_tokens, max_tokens, _split_words)


def _split_words(
    text: str, lo: int, hi: int, count_tokens: Callable[[str], int], max_tokens: int
) -> list[tuple[int, int]]:
    """Greedy word-boundary pieces of text[lo:hi]; an oversized word is cut at characters."""
    words = [(lo + m.start(), lo + m.end()) for m in _WORD.finditer(text[lo:hi])]
    return _pack(text, words, count_tokens, max_tokens, _split_chars)


def _pack(
    text: str, units: list[tuple[int, int]], count_tokens: Callable[[str], int], max_tokens: int,
    split_oversized: Callable[..., list[tuple[int, int]]],
) -> list[tuple[int, int]]:
    """Greedily join consecutive units (sentences, words) into spans within the budget; a unit
    over the budget on its own is cut finer by `split_oversized`."""
    spans: list[tuple[int, int]] = []
    i = 0
    while i < len(units):
        start, end = units[i]
        if count_tokens(text[start:end]) > max_tokens:
            spans.extend(split_oversized(text, start, end, count_tokens, max_tokens))
            i += 1
            continue
        j = i + 1
        while j < len(units) and count_tokens(text[start:units[j][1]]) <= max_tokens:
            end = units[j][1]
            j += 1
        spans.append((start, end))
        i = j
    return spans


def _split_chars(
    text: str, lo: int, hi: int, count_tokens: Callable[[str], int], max_tokens: int
) -> list[tuple[int, int]]:
    """Longest-prefix pieces of one word; at least one character each so this always ends."""
    pieces = []
    while lo < hi:
        good, bad = lo + 1, hi + 1  # binary search the largest end with a fitting prefix
        while bad - good > 1:
            mid = (good + bad) // 2
            if count_tokens(text[lo:mid]) <= max_tokens:
                good = mid
            else:
                bad = mid
        pieces.append((lo, good))
        lo = good
    return pieces
