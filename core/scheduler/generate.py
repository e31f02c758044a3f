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
from .engine import BatchEngine, EngineConfig
from .kv import CacheStore
from .sequence import Generation, GenerationStats, Request, SamplingParams, StepCallback, context_length, eos_end, eos_token_ids, turn_end_token
from ..speculation.draft_budget import DraftPolicy

__all__ = ["Generation", "GenerationStats", "StepCallback", "context_length", "eos_end", "eos_token_ids",
           "generate", "turn_end_token"]


@torch.inference_mode()
def generate(
    model,
    prompt: Sequence[int] | torch.Tensor,
    drafter: Drafter | None = None,
    params: SamplingParams | None = None,
    *,
    max_new_tokens: int | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    tokenizer=None,
    on_step: StepCallback | None = None,
    prefix_cache=None,
    policy: DraftPolicy | None = None,
    backend: Backend | None = None,
) -> Generation:
    """Decode from `prompt` (token ids, or a (1, T) tensor) with draft-then-verify.

    drafter: proposes drafts (None: plain decoding). params: what to generate (`SamplingParams`:
    greedy, which is exact, or lossless speculative sampling; stop strings need `tokenizer`);
    `max_new_tokens` alone is short for `SamplingParams(max_new_tokens)`. prefix_cache: an
    optional `PrefixCache` that reuses the KV of a shared prompt prefix. backend: how the forwards
    are computed (`core/model/backend.py`): choose it once per loaded model with
    `choose_backend(model)` and pass it to every call (None: chosen for this call, which packs a
    copy of the weights anew). policy: how drafts are sized and near-ties guarded (`DraftPolicy`;
    None: the backend's, `backend.policy`).
    """
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() > 2 or (prompt.dim() == 2 and prompt.shape[0] != 1):
            raise ValueError(f"one prompt at a time: expected (T,) or (1, T) token ids, got {tuple(prompt.shape)}")
        prompt = prompt.reshape(-1).tolist()
    if max_new_tokens is not None:
        if params is not None:
            raise ValueError("give max_new_tokens in params, or alone")
        params = SamplingParams(max_new_tokens)
    params = params or SamplingParams()
    # The prompt, the parameters and the tokenizer's presence are checked where the engine admits it.
    backend = backend or choose_backend(model)
    config = EngineConfig(1, backend=backend, draft_budget=False, policy=policy or backend.policy)
    engine = BatchEngine(model, config, eos_token_id=eos_token_id, tokenizer=tokenizer,
                         store=CacheStore(model, backend, prefix_cache))
    ((_, result),) = engine.run([Request(list(prompt), drafter, params, on_step=on_step)])
    if isinstance(result, Exception):
        raise result
    return result
