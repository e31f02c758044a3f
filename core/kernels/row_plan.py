"""How one forward computes its rows: the plan a backend hands down the layer loop (forward.py).

The first `block` rows (the prompt, or a sequence's fresh tokens) run as one block, as a prefill
does; the other `total - block` (the draft nodes) each as a one-token decode step would. How is
the backend's: `linear`, a kernel form of exact_linear.py, on the backend's `packed` weights, and
`attention`, whether the attention runs the draft rows as one-row calls (exact_attention.py). The plan is data, passed to every
layer of one forward; nothing is looked up per call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from .exact_linear import PackedWeights


@dataclass
class RowPlan:
    """block, total: the forward's rows as above. linear: (layer, x, block, packed) -> y, the linear
    layers' form (None: plain F.linear). packed: the backend's `PackedWeights` (None: packed per
    call). attention: draft rows as one-row attention calls (False: one sdpa call for all rows).
    memo: what every layer of the forward would otherwise work out again. mlp_rows: the MLP runs
    in blocks of this many rows (None: all at once); only for a `linear` that computes every row
    as alone, whatever the call (int8's), since a block's rows are not the forward's last rows."""

    block: int
    total: int
    linear: Callable | None = None
    attention: bool = True
    packed: PackedWeights | None = None
    memo: dict = field(default_factory=dict)
    mlp_rows: int | None = None

    def project(self, layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """layer(x) for x (1, rows, in), the forward's last `rows` rows (all of them, except for the
        output layer, which sees only the rows whose logits are kept), in the plan's form."""
        if self.linear is None or layer.weight.device.type != "cpu" or x.dim() != 3 or x.shape[0] != 1:
            return F.linear(x, layer.weight, layer.bias)
        return self.linear(layer, x, self.block - (self.total - x.shape[1]), self.packed)
