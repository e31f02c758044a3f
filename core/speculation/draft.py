"""What a drafter proposes (a token tree) and the protocol every drafter follows."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Draft:
    """Candidate continuations of the sequence, as a token tree rooted at the last accepted token.

    Node i holds `tokens[i]`; its parent is node `parents[i]`, or -1 for the root (the last token of
    the sequence, not part of the draft). Parents precede their children. A plain chain of k tokens
    has parents [-1, 0, 1, ..., k-2]. Siblings should hold distinct tokens.

    probs: (n, vocab) float, the distribution each node's token was sampled from (only for drafts
        sampled from a model, used by speculative sampling); None for a deterministic draft.
    """

    tokens: list[int]
    parents: list[int]
    probs: torch.Tensor | None = None
    depths: list[int] = field(init=False)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError("a draft needs one parent per token")
        depths = []
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"draft node {i} has parent {p}; parents must come before their children")
            depths.append(1 if p < 0 else depths[p] + 1)
        self.depths = depths

    @classmethod
    def chain(cls, tokens: list[int], probs: torch.Tensor | None = None) -> "Draft":
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), probs)

    @classmethod
    def from_paths(cls, paths: list[list[int]]) -> "Draft":
        """Merge several continuations into a tree, sharing their common prefixes."""
        tokens: list[int] = []
        parents: list[int] = []
        index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        for path in paths:
            parent = -1
            for t in path:
                node = index.get((parent, t))
                if node is None:
                    node = index[(parent, t)] = len(tokens)
                    tokens.append(t)
                    parents.append(parent)
                parent = node
        return cls(tokens, parents)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def limit_depth(self, max_depth: int) -> "Draft":
        """The nodes at depth <= max_depth (a tree stays a tree: ancestors are shallower)."""
        if not self.depths or max(self.depths) <= max_depth:
            return self
        keep = [i for i, d in enumerate(self.depths) if d <= max_depth]
        remap = {old: new for new, old in enumerate(keep)}
        return Draft(
            [self.tokens[i] for i in keep],
            [remap.get(self.parents[i], -1) for i in keep],
            None if self.probs is None else self.probs[keep],
        )

    def limit_size(self, size: int) -> "Draft":
        """The `size` shallowest nodes, in layout order among equals (a tree stays a tree: ancestors
        are shallower, or earlier at the same depth)."""
        if len(self.tokens) <= size:
            return self
        keep = sorted(sorted(range(len(self.tokens)), key=lambda i: self.depths[i])[:size])
        remap = {old: new for new, old in enumerate(keep)}
        return Draft(
            [self.tokens[i] for i in keep],
            [remap.get(self.parents[i], -1) for i in keep],
            None if self.probs is None else self.probs[keep],
        )


class Drafter:
    """Base class of drafters: propose continuations of the sequence; learn from what was accepted.

    The decoding loop calls `reset` once per generation, then per step `propose` and `update`.
    """

    name = "drafter"

    def reset(self, prompt: list[int], sampling: "object | None" = None) -> None:
        """A new generation starts from `prompt` (token ids)."""

    def propose(self, tokens: list[int], max_depth: int) -> Draft | None:
        """Draft continuations of `tokens` (prompt + generated so far; the loop appends to this same
        list, so it must not be modified). At most `max_depth` tokens deep. None: no draft."""
        raise NotImplementedError

    def update(self, draft: Draft | None, path: list[int]) -> None:
        """The last proposal (None: no draft) had the nodes `path` accepted: indices into
        `draft.tokens`, root to leaf. The target's own next token follows them (the next
        `propose` sees it at the end of `tokens`)."""


def propose_within(drafter: Drafter, tokens: list[int], room: int, vocab: int, cap: int | None = None) -> Draft | None:
    """The drafter's draft for `tokens`, cut to the room - 1 tokens a step can add besides the
    target's own and to `cap` nodes (None: no cap); None if nothing is left. A token id outside
    0..vocab - 1 is the drafter's bug: ValueError. (The decoding loops of generate() and the engine.)"""
    if room <= 1 or cap == 0:
        return None
    draft = drafter.propose(tokens, room - 1)
    if draft is None:
        return None
    draft = draft.limit_depth(room - 1)
    if cap is not None:
        draft = draft.limit_size(cap)
    if not len(draft):
        return None
    if max(draft.tokens) >= vocab or min(draft.tokens) < 0:
        raise ValueError(f"drafter {drafter.name!r} proposed token ids outside the vocabulary (0..{vocab - 1})")
    return draft


