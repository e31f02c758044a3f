"""Linear layers that round every draft row exactly as one-token decoding does (bf16 on CPU).

The companion of exact_attention.py. A bf16 matmul rounds the last bit of some outputs according to
the number of rows in the call: a k-row verify call may round otherwise than a decode step's
one-row call, and so may a prefill's rows when draft rows follow them in the same call. Those last
bits drift into the KV cache and flip an exact tie of the logits now and then
(docs/architecture-core.md, Measurements: bf16 rounding by row count). So in a forward whose
block is n (the `block` each linear module is called with), the n block rows (a prefill) run as one call of their own, as `generate()`'s
prefill does, and the other rows in a form that rounds each row as a one-row call does.

Why calls round differently: oneDNN (AMX) may split the sum over a call's input dimension into
runs summed apart in fp32 (by threads, by cache blocks), according to the call's shape: a one-row
call of a wide down projection may sum its input in two or four runs apart, a plain multi-row call
in one run (docs/architecture-core.md, Measurements: split sums). `_split_sums` shows where a
call splits (inputs 2^24, 1, -2^24 in turn: the 1 survives only where it is summed apart from the
first 2^24). The forms, chosen per weight shape by a check on this machine's kernel (`_form`),
cheapest first:

- "packed": oneDNN calls on the weights packed once (`PackedWeights`, a second copy of them),
  where neither a one-row call nor a packed call of 1..PLAIN_ROWS rows splits the sum (typically
  every projection but the down projections, and the lm_head). Bit for bit a one-row
  `F.linear` at every row count, and cheaper: the plain call repacks the weights on every call.
  One-token steps take it too.
- "plain": `F.linear` in calls of up to PLAIN_ROWS rows (where no packed weights are at hand).
- "padded": `weight @ x.T` in calls of exactly `width` columns (zero-padded), the narrowest of
  PAD_WIDTHS whose calls split the input as the one-row call does (a wider one is not safe
  everywhere). Short calls go cheaper: `F.linear` of the rows laid out column-major splits the
  input as the one-row call does for 2..`short` rows (`_column_major_rows`), at about half the
  cost of the padded call (docs/architecture-core.md, Measurements: kernel forms per weight shape).
- "rows": one call per row, where nothing else passes (exact, slow).

Where a layer takes another form, its one-token steps still run on packed weights wherever a
one-row call there rounds as `F.linear`'s (`packed_one_row_is_plain`, checked per weight shape).
The `plain-packed` backend's draft rows run on packed weights too (`packed_rows`): cheaper than
plain calls, not exact.

Every form is also checked on random rows, and tested on real activations. The model's own layers
are never changed: HF's generate() computes as ever; only the owned decoder's modules (linear.py) call these forms.

In fp32 no form rounds draft rows bit for bit as one-row calls, and none needs to: rows differ
from plain calls by ~1e-6, and generate()'s tie guard redoes, as plain decoding computes them, the
rows where that could matter.
So in fp32 every row of generate()'s forwards takes the fastest kernel form for its row count
instead (`fp32_linear`), as measured for the model on this machine (`backend.fp32_forms`): torch's
own fp32 `F.linear` (MKL's where there is no bf16 hardware) packs the weights on every call, oneDNN
on weights packed once (`PackedWeights`) does not, and `weight @ x.T` of a few columns suits 2-4
rows on some CPUs; the ranking differs by CPU (docs/architecture-core.md, Measurements: fp32 kernel
forms).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
import weakref
from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F

PLAIN_ROWS = 32
PAD_WIDTHS = (33, 64, 96, 128, 192, 256)  # the padded widths `_form` tries, narrowest (cheapest) first


def bf16_rows(layer: torch.nn.Linear, x: torch.Tensor, block: int, packed: PackedWeights | None = None) -> torch.Tensor:
    """x (1, rows, in) -> (1, rows, out): the first `block` rows as one call (a prefill), the
    others each rounded as a one-row call (`one_row_rounding`, on `packed`'s weights)."""
    if x.shape[1] > 1 and block >= x.shape[1]:  # a prefill without draft rows
        return F.linear(x, layer.weight, layer.bias)
    if block <= 1:  # a one-token step, or a lone root token: a decode step like the draft rows
        return one_row_rounding(x[0], layer.weight, layer.bias, packed)[None]
    return torch.cat([F.linear(x[:, :block], layer.weight, layer.bias),
                      one_row_rounding(x[0, block:], layer.weight, layer.bias, packed)[None]], dim=1)


# The fp32 kernel forms: torch's `F.linear`, `weight @ x.T` in padded column calls (`fp32_rows`),
# oneDNN on packed weights. Which is fastest for a row count depends on the CPU and the model:
# `backend.fp32_forms` measures it. FP32_DEFAULT_FORMS is the ranking found on an AVX2-only CPU
# (docs/architecture-core.md, Measurements: fp32 kernel forms).
FP32_FORMS = ("plain", "columns", "packed")
FP32_ROW_BUCKETS = (1, 2, 4, 8, 16, 32)  # a forward of r rows takes the form of the first bucket >= r
FP32_DEFAULT_FORMS = ("packed", "columns", "columns", "packed", "packed", "packed")


def fp32_linear(layer: torch.nn.Linear, x: torch.Tensor, block: int, packed: PackedWeights | None = None,
                forms: tuple[str, ...] = FP32_DEFAULT_FORMS) -> torch.Tensor:
    """x (1, rows, in) -> (1, rows, out) in the form `forms` names for the row count (one per
    FP32_ROW_BUCKETS). Without oneDNN, "packed" is `F.linear` for one row or a prefill and
    "columns" for draft rows."""
    rows = x.shape[1]
    form = forms[next((i for i, b in enumerate(FP32_ROW_BUCKETS) if rows <= b), len(FP32_ROW_BUCKETS) - 1)]
    if form == "packed" and not ONEDNN:
        form = "plain" if rows == 1 or block >= rows else "columns"
    if form == "columns":
        return fp32_rows(x[0], layer.weight, layer.bias)[None]
    if form == "packed":
        return _packed_call(x, layer.weight, layer.bias, packed)
    return F.linear(x, layer.weight, layer.bias)


@dataclass(frozen=True)
class Fp32Forms:
    """`fp32_linear` with its `forms` fixed, as a value: two backends chosen alike compare equal."""
    forms: tuple[str, ...] = FP32_DEFAULT_FORMS

    def __call__(self, layer: torch.nn.Linear, x: torch.Tensor, block: int,
                 packed: PackedWeights | None = None) -> torch.Tensor:
        return fp32_linear(layer, x, block, packed, self.forms)


ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
PACK_ROWS = 32  # the row count oneDNN lays the packed weights out for (any count runs on them)


def weight_state(weight: torch.Tensor) -> tuple:
    """What tells a copy made from `weight` is stale: where its data is, how often it was changed
    in place, its dtype."""
    version = None if weight.is_inference() else weight._version  # inference tensors keep none
    return weight.data_ptr(), version, weight.dtype


class PackedWeights:
    """Weights packed for oneDNN (a second copy of each), made on first use and again whenever a
    weight changes. A backend owns one (backend.py) and gives it to the linear modules of
    its decoders (linear.py): the copies live as long as the backend, outside HF's model, so that
    copying or saving that model never meets the opaque tensors."""

    def __init__(self, make: Callable[[torch.Tensor], object] | None = None) -> None:
        # id(weight) -> (a weak reference to it, its weight_state, its copy). Nothing here keeps a
        # weight alive, and nothing on the weight keeps these copies alive: they go with the
        # backend (a finalizer on the weight would hold them as long as the model lives).
        self._by_weight: dict[int, tuple] = {}
        self._make = make or _pack  # weight -> its copy (int8_linear.Int8Weights: its int8 form)

    def __call__(self, weight: torch.Tensor):
        key = weight_state(weight)
        entry = self._by_weight.get(id(weight))
        if entry is None or entry[0]() is not weight or entry[1] != key:
            entry = self._by_weight[id(weight)] = (weakref.ref(weight), key, self._make(weight))
        return entry[2]

    def __len__(self) -> int:
        return len(self._by_weight)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def one_row_rounding(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     packed: PackedWeights | None = None) -> torch.Tensor:
    """x (m, in) -> (m, out): `F.linear` of each row alone, bit for bit, in as few calls as the
    kernel allows (`_form`); oneDNN calls on `packed`'s weights (None: packed for this call)."""
    form = _form(*weight.shape, bias is not None)
    if x.shape[0] == 1 and form.kind != "packed":  # the call of a decode step itself
        return _one_row_call(x, weight, bias, packed)
    if x.shape[0] <= form.short:
        return _column_major_call(x, weight, bias)
    if form.kind == "rows":
        return torch.cat([F.linear(x[i: i + 1], weight, bias) for i in range(x.shape[0])])
    return _in_calls(x, weight, bias, form, packed)


def short_call_rows(model: torch.nn.Module) -> int:
    """The most rows that every linear layer of `model` (bf16) rounds as one-row calls in
    one cheap call: PLAIN_ROWS, or fewer where a layer that otherwise needs padded columns (or one
    call per row) takes them column-major only up to its `short` rows."""
    shapes = {(*m.weight.shape, m.bias is not None) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    forms = [_form(*shape) for shape in shapes]
    return min([f.short for f in forms if f.short], default=PLAIN_ROWS)  # only those layers have a `short`


class _Form(NamedTuple):
    """How `one_row_rounding` computes a weight's rows: "packed" (oneDNN calls of at most
    PLAIN_ROWS rows on the weights packed once, `PackedWeights`), "plain" (`F.linear` in such
    calls), "padded" (`weight @ x.T` in calls of exactly `width` columns, zero-padded) or "rows"
    (one call per row); calls of 2..`short` rows take `_column_major_call` instead."""

    kind: str
    width: int = 0
    short: int = 0


def _in_calls(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, form: _Form,
              packed: PackedWeights | None = None) -> torch.Tensor:
    """x (m, in) -> (m, out) in `form` ("packed", "plain" or "padded")."""
    if form.kind == "padded":
        return _transposed_calls(x, weight, bias, lambda rows: form.width, form.width)
    call = functools.partial(_packed_call, packed=packed) if form.kind == "packed" else F.linear
    if x.shape[0] <= PLAIN_ROWS:
        return call(x, weight, bias)
    return torch.cat([call(rows, weight, bias) for rows in x.split(PLAIN_ROWS)])


def _packed_call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 packed: PackedWeights | None = None) -> torch.Tensor:
    """A oneDNN call on `packed`'s copy of `weight` (None: packed for this call alone, as the
    kernel checks do with their random weights)."""
    return torch.ops.mkldnn._linear_pointwise(x, _pack(weight) if packed is None else packed(weight), bias, "none", [], "")


def packed_rows(layer: torch.nn.Linear, x: torch.Tensor, block: int, packed: PackedWeights | None = None) -> torch.Tensor:
    """x (1, rows, in) -> (1, rows, out) for the `plain-packed` backend: the first `block` rows (a
    prefill) as one `F.linear` call, as plain decoding prefills; every other row on the weights
    packed once (`packed`), which skips the repacking of every plain call. A one-row step
    then rounds as plain decoding's (`_one_row_call`); draft rows round as neither, like the
    multi-row calls of plain verification."""
    weight, bias = layer.weight, layer.bias
    if x.shape[1] > 1 and block >= x.shape[1]:  # a prefill without draft rows
        return F.linear(x, weight, bias)
    if x.shape[1] == 1:
        return _one_row_call(x, weight, bias, packed)
    if block <= 1:  # a root token and its draft
        return _packed_call(x, weight, bias, packed)
    return torch.cat([F.linear(x[:, :block], weight, bias), _packed_call(x[:, block:], weight, bias, packed)], dim=1)


def _one_row_call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  packed: PackedWeights | None = None) -> torch.Tensor:
    """A one-row `F.linear` (a decode step's call), bit for bit, on the packed weights where they
    round it alike (`packed_one_row_is_plain`): about half the time of the plain call, which
    repacks the weights (docs/architecture-core.md, Measurements: one-row calls on packed
    weights)."""
    if packed_one_row_is_plain(*weight.shape, bias is not None):
        return _packed_call(x, weight, bias, packed)
    return F.linear(x, weight, bias)


