"""Word-level edits between a source text and its correction.

Tokens are maximal runs of non-whitespace; every edit keeps the character offsets of
its words in both texts, so a UI can highlight them in place. Whitespace-only changes
are not edits (the tokens compare equal).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from difflib import SequenceMatcher
from typing import Literal

_WORD = re.compile(r"\S+")


@dataclass(frozen=True)
class Edit:
    """One changed span: `source[src_start:src_end] == src` becomes `target[tgt_start:tgt_end] == tgt`.

    An insertion has `src_start == src_end` (the point in the source where the words go);
    a deletion has `tgt_start == tgt_end`.
    """

    src_start: int
    src_end: int
    tgt_start: int
    tgt_end: int
    src: str
    tgt: str

    @property
    def kind(self) -> Literal["insert", "delete", "replace"]:
        if self.src_start == self.src_end:
            return "insert"
        if self.tgt_start == self.tgt_end:
            return "delete"
        return "replace"

    def to_dict(self) -> dict:
        """JSON-ready fields, `kind` included."""
        return {**asdict(self), "kind": self.kind}


def _words(text: str) -> list[re.Match[str]]:
    return list(_WORD.finditer(text))


def _span(words: list[re.Match[str]], i: int, j: int) -> tuple[int, int]:
    """Character span of words[i:j]; for an empty range, the point where word i would start."""
    if i < j:
        return words[i].start(), words[j - 1].end()
    if i < len(words):
        return words[i].start(), words[i].start()
    # Past the last word: attach to its end rather than after trailing whitespace/newlines.
    point = words[-1].end() if words else 0
    return point, point


def word_diff(source: str, target: str) -> list[Edit]:
    """The word-level edits turning `source` into `target`, in text order."""
    src_words, tgt_words = _words(source), _words(target)
    # autojunk would treat frequent words ("the", ",") as junk in texts over 200 words.
    matcher = SequenceMatcher(
        None, [w.group() for w in src_words], [w.group() for w in tgt_words], autojunk=False
    )
    edits = []
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op == "equal":
            continue
        s0, s1 = _span(src_words, i1, i2)
        t0, t1 = _span(tgt_words, j1, j2)
        edits.append(Edit(s0, s1, t0, t1, source[s0:s1], target[t0:t1]))
    return edits
