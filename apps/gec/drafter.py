"""Copy drafting for grammar correction: the correction is mostly the source, so draft the rest of it.

A pointer tracks which source token the output should copy next. While the output copies, the
draft is the rest of the source (to the end of the sentence, then the end-of-turn token). An
accepted draft moves the pointer to just past the source token of its last accepted node (each
draft node knows where it was copied from); the target's own next token is then aligned with the
source. After an edit the pointer is re-anchored: on the next few source tokens if the new token
is there (a deletion), else on a unique 1-3-gram of the output in the source; failing both, a
token tree verifies three alignment hypotheses in the same forward pass: "substitution" (skip one
source token), "insertion" (stay) and "word replaced" (skip to the next source word, which covers
a misspelt word of several tokens written back as one, e.g. " know|led|ges" -> " knowledge"; else
skip two tokens). A punctuation mark is most often inserted, so after one the insertion branch
goes first and gets the longest draft.
"""

from __future__ import annotations

import re

from specsuite.core.speculation.draft import AdaptiveLength, Draft, Drafter
from specsuite.core.speculation.prompt_lookup import CopiedDraft, NgramIndex

SENTENCE_END_CHARS = (".", "!", "?", "\n")

# Tokenized corpora (JFLEG, PTB) write "word ." and "do n't"; models write "word." and "don't".
_DETOKENIZE = [
    (re.compile(r" +([.,!?;:%)\]}])"), r"\1"),
    (re.compile(r"([(\[{$]) +"), r"\1"),
    (re.compile(r" +(n't|'s|'re|'ve|'ll|'d|'m)\b", re.IGNORECASE), r"\1"),
]


def as_written(text: str) -> str:
    """The source as a model would write it back: no spaces before punctuation and clitics. Drafting
    from this form rather than from tokenized text keeps the copy aligned through punctuation."""
    for pattern, repl in _DETOKENIZE:
        text = pattern.sub(repl, text)
    return text


def punctuation_tokens(tokenizer, marks: str = ",.;:!?") -> set[int]:
    """The ids of the tokens that are one punctuation mark, with or without a leading space."""
    ids = set()
    for mark in marks:
        for text in (mark, " " + mark):
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(piece) == 1:
                ids.add(piece[0])
    return ids


