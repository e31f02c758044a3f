"""The draft-then-verify decoding loop shared by every app.

Each step: the drafter proposes a token tree continuing the sequence; ONE forward pass of the target
over [last token, draft nodes] scores all of it; the longest path the target agrees with is kept,
plus the target's own next token; the KV cache is rolled back past everything else. With greedy
verification the output is token for token that of plain greedy decoding; with speculative sampling
it is distributed as plain sampling.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from transformers import DynamicCache

from . import decoder_forward
from .draft import Draft, Drafter, NoDrafter, SizeLadder
from .exact_attention import NAME as EXACT_ATTENTION, block_rows
from .verify import Sampling, top_two, tree_attention_mask, verify_greedy, verify_sample, warp

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
            "cached_prompt_tokens": self.cached_prompt_tokens,
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


def context_length(model) -> int:
    return int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)


def _tie_margin(model) -> float:
    """Logit gap below which a multi-token forward's argmax is not trusted to match plain decoding.

    Without exact attention, rows differ from one-token forwards by up to ~0.17 in bf16 (measured on
    Qwen2.5-0.5B). With exact attention and exact linear layers in bf16, every row rounds bit for
    bit as in a one-token step, so no guard is needed (measured on Qwen2.5-0.5B: 100 of 100 JFLEG
    corrections identical to greedy without one). In fp32 every row runs on faster kernels than
    plain decoding's (exact_linear.py) and differs from it by up to ~4e-5 (Qwen2.5-0.5B's logits
    after a prefill, measured on JFLEG prompts): a guard 25x wider."""
    exact = model.config._attn_implementation == EXACT_ATTENTION
    if model.dtype == torch.bfloat16:
        return 0.0 if exact else 0.25
    if model.dtype == torch.float16:
        return 0.02 if exact else 0.05
    return 1e-3


# fp32 on the CPU: a verify step of 2-4 rows costs 1.1-1.2x a one-row step, 5-9 rows ~1.4-1.7x,
# 16-17 ~2x, 32-33 ~2.7x (`specsuite step-cost`, Qwen2.5-0.5B on an AVX2-only CPU, with
# exact_linear's fp32 kernels). Replayed on 100 JFLEG outputs with such costs, drafts capped at 3
# nodes needed about a quarter less decode time than uncapped ones; the ladder, which grows on
# whole acceptances, did as well there and lets long copies (summaries) draft more. (Replayed again
# with the oneDNN kernels' costs: other ladders such as (3, 11, 31) within ~3%, uncapped 7% more.)
FP32_CPU_DRAFT_SIZES = (3, 7, 15, 31)


# fp32 on the CPU, a prefill is compute-bound: 8 more rows after a 30-row GEC prompt suffix cost
# ~0.45 of a one-token step, 16 rows ~0.9 (Qwen2.5-0.5B, measured ad hoc), so the prefill verifies a
# draft too. Replayed on 100 JFLEG outputs with those costs, an 8-node draft in the prefill saved
# ~10% of the decode time, 16 nodes as much, 32 less.
FP32_CPU_PREFILL_DRAFT = 8


def _fp32_cpu(model) -> bool:
    return model.dtype == torch.float32 and model.device.type == "cpu"


def default_draft_sizes(model) -> tuple[int, ...]:
    """The `draft_sizes` ladder for this model's kernels (see `SizeLadder`); () for no cap (bf16,
    where a verify step's cost grows smoothly with its rows)."""
    return FP32_CPU_DRAFT_SIZES if _fp32_cpu(model) else ()


def default_prefill_draft(model) -> int:
    """Draft nodes the prefill verifies along with the prompt: 8 in fp32 on the CPU; 0 in bf16,
    where draft rows must run apart from the prompt's to round as decode steps do, which in an
    experiment on JFLEG sentences cost as much as the step it saves."""
    return FP32_CPU_PREFILL_DRAFT if _fp32_cpu(model) else 0


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


