"""The draft-then-verify decoding of one sequence, shared by every app.

Each step: the drafter proposes a token tree continuing the sequence; ONE forward pass of the target
over [last token, draft nodes] scores all of it; the longest path the target agrees with is kept,
plus the target's own next token; the KV cache is rolled back past everything else. With greedy
verification the output is token for token that of plain greedy decoding; with speculative sampling
it is distributed as plain sampling.

The loop is the engine's (`BatchEngine.run`, steps in `core/scheduler/sequence.py`) with one sequence in a
`CacheStore` (`core/scheduler/kv.py`): the model's own `DynamicCache`, each forward the model's backend's
(`core/model/backend.py`), so that every row rounds as plain decoding's and any architecture runs.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..model.backend import Backend, choose_backend
from ..speculation.draft import Drafter
from .engine import BatchEngine
from .kv import CacheStore
from .sequence import Generation, GenerationStats, Request, StepCallback, context_length, eos_end, eos_token_ids, turn_end_token
from ..speculation.verify import Sampling

__all__ = ["Generation", "GenerationStats", "StepCallback", "context_length", "eos_end", "eos_token_ids",
           "generate", "turn_end_token"]


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
    backend: Backend | None = None,
) -> Generation:
    """Decode from `prompt` (token ids, or a (1, T) tensor) with draft-then-verify.

    drafter: proposes drafts (None: plain decoding). sampling: None for greedy (exact), else
    lossless speculative sampling with `generator` as the source of randomness. stop_strings need
    `tokenizer`. prefix_cache: an optional `PrefixCache` that reuses the KV of a shared prompt prefix.
    backend: how the forwards are computed (`core/model/backend.py`): choose it once per loaded model
    with `choose_backend(model)` and pass it to every call (None: chosen for this call, which
    packs a copy of the weights anew). It sets the defaults of:
    tie_margin (greedy only; rows whose top two logits are closer are recomputed as plain decoding
    does), draft_sizes (a ladder of caps on draft nodes, see `SizeLadder`; () for none; where the
    backend measured its step costs and draft_sizes is not given, drafts are capped by
    `GoodputCap` instead) and prefill_draft (draft nodes verified in the prefill's forward).
    """
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() > 2 or (prompt.dim() == 2 and prompt.shape[0] != 1):
            raise ValueError(f"one prompt at a time: expected (T,) or (1, T) token ids, got {tuple(prompt.shape)}")
        prompt = prompt.reshape(-1).tolist()
    # The prompt and max_new_tokens are checked where the loop admits a request (`BatchEngine._admit`).
    if prefill_draft is not None and prefill_draft < 0:
        raise ValueError(f"prefill_draft must be >= 0, got {prefill_draft}")
    if tie_margin is not None and tie_margin < 0:
        raise ValueError(f"tie_margin must be >= 0, got {tie_margin}")
    if stop_strings and tokenizer is None:
        raise ValueError("stop_strings need the tokenizer")
    backend = backend or choose_backend(model)
    request = Request(list(prompt), drafter, max_new_tokens=max_new_tokens, sampling=sampling, generator=generator,
                      on_step=on_step, stop_strings=tuple(stop_strings), tokenizer=tokenizer,
                      tie_margin=backend.tie_margin if tie_margin is None else tie_margin,
                      draft_sizes=backend.draft_sizes if draft_sizes is None else tuple(draft_sizes),
                      prefill_draft=backend.prefill_draft if prefill_draft is None else prefill_draft,
                      draft_cost=backend.draft_cost if draft_sizes is None else None)
    engine = BatchEngine(model, 1, eos_token_id=eos_token_id, tokenizer=tokenizer, draft_budget=False,
                         store=CacheStore(model, backend, prefix_cache))
    ((_, result),) = engine.run([request])
    if isinstance(result, Exception):
        raise result
    return result
