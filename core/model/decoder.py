"""Our own Llama/Qwen2 decoder: embedding, RMSNorm, rotary, GQA attention projections, SwiGLU MLP,
the layer loop and the output layer, in the order HF's modeling code computes them (so bit for bit
its numerics).

It is built from a loaded HF model (`Decoder.from_hf`) and shares its tensors (no copy): HF's model
stays as it is, for `generate()` and anything else that wants it. Each linear layer is a module
taking (x, block), x (1, rows, in) and `block` the leading rows that run as one prefill-like block
(the rest are draft rows; see core/kernels/exact_linear.py); `from_hf` takes the function that
makes them, so a backend chooses every projection's kernel once, when it builds its decoder. The
attention itself is the caller's (`attend`): a cache, a batch of slots and the exact row calls
each attend differently.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

# attend(layer index, q, k, v) -> the attention's output (1, rows, heads * dim); q (1, heads, rows,
# dim), k and v (1, kv_heads, rows, dim) after the rotary embedding
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Linear(nn.Module):
    """A plain linear layer on shared weights: `F.linear`, whatever the block."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor, block: int) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def plain(layer: nn.Linear) -> nn.Module:
    return Linear(layer.weight, layer.bias)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = weight, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """cos and sin of the default rotary embedding. inv_freq is HF's buffer, shared: after
    `model.to(bf16)` HF holds it in bf16, and the rounding must be the one its model uses."""

    def __init__(self, inv_freq: torch.Tensor) -> None:
        super().__init__()
        self.inv_freq = inv_freq

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.to(device=positions.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k (batch, heads, rows, dim) rotated, by the modeling code's operations in its order."""
    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class MLP(nn.Module):
    """SwiGLU; in blocks of `rows` rows where set (a long prefill's intermediates then stay in the
    CPU's caches): only for linear layers that compute every row alike in any call (int8's)."""

    def __init__(self, gate: nn.Module, up: nn.Module, down: nn.Module, rows: int | None = None) -> None:
        super().__init__()
        self.gate, self.up, self.down, self.rows = gate, up, down, rows

    def forward(self, h: torch.Tensor, block: int) -> torch.Tensor:
        if not self.rows or h.shape[1] <= self.rows:
            return self.down(F.silu(self.gate(h, block)) * self.up(h, block), block)
        return torch.cat([self(h[:, s: s + self.rows], block) for s in range(0, h.shape[1], self.rows)], dim=1)


class Layer(nn.Module):
    def __init__(self, index: int, input_norm: RMSNorm, q: nn.Module, k: nn.Module, v: nn.Module, o: nn.Module,
                 post_norm: RMSNorm, mlp: MLP, head_dim: int) -> None:
        super().__init__()
        self.index, self.head_dim = index, head_dim
        self.input_norm, self.q_proj, self.k_proj, self.v_proj, self.o_proj = input_norm, q, k, v, o
        self.post_norm, self.mlp = post_norm, mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend, block: int) -> torch.Tensor:
        h = self.input_norm(x)
        shape = (*h.shape[:-1], -1, self.head_dim)
        q = self.q_proj(h, block).view(shape).transpose(1, 2)
        k = self.k_proj(h, block).view(shape).transpose(1, 2)
        v = self.v_proj(h, block).view(shape).transpose(1, 2)
        q, k = rotary(q, k, cos, sin)
        x = x + self.o_proj(attend(self.index, q, k, v), block)
        return x + self.mlp(self.post_norm(x), block)


class Decoder(nn.Module):
    """The decoder's layers, final norm and output layer (`lm_head`, called with the block counted
    from the end: it may see only the last rows)."""

    def __init__(self, config, embed: torch.Tensor, rope: Rotary, layers: list[Layer], norm: RMSNorm,
                 lm_head: nn.Module) -> None:
        super().__init__()
        self.config, self.embed, self.rope = config, embed, rope
        self.layers, self.norm, self.lm_head = nn.ModuleList(layers), norm, lm_head
        self.head_dim = layers[0].head_dim
        self.scaling = self.head_dim ** -0.5
        self.kv_heads = config.num_key_value_heads

    @classmethod
    def from_hf(cls, model, linear: Callable[[nn.Linear], nn.Module] = plain, mlp_rows: int | None = None) -> Decoder:
        """The decoder of HF `model` (a forward.ARCHITECTURES model), on its tensors; `linear` makes
        each linear layer's module from HF's `nn.Linear`."""
        config, body = model.config, model.model
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        eps = config.rms_norm_eps
        layers = []
        for i, hf in enumerate(body.layers[: config.num_hidden_layers]):
            attn, mlp = hf.self_attn, hf.mlp
            layers.append(Layer(i, RMSNorm(hf.input_layernorm.weight, eps),
                                linear(attn.q_proj), linear(attn.k_proj), linear(attn.v_proj), linear(attn.o_proj),
                                RMSNorm(hf.post_attention_layernorm.weight, eps),
                                MLP(linear(mlp.gate_proj), linear(mlp.up_proj), linear(mlp.down_proj), mlp_rows),
                                head_dim))
        return cls(config, body.embed_tokens.weight, Rotary(body.rotary_emb.inv_freq), layers,
                   RMSNorm(body.norm.weight, eps), linear(model.lm_head))

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, attend: Attend, block: int) -> torch.Tensor:
        """ids, positions (1, T) -> the hidden states before the final norm (1, T, dim)."""
        x = F.embedding(ids, self.embed)
        cos, sin = self.rope(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, attend, block)
        return x