class NoDrafter(Drafter):
    """Plain autoregressive decoding through the same loop: one token per forward pass."""

    name = "none"

    def propose(self, tokens: list[int], max_depth: int) -> Draft | None:
        return None


class AdaptiveLength:
    """Draft length that follows recent acceptance.

    Default (for drafts that cost compute, e.g. a draft model): grow by `grow` after a fully
    accepted draft, else shrink towards what was accepted. With `keep_on_partial` (for drafts
    copied from the input, which cost nothing to make and little to verify): a partial acceptance
    keeps the length (the source was right, the output just diverged), only an outright miss halves
    it, so a drafter that keeps missing drafts little and costs about what plain decoding does."""

    def __init__(self, initial: int, minimum: int = 1, maximum: int = 16, grow: int = 2,
                 keep_on_partial: bool = False) -> None:
        self.initial, self.minimum, self.maximum, self.grow = initial, minimum, maximum, grow
        self.keep_on_partial = keep_on_partial
        self.value = initial

    def reset(self) -> None:
        self.value = self.initial

    def update(self, accepted: int, drafted: int) -> None:
        if drafted == 0:
            return
        if accepted >= drafted:
            self.value = min(self.maximum, self.value + self.grow)
        elif self.keep_on_partial:
            if accepted == 0:
                self.value = max(self.minimum, self.value // 2)
        else:
            self.value = max(self.minimum, min(self.value - 1, accepted + 2))


class SizeLadder:
    """A cap on draft nodes for kernels whose verify cost rises in steps: the cap climbs the
    ladder `sizes` while drafts are accepted whole and drops to the first rung on a partial
    acceptance. `sizes` are node counts that fill a row count the kernel verifies cheaply (the
    root row plus 3, 7, 15, 31 nodes: 4, 8, 16, 32 rows)."""

    def __init__(self, sizes: tuple[int, ...]) -> None:
        if not sizes or any(n < 1 for n in sizes):
            raise ValueError(f"draft sizes must be >= 1, got {sizes}")
        self.sizes = tuple(sizes)
        self.rung = 0

    @property
    def value(self) -> int:
        return self.sizes[self.rung]

    def update(self, accepted: int, deepest: int) -> None:
        """The last draft, `deepest` nodes deep, had `accepted` tokens verified."""
        if accepted >= deepest:
            self.rung = min(self.rung + 1, len(self.sizes) - 1)
        else:
            self.rung = 0


class FallbackDrafter(Drafter):
    """Drafts with `primary` (e.g. copying from the input); where it has nothing, with `fallback`
    (e.g. a small draft model), so that a costly drafter runs only for what the input does not cover."""

    def __init__(self, primary: Drafter, fallback: Drafter) -> None:
        self.primary, self.fallback = primary, fallback
        self.name = f"{primary.name}+{fallback.name}"
        self.last: Drafter | None = None  # which one drafted the last proposal

    def reset(self, prompt: list[int], sampling: "object | None" = None) -> None:
        self.primary.reset(prompt, sampling)
        self.fallback.reset(prompt, sampling)
        self.last = None

    def propose(self, tokens: list[int], max_depth: int) -> Draft | None:
        self.last = self.primary
        draft = self.primary.propose(tokens, max_depth)
        if draft is None:
            self.last = self.fallback
            draft = self.fallback.propose(tokens, max_depth)
        return draft

    def update(self, draft: Draft | None, path: list[int]) -> None:
        # Each learns from its own drafts only; to the other, this step had no draft.
        for drafter in (self.primary, self.fallback):
            drafter.update(draft, path) if drafter is self.last else drafter.update(None, [])
