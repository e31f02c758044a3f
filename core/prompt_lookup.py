"""Prompt lookup drafting: find the latest n-gram of the sequence earlier in it and draft what followed."""

from __future__ import annotations

from .draft import AdaptiveLength, Draft, Drafter


class NgramIndex:
    """Positions of every 1..max_ngram-gram of a growing token list, for O(1) suffix lookups.

    Maps an n-gram to the index just past one occurrence that has a continuation: the first one
    (`keep="first"`, as HF's prompt lookup picks; measured here on Spec-Bench summaries, it drafts
    better than the latest) or the most recent (`keep="last"`)."""

    def __init__(self, max_ngram: int, keep: str = "first") -> None:
        if keep not in ("first", "last"):
            raise ValueError("keep must be 'first' or 'last'")
        self.max_ngram, self.keep_first = max_ngram, keep == "first"
        self.table: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in the table

    def reset(self) -> None:
        self.table.clear()
        self.indexed = 0

    def extend(self, tokens: list[int]) -> None:
        """Index the n-grams of `tokens` that end before its last token (so each has a continuation)."""
        table, m = self.table, self.max_ngram
        for end in range(self.indexed + 1, len(tokens)):  # n-gram = tokens[end - n : end]
            for n in range(1, min(m, end) + 1):
                key = tuple(tokens[end - n: end])
                if not (self.keep_first and key in table):
                    table[key] = end
        self.indexed = max(self.indexed, len(tokens) - 1)

    def lookup(self, tokens: list[int], min_ngram: int = 1) -> tuple[int, int] | None:
        """(continuation start, n) for the longest suffix n-gram of `tokens` seen before, or None."""
        for n in range(min(self.max_ngram, len(tokens)), min_ngram - 1, -1):
            pos = self.table.get(tuple(tokens[-n:]))
            if pos is not None:
                return pos, n
        return None


class PromptLookupDrafter(Drafter):
    """Drafts the tokens that followed the first earlier occurrence of the sequence's last
    1..max_ngram tokens (longest match first), in the prompt or in the output so far.

    The draft length adapts to acceptance between `min_tokens` and `max_tokens`."""

    name = "prompt_lookup"

    def __init__(self, max_ngram: int = 3, max_tokens: int = 16, min_tokens: int = 2, min_ngram: int = 1) -> None:
        self.index = NgramIndex(max_ngram)
        self.min_ngram = min_ngram
        self.length = AdaptiveLength(max_tokens, min_tokens, max_tokens, grow=max_tokens, keep_on_partial=True)

    def reset(self, prompt: list[int], sampling=None) -> None:
        self.index.reset()
        self.length.reset()

    def propose(self, tokens: list[int], max_depth: int) -> Draft | None:
        self.index.extend(tokens)
        hit = self.index.lookup(tokens, self.min_ngram)
        if hit is None:
            return None
        start = hit[0]
        draft = tokens[start: start + min(self.length.value, max_depth)]
        return Draft.chain(draft) if draft else None

    def update(self, draft: Draft | None, path: list[int]) -> None:
        self.length.update(len(path), len(draft) if draft else 0)