@functools.cache
def packed_one_row_is_plain(out_features: int, in_features: int, bias: bool) -> bool:
    """Whether a one-row call on packed weights rounds bit for bit as a one-row `F.linear` for
    this weight shape: it splits the sum over the input alike (`_split_sums`) and gives the same
    bits on random rows. Checked once per shape (tens of ms; where it holds:
    docs/architecture-core.md, Measurements: kernel forms per weight shape)."""
    if not packed_bf16_runs():
        return False
    out_features = min(out_features, 8192)  # as `_form`: a wide lm_head is blocked alike
    if _split_sums(_packed_call, out_features, in_features, [1]) != _split_sums(F.linear, out_features, in_features, [1]):
        return False
    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(out_features, in_features, generator=gen) * in_features ** -0.5).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    rows = torch.randn(16, 1, in_features, generator=gen).bfloat16()
    return all(torch.equal(_packed_call(row, weight, b), F.linear(row, weight, b)) for row in rows)


def _column_major_call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` of x (m, in) laid out column-major: the kernel takes another path for it, one
    that splits the sum over the input as a one-row call does on some shapes (see `_form`)."""
    return F.linear(x.T.contiguous().T, weight, bias)


def fp32_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (m, in) -> (m, out): `weight @ x.T` in calls of 2, 4, 8, 16 or 32 columns (zero-padded),
    the fastest form of 2-4-row fp32 calls on the CPU (see the module docstring)."""
    return _transposed_calls(x, weight, bias, lambda rows: max(2, 1 << (rows - 1).bit_length()), 32)


def _transposed_calls(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      columns: Callable[[int], int], most: int) -> torch.Tensor:
    """x (m, in) -> (m, out) as `weight @ x.T`, `most` rows a call, each call zero-padded to
    `columns(rows)` columns."""
    calls = []
    for rows in x.split(most):
        width = columns(rows.shape[0])
        if width > rows.shape[0]:
            rows = _zero_padded(rows, width)
        if bias is None:
            calls.append(weight @ rows.T)
        else:
            calls.append(torch.addmm(bias[:, None].expand(-1, width), weight, rows.T))
    # Contiguous rows: a transposed result would pass its layout on through the elementwise ops
    # to the next layer's input, and `weight @ x.T` of a column-major x is much slower
    # (docs/architecture-core.md, Measurements: fp32 kernel forms).
    return (calls[0] if len(calls) == 1 else torch.cat(calls, dim=1)).T[: x.shape[0]].contiguous()


_pads = threading.local()  # per thread: generate() may run in several threads at once


def _zero_padded(rows: torch.Tensor, width: int) -> torch.Tensor:
    """rows (m, in) -> (width, in): rows, then zeros. A buffer kept per thread and shape, of
    which only the rows an earlier call wrote are zeroed again: a fresh zero-padded copy per call
    pays page faults on a new tensor (docs/architecture-core.md, Measurements: padded calls'
    buffer). Kept apart inside and outside inference mode: a buffer made inside is an inference
    tensor, which may not be written outside it."""
    m = rows.shape[0]
    buffers = _pads.__dict__.setdefault("buffers", {})
    key = (width, rows.shape[1], rows.dtype, rows.device, torch.is_inference_mode_enabled())
    buffer, used = buffers.get(key) or (rows.new_zeros(width, rows.shape[1]), 0)
    if used > m:
        buffer[m:used].zero_()
    buffer[:m] = rows
    buffers[key] = (buffer, m)
    return buffer


@functools.cache
def _form(out_features: int, in_features: int, bias: bool) -> _Form:
    """The cheapest way for `one_row_rounding` to round as one-row calls on this machine's kernel,
    for this weight shape: oneDNN calls on packed weights (where neither they nor a one-row call
    split the sum over the input, `_split_sums`), plain calls, the narrowest padded width of
    PAD_WIDTHS, else one call per row. Checked once on random rows (tens of ms); a wide output
    (an lm_head) is checked on its first 8192 features, which the kernel blocks alike."""
    gen = torch.Generator().manual_seed(0)
    out_features = min(out_features, 8192)
    weight = (torch.randn(out_features, in_features, generator=gen) * in_features ** -0.5).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    x = torch.randn(2 * PAD_WIDTHS[0], in_features, generator=gen).bfloat16()
    alone = torch.cat([F.linear(x[i: i + 1], weight, b) for i in range(x.shape[0])])
    forms = [_Form("plain"), *(_Form("padded", width) for width in PAD_WIDTHS)]
    every_count = range(1, PLAIN_ROWS + 1)  # every row count a packed call may take
    one_row = _split_sums(F.linear, out_features, in_features, [1])[0]  # where a decode step's call splits the sum
    if (packed_bf16_runs() and not one_row
            and not any(_split_sums(functools.partial(_packed_call, packed=PackedWeights()), out_features, in_features,
                                    every_count))):
        forms.insert(0, _Form("packed"))
    for form in forms:
        # else the row counts at which some forms were seen to round otherwise (module docstring)
        counts = every_count if form.kind == "packed" else (2, 9, 17, 32)
        packed = PackedWeights()  # the random weight packed once for all the counts
        if all(torch.equal(_in_calls(x[:m], weight, b, form, packed), alone[:m]) for m in (*counts, x.shape[0])):
            break
    else:
        form = _Form("rows")
    if form.kind in ("padded", "rows"):
        form = form._replace(short=_column_major_rows(weight, b, x, alone, one_row))
    return form


def _column_major_rows(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor, alone: torch.Tensor,
                       one_row: list[int]) -> int:
    """The most rows k <= PLAIN_ROWS such that `_column_major_call`s of 2..k rows split the sum
    over the input where a one-row `F.linear` does (`one_row`, from `_split_sums`) and round the
    random rows `x` as their one-row calls (`alone`); 0 where 2 rows do not
    (docs/architecture-core.md, Measurements: kernel forms per weight shape)."""
    out_features, in_features = weight.shape
    counts = range(2, PLAIN_ROWS + 1)
    short = 0
    for m, split in zip(counts, _split_sums(_column_major_call, out_features, in_features, counts)):
        if split != one_row or not torch.equal(_column_major_call(x[:m], weight, bias), alone[:m]):
            break
        short = m
    return short


@functools.cache
def packed_bf16_runs() -> bool:
    """Whether oneDNN runs bf16 calls on packed weights here (torch refuses them on a CPU without
    avx512 or avx_ne_convert, e.g. AVX2-only)."""
    if not ONEDNN:
        return False
    x, weight = torch.ones(2, 64, dtype=torch.bfloat16), torch.ones(8, 64, dtype=torch.bfloat16)
    try:
        return torch.equal(_packed_call(x, weight, None), F.linear(x, weight))
    except RuntimeError:
        return False


BIG = 2.0 ** 24  # 2^24 + 1 rounds back to 2^24 in fp32


def _split_sums(call: Callable, out_features: int, in_features: int, counts: Sequence[int]) -> list[list[int]]:
    """For calls of each row count in `counts`: where `call` (x (rows, in), weight (out, in), bias ->
    (rows, out), bf16) starts a separate running sum over the input dimension (multiples of 32; []
    for one sum), as the kernel may split it (by threads or cache blocks) according to the call's
    shape. Each output feature probes one position p on inputs of ones: weights 2^24 at p - 32, 1
    at p, -2^24 at p + 32; the 1 survives only where the sum that holds it does not hold the 2^24
    before it. One probe weight for all counts (packed once where `call` keeps a `PackedWeights`)."""
    positions = list(range(32, in_features - 32, 32))[:out_features]
    if not positions:
        return [[] for _ in counts]
    weight = torch.zeros(out_features, in_features, dtype=torch.bfloat16)
    n = torch.arange(len(positions))
    p = torch.tensor(positions)
    weight[n, p - 32], weight[n, p], weight[n, p + 32] = BIG, 1.0, -BIG
    splits = []
    for rows in counts:
        y = call(torch.ones(rows, in_features, dtype=torch.bfloat16), weight, None)[:, : len(positions)]
        splits.append([q for q, survived in zip(positions, (y != 0).any(0).tolist()) if survived])
    return splits
