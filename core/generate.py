"""The draft-then-verify decoding loop shared by every app.

Each step: the drafter proposes a token tree continuing the sequence; ONE forward pass of the target
over [last token, draft nodes] scores all of it; the longest path the target agrees with is kept,
plus the target's own next token; the KV cache is rolled back past everything else. With greedy
verification the output is token for token that of plain greedy decoding; with speculative sampling
it is distributed as plain sampling.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from transformers import DynamicCache

from .backend import Backend, backend_for, plain_backend
from .draft import Draft, Drafter, NoDrafter, SizeLadder, propose_within
from .verify import Sampling, top_two, verify_greedy, verify_sample, warp

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
    backend: str = ""  # how the forwards were computed (`core.backend`)

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


def _keep_path(cache: DynamicCache, root: int, path: list[int], n: int) -> None:
    """The cache holds tokens up to the root (at index `root`) + n draft nodes: keep the nodes on `path`."""
    if path == list(range(len(path))):  # a prefix of the laid-out nodes: a plain crop
        if n - len(path):
            cache.crop(-(n - len(path)))
        return
    keep = torch.tensor([root + 1 + i for i in path])
    for layer in cache.layers:
        layer.keys = torch.cat([layer.keys[..., : root + 1, :], layer.keys[..., keep, :]], dim=-2)
        layer.values = torch.cat([layer.values[..., : root + 1, :], layer.values[..., keep, :]], dim=-2)


def _near_tie(logits: torch.Tensor, margin: float) -> bool:
    """Whether the top two logits of a (1, vocab) row are closer than `margin`."""
    _, first, second = top_two(logits)
    return float(first[0] - second[0]) < margin


def _first_stop(tokenizer, new: list[int], stop_strings: Sequence[str], start: int) -> int | None:
    """Length of the shortest prefix of `new` (at least `start` + 1 tokens) whose text contains a
    stop string, or None. Stopping there leaves the same tokens as one-token-at-a-time decoding."""
    if not any(s in tokenizer.decode(new) for s in stop_strings):
        return None
    for k in range(max(1, start + 1), len(new) + 1):
        if any(s in tokenizer.decode(new[:k]) for s in stop_strings):
            return k
    return None


class _Decoding:
    """The state of one `generate()` call; its methods are the steps of the loop."""

    def __init__(self, model, prompt: list[int], drafter: Drafter, eos: set[int], max_new_tokens: int,
                 sampling: Sampling | None, generator: torch.Generator | None, stop_strings: Sequence[str],
                 tokenizer, on_step: StepCallback | None, prefix_cache, backend: Backend, tie_margin: float,
                 draft_sizes: tuple[int, ...], prefill_draft: int) -> None:
        self.model, self.prompt, self.drafter, self.eos = model, prompt, drafter, eos
        self.sampling, self.generator, self.on_step = sampling, generator, on_step
        self.stop_strings, self.tokenizer, self.prefix_cache = stop_strings, tokenizer, prefix_cache
        self.backend, self.plain = backend, plain_backend(model.dtype)
        self.tie_margin = 0.0 if sampling is not None else tie_margin
        self.ladder = SizeLadder(draft_sizes) if draft_sizes else None
        self.prefill_draft = prefill_draft
        self.limit = context_length(model)
        self.max_new_tokens = min(max_new_tokens, self.limit - len(prompt))
        self.vocab = model.get_output_embeddings().weight.shape[0]
        self.stats = GenerationStats(prompt_tokens=len(prompt), backend=backend.name)
        self.seq, self.new, self.from_draft = list(prompt), [], []
        self.finish: str | None = None
        self.stop_from = 0  # new tokens before this index were already searched for stop strings
        self.redo = False  # the last step ended on a near-tie: recompute it with a plain one-token forward
        if prefix_cache is not None:  # reuse the KV of the longest cached prefix of the prompt
            self.cache, self.cached = prefix_cache.lookup(prompt)
        else:
            self.cache, self.cached = DynamicCache(config=model.config), 0
        self.stats.cached_prompt_tokens = self.cached
        self.fresh = prompt[self.cached:]  # tokens not in the cache yet; the last one is the root of the draft
        drafter.reset(prompt, sampling)

    @property
    def room(self) -> int:
        return self.max_new_tokens - len(self.new)

    def propose(self, cap: int | None) -> Draft | None:
        """The drafter's draft, cut to the room left and to `cap` nodes (None: no cap)."""
        return None if self.redo else propose_within(self.drafter, self.seq, self.room, self.vocab, cap)

    def forward(self, draft: Draft | None, plain: bool = False) -> torch.Tensor:
        """ONE target forward over [fresh tokens, draft]: (1 + len(draft), vocab) logits. plain:
        computed as plain decoding computes it (a redo after a near-tie)."""
        self.stats.forward_passes += 1
        past = len(self.seq) - len(self.fresh)
        return (self.plain if plain else self.backend).forward(self.model, self.fresh, self.cache, past, draft)

    def unsure(self, logits: torch.Tensor, draft: Draft | None, prefill: bool) -> bool:
        """Whether the root row of a step computed otherwise than plain decoding's (after a cached
        prefix, or on kernels that differ from it) ends on a near-tie, and cannot be trusted."""
        if self.redo or self.tie_margin <= 0 or (draft is not None and not prefill):
            return False  # a draft's rows are guarded by verify_greedy
        differs = not self.backend.plain_steps or (prefill and self.cached > 0)
        return differs and _near_tie(logits[:1], self.tie_margin)

    def prefill(self) -> None:
        """The first step: the prompt (after any cached prefix) and a draft of at most
        `prefill_draft` nodes in one forward. A near-tie of the first token is decided by plain
        decoding's whole-prompt prefill instead."""
        draft = self.propose(self.prefill_draft)
        logits = self.forward(draft)
        if self.unsure(logits, draft, prefill=True):
            self.cache, self.cached, self.fresh = DynamicCache(config=self.model.config), 0, list(self.prompt)
            self.stats.cached_prompt_tokens = 0
            draft = None
            logits = self.forward(None, plain=True)
        if self.prefix_cache is not None:
            self.prefix_cache.store(self.prompt, self.cache)
        self.commit(draft, *self.accept(draft, logits, unsure=False))

    def step(self) -> None:
        """A decode step: propose, verify in one forward, accept, commit."""
        t0 = time.perf_counter()
        draft = self.propose(self.ladder.value if self.ladder is not None else None)
        t1 = time.perf_counter()
        logits = self.forward(draft, plain=self.redo)
        path, nxt = self.accept(draft, logits, unsure=self.unsure(logits, draft, prefill=False))
        self.stats.draft_s += t1 - t0
        self.stats.verify_s += time.perf_counter() - t1
        self.commit(draft, path, nxt)

    def accept(self, draft: Draft | None, logits: torch.Tensor, unsure: bool) -> tuple[list[int], int | None]:
        """The accepted path (node indices) and the target's next token (None: redo this position)."""
        if draft is None:
            return [], None if unsure else self.pick(logits[0])
        if self.sampling is None:
            return verify_greedy(draft, logits, self.tie_margin)
        return verify_sample(draft, logits, self.sampling, self.generator)

    def pick(self, logits: torch.Tensor) -> int:
        """The next token from a (vocab,) row: argmax, or a sample."""
        if self.sampling is None:
            return int(top_two(logits[None])[0])
        return int(torch.multinomial(warp(logits[None], self.sampling)[0], 1, generator=self.generator))

    def commit(self, draft: Draft | None, path: list[int], nxt: int | None) -> None:
        """Keep the accepted path's KV, append the new tokens, tell the drafter; set `finish` at an
        EOS, a stop string, or the length limit."""
        n = len(draft) if draft else 0
        _keep_path(self.cache, len(self.seq) - 1, path, n)
        self.stats.drafted.append(n)
        self.stats.accepted.append(len(path))
        self.drafter.update(draft, path)
        if self.ladder is not None and n:
            self.ladder.update(len(path), max(draft.depths))
        step, flags = [draft.tokens[i] for i in path], [True] * len(path)
        self.redo = nxt is None
        if self.redo:  # a near-tie: redo the last position alone, without a draft
            self.cache.crop(-1)
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
        if self.stop_strings and (cut := _first_stop(self.tokenizer, self.new, self.stop_strings, self.stop_from)) is not None:
            step, flags = step[: max(0, cut - self.stop_from)], flags[: max(0, cut - self.stop_from)]
            del self.new[cut:], self.from_draft[cut:]
            self.finish = "stop_string"
        self.stop_from = len(self.new)
        if self.on_step and step:
            self.on_step(step, flags)
        if self.finish is None and self.room <= 0:
            self.finish = "length" if len(self.prompt) + len(self.new) < self.limit else "context"


