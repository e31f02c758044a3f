"""Linear layers with int8 weights and bf16 activations (ATen's `_weight_int8pack_mm`), for the
`weight-int8` backend (asked for by name: no default takes it; docs/exactness.md, weight-only int8).

Each weight is quantized once, on first use, by symmetric per-channel scales (absmax / 127, kept
in bf16 as the kernel takes them); a call's rows go in as bf16 and come out in bf16, each row's
sums in fp32 over the int8 weights converted on the fly. A decode step then streams a quarter of
an fp32 weight's bytes. What a drafting backend needs is that a row of a call of any row count
comes out bit for bit as its one-row call: the kernel computes each row with its own accumulators,
so nothing in a row depends on the other rows of its call; `weight_int8_runs` checks that once per
process, at 1..40 rows and at a prefill's row count, and the backend is refused where it fails. Greedy
output is then identical to this backend's own one-token greedy decoding (not to fp32 greedy:
the weights and activations are rounded; docs/exactness.md, weight-only int8).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from .int8_linear import Int8Weights, quantize_channels


class WeightInt8(NamedTuple):
    """A weight's int8 values (out, in) and its bf16 channel scales (out,)."""

    q: torch.Tensor
    scale: torch.Tensor


class WeightInt8Store(Int8Weights):
    """The int8 form of each weight a backend's forwards use (`quantized_weight`), and the last
    input cast to bf16 (`Int8Weights`' cache: q, k and v read one input). A backend owns one."""

    def __init__(self) -> None:
        super().__init__(quantized_weight, lambda rows: rows.to(torch.bfloat16))


def quantized_weight(weight: torch.Tensor) -> WeightInt8:
    return WeightInt8(*quantize_channels(weight, scale_dtype=torch.bfloat16))


def weight_int8_call(x: torch.Tensor, weight: WeightInt8) -> torch.Tensor:
    """x (m, in) in bf16 -> (m, out) in bf16: each row's sums over the int8 weight, times its scales."""
    return torch._weight_int8pack_mm(x, weight.q, weight.scale)


def weight_int8_rows(layer: torch.nn.Linear, x: torch.Tensor, block: int, store: WeightInt8Store) -> torch.Tensor:
    """x (1, rows, in) -> (1, rows, out) in x's dtype, every row as its one-row call, in one call
    whatever `block` is (a prefill's rows compute as any other row here)."""
    y = weight_int8_call(store.rows(x), store(layer.weight)).to(x.dtype)
    if layer.bias is not None:
        y += layer.bias
    return y[None]


@functools.cache
def weight_int8_runs() -> bool:
    """Whether the kernel runs here and computes every row of a call of 1..40 rows and of a
    prefill's row count bit for bit as its one-row call (random rows, a wide input, in any place
    of the call). Checked once per process."""
    gen = torch.Generator().manual_seed(0)
    try:
        weight = quantized_weight(torch.randn(160, 4864, generator=gen))
        x = torch.randn(300, 4864, generator=gen).to(torch.bfloat16)
        alone = torch.cat([weight_int8_call(x[i: i + 1], weight) for i in range(x.shape[0])])
        calls = [(0, m) for m in range(1, 41)] + [(0, 300), (5, 37), (101, 300)]
        return all(torch.equal(weight_int8_call(x[a:b], weight), alone[a:b]) for a, b in calls)
    except (RuntimeError, NotImplementedError, AttributeError):  # no such kernel in this torch or for this CPU
        return False
