"""Linear layers in int8 (weights per output channel, activations per row) whose rows round alike
at every row count, for the `int8` backend (backend.py).

A bf16 matmul rounds some outputs according to the call's shape (exact_linear.py), so its exact
forms must compute draft rows as one-row calls would. Here the sums are integer sums: a row's
int8 activations times the int8 weights, summed exactly in int32, then
scaled elementwise (the weight's channel scale, then the row's scale and the bias). The kernel is
oneDNN's packed s8 matmul or ATen's `_int_mm`, whichever sums exactly and is fast here (`int8_kernel`,
once per process). Nothing in that depends on the other rows of the call, so a verify forward of any number of
rows, a prefill, or a batched engine step computes each row's projection bit for bit as a one-token
step does, in one call on weights packed once. And the int8 weights are half the bf16 bytes, so
a step streams less (docs/architecture-core.md, Measurements: int8 calls).

The numerics are not bf16's: greedy output is identical to this backend's own one-token greedy
decoding, not to bf16 greedy (docs/exactness.md). Each weight is quantized once, on first use, by
symmetric per-channel scales (absmax / 127); each row of activations when it is computed, by its
own absmax. `int8_runs` checks once per process that the kernel gives the exact integer sums at
every row count a forward uses. On CPUs without VNNI (AVX2 only) oneDNN sums u8 x s8 pairs in 16
bits with saturation (the s8 activations shifted to u8): 8-bit weights can overflow there, weights
of -64..64 cannot (2 x 255 x 64 < 2^15), so such a CPU gets weights of 7 bits and a sign
(`Int8Kernel.weight_max`), the activations keep their 8 bits (docs/exactness.md, int8 on AVX2).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch

from .exact_linear import PackedWeights
from .timing import timed_seconds

# Calls of fewer rows are zero-padded: the kernel is far slower on 1-2 rows than on 4
# (docs/architecture-core.md, Measurements: int8 short calls and quantization).
MIN_ROWS = 4
QUANTIZE_ROWS = 1024  # rows of a weight quantized at a time (fp32 temporaries of a few MB)
QMAX = 127  # symmetric int8: -127..127 (the kernel's s8 x s8 products fit int32 sums of any input width here)
REDUCED_WEIGHT_MAX = 64  # weights of -64..64 where 8-bit ones saturate (see the module docstring)
PAYS_RATIO = 1.5  # an int8 call of MIN_ROWS rows against a one-row float call (`_pays`)


class Int8Kernel(NamedTuple):
    """The int8 kernel a process uses: "onednn" or "aten" (`KERNELS`), and the weights' range."""

    name: str
    weight_max: int = QMAX

    @property
    def label(self) -> str:
        return "int8" if self.weight_max == QMAX else f"int8 (weights -{self.weight_max}..{self.weight_max}: no VNNI)"


class Int8Weights(PackedWeights):
    """The int8 form of each weight a backend's forwards use, made on first use and again when the
    weight changes (`exact_linear.PackedWeights`' cache, with `_quantized_weight` for the copy); and
    the last input quantized, since q, k and v (and gate and up) read the same hidden states. A
    backend owns one (`owned`): nothing is kept on the model."""

    def __init__(self, make: Callable | None = None, convert: Callable | None = None) -> None:
        """make: a weight -> its int8 form (default `_quantized_weight`); convert: rows (m, in) -> what
        the form's kernel takes of them (default `quantize_rows`; weight_int8.py: bf16 rows)."""
        super().__init__(make or _quantized_weight)
        self._convert = convert or quantize_rows
        self._last: tuple | None = None  # (the input, its version, its converted rows)

    def rows(self, x: torch.Tensor):
        """x (..., in) -> its rows converted (int8: int8 rows (m, in) and their fp32 scales (m, 1)),
        reused while x is the same unchanged tensor (q, k and v read one input)."""
        version = None if x.is_inference() else x._version  # inference tensors keep none
        last = self._last
        if last is not None and last[0] is x and last[1] == version:
            return last[2]
        rows = self._convert(x.reshape(-1, x.shape[-1]))
        self._last = (x, version, rows)
        return rows


