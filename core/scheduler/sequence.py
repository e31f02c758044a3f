"""One sequence being decoded: its state, and the draft-then-verify steps for it.

The engine (`core/scheduler/engine.py`) runs one loop over the sequences in flight: each `Sequence` proposes a
draft, one forward scores every sequence's rows, and each sequence verifies its rows and commits
the accepted path (`settle`). `generate()` is that loop with one sequence.
"""

from __future__ import annotations

import time
from dataclasses import KW_ONLY, dataclass, field
from typing import Callable, Sequence as Seq

import torch

from ..speculation.draft import Draft, Drafter, NoDrafter, SizeLadder, propose_within
from ..speculation.draft_budget import DraftPolicy, GoodputCap
from ..speculation.verify import Sampling, top_two, verify_greedy, verify_sample, warp

# Called after every step with the new tokens and, per token, whether it came from an accepted draft.
StepCallback = Callable[[list[int], list[bool]], None]


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    forward_passes: int = 0  # target forward passes, prefill included
    drafted: list[int] = field(default_factory=list)  # draft nodes per step (the first step is the prefill)
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens per step
    prefill_s: float = 0.0  # the first forward (the prompt): the time to first token
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    cached_prompt_tokens: int = 0  # prompt tokens whose KV came from a prefix cache
    backend: str = ""  # how the forwards were computed (`core.backend`, or "batch")

    @property
    def decode_s(self) -> float:
        return self.total_s - self.prefill_s

    @property
    def tokens_per_step(self) -> float:
        """New tokens per target forward pass (1.0 for plain decoding)."""
        return self.new_tokens / self.forward_passes if self.forward_passes else 0.0

    @property
    def acceptance_rate(self) -> float:
        return sum(self.accepted) / max(1, sum(self.drafted))

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
            "forward_passes": self.forward_passes, "steps": len(self.accepted),
            "drafted_tokens": sum(self.drafted), "accepted_tokens": sum(self.accepted),
            "tokens_per_step": round(self.tokens_per_step, 3), "acceptance_rate": round(self.acceptance_rate, 3),
            "prefill_s": round(self.prefill_s, 4), "draft_s": round(self.draft_s, 4),
            "verify_s": round(self.verify_s, 4), "total_s": round(self.total_s, 4),
            "cached_prompt_tokens": self.cached_prompt_tokens, "backend": self.backend,
        }


@dataclass
class Generation:
    tokens: list[int]  # new tokens only
    from_draft: list[bool]  # per new token: accepted from a draft (True) or picked by the target itself
    finish_reason: str  # "eos", "stop_string", "length" or "context"
    stats: GenerationStats


@dataclass
class SamplingParams:
    """What one request asks of its output: at most `max_new_tokens` tokens, greedy (`sampling`
    None) or sampled by `sampling` with `generator` as the source of randomness, ending where its
    text first contains one of `stop_strings` (the engine needs the tokenizer for them), and at
    the end-of-sequence token unless `ignore_eos` (fixed-length outputs, for load tests)."""

    max_new_tokens: int = 256
    sampling: Sampling | None = None
    generator: torch.Generator | None = None
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self.stop_strings = tuple(self.stop_strings)


@dataclass
class Request:
    """One sequence to decode: its prompt, its drafter (None: no drafts), what to generate, and
    `on_step`, called after each step with its new tokens and which came from the draft."""

    prompt: list[int]
    drafter: Drafter | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    _: KW_ONLY
    on_step: StepCallback | None = None


def eos_token_ids(model, tokenizer=None) -> set[int]:
    """End-of-sequence ids from the generation config, the config and the tokenizer (chat models
    often end turns with a token the config does not list, e.g. <|im_end|>)."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(src, "eos_token_id", None) if src is not None else None
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    if tokenizer is not None:
        for special in ("<|im_end|>", "<|eot_id|>", "<|end|>"):
            tid = tokenizer.convert_tokens_to_ids(special) if special in tokenizer.get_vocab() else None
            if isinstance(tid, int):
                ids.add(tid)
    return ids


def turn_end_token(model, tokenizer=None) -> int:
    """The token the model ends its answer with (for drafters that draft the end of the answer):
    the generation config's first EOS, which for chat models is the end-of-turn token; else the
    tokenizer's EOS; else the lowest of `eos_token_ids`."""
    eos = eos_token_ids(model, tokenizer)
    value = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    first = value[0] if isinstance(value, (list, tuple)) and value else value
    for candidate in (first, getattr(tokenizer, "eos_token_id", None)):
        if candidate in eos:
            return candidate
    return min(eos)


