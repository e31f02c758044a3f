"""One forward pass of a Llama-family decoder (Llama, Qwen2) without transformers' per-call machinery.

`generate()` makes a forward pass per step, each ~75-150 ms on 2 CPU cores, and transformers'
modeling code spends ~6% of that around the tensor ops: decorators on every layer and attention
call, mask building, output records (measured on Qwen2.5-0.5B in bf16, 1 and 17 rows alike). This
module calls the model's own submodules, attention implementation and rotary function in the
order the modeling code does, with the attention mask it would build, so its logits are bit for bit
those of `model(...)` (tested against it on tiny random and real models). Other architectures, and
eager attention, take `model(...)` (`supports`).
"""

from __future__ import annotations

import sys

import torch
from transformers import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .exact_attention import NAME as EXACT_ATTENTION

ARCHITECTURES = ("llama", "qwen2")


def supports(model) -> bool:
    """Whether `forward` computes exactly what this model's own forward does."""
    config = model.config
    rope = getattr(config, "rope_parameters", None) or {}
    return (config.model_type in ARCHITECTURES and not model.training
            and config._attn_implementation in ("sdpa", EXACT_ATTENTION)
            and rope.get("rope_type", "default") == "default"
            and all(t == "full_attention" for t in getattr(config, "layer_types", None) or ())
            and hasattr(sys.modules[type(model).__module__], "apply_rotary_pos_emb"))


def causal_mask(past: int, rows: int) -> torch.Tensor | None:
    """The mask the modeling code gives sdpa for `rows` new tokens after `past` cached ones: None
    where the kernel's own causal flag (or no mask) does the same, else (1, 1, rows, past + rows) bool."""
    if rows == 1 or past == 0:
        return None
    return (torch.arange(past + rows)[None, :] <= past + torch.arange(rows)[:, None])[None, None]


def forward(model, ids: torch.Tensor, cache: DynamicCache, position_ids: torch.Tensor,
            attention_mask: torch.Tensor | None, logits_to_keep: int, head=None) -> torch.Tensor:
    """ids, position_ids (1, T); attention_mask: a (1, 1, T, past + T) bool mask, or None for causal
    attention. Appends the T tokens' keys and values to `cache`; returns the logits of the last
    `logits_to_keep` rows, (logits_to_keep, vocab). head: computes the logits from the final
    hidden states (1, rows, dim) in place of `model.lm_head`."""
    body = model.model
    rotate = sys.modules[type(model).__module__].apply_rotary_pos_emb
    attend = ALL_ATTENTION_FUNCTIONS[model.config._attn_implementation]
    if attention_mask is None:
        attention_mask = causal_mask(cache.get_seq_length(), ids.shape[1])
    x = body.embed_tokens(ids)
    cos, sin = body.rotary_emb(x, position_ids)
    for layer in body.layers[: model.config.num_hidden_layers]:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        shape = (*h.shape[:-1], -1, attn.head_dim)
        q = attn.q_proj(h).view(shape).transpose(1, 2)
        k = attn.k_proj(h).view(shape).transpose(1, 2)
        v = attn.v_proj(h).view(shape).transpose(1, 2)
        q, k = rotate(q, k, cos, sin)
        k, v = cache.update(k, v, attn.layer_idx)
        out, _ = attend(attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling)
        x = x + attn.o_proj(out.reshape(*h.shape[:-1], -1).contiguous())
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return (head or model.lm_head)(body.norm(x)[:, -logits_to_keep:])[0]
