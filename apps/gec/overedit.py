"""How often a correction rewrites a sentence beyond its errors.

A sentence is over-edited when the hypothesis changes more of its source words than the most
editing human reference does: word-level edit distance (insertions, deletions, substitutions of
JFLEG tokens) from the source, hypothesis against the largest over the references. A paraphrase
of a sentence with one error changes many words where every reference changes one or two; a
minimal correction stays within what a human corrector changed.
"""

from __future__ import annotations

from collections.abc import Sequence

Tokens = Sequence[str]


def word_edits(source: Tokens, target: Tokens) -> int:
    """Levenshtein distance between two token sequences (one row of the table at a time)."""
    previous = list(range(len(target) + 1))
    for i, s in enumerate(source, 1):
        current = [i]
        for j, t in enumerate(target, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (s != t)))
        previous = current
    return previous[-1]


def over_edited(source: Tokens, references: Sequence[Tokens], hypothesis: Tokens) -> bool:
    """Whether `hypothesis` changes more words of `source` than every one of its `references`."""
    return word_edits(source, hypothesis) > max(word_edits(source, r) for r in references)


def over_edit_rate(sources: Sequence[Tokens], references: Sequence[Sequence[Tokens]],
                   hypotheses: Sequence[Tokens]) -> float:
    """The share of sentences whose hypothesis is `over_edited` (0 for no sentences)."""
    flags = [over_edited(s, r, h) for s, r, h in zip(sources, references, hypotheses, strict=True)]
    return sum(flags) / len(flags) if flags else 0.0