class Int8Weight(NamedTuple):
    """A weight in int8 in `kernel`'s form (oneDNN: packed; ATen: (out, in) as it is), with its fp32
    channel scales and (zero) zero points."""

    packed: torch.Tensor
    scale: torch.Tensor
    zero_points: torch.Tensor
    kernel: str = "onednn"


def _quantized_weight(weight: torch.Tensor) -> Int8Weight:
    """In blocks of rows: whole-weight fp32 temporaries of a large output layer made the first int8
    forward slow (docs/architecture-core.md, Measurements: int8 short calls and quantization)."""
    kernel = int8_kernel() or Int8Kernel("onednn")
    q, scale = quantize_channels(weight, kernel.weight_max)
    return _packed(q, scale, kernel.name)


def quantize_channels(weight: torch.Tensor, top: int = QMAX,
                      scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (out, in) -> (int8 values, channel scales (out,) in `scale_dtype`): symmetric per
    channel, absmax / top, in blocks of QUANTIZE_ROWS rows (no whole-weight fp32 temporary)."""
    w = weight.detach()
    scale = (w.abs().amax(dim=1).float().clamp_(min=1e-12) / top).to(scale_dtype)  # a max is exact in any float dtype
    q = torch.empty(w.shape, dtype=torch.int8)
    for start in range(0, w.shape[0], QUANTIZE_ROWS):
        rows = slice(start, start + QUANTIZE_ROWS)
        block = w[rows].to(torch.float32, copy=True)  # a copy: scaled in place (an fp32 weight's rows are no copy)
        q[rows] = block.div_(scale[rows, None].float()).round_().clamp_(-top, top)  # integers: exact in int8
    return q, scale


def _packed(q: torch.Tensor, scale: torch.Tensor, kernel: str) -> Int8Weight:
    packed = torch.ops.onednn.qlinear_prepack(q, None) if kernel == "onednn" else q
    return Int8Weight(packed, scale, torch.zeros(q.shape[0], dtype=torch.long), kernel)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (m, in) -> (int8 rows, fp32 scales (m, 1)): each row by its own absmax, so a row's
    integers do not depend on the other rows of the call."""
    xf = x.to(torch.float32, copy=True)  # a copy: the rows are scaled in place below
    scale = xf.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12).div_(QMAX)
    return xf.div_(scale).round_().clamp_(-QMAX, QMAX).to(torch.int8), scale


