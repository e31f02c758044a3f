"""Reference drafting for RAG: answers quote their passages, so draft what follows in them.

Every 1..max_ngram-gram of the reference passages (and, per generation, of the prompt) maps to the
positions just past its occurrences (an `NgramIndex`). Each step looks up the longest suffix of the
sequence (longest first) and drafts the tokens that follow those positions. A pointer follows the
copy: when the output went on as a drafted source did (the draft's accepted path, then the target's
own next token), that source's next tokens are the first choice, so a quote is drafted from the
passage it started in even where its words occur elsewhere too. Distinct candidate continuations
are verified together as a small token tree.

The answer so far is indexed too, for answers that repeat themselves.
"""

from __future__ import annotations

from typing import Sequence

from specsuite.core.speculation.draft import AdaptiveLength, Draft, Drafter
from specsuite.core.speculation.prompt_lookup import CopiedDraft, Location, NgramIndex

from .prompt import passage_text

OWN = -1  # source id of the sequence itself (prompt + answer so far)


class ReferenceDrafter(Drafter):
    """Drafts continuations copied from `references` (token ids of each passage), the prompt, and
    the answer so far.

    max_ngram: longest suffix matched. max_tokens: longest draft (the length adapts to acceptance).
    branches: distinct candidate continuations verified at once (1 = a chain only).
    branch_tokens: length of the candidates after the first. max_nodes: tree size bound (each
    drafted token costs a row of the verifying forward pass: ~3% of a decode step at the ~800-token
    contexts of Spec-Bench RAG, where 12 nodes ran 4% faster than 20, and as fast as a chain).
    """

    name = "reference"

    def __init__(self, references: Sequence[Sequence[int]], max_ngram: int = 4, max_tokens: int = 16,
                 branches: int = 2, branch_tokens: int = 4, max_nodes: int = 12, max_positions: int = 16) -> None:
        if branches < 1 or max_ngram < 1:
            raise ValueError("branches and max_ngram must be at least 1")
        self.references = [list(r) for r in references]
        self.max_ngram, self.branches, self.branch_tokens = max_ngram, branches, branch_tokens
        self.max_nodes = max_nodes
        self.index = NgramIndex(max_ngram, max_positions=max_positions)
        for source, ref in enumerate(self.references):
            self.index.extend(ref, source)
        self.prompt_source = len(self.references)  # the prompt is one more reference, per generation
        # Apart from the passages' index: that one is built once, this one per generation.
        self.prompt_index = NgramIndex(max_ngram, max_positions=max_positions)
        self.own = NgramIndex(max_ngram)
        # As for the other copy drafters: a partial acceptance keeps the length (the output diverged
        # from a right source), an outright miss halves it.
        self.length = AdaptiveLength(max_tokens, 2, max_tokens, grow=max_tokens, keep_on_partial=True)
        self.reset([])

    @classmethod
    def for_passages(cls, tokenizer, passages: Sequence[str], **kwargs) -> "ReferenceDrafter":
        """Tokenize passages as an answer quotes them: mid-sentence, after a space."""
        refs = [tokenizer(" " + passage_text(p), add_special_tokens=False)["input_ids"] for p in passages]
        return cls(refs, **kwargs)

    def reset(self, prompt: list[int], sampling=None) -> None:
        self.prompt = list(prompt)
        self.prompt_index.reset()
        self.prompt_index.extend(self.prompt, self.prompt_source)
        self.own.reset()
        self.length.reset()
        self.copied: CopiedDraft | None = None  # the last draft
        self.followed: list[Location] = []  # where the accepted path leads: the next token to copy
        self.recent: int | None = None  # the source the answer copied from last
        self.misses = 0  # drafts in a row with nothing accepted
        self.depth = 0  # depth of the last draft

    def _source(self, source: int, tokens: list[int]) -> list[int]:
        if source == OWN:
            return tokens
        return self.prompt if source == self.prompt_source else self.references[source]

    def _follow(self, tokens: list[int]) -> Location | None:
        """Where the copy goes on: past the source of the last accepted draft node, if the target's
        own next token (the last of `tokens`) is also that source's next token."""
        followed, self.followed = self.followed, []
        for source, pos in followed:
            if self._source(source, tokens)[pos: pos + 1] == tokens[-1:]:
                self.recent = source
                return source, pos + 1
        return None

    def _candidates(self, tokens: list[int], pointer: Location | None) -> list[Location]:
        """Locations to copy from, best first: the pointer, then matches of the longest suffix."""
        out = [pointer] if pointer else []
        # After drafts keep missing, a one-token match is too weak a hint to pay for verifying.
        shortest = 2 if self.misses >= 2 else 1
        own = self.own.lookup(tokens, shortest)
        for n in range(min(self.max_ngram, len(tokens)), shortest - 1, -1):
            key = tuple(tokens[-n:])
            places = self.index.positions(key) + self.prompt_index.positions(key)
            # The passage being quoted first (a stable sort keeps passages before the prompt).
            places.sort(key=lambda loc: loc[0] != self.recent)
            out += places
            if own and own[1] == n:
                out.append(own[0])
            if len(out) >= 4 * self.branches:
                break
        return out

    def propose(self, tokens: list[int], max_depth: int) -> Draft | None:
        if len(tokens) <= len(self.prompt):
            # At the prefill the sequence ends with the chat template's "assistant" header: its
            # matches in the passages are noise, and each drafted row costs the long prefill more.
            return None
        pointer = self._follow(tokens)
        self.own.extend(tokens, OWN)
        depth = min(self.length.value, max_depth)
        # While the output copies a source, its continuation is the draft. Otherwise several
        # candidates are verified at once; the first one keeps the longest share of the node budget.
        found: list[tuple[Location, list[int]]] = []
        for source, pos in self._candidates(tokens, pointer):
            path = self._source(source, tokens)[pos: pos + depth]
            if path and not any(p[: len(path)] == path for _, p in found):
                found.append(((source, pos), path))
            if len(found) == (1 if pointer else self.branches):
                break
        first = max(1, self.max_nodes - (len(found) - 1) * self.branch_tokens)
        copies: list[tuple[Location, list[int]]] = []
        nodes: set[tuple[int, ...]] = set()  # the tree so far, as root-to-node token paths
        for location, path in found:
            path = path[: first if not copies else self.branch_tokens]
            shared = 0
            while shared < len(path) and tuple(path[: shared + 1]) in nodes:
                shared += 1
            path = path[: shared + self.max_nodes - len(nodes)]
            if len(path) <= shared:  # no room, or nothing new
                continue
            nodes.update(tuple(path[: i + 1]) for i in range(shared, len(path)))
            copies.append((location, path))
        self.depth = max((len(p) for _, p in copies), default=0)
        self.copied = CopiedDraft(copies) if copies else None
        return self.copied.draft if copies else None

    def update(self, draft: Draft | None, path: list[int]) -> None:
        if not draft or self.copied is None:
            return
        self.misses = 0 if path else self.misses + 1
        # The length follows the deepest path: a tree never has all its nodes accepted.
        self.length.update(len(path), self.depth)
        self.followed = [(source, pos + 1) for source, pos in self.copied.origins_of(draft, path)]
