"""The linear layers a backend puts into its decoder (core/model/decoder.py), chosen once when it
builds it, as gpt-fast swaps its int8 layers in.

Every one is called as layer(x, block): x (1, rows, in), `block` the leading rows that run as one
prefill-like call (the rest round as one-token steps where the form is exact; exact_linear.py).
- `Linear` (decoder.py): plain `F.linear`, what HF's model computes;
- `FormLinear`: one of the kernel forms (exact_linear.py's `bf16_rows`, `packed_rows`,
  `Fp32Forms`; int8_linear.py's `int8_rows`; weight_int8.py's `weight_int8_rows`) on `weights`,
  the backend's packed or int8 copies.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .exact_linear import PackedWeights

# form(layer, x, block, weights) -> y: a kernel form, reading layer.weight and layer.bias
Form = Callable[[nn.Module, torch.Tensor, int, PackedWeights | None], torch.Tensor]


class FormLinear(nn.Module):
    """A linear layer in a kernel form. `weights` is the backend's store of packed (or int8) copies:
    one store for all layers, since q, k and v share their int8 input rows (`Int8Weights.rows`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, form: Form,
                 weights: PackedWeights | None) -> None:
        super().__init__()
        self.weight, self.bias, self.form, self.weights = weight, bias, form, weights

    def forward(self, x: torch.Tensor, block: int) -> torch.Tensor:
        return self.form(self, x, block, self.weights)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, form={getattr(self.form, '__name__', self.form)}"
