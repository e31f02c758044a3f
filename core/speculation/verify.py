"""Verification of a draft against the target model's logits: greedy (exact) and speculative sampling.

Both take the logits of one forward pass over [root, node_0, ..., node_{n-1}] and return the
accepted draft nodes (a root-to-node path) plus the token the target itself picks next.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .draft import Draft


@dataclass(frozen=True)
class Sampling:
    """Sampling settings of the target; the output distribution equals HF's `do_sample=True` one."""

    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError("temperature must be > 0 (use greedy decoding for temperature 0)")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")


def warp(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """(rows, vocab) logits -> (rows, vocab) float32 probabilities after temperature, top-k, top-p
    (in that order, as HF's logits processors apply them)."""
    scores = logits.float() / sampling.temperature
    if sampling.top_k and sampling.top_k < scores.shape[-1]:
        kth = torch.topk(scores, sampling.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_scores, idx = torch.sort(scores, dim=-1, descending=False)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        remove = cum <= 1 - sampling.top_p
        remove[..., -1] = False  # always keep the most likely token
        scores = scores.masked_fill(remove.scatter(-1, idx, remove), float("-inf"))
    return scores.softmax(-1)


def top_two(logits: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(argmax, largest, second largest) of each row of (n, vocab) logits; the argmax is the first
    index among exact ties, like torch.argmax (and generate()).

    Reduces blocks of `block` logits first: on a CPU, argmax and topk over a 150k vocabulary take
    milliseconds per row in bf16, which a draft of 16 rows pays at every step."""
    n, vocab = logits.shape
    if vocab % block or vocab < 2 * block:
        scores = logits.float()
        top = scores.topk(2, dim=-1).values
        return scores.argmax(-1), top[:, 0], top[:, 1]
    blocks = logits.view(n, vocab // block, block)
    block_max = blocks.amax(-1)  # (n, vocab / block)
    first = block_max.argmax(-1)  # the first block holding the maximum
    inside = blocks[torch.arange(n, device=logits.device), first]  # (n, block)
    best = first * block + inside.argmax(-1)
    top_inside = inside.float().topk(2, dim=-1).values
    # The runner-up is the second of the best block, or the best of another block.
    second = torch.maximum(top_inside[:, 1], block_max.float().topk(2, dim=-1).values[:, 1])
    return best, top_inside[:, 0], second


def _children(draft: Draft) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(draft.parents):
        kids.setdefault(p, []).append(i)
    return kids


def verify_greedy(draft: Draft, logits: torch.Tensor, tie_margin: float = 0.0,
                  best: list[int] | None = None) -> tuple[list[int], int | None]:
    """Accept the longest draft path that greedy decoding would have produced.

    logits: (n + 1, vocab); row 0 is the root, row i + 1 is draft node i.
    Returns (accepted node indices along the path, the target's argmax after the last of them).

    tie_margin: a row whose top two logits are closer than this is not trusted. A multi-token
    forward rounds differently from the one-token forwards of plain decoding (other kernels, other
    summation order), which can flip a near-tie. The path then stops before that row and the next
    token is None: the caller recomputes that position with a one-token forward.

    best: each row's argmax where the caller has it already (a batch takes all its rows' at once);
    only without a tie margin."""
    unsure = None
    if best is None or tie_margin > 0:
        best_t, first, second = top_two(logits)
        best = best_t.tolist()  # argmax, like generate(): the first index among exact ties
        if tie_margin > 0:
            unsure = (first - second < tie_margin).tolist()
    kids = None if draft.is_chain else _children(draft)
    path: list[int] = []
    row = 0
    while True:
        if unsure is not None and unsure[row]:
            return path, None
        if kids is None:  # chain: node `row` follows row `row`
            nxt = row if row < len(draft.tokens) and draft.tokens[row] == best[row] else None
        else:
            nxt = next((c for c in kids.get(path[-1] if path else -1, []) if draft.tokens[c] == best[row]), None)
        if nxt is None:
            return path, best[row]
        path.append(nxt)
        row = nxt + 1


def verify_sample(draft: Draft, logits: torch.Tensor, sampling: Sampling,
                  generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Lossless speculative sampling over a draft tree (recursive rejection sampling).

    At each node, its children are tried in order: child x (drafted from q, a one-hot q for a
    deterministic draft) is accepted with probability min(1, p(x) / q(x)); on rejection the target
    distribution becomes normalize(max(p - q, 0)) and the next child is tried. When no child is
    accepted, the next token is sampled from what remains. The result is distributed exactly as
    sampling from the target one token at a time.

    logits: (n + 1, vocab); row 0 is the root, row i + 1 is draft node i."""
    p_all = warp(logits, sampling)
    kids = _children(draft)
    path: list[int] = []
    row, node = 0, -1
    while True:
        p = p_all[row]
        for child in kids.get(node, []):
            x = draft.tokens[child]
            if draft.probs is None:
                q = torch.zeros_like(p)
                q[x] = 1.0
            else:
                q = draft.probs[child].to(p)
            u = torch.rand((), generator=generator, device=p.device)
            if q[x] > 0 and u * q[x] < p[x]:
                path.append(child)
                row, node = child + 1, child
                break
            residual = (p - q).clamp_min(0)
            total = residual.sum()
            # p <= q everywhere means p == q: rejection is then impossible, but guard rounding.
            p = residual / total if total > 0 else p
        else:
            return path, int(torch.multinomial(p, 1, generator=generator))


def tree_attention_mask(draft: Draft, past: int, extra: int = 0, device: torch.device | None = None) -> torch.Tensor:
    """Bool mask (True = attend) of shape (1, 1, extra + 1 + n, past + extra + 1 + n) for a forward over
    [extra plain tokens, root, draft nodes] after `past` cached tokens: plain tokens and the root
    attend causally; each node sees everything up to the root, its ancestors and itself."""
    n = len(draft)
    q = extra + 1 + n
    mask = torch.ones(q, past + q, dtype=torch.bool, device=device).tril(past)
    base = past + extra + 1  # column of node 0
    mask[extra + 1:, base:] = False
    for i, p in enumerate(draft.parents):
        row = extra + 1 + i
        mask[row, base + i] = True
        if p >= 0:
            mask[row, base:] |= mask[extra + 1 + p, base:]
    return mask[None, None]