def _int8_call(q: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """The int32 sums of q (m, in) x the packed weight, times each channel's scale: (m, out) fp32."""
    if weight.kernel == "aten":
        return torch._int_mm(q, weight.packed.t()).float().mul_(weight.scale)
    rows = q.shape[0]
    if rows < MIN_ROWS:  # zero rows change no other row's integer sums
        q = torch.cat([q, q.new_zeros(MIN_ROWS - rows, q.shape[1])])
    return torch.ops.onednn.qlinear_pointwise(q, 1.0, 0, weight.packed, weight.scale, weight.zero_points, None, 1.0, 0,
                                              torch.float32, "none", [], "")[:rows]


def int8_rows(layer: torch.nn.Linear, x: torch.Tensor, block: int, weights: Int8Weights) -> torch.Tensor:
    """x (1, rows, in) -> (1, rows, out) in x's dtype: every row in int8 (see the module docstring),
    in one call whatever `block` is (a prefill's rows round as any other row here)."""
    q, row_scale = weights.rows(x)
    y = _int8_call(q, weights(layer.weight)).mul_(row_scale)
    if layer.bias is not None:
        y += layer.bias
    return y.to(x.dtype)[None]


# The int8 kernels, in order of preference: oneDNN's s8 x s8 matmul on weights packed once (fast
# with AMX), ATen's `_int_mm` (oneDNN's s8 gemm; fast on avx512_vnni CPUs without AMX, where the
# first falls back to a reference kernel: docs/exactness.md, int8). Each with 8-bit weights first,
# then with REDUCED_WEIGHT_MAX where 8-bit ones saturate (CPUs without VNNI).
KERNELS = ("onednn", "aten")
CANDIDATES = tuple(Int8Kernel(k, top) for top in (QMAX, REDUCED_WEIGHT_MAX) for k in KERNELS)


@functools.cache
def int8_kernel() -> Int8Kernel | None:
    """The int8 kernel this process uses: the first of CANDIDATES that gives the exact integer sums
    here (`_sums_exactly`) and is fast (`_pays`), else the first that is exact, else None. Chosen
    once per process, before any weight is quantized."""
    fast = next((k for k in CANDIDATES if _pays(k.name) and _sums_exactly(k)), None)
    return fast or next((k for k in CANDIDATES if _sums_exactly(k)), None)


def int8_runs() -> bool:
    """Whether an int8 kernel gives the exact integer sums here (the `int8` backend runs)."""
    return int8_kernel() is not None


def int8_pays() -> bool:
    """Whether this process's int8 kernel is also fast here (the `fast` kind takes it)."""
    kernel = int8_kernel()
    return kernel is not None and _pays(kernel.name)


def _random_int8(out_features: int, in_features: int, top: int = QMAX, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-top, top + 1, (out_features, in_features), generator=gen, dtype=torch.int8)


@functools.cache
def _sums_exactly(kernel: Int8Kernel) -> bool:
    """Whether `kernel` gives the exact integer sums at 1..40 rows and at a prefill's row count:
    random integers, and rows and columns at the extremes of their ranges (where 16-bit pair sums
    saturate first), against float64 sums."""
    if kernel.name == "onednn" and not (torch.backends.mkldnn.is_available()
                                        and hasattr(torch.ops.onednn, "qlinear_pointwise")):
        return False
    top = kernel.weight_max
    try:
        w = _random_int8(160, 4864, top)  # wide enough for the kernel to block the input
        w[:8] = top
        w[8:16] = -top
        weight = _packed(w, torch.ones(160), kernel.name)
        x = _random_int8(300, 4864, QMAX, seed=1)
        x[:4] = QMAX
        x[4:8] = -QMAX
        exact = (x.double() @ w.double().T).float()
        return all(torch.equal(_int8_call(x[:m], weight), exact[:m]) for m in (*range(1, 41), 300))
    except (RuntimeError, NotImplementedError):  # no int8 kernel of that kind for this CPU
        return False


@functools.cache
def _pays(kernel: str) -> bool:
    """Whether `kernel` ("onednn" or "aten") is fast here: a call of MIN_ROWS rows on a 4864 x 896
    int8 weight takes at most PAYS_RATIO x a one-row `F.linear` call in bf16 or fp32 (the faster:
    a CPU without bf16 runs fp32 models), fastest of 10 alternated timings after a warm-up. Against
    one row, since that is what a decode step costs in the float forms (fp32 `F.linear` of a few
    rows repacks the weights on some CPUs and would flatter a slow int8 kernel). The margin keeps
    the choice, and so the numerics, the same in every process of a machine: a fast int8 kernel
    took 0.3-0.6x bf16 (AMX), a slow one 7x or more (AVX2-only EPYC; docs/exactness.md, int8)."""
    gen = torch.Generator().manual_seed(0)
    x, float_weight = torch.randn(MIN_ROWS, 896, generator=gen), torch.randn(4864, 896, generator=gen)
    floats = {dtype: (x[:1].to(dtype), float_weight.to(dtype)) for dtype in (torch.bfloat16, torch.float32)}
    try:
        q, weight = quantize_rows(x)[0], _packed(_random_int8(4864, 896), torch.ones(4864), kernel)
        calls = {"int8": lambda: _int8_call(q, weight),
                 **{str(d): (lambda d=d: torch.nn.functional.linear(*floats[d])) for d in floats}}
        times = timed_seconds(lambda name, _: calls[name], list(calls), [MIN_ROWS], reps=10)
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return min(times["int8"][MIN_ROWS]) <= PAYS_RATIO * min(min(times[str(d)][MIN_ROWS]) for d in floats)
