"""Greedy's fp32 logits from a bf16 copy of the output layer, exact where they can matter.

In fp32 on the CPU a large-vocabulary output layer is a sizeable share of a forward's weights and
of its arithmetic per row (docs/architecture-core.md, Measurements: logit screen). Greedy
verification needs only each row's argmax and whether its top two are closer than the tie
margin. So `LogitScreen` scores the rows with a bf16 copy of the weights (half the bytes, AMX
arithmetic), bounds that score's error, and computes in fp32 only the tokens whose bound reaches
the best one's: every other token is more than `margin` below the best, by its bound, and keeps
its bf16 score. The argmax and the near-tie test of the result are those of the fp32 logits.

The bound: bf16 keeps 8 significant bits, so rounding h and w costs at most 2u|h_i||w_i| per
product (u = 2^-8), the fp32 sum of K exact products at most gamma_K sum|h_i w_i| (gamma_K ~ K 2^-24,
counted twice: the fp32 logits it stands for are rounded sums too), and the bf16 output u|score|.
sum|h_i||w_i| <= |h| |w| (Cauchy-Schwarz), with |w| the largest row norm of the weights.
In practice the bound is loose, and only a few tokens a row are computed again in fp32 (same
Measurements topic).
"""

from __future__ import annotations

import torch

from .exact_linear import packed_bf16_runs, weight_state

U_BF16 = 2.0 ** -8  # unit roundoff of bf16 (8 significant bits)
U_FP32 = 2.0 ** -24


class LogitScreen:
    """logits = screen(hidden, margin) for an output layer `weight` (vocab, dim) in fp32, no bias.
    Owned by the backend that uses it (`core.backend.Backend.screen`); its bf16 copy of the weight is
    made on first use, and again whenever the weight changes in place."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight, self.state = weight.detach(), None

    def _copy(self) -> None:
        """The bf16 copy of the weight (packed once where oneDNN runs bf16 calls on packed weights: a
        plain call repacks them every time) and the error bound per unit of |hidden|."""
        self.state = weight_state(self.weight)
        self.bf16 = self.weight.to(torch.bfloat16)
        self.packed = packed_bf16_runs()
        if self.packed:
            self.bf16 = torch.ops.mkldnn._reorder_linear_weight(self.bf16, 32)
        dim = self.weight.shape[1]
        gamma = dim * U_FP32 / (1 - dim * U_FP32)
        self.product_error = (2 * U_BF16 + U_BF16 ** 2 + 2 * gamma * (1 + U_BF16) ** 2) * float(self.weight.norm(dim=1).max())

    def bf16_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """(m, dim) -> (m, vocab) bf16 scores."""
        hidden = hidden.to(torch.bfloat16)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(hidden, self.bf16, None, "none", [], "")
        return torch.nn.functional.linear(hidden, self.bf16)  # fp32 sums too, slower

    def __call__(self, hidden: torch.Tensor, margin: float) -> torch.Tensor:
        """hidden (m, dim) fp32 -> (m, vocab) fp32 logits: exact (an fp32 dot product) for every
        token within `margin` of the best by the bound, the bf16 score elsewhere."""
        if self.state != weight_state(self.weight):
            self._copy()
        logits = self.bf16_scores(hidden).float()  # fp32 reductions run faster than bf16 ones
        best, low = logits.amax(dim=1, keepdim=True), logits.amin(dim=1, keepdim=True)
        bound = (self.product_error * hidden.norm(dim=1, keepdim=True)
                 + U_BF16 / (1 - U_BF16) * torch.maximum(best.abs(), low.abs()) + 1e-5)  # 1e-5: denormals
        # the best fp32 logit is >= best - bound; a token can reach within margin of it only if
        # its score + bound >= best - bound - margin
        rows, tokens = torch.nonzero(logits >= best - 2 * bound - margin, as_tuple=True)
        logits[rows, tokens] = (hidden[rows] * self.weight[tokens]).sum(dim=1)
        return logits