def eos_end(tokens: list[int], eos: set[int]) -> int | None:
    """How many of `tokens` to keep when one is an EOS (an EOS inside an accepted draft ends the
    sequence there): up to and including the first; None if there is none."""
    return next((i + 1 for i, t in enumerate(tokens) if t in eos), None)


def context_length(model) -> int:
    return int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)


def _first_stop(tokenizer, new: list[int], stop_strings: Seq[str], start: int) -> int | None:
    """Length of the shortest prefix of `new` (at least `start` + 1 tokens) whose text contains a
    stop string, or None. Stopping there leaves the same tokens as one-token-at-a-time decoding.
    The text before `start` was searched already, so only a stop string ending after it is new; one
    of L characters spans at most 4L tokens (a token is at least a byte), so the tail from `lo` holds
    it whole, past the window's first token (whose text may decode otherwise on its own): each step
    decodes that tail, not the whole output."""
    lo = max(0, start - 4 * max(map(len, stop_strings)) - 2)
    if not any(s in tokenizer.decode(new[lo:]) for s in stop_strings):
        return None
    for k in range(max(1, start + 1), len(new) + 1):
        if any(s in tokenizer.decode(new[lo:k]) for s in stop_strings):
            return k
    return None


class Sequence:
    """A sequence in flight. Its KV store holds `length` tokens; `fresh` follow them (the last one
    is the root of the next draft). One step: `propose`, one forward (the engine's), `settle`."""

    def __init__(self, index: int, request: Request, eos: set[int], context: int, cached: int = 0,
                 backend: str = "", policy: DraftPolicy = DraftPolicy(), tokenizer=None) -> None:
        prompt, params = list(request.prompt), request.params
        self.index, self.request, self.context = index, request, context
        self.eos = set() if params.ignore_eos else eos
        self.prompt, self.params, self.sampling, self.tokenizer = prompt, params, params.sampling, tokenizer
        self.drafter = request.drafter or NoDrafter()
        self.max_new_tokens = min(params.max_new_tokens, context - len(prompt))
        self.tie_margin = 0.0 if params.sampling is not None else policy.tie_margin
        self.prefill_draft = policy.prefill_draft
        # the cap on draft nodes after the prefill (None: none), updated after every draft
        self.size_cap = (GoodputCap(policy.draft_cost) if policy.draft_cost is not None
                         else SizeLadder(policy.draft_sizes) if policy.draft_sizes else None)
        self.length = cached
        self.fresh, self.seq = prompt[cached:], list(prompt)
        self.new: list[int] = []
        self.from_draft: list[bool] = []
        self.finish: str | None = None
        self.redo = False  # the last step ended on a near-tie: recompute it with a plain one-token forward
        self.stop_from = 0  # new tokens before this index were already searched for stop strings
        self.accepted = self.offered = 0  # drafted tokens accepted / offered so far, for a draft budget
        self.start = time.perf_counter()
        self.draft_s = 0.0  # the time of the last `propose`
        self.stats = GenerationStats(prompt_tokens=len(prompt), cached_prompt_tokens=cached, backend=backend)
        self.drafter.reset(prompt, params.sampling)

    @property
    def room(self) -> int:
        return self.max_new_tokens - len(self.new)

    @property
    def prefilling(self) -> bool:
        return not self.stats.accepted

    def propose(self, vocab: int) -> Draft | None:
        """The drafter's draft, cut to the room left and to the prefill's or `size_cap`'s cap
        (none while a near-tie is redone)."""
        t0 = time.perf_counter()
        cap = self.prefill_draft if self.prefilling else self.size_cap.value if self.size_cap else None
        draft = None if self.redo else propose_within(self.drafter, self.seq, self.room, vocab, cap)
        self.draft_s = time.perf_counter() - t0
        return draft

    def settle(self, draft: Draft | None, logits: torch.Tensor, best: list[int], plain_steps: bool,
               step_s: float) -> list[int] | None:
        """After the forward: verify `draft` against the sequence's `logits` rows ((1 + nodes,
        vocab); `best`: their argmax) and commit the accepted tokens. Returns the accepted path
        (node indices; the store keeps their KV and drops the rest up to `length`), or None where
        the prefill is to be run again as plain decoding runs it (a near-tie of the first token
        after a cached prefix, or computed by other kernels: `plain_steps` False)."""
        self.stats.forward_passes += 1
        if self.unsure(logits, draft, plain_steps):
            if self.prefilling:  # the next forward is the whole prompt, as plain decoding prefills it
                self.length, self.fresh = 0, list(self.prompt)
                self.stats.cached_prompt_tokens = 0
                self.redo = True
                return None
            path, nxt = [], None
        elif draft is None:
            path, nxt = [], self.pick(logits[0], best[0])
        elif self.sampling is None:
            path, nxt = verify_greedy(draft, logits, self.tie_margin, best=best)
        else:
            path, nxt = verify_sample(draft, logits, self.sampling, self.params.generator)
        if self.prefilling:
            self.stats.prefill_s = time.perf_counter() - self.start
        else:
            self.stats.draft_s += self.draft_s
            self.stats.verify_s += step_s
        self.commit(draft, path, nxt)
        return path

    def unsure(self, logits: torch.Tensor, draft: Draft | None, plain_steps: bool) -> bool:
        """Whether the root row, computed otherwise than plain decoding's (after a cached prefix,
        or on kernels that differ from it), ends on a near-tie and cannot be trusted."""
        if self.redo or self.tie_margin <= 0 or (draft is not None and not self.prefilling):
            return False  # a draft's rows are guarded by verify_greedy
        if plain_steps and not (self.prefilling and self.stats.cached_prompt_tokens > 0):
            return False
        _, first, second = top_two(logits[:1])
        return float(first[0] - second[0]) < self.tie_margin

    def pick(self, logits: torch.Tensor, best: int) -> int:
        """The next token from a (vocab,) row: `best` (its argmax), or a sample."""
        if self.sampling is None:
            return best
        return int(torch.multinomial(warp(logits[None], self.sampling)[0], 1, generator=self.params.generator))

    def commit(self, draft: Draft | None, path: list[int], nxt: int | None) -> None:
        """Append the accepted tokens and the target's next one (None: redo the last position
        alone), tell the drafter; set `finish` at an EOS, a stop string, or the length limit."""
        n = len(draft) if draft else 0
        self.length += len(self.fresh) + len(path)
        self.stats.drafted.append(n)
        self.stats.accepted.append(len(path))
        if n:
            self.offered += min(n, max(draft.depths))
            self.accepted += len(path)
        self.drafter.update(draft, path)
        if self.size_cap is not None and n:
            self.size_cap.update(len(path), max(draft.depths))
        step, flags = [draft.tokens[i] for i in path], [True] * len(path)
        self.redo = nxt is None
        if self.redo:  # a near-tie: the last position again, alone and without a draft
            self.length -= 1
            self.fresh = step[-1:] or self.fresh[-1:]
        else:
            step.append(nxt)
            flags.append(False)
            self.fresh = [nxt]
        if (end := eos_end(step, self.eos)) is not None:
            step, flags, self.finish = step[:end], flags[:end], "eos"
        self.seq += step
        self.new += step
        self.from_draft += flags
        stops = self.params.stop_strings
        if stops and (cut := _first_stop(self.tokenizer, self.new, stops, self.stop_from)) is not None:
            step, flags = step[: max(0, cut - self.stop_from)], flags[: max(0, cut - self.stop_from)]
            del self.new[cut:], self.from_draft[cut:]
            self.finish = "stop_string"
        self.stop_from = len(self.new)
        if self.request.on_step is not None and step:
            self.request.on_step(step, flags)
        if self.finish is None and self.room <= 0:
            self.finish = "length" if len(self.prompt) + len(self.new) < self.context else "context"

    def result(self) -> Generation:
        self.stats.new_tokens = len(self.new)
        self.stats.total_s = time.perf_counter() - self.start
        return Generation(self.new, self.from_draft, self.finish, self.stats)