class CopyDrafter(Drafter):
    """Drafts continuations of the output by copying `source` (token ids of the text to correct).

    end_tokens: appended to the source in drafts (the end-of-turn token), so that the final step
        also verifies the end of the answer.
    sentence_ends: source token indices after which a sentence ends; a draft stops there (plus
        `overrun` tokens) so that a long text is not drafted to its end at every step.
    word_starts: source token indices that begin a word (None: every token does).
    branches: alignment hypotheses verified at once after an unanchored edit (1 = a chain only).
    branch_tokens: draft length of each hypothesis, likeliest first. Every draft row costs a
        one-row attention call per layer; replayed on 100 JFLEG outputs with step costs measured
        here, (12, 8, 8) and (8, 4, 4) need the same time, the former 4% fewer forward passes
        (bf16 on an AMX CPU; in fp32 on the CPU, generate()'s draft size ladder caps the tree).
    """

    name = "copy"

    def __init__(self, source: list[int], end_tokens: list[int] = (), sentence_ends: list[int] = (),
                 max_tokens: int = 64, branches: int = 3, branch_tokens: tuple[int, ...] = (12, 8, 8),
                 window: int = 4, overrun: int = 4, word_starts: list[int] | None = None,
                 punctuation: set[int] = frozenset()) -> None:
        if len(branch_tokens) < branches:
            raise ValueError(f"branch_tokens needs a length for each of the {branches} branches")
        self.target = list(source) + list(end_tokens)
        # The last sentence runs on into the end tokens.
        self.sentence_ends = sorted({e for e in sentence_ends if e < len(source)} | {len(self.target)})
        n = len(self.target)
        starts = sorted({s for s in (range(n) if word_starts is None else word_starts) if s < len(source)}
                        | {len(source), n})  # the end tokens are words of their own
        # next_word[p]: the first word start after source index p
        self.next_word = [n] * (n + 1)
        for a, b in zip([0] + starts, starts):
            self.next_word[a:b] = [b] * (b - a)
        self.punctuation = set(punctuation)
        self.branches, self.branch_tokens, self.window, self.overrun = branches, branch_tokens, window, overrun
        self.length = AdaptiveLength(max_tokens, 4, max_tokens, grow=max_tokens, keep_on_partial=True)
        # Source n-grams (n = 1..3) -> the positions just past them, for re-anchoring. Two
        # positions are enough to tell a unique n-gram; the last one counts too (it ends the source).
        self.anchors = NgramIndex(3, max_positions=2)
        self.anchors.extend(self.target, complete=True)
        self.fallback = NgramIndex(3)
        self.reset([])

    @classmethod
    def for_text(cls, tokenizer, text: str, end_tokens: list[int] = (), **kwargs) -> "CopyDrafter":
        """Tokenize `text` as the answer would be and mark its sentence ends."""
        ids = tokenizer(as_written(text), add_special_tokens=False)["input_ids"]
        pieces = [tokenizer.decode([t]) for t in ids]
        ends = [i + 1 for i, p in enumerate(pieces) if p.rstrip(" \"')").endswith(SENTENCE_END_CHARS)]
        # A token that does not go on a word (a leading space, punctuation) starts one.
        words = [i for i, p in enumerate(pieces) if i == 0 or not p[:1].isalnum()]
        return cls(ids, end_tokens, ends, word_starts=words, punctuation=punctuation_tokens(tokenizer), **kwargs)

    def reset(self, prompt: list[int], sampling=None) -> None:
        self.prompt_len = len(prompt)
        self.seen = 0  # output tokens already used to move the pointer
        self.pos = 0  # index in target of the token the output should copy next
        self.synced = True  # the last output token was copied from target[pos - 1]
        self.copied: CopiedDraft | None = None  # the last draft, if copied from target
        self.length.reset()
        self.fallback.reset()

    def _advance(self, out: list[int]) -> None:
        """Move the pointer over the output tokens not seen yet: after an accepted draft, only the
        target's own next token (`update` moved the pointer over the accepted ones)."""
        target = self.target
        for i in range(self.seen, len(out)):
            t = out[i]
            # Copying on, or resuming after a deletion of up to `window` source tokens.
            nearby = target[self.pos: self.pos + self.window]
            if t in nearby:
                self.pos += nearby.index(t) + 1
                self.synced = True
                continue
            self.synced = False
            for n in (3, 2, 1):  # re-anchor on a unique n-gram of the output, longest first
                ends = self.anchors.positions(out[i + 1 - n: i + 1]) if i + 1 >= n else []
                if len(ends) == 1:
                    self.pos, self.synced = ends[0][1], True
                    break
        self.seen = len(out)

    def _chain(self, start: int, length: int) -> list[int]:
        # Stop at the first sentence end after a few tokens: later sentences are drafted later.
        stop = next((e for e in self.sentence_ends if e >= start + self.overrun), len(self.target))
        return self.target[start: min(stop, start + length)]

    def _copy(self, chains: list[tuple[int, list[int]]]) -> Draft | None:
        """The draft of `chains` (target index of its first token, tokens), remembered for `update`."""
        copies = [((0, start), chain) for start, chain in chains if chain]
        self.copied = CopiedDraft(copies) if copies else None
        return self.copied.draft if self.copied else None

    def propose(self, tokens: list[int], max_depth: int) -> Draft | None:
        out = tokens[self.prompt_len:]
        self._advance(out)
        self.copied = None
        length = min(self.length.value, max_depth)
        if self.pos < len(self.target):
            if self.synced or self.branches == 1:
                return self._copy([(self.pos, self._chain(self.pos, length))])
            # Unanchored edit: substitution, insertion or a replaced word (see the module docstring).
            p = self.pos
            word = self.next_word[p] if self.next_word[p] > p + 1 else p + 2
            hypotheses = (p, p + 1, word) if out and out[-1] in self.punctuation else (p + 1, p, word)
            starts = [s for s in dict.fromkeys(hypotheses) if s < len(self.target)][: self.branches]
            return self._copy([(s, self._chain(s, min(length, n))) for s, n in zip(starts, self.branch_tokens)])
        # Past the end of the source: the model writes on; look up its own text.
        self.fallback.extend(tokens)
        hit = self.fallback.lookup(tokens, 2)
        if hit is None:
            return None
        (_, start), _ = hit
        return Draft.chain(tokens[start: start + min(8, max_depth)])

    def update(self, draft: Draft | None, path: list[int]) -> None:
        self.length.update(len(path), len(draft) if draft else 0)
        if self.copied is not None and draft is not None and path:
            # The output copied the accepted branch: go on just past its last node's source token.
            (_, last), *_ = self.copied.origins_of(draft, path)
            self.pos, self.synced = last + 1, True
            self.seen += len(path)