@torch.inference_mode()
def generate(
    model,
    prompt: Sequence[int] | torch.Tensor,
    drafter: Drafter | None = None,
    *,
    max_new_tokens: int = 256,
    eos_token_id: int | Sequence[int] | None = None,
    sampling: Sampling | None = None,
    generator: torch.Generator | None = None,
    stop_strings: Sequence[str] = (),
    tokenizer=None,
    on_step: StepCallback | None = None,
    prefix_cache=None,
    tie_margin: float | None = None,
    draft_sizes: Sequence[int] | None = None,
    prefill_draft: int | None = None,
) -> Generation:
    """Decode from `prompt` (token ids, or a (1, T) tensor) with draft-then-verify.

    drafter: proposes drafts (None: plain decoding). sampling: None for greedy (exact), else
    lossless speculative sampling with `generator` as the source of randomness. stop_strings need
    `tokenizer`. prefix_cache: an optional `PrefixCache` that reuses the KV of a shared prompt prefix.
    The model's backend (`backend_for`) computes the forwards and sets the defaults of:
    tie_margin (greedy only; rows whose top two logits are closer are recomputed as plain decoding
    does), draft_sizes (a ladder of caps on draft nodes, see `SizeLadder`; () for none) and
    prefill_draft (draft nodes verified in the prefill's forward).
    """
    start = time.perf_counter()
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() > 2 or (prompt.dim() == 2 and prompt.shape[0] != 1):
            raise ValueError(f"one prompt at a time: expected (T,) or (1, T) token ids, got {tuple(prompt.shape)}")
        prompt = prompt.reshape(-1).tolist()
    prompt_ids = list(prompt)
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if len(prompt_ids) >= context_length(model):
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {context_length(model)}")
    if prefill_draft is not None and prefill_draft < 0:
        raise ValueError(f"prefill_draft must be >= 0, got {prefill_draft}")
    if tie_margin is not None and tie_margin < 0:
        raise ValueError(f"tie_margin must be >= 0, got {tie_margin}")
    if stop_strings and tokenizer is None:
        raise ValueError("stop_strings need the tokenizer")
    if eos_token_id is None:
        eos = eos_token_ids(model, tokenizer)
    else:
        eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
    backend = backend_for(model)
    run = _Decoding(model, prompt_ids, drafter or NoDrafter(), eos, max_new_tokens, sampling, generator,
                    stop_strings, tokenizer, on_step, prefix_cache, backend,
                    backend.tie_margin if tie_margin is None else tie_margin,
                    backend.draft_sizes if draft_sizes is None else tuple(draft_sizes),
                    backend.prefill_draft if prefill_draft is None else prefill_draft)
    run.prefill()
    run.stats.prefill_s = time.perf_counter() - start
    while run.finish is None:
        run.step()
    run.stats.new_tokens = len(run.new)
    run.stats.total_s = time.perf_counter() - start
    return Generation(run.new, run.from_draft, run.finish, run.stats)
