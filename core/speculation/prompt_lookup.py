"""Prompt lookup drafting: find the latest n-gram of the sequence earlier in it and draft what followed.

Also the pieces that every drafter copying from its input shares: `NgramIndex` (where an n-gram
occurs in one or more token lists) and `CopiedDraft` (a draft tree that remembers where its nodes
were copied from).
"""

from __future__ import annotations

from typing import Sequence

from .draft import AdaptiveLength, Draft, Drafter

Location = tuple[int, int]  # (source id, index of a token in that source)


class NgramIndex:
    """Where each 1..max_ngram-gram of one or more token lists ("sources") occurs, for O(1) lookups.

    Maps an n-gram to up to `max_positions` locations (source id, index just past an occurrence):
    the first ones (`keep="first"`, as HF's prompt lookup picks, and it drafts better than the
    latest: docs/architecture-core.md, Measurements: prompt lookup) or the latest, latest first
    (`keep="last"`)."""

    def __init__(self, max_ngram: int, keep: str = "first", max_positions: int = 1) -> None:
        if keep not in ("first", "last"):
            raise ValueError("keep must be 'first' or 'last'")
        if max_ngram < 1 or max_positions < 1:
            raise ValueError("max_ngram and max_positions must be at least 1")
        self.max_ngram, self.keep_first, self.max_positions = max_ngram, keep == "first", max_positions
        self.table: dict[tuple[int, ...], list[Location]] = {}
        self.indexed: dict[int, int] = {}  # source -> n-grams ending at or before this index are in

    def reset(self) -> None:
        self.table.clear()
        self.indexed.clear()

    def extend(self, tokens: Sequence[int], source: int = 0, complete: bool = False) -> None:
        """Index the n-grams of source `source` (`tokens`, which may have grown since the last call)
        not indexed yet. Only those followed by a token, since a draft copies what follows (the last
        token's come with the next call), unless `complete`: the list is whole, its end counts too."""
        table, cap, stop = self.table, self.max_positions, len(tokens) + (1 if complete else 0)
        done = self.indexed.get(source, 0)
        for end in range(done + 1, stop):  # n-gram = tokens[end - n : end]
            for n in range(1, min(self.max_ngram, end) + 1):
                places = table.setdefault(tuple(tokens[end - n: end]), [])
                if not self.keep_first:
                    places.insert(0, (source, end))
                    del places[cap:]
                elif len(places) < cap:  # a frequent n-gram need not list every occurrence
                    places.append((source, end))
        self.indexed[source] = max(done, stop - 1)

    def positions(self, ngram: Sequence[int]) -> list[Location]:
        """The locations kept for `ngram`, best first (a new list)."""
        return list(self.table.get(tuple(ngram), ()))

    def lookup(self, tokens: Sequence[int], min_ngram: int = 1) -> tuple[Location, int] | None:
        """(best location, n) of the longest suffix n-gram of `tokens` indexed, or None."""
        for n in range(min(self.max_ngram, len(tokens)), min_ngram - 1, -1):
            places = self.table.get(tuple(tokens[-n:]))
            if places:
                return places[0], n
        return None


class CopiedDraft:
    """A draft tree merged from continuations copied out of sources, that remembers where each node
    was copied from: an accepted path then tells where the output goes on in its source, with no
    need to find the accepted tokens there again."""

    def __init__(self, copies: Sequence[tuple[Location, Sequence[int]]]) -> None:
        """copies: (location of its first token, tokens) per continuation, best first."""
        self.draft = Draft.from_paths([list(tokens) for _, tokens in copies])
        self.nodes = {(p, t): i for i, (t, p) in enumerate(zip(self.draft.tokens, self.draft.parents))}
        # Every continuation through a node, best first (merged prefixes can come from several).
        self.origins: list[list[Location]] = [[] for _ in self.draft.tokens]
        for (source, start), tokens in copies:
            node = -1
            for k, t in enumerate(tokens):
                node = self.nodes[(node, t)]
                self.origins[node].append((source, start + k))

    def origins_of(self, draft: Draft, path: list[int]) -> list[Location]:
        """Where the last node of `path` (accepted nodes of `draft`) was copied from, best first;
        empty for an empty path. `draft` is this tree or a cut of it (`Draft.limit_depth` and
        `limit_size` renumber the nodes), so the path is followed by its tokens."""
        node = -1
        for i in path:
            node = self.nodes[(node, draft.tokens[i])]
        return self.origins[node] if path else []


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
        (_, start), _ = hit
        draft = tokens[start: start + min(self.length.value, max_depth)]
        return Draft.chain(draft) if draft else None

    def update(self, draft: Draft | None, path: list[int]) -> None:
        self.length.update(len(path), len(draft) if draft else 0)