def _forward(model, fresh: list[int], cache: DynamicCache, past: int, draft: Draft | None,
             plain: bool = False) -> torch.Tensor:
    """One target forward over [fresh tokens..., draft nodes...] after `past` cached tokens.
    Returns (1 + len(draft), vocab) logits: row 0 for the last fresh token (the root), then one per node.
    plain: computed as the model's own forward does (no draft allowed), not in exact_attention's
    and exact_linear's forms."""
    n = len(draft) if draft else 0
    ids = torch.tensor([fresh + (draft.tokens if draft else [])], device=model.device)
    positions, mask = None, None  # a chain needs no mask: plain causal attention
    if draft is not None and not draft.is_chain:
        root = past + len(fresh) - 1
        positions = torch.tensor([list(range(past, root + 1)) + [root + d for d in draft.depths]],
                                 device=model.device)
        mask = tree_attention_mask(draft, past, len(fresh) - 1, model.device)
        if model.config._attn_implementation == "eager":
            mask = torch.zeros(mask.shape, dtype=model.dtype, device=model.device).masked_fill(
                ~mask, torch.finfo(model.dtype).min)
    with contextlib.nullcontext() if plain else block_rows(len(fresh), len(fresh) + n):
        if decoder_forward.supports(model):
            if positions is None:
                positions = torch.arange(past, past + ids.shape[1], device=model.device)[None]
            return decoder_forward.forward(model, ids, cache, positions, mask, n + 1)
        extra = {} if mask is None else {"position_ids": positions, "attention_mask": mask}
        return model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=n + 1, **extra).logits[0]


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
    tie_margin: greedy only; rows whose top two logits are closer are recomputed as plain decoding
    does (default: per dtype and attention, see `_tie_margin`). draft_sizes: a ladder of caps on
    draft nodes (see `SizeLadder`); default `default_draft_sizes(model)`, () for none.
    prefill_draft: draft nodes verified in the prefill's forward (0: the prefill only computes the
    prompt); default `default_prefill_draft(model)`.
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
    limit = context_length(model)
    if len(prompt_ids) >= limit:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {limit}")
    if prefill_draft is not None and prefill_draft < 0:
        raise ValueError(f"prefill_draft must be >= 0, got {prefill_draft}")
    if tie_margin is not None and tie_margin < 0:
        raise ValueError(f"tie_margin must be >= 0, got {tie_margin}")
    if stop_strings and tokenizer is None:
        raise ValueError("stop_strings need the tokenizer")
    vocab = model.get_output_embeddings().weight.shape[0]
    if eos_token_id is None:
        eos = eos_token_ids(model, tokenizer)
    else:
        eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
    drafter = drafter or NoDrafter()
    sizes = default_draft_sizes(model) if draft_sizes is None else tuple(draft_sizes)
    if prefill_draft is None:
        prefill_draft = default_prefill_draft(model)
    ladder = SizeLadder(sizes) if sizes else None
    stats = GenerationStats(prompt_tokens=len(prompt_ids))

    def pick(logits: torch.Tensor) -> int:
        if sampling is None:
            return int(top_two(logits[None])[0])
        return int(torch.multinomial(warp(logits[None], sampling)[0], 1, generator=generator))

    if prefix_cache is not None:  # reuse the KV of the longest cached prefix of the prompt
        cache, cached = prefix_cache.lookup(prompt_ids)
    else:
        cache, cached = DynamicCache(config=model.config), 0
    stats.cached_prompt_tokens = cached
    drafter.reset(prompt_ids, sampling)
    max_new_tokens = min(max_new_tokens, limit - len(prompt_ids))
    seq = list(prompt_ids)
    new: list[int] = []
    from_draft: list[bool] = []
    fresh = prompt_ids[cached:]  # tokens not in the cache yet; the last one is the root of the draft
    finish = None
    stop_from = 0  # new tokens before this index were already searched for stop strings
    redo = False  # the last step ended on a near-tie: recompute it with a plain one-token forward
    # whether our prefill and one-token steps compute as plain decoding does (exact_linear's fp32
    # kernels on the CPU do not)
    plain_steps = not _fp32_cpu(model)
    if sampling is not None:
        tie_margin = 0.0
    elif tie_margin is None:
        tie_margin = _tie_margin(model)

    # Each step drafts, then runs ONE forward over [fresh tokens, draft]. The first step is the
    # prefill; it verifies a draft of at most `prefill_draft` nodes.
    while finish is None:
        room = max_new_tokens - len(new)
        if room <= 0:
            finish = "length" if len(prompt_ids) + len(new) < limit else "context"
            break
        past = len(seq) - len(fresh)  # tokens in the cache

        t0 = time.perf_counter()
        cap = (ladder.value if ladder is not None else None) if new else prefill_draft
        draft = drafter.propose(seq, room - 1) if room > 1 and not redo and cap != 0 else None
        if draft is not None:
            draft = draft.limit_depth(room - 1)
            if cap is not None:
                draft = draft.limit_size(cap)
            if not len(draft):
                draft = None
            elif max(draft.tokens) >= vocab or min(draft.tokens) < 0:
                raise ValueError(f"drafter {drafter.name!r} proposed token ids outside the vocabulary (0..{vocab - 1})")
        t1 = time.perf_counter()
        logits = _forward(model, fresh, cache, past, draft, plain=redo)
        # A prefill or one-token step computed otherwise than plain decoding's (after a cached
        # prefix, or on exact_linear's fp32 kernels) is not trusted on a near-tie.
        unsure = ((draft is None or not new) and not redo and tie_margin > 0
                  and (not plain_steps or (cached and not new)) and _near_tie(logits[:1], tie_margin))
        if unsure and not new:  # the first token is decided by plain decoding's whole-prompt prefill
            cache, cached, past, fresh = DynamicCache(config=model.config), 0, 0, list(prompt_ids)
            draft = None
            stats.cached_prompt_tokens = 0
            stats.forward_passes += 1
            logits = _forward(model, fresh, cache, past, None, plain=True)
        if prefix_cache is not None and not new:
            prefix_cache.store(prompt_ids, cache)
        if draft is None:
            path, nxt = [], None if unsure and new else pick(logits[0])
        elif sampling is None:
            path, nxt = verify_greedy(draft, logits, tie_margin)
        else:
            path, nxt = verify_sample(draft, logits, sampling, generator)
        n = len(draft) if draft else 0
        _keep_path(cache, past + len(fresh) - 1, path, n)
        t2 = time.perf_counter()
        if not new:
            stats.prefill_s = t2 - start
        else:
            stats.draft_s += t1 - t0
            stats.verify_s += t2 - t1
        stats.forward_passes += 1
        stats.drafted.append(n)
        stats.accepted.append(len(path))
        drafter.update(draft, path)
        if ladder is not None and n:
            ladder.update(len(path), max(draft.depths))

        step = [draft.tokens[i] for i in path]
        flags = [True] * len(path)
        redo = nxt is None
        if redo:  # a near-tie: redo the last position alone, without a draft
            cache.crop(-1)
            fresh = step[-1:] or fresh[-1:]
        else:
            step.append(nxt)
            flags.append(False)
            fresh = [nxt]
        for i, t in enumerate(step):  # an EOS inside the accepted draft ends the generation there
            if t in eos:
                step, flags, finish = step[: i + 1], flags[: i + 1], "eos"
                break
        seq += step
        new += step
        from_draft += flags
        if stop_strings and (cut := _first_stop(tokenizer, new, stop_strings, stop_from)) is not None:
            step, flags = step[: max(0, cut - stop_from)], flags[: max(0, cut - stop_from)]
            del new[cut:], from_draft[cut:]
            finish = "stop_string"
        stop_from = len(new)
        if on_step and step:
            on_step(step, flags)

    stats.new_tokens = len(new)
    stats.total_s = time.perf_counter() - start
    return Generation(new, from_draft, finish, stats)
