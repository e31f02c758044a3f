"""How a loaded model's forwards are computed, and the decoding policy that follows from it.

One `Backend` per loaded model, chosen once (`choose_backend`) by whoever loaded it and passed to
`generate()` and the engine; nothing is kept on the model. Each kind owns its forward (`forward`),
its decoders of the model (decoder.py: its linear layers swapped for the kind's kernel forms,
`module`), the packed copies of the weights those forms run on (`packed`), and its policy: the tie
margin of greedy verification, the draft size ladder, the draft verified in the prefill, and
whether a prefix cache is lossless.

- `exact-bf16` (bf16 on the CPU): draft rows round bit for bit as one-token decode steps
  (exact_attention.py, exact_linear.py's `bf16_rows`): no tie guard, output identical to greedy.
- `fp32-cpu`: every row on the fastest fp32 kernel form for its row count (exact_linear.py's
  `fp32_linear`; measured once per machine and model by `fp32_forms`), attention in one call;
  rows differ from plain decoding by ~1e-6, so a near-tie (top two logits within 1e-3) is redone
  as plain decoding computes it; drafts capped by their expected tokens per second under the
  measured costs (`GoodputCap`); where it pays (`fp32_backend`), greedy's logits from a bf16
  copy of the output layer, exact where they can matter (logit_screen.py).
- `plain` (CUDA, fp16, or bf16 where the exact forms cost too much): the model's own multi-row
  forward, as HF's prompt lookup verifies; a tie guard in fp32 only (see PLAIN_TIE_MARGIN).
- `plain-packed` (bf16 on the CPU): `plain`, with the draft rows and one-token steps on weights
  packed once (exact_linear.py's `packed_rows`); the prefill and one-token steps round as plain
  decoding's, draft rows as neither (as `plain`'s do).
- `int8`: every linear layer in int8, weights per channel and activations per row
  (int8_linear.py); integer sums make every row of any call round as a one-token step's, so
  output is identical to int8 greedy decoding, and the weights stream half the bytes of bf16.
  Chosen by "fast" (the apps' default) where it runs and is fast; "auto" keeps the model's own numerics.
- `weight-int8`: every linear layer with int8 weights and fp32 activations (weight_int8.py, our
  AVX2 kernel); each row computes alike in any call too, so output is identical to this backend's
  own greedy decoding. Chosen by "fast" for an fp32 model where int8 is not (AVX2-only CPUs) and
  its verify forwards of 1 to 4 rows cost less than fp32-cpu's (`weight_int8_if_it_pays`): it streams a
  quarter of fp32's bytes, but its rows cost more with every row of a call (docs/exactness.md,
  weight-only int8).

Whatever the kind chosen for a bf16 model on the CPU, the batched engine computes every row of
its forwards on packed weights where oneDNN runs on them (`engine_linear`): batched rows round as
no one-token step does anyway, and a plain call repacks the weights every time.

In bf16 on the CPU the exact forms are used only where they are affordable: `choose_backend`
times one verify forward of the row counts a copy draft uses in each form (once per machine,
model and dtype; kept on disk) and takes the cheaper of `plain` and `plain-packed` when the exact
one costs over EXACT_OVERHEAD more than `plain`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from torch import nn
from transformers import DynamicCache

from .calibration import calibrated, forward_times
from ..speculation.draft import Draft
from ..speculation.draft_budget import DraftPolicy, StepCost, cost_file
from . import forward as llama
from ..kernels.exact_linear import (FP32_FORMS, Fp32Forms, FP32_ROW_BUCKETS, PLAIN_ROWS, PackedWeights, bf16_rows,
                                    fp32_linear, packed_bf16_runs, packed_rows, short_call_rows)
from ..kernels.int8_linear import Int8Weights, int8_kernel, int8_pays, int8_rows, int8_runs
from ..kernels.logit_screen import LogitScreen
from ..kernels.weight_int8 import KERNEL_VERSION as WEIGHT_INT8_KERNEL, WeightInt8Store, weight_int8_rows, weight_int8_runs
from ..kernels.linear import FormLinear
from .decoder import Decoder, Linear
from ..speculation.verify import tree_attention_mask

# fp32 on the CPU a verify step costs more with every few rows, so drafts climb a ladder filling
# 4, 8, 16, 32 rows (long copies still draft long). Only the fallback where no step costs were
# measured: fp32-cpu caps drafts by `GoodputCap` on its measured costs
# (docs/architecture-core.md, Measurements: fp32 draft ladder).
FP32_CPU_DRAFT_SIZES = (3, 7, 15, 31)

# fp32 on the CPU a prefill is compute-bound, so a few more rows cost little: the prefill verifies a
# draft of up to this many nodes too (docs/architecture-core.md, Measurements: fp32 prefill draft).
FP32_CPU_PREFILL_DRAFT = 16

# The exact bf16 forms are kept while forwards in them cost at most this much more than plain ones,
# summed over AFFORDABILITY_ROWS rows: a one-token step (cheaper in the exact forms, on packed
# weights) and what a copy draft verifies.
EXACT_OVERHEAD = 0.15
AFFORDABILITY_ROWS = (1, 9, 17)
# What that measurement is kept on disk as; versioned, so that a change to the forms it times makes
# older timings stale (docs/architecture-core.md, Measurements: cost file versions).
EXACT_VS_PLAIN = "exact-vs-plain v4"

KINDS = ("fast", "auto", "exact", "plain", "int8", "weight-int8")


@dataclass(frozen=True)
class Backend:
    """How the forwards of `generate()` are computed for one model, and the policy that follows.

    name: "exact-bf16", "fp32-cpu" or "plain". linear: how the linear layers compute a verify
    forward's rows (see exact_linear.py); None with `exact_rows` off. exact_rows: draft rows run
    as one-token steps would (exact_attention.py). tie_margin: greedy only; a row whose top two
    logits are closer is not trusted and is redone as plain decoding computes it.
    draft_sizes: a ladder of caps on draft nodes (`SizeLadder`; () for none). draft_cost: measured
    seconds of a verify forward by row count; with it drafts are capped by `GoodputCap` instead.
    prefill_draft: draft nodes verified along with the prompt. plain_steps: prefill and one-token
    steps compute as plain decoding's do. lossless_prefix_cache: a prefix cache leaves the output
    unchanged. exact_attention: with `exact_rows`, the attention rounds draft rows as one-token
    steps too (else one sdpa call). screen: greedy forwards take their logits from this bf16
    screen of the model's output layer (logit_screen.py; None: from the layer). engine_linear: the
    form of every row of the batched engine's forwards (`packed_rows`: on the packed weights);
    None: all rows as one block in `linear`'s form (a prefill's). mlp_rows: a long forward's MLP
    runs in blocks of this many rows (decoder.py's `MLP`; only where rows compute alike in any
    call). packed: the weights packed for oneDNN that `linear` runs on, this backend's own
    (`owned`; None in the kinds below, which are templates: their calls would pack the weights
    every time).
    """

    name: str
    linear: Callable | None
    exact_rows: bool
    tie_margin: float
    draft_sizes: tuple[int, ...] = ()
    prefill_draft: int = 0
    plain_steps: bool = True
    lossless_prefix_cache: bool = False
    draft_cost: StepCost | None = None
    exact_attention: bool = True
    screen: LogitScreen | None = field(default=None, compare=False, repr=False)
    engine_linear: Callable | None = None
    mlp_rows: int | None = None
    packed: PackedWeights | None = field(default=None, compare=False, repr=False)
    store: Callable = field(default=PackedWeights, compare=False, repr=False)
    kernel: str = ""  # the version of our own kernel it runs (weight_int8.c), "" where it runs ATen's
    # Set by `loaded`. A copy changed by `replace` may carry them over; `decoders` uses them only
    # while they were built in this backend's forms (`Decoders.forms`), else builds its own.
    loaded_decoders: Decoders | None = field(default=None, compare=False, repr=False)

    def owned(self) -> Backend:
        """This backend with a `store` of its own (`packed`: the weights in the form its kernels
        run on), made as its forwards need them; itself where it has one."""
        if self.packed is not None or (self.linear is None and self.engine_linear is None):
            return self
        return replace(self, packed=self.store())

    @property
    def cost_key(self) -> str:
        """What its measured step costs are kept on disk under: the name, with the version of our own
        kernel where it runs one (a changed kernel makes the costs timed on the old one stale)."""
        return f"{self.name} {self.kernel}" if self.kernel else self.name

    @property
    def policy(self) -> DraftPolicy:
        """The draft policy of `generate()` on this backend."""
        return DraftPolicy(self.tie_margin, self.draft_sizes, self.prefill_draft, self.draft_cost)

    @property
    def label(self) -> str:
        """The name, with int8's weight range where it is reduced and the logit screen where it is on
        (for reports)."""
        kernel = int8_kernel() if self.name == "int8" else None
        return (kernel.label if kernel else self.name) + (" + logit screen" if self.screen is not None else "")

    def module(self, layer: nn.Linear, engine: bool = False) -> nn.Module:
        """HF's `layer` as this backend's decoder computes it: in the form of its one-sequence
        forwards, or with `engine` of the batched engine's; plain where it has none (or off the CPU)."""
        form = self.linear if self.exact_rows else None
        if engine and self.engine_linear is not None:
            form = self.engine_linear
        if form is None or layer.weight.device.type != "cpu":
            return Linear(layer.weight, layer.bias)
        return FormLinear(layer.weight, layer.bias, form, self.packed)

    def decoder(self, model, engine: bool = False) -> Decoder:
        """The owned decoder of `model` whose linear layers are this backend's modules (`module`)."""
        return Decoder.from_hf(model, functools.partial(self.module, engine=engine),
                               self.mlp_rows if self.exact_rows else None)

    def forms(self) -> tuple:
        """What the modules of this backend's decoders are made of (`module`, `decoder`)."""
        return self.exact_rows, self.linear, self.engine_linear, id(self.packed), self.mlp_rows

    def loaded(self, model) -> Backend:
        """This backend (`owned`) with its decoders of `model` built once (`decoders`), where the
        owned decoder runs it (`forward.supports`)."""
        backend = self.owned()
        if not llama.supports(model) or backend._kept(model) is not None:
            return backend
        return replace(backend, loaded_decoders=Decoders(model, backend.decoder(model), backend.decoder(model, engine=True),
                                                         backend.forms()))

    def decoders(self, model) -> Decoders:
        """The decoders of `model` in this backend's forms: the ones built by `loaded`, else made now
        (a backend not chosen for this model, as tests make them: their modules are a few
        wrappers around the model's tensors)."""
        return self._kept(model) or Decoders(model, self.decoder(model), self.decoder(model, engine=True), self.forms())

    def _kept(self, model) -> Decoders | None:
        kept = self.loaded_decoders
        return kept if kept is not None and kept.model is model and kept.forms == self.forms() else None

    def forward(self, model, fresh: list[int], cache: DynamicCache, past: int, draft: Draft | None,
                greedy_margin: float | None = None) -> torch.Tensor:
        """One target forward over [fresh tokens..., draft nodes...] after `past` cached tokens.
        Returns (1 + len(draft), vocab) logits: row 0 for the last fresh token (the root), then
        one per node. greedy_margin: the logits serve greedy verification with this tie margin
        only (their argmax and near-ties), so a backend with a `screen` may screen them."""
        n = len(draft) if draft else 0
        ids = torch.tensor([fresh + (draft.tokens if draft else [])], device=model.device)
        positions, mask = None, None  # a chain needs no mask: plain causal attention
        if draft is not None and not draft.is_chain:
            root = past + len(fresh) - 1
            positions = torch.tensor([list(range(past, root + 1)) + [root + d for d in draft.depths]],
                                     device=model.device)
            mask = tree_attention_mask(draft, past, len(fresh) - 1, model.device)
            if model.config._attn_implementation == "eager":
                mask = torch.zeros(mask.shape, dtype=model.dtype, device=model.device).masked_fill(
                    ~mask, torch.finfo(model.dtype).min)
        if llama.supports(model):
            if positions is None:
                positions = torch.arange(past, past + ids.shape[1], device=model.device)[None]
            head = None
            if self.screen is not None and greedy_margin is not None:
                head = lambda hidden: self.screen(hidden[0], greedy_margin)[None]  # noqa: E731
            return llama.cache_forward(self.decoders(model).one, ids, cache, positions, mask, n + 1, len(fresh),
                                       exact=self.exact_rows and self.exact_attention, head=head)
        # other architectures: the model's own forward (their backend is `plain`, see choose_backend)
        extra = {} if mask is None else {"position_ids": positions, "attention_mask": mask}
        return model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=n + 1, **extra).logits[0]


@dataclass(frozen=True)
class Decoders:
    """A backend's decoders of one HF model: `one` for one-sequence forwards (`linear`'s forms),
    `engine` for the batched engine's (`engine_linear`'s); the same modules' tensors, HF's. forms:
    the backend's `forms()` they were built in."""

    model: nn.Module
    one: Decoder
    engine: Decoder
    forms: tuple = ()


# exact-bf16: every row rounds bit for bit as in a one-token step, so no tie guard is needed
# (docs/architecture-core.md, Measurements: tie margins).
# Its drafts are capped at PLAIN_ROWS - 1 nodes: with the root, every layer then verifies them in one
# call; more rows take two (a second pass over the weights; docs/architecture-core.md,
# Measurements: exact-bf16's draft cap).
EXACT_BF16 = Backend("exact-bf16", bf16_rows, exact_rows=True, tie_margin=0.0, draft_sizes=(PLAIN_ROWS - 1,))
# Where a layer rounds as one-row calls in cheap column-major calls only up to fewer rows
# (`exact_linear.short_call_rows`), drafts are capped to fit them, down to this many rows (the
# replay that chose it: docs/architecture-core.md, Measurements: `MIN_SHORT_CALL_ROWS`).
MIN_SHORT_CALL_ROWS = 12
# fp32-cpu's attention runs all rows in one sdpa call: one call per draft row rounds no closer to
# plain decoding while the linear layers differ from it anyway (tie guard), and cost more.
# Its rows differ slightly from plain decoding's, so its tie margin is set well above that
# drift (docs/architecture-core.md, Measurements: tie margins; fp32-cpu's attention in one call).
FP32_CPU = Backend("fp32-cpu", fp32_linear, exact_rows=True, tie_margin=1e-3, draft_sizes=FP32_CPU_DRAFT_SIZES,
                   prefill_draft=FP32_CPU_PREFILL_DRAFT, plain_steps=False, lossless_prefix_cache=True,
                   exact_attention=False)
# A redone row inherits KV that multi-row calls wrote. In fp32 that drift is ~1e-6, so redoing rows
# within 1e-3 settles near-ties as plain decoding does. In bf16 it is not: the drift is far larger,
# and a guard made decoding slower without bringing it closer to greedy, so bf16 has none
# (docs/architecture-core.md, Measurements: tie margins).
# int8: every linear layer, the output layer included, in int8 with per-row activation scales
# (int8_linear.py). Its integer sums make every row of any call round as a one-token step's, so
# prefill, draft and batched rows all take one call on the packed int8 weights, and greedy output
# is identical to this backend's own one-token greedy decoding (not to bf16 greedy's). The
# attention stays in the model's dtype, draft rows as one-row calls (exact_attention.py). A prefix
# cache is lossless: the linear rows do not depend on the call, and the attention of a block after
# cached keys rounds as the whole prompt's prefill (exact_attention.py's `_prefill_block`).
# Its rows compute alike in any call, so a long prefill's MLP runs in blocks of INT8_MLP_ROWS rows,
# whose intermediates stay in the CPU's caches (docs/exactness.md, int8: MLP blocks).
INT8_MLP_ROWS = 256
INT8 = Backend("int8", int8_rows, exact_rows=True, tie_margin=0.0, draft_sizes=(PLAIN_ROWS - 1,),
               lossless_prefix_cache=True, engine_linear=int8_rows, mlp_rows=INT8_MLP_ROWS, store=Int8Weights)
# weight-int8: as int8 (rows alike in any call, attention draft rows as one-row calls, prefix cache
# lossless, MLP in blocks), with int8 weights and fp32 activations (weight_int8.py). A row costs
# more with every row of a call here, so drafts are capped on its measured costs (`GoodputCap`).
WEIGHT_INT8 = replace(INT8, name="weight-int8", linear=weight_int8_rows, engine_linear=weight_int8_rows,
                      store=WeightInt8Store, kernel=WEIGHT_INT8_KERNEL)
PLAIN = Backend("plain", None, exact_rows=False, tie_margin=0.0)
PLAIN_TIE_MARGIN = {torch.float32: 1e-3}
# plain-packed: where the exact forms cost too much (e.g. without AMX), plain calls still repack the
# weights every time, so draft rows and one-token steps run on weights packed once: faster, no
# further from greedy. The batched engine's rows round otherwise than greedy's anyway (batched
# rows), so they all take the packed weights (docs/architecture-core.md, Measurements:
# plain-packed).
PLAIN_PACKED = Backend("plain-packed", packed_rows, exact_rows=True, tie_margin=0.0, exact_attention=False,
                       engine_linear=packed_rows)


def plain_backend(dtype: torch.dtype) -> Backend:
    """`plain` with the tie margin of `dtype` (none in bf16/fp16); in fp32 a prefix cache stays lossless."""
    return replace(PLAIN, tie_margin=PLAIN_TIE_MARGIN.get(dtype, 0.0), lossless_prefix_cache=dtype == torch.float32)


def plain_forms(dtype: torch.dtype) -> list[Backend]:
    """The plain backends a model of forward.py's architectures can run on the CPU in `dtype`:
    `plain`, and in bf16 `plain-packed` where oneDNN runs bf16 calls on packed weights."""
    return [plain_backend(dtype)] + ([PLAIN_PACKED] if dtype == torch.bfloat16 and packed_bf16_runs() else [])


def choose_backend(model, kind: str = "auto") -> Backend:
    """The backend for `model`: kind "exact" (the exact form for its dtype where one exists),
    "plain", "auto" (exact where affordable, see the module docstring), "int8", "weight-int8", or
    "fast" (int8 where it runs on this CPU and model and its kernel is fast here, `int8_pays`; else
    weight-int8 where it pays, `weight_int8_if_it_pays`; else "auto"). Choose once per loaded
    model and pass it on: the measurements it rests on are read from disk, but its packed weights
    and logit screen are made anew for each backend, and so are its decoders of the model."""
    return _choose(model, kind).loaded(model)


def requested_kind(int8: bool, exact: bool, default: str) -> str:
    """The kind a command's flags ask for: --int8, else --exact, else the app's default."""
    return "int8" if int8 else "exact" if exact else default


def _choose(model, kind: str) -> Backend:
    if kind not in KINDS:
        raise ValueError(f"unknown backend {kind!r}; use one of {', '.join(KINDS)}")
    cpu = model.device.type == "cpu"
    if kind == "fast":
        kind = "int8" if int8_pays() and integer_fits(model, "int8") else "auto"
        if kind == "auto" and (backend := weight_int8_if_it_pays(model)) is not None:
            return backend
    if kind in INTEGER_KINDS:
        if not integer_fits(model, kind):
            raise ValueError(f"the {kind} backend needs a Llama-family model (Llama, Qwen2) in bf16 or fp32 on a CPU "
                             f"where its kernel {INTEGER_KINDS[kind][1]}")
        return _integer_backend(model, kind)
    if kind == "plain" or not cpu or not llama.supports(model) or model.dtype not in (torch.bfloat16, torch.float32):
        return plain_backend(model.dtype)
    if model.dtype == torch.float32:
        return fp32_backend(model)
    backend = _bf16_backend(model, kind)
    # The batched engine's rows round as no one-token step does anyway (batched rows, see engine.py),
    # so where oneDNN runs on packed weights they all take them, whatever the one-sequence forms:
    # a plain call repacks the weights every time (docs/architecture-core.md, Measurements: engine rows
    # on packed weights).
    return replace(backend, engine_linear=packed_rows) if packed_bf16_runs() else backend


# The integer kinds: their backend, and what their kernel must do on this CPU (checked once per process).
INTEGER_KINDS = {"int8": (INT8, "sums exactly"), "weight-int8": (WEIGHT_INT8, "computes each row as its one-row call")}


def integer_fits(model, kind: str = "int8") -> bool:
    """Whether the `kind` backend ("int8" or "weight-int8") runs `model`: forward.py's architectures
    in bf16 or fp32 on a CPU where its kernel is exact (`int8_runs`, `weight_int8_runs`)."""
    runs = int8_runs if kind == "int8" else weight_int8_runs
    return (model.device.type == "cpu" and llama.supports(model)
            and model.dtype in (torch.bfloat16, torch.float32) and runs())


# The row counts of one-sequence decoding's usual verify forwards (a token and short drafts).
WEIGHT_INT8_PAYS_ROWS = (1, 2, 4)


def weight_int8_if_it_pays(model) -> Backend | None:
    """weight-int8 for an fp32 model where it runs (`integer_fits`) and its verify forwards of each
    of WEIGHT_INT8_PAYS_ROWS rows cost less than fp32-cpu's (both measured once per machine and
    model, kept on disk); else None. Only fp32 models: a bf16 one is on a CPU with bf16 kernels,
    where int8 or the bf16 forms are the fast ones."""
    if model.dtype != torch.float32 or not integer_fits(model, "weight-int8"):
        return None
    backend, fp32 = _integer_backend(model, "weight-int8"), fp32_step_cost(model)
    return backend if all(backend.draft_cost(rows) < fp32(rows) for rows in WEIGHT_INT8_PAYS_ROWS) else None


def _integer_backend(model, kind: str) -> Backend:
    """The `kind` integer backend with its own store (its costs are measured on its own quantized
    weights: quantized once), its drafts capped on those costs."""
    backend = INTEGER_KINDS[kind][0].owned()
    return replace(backend, draft_cost=integer_step_cost(model, backend))


def _bf16_backend(model, kind: str) -> Backend:
    costs = None if kind == "exact" else bf16_form_costs(model)
    if costs is None or _exact_within_overhead(costs):
        rows = short_call_rows(model)
        return replace(EXACT_BF16, draft_sizes=(rows - 1,)) if MIN_SHORT_CALL_ROWS <= rows < PLAIN_ROWS else EXACT_BF16
    if costs.get(PLAIN_PACKED.name, float("inf")) < costs[PLAIN.name]:
        return PLAIN_PACKED
    return plain_backend(model.dtype)


def _measured(model, measure: str, backends: list[Backend], rows: list[int]) -> dict[str, dict[int, float]]:
    """`forward_times` of `backends` (reps 2, alternating): {name: {rows: s}}, each backend's kept
    on disk as a `StepCost` per machine and model (`cost_file` of `measure`), checked and re-timed
    as `calibration.calibrated` says."""
    paths = {b.name: cost_file(model, measure=f"{measure}:{b.cost_key}") for b in backends}
    owned = {b.name: b.loaded(model) for b in backends}  # their packed copies and decoders go with them

    costs = calibrated(paths, rows, lambda rows, reps: forward_times(model, list(owned.values()), rows, reps=reps),
                       reps=2)
    return {name: dict(zip(cost.rows, cost.secs)) for name, cost in costs.items()}


def _fp32_form_costs(model) -> dict[str, dict[int, float]]:
    """Seconds of a verify forward of each of FP32_ROW_BUCKETS rows in each fp32 kernel form
    (`exact_linear.FP32_FORMS`): {form: {rows: s}} (measured once per machine and model, kept on
    disk; docs/architecture-core.md, Measurements: calibration times)."""
    backends = [replace(FP32_CPU, name=form,
                        linear=Fp32Forms((form,) * len(FP32_ROW_BUCKETS)))
                for form in FP32_FORMS]
    return _measured(model, "fp32-forms", backends, list(FP32_ROW_BUCKETS))


def fp32_forms(model) -> tuple[str, ...]:
    """The fastest fp32 kernel form for each of FP32_ROW_BUCKETS row counts (`_fp32_form_costs`)."""
    costs = _fp32_form_costs(model)
    return tuple(min(FP32_FORMS, key=lambda form: costs[form][rows]) for rows in FP32_ROW_BUCKETS)


def integer_step_cost(model, backend: Backend) -> StepCost:
    """The cost of an int8 or weight-int8 verify forward by row count (measured once per machine
    and model, kept on disk): drafts are capped on it (`GoodputCap`), since without AMX the
    integer kernels' cost grows with the rows (docs/exactness.md, int8 on AVX2)."""
    return StepCost(_measured(model, backend.name, [backend], list(FP32_ROW_BUCKETS))[backend.name])


def fp32_step_cost(model) -> StepCost:
    """The cost of a verify forward by row count, each row count in its fastest fp32 form."""
    costs = _fp32_form_costs(model)
    return StepCost({rows: min(per_rows[rows] for per_rows in costs.values()) for rows in FP32_ROW_BUCKETS})


# What the fp32 forwards with and without the logit screen are kept on disk as.
LOGIT_SCREEN_COSTS = "fp32-logit-screen v2"


def fp32_backend(model) -> Backend:
    """`fp32-cpu` for `model`: the kernel forms measured for it (`fp32_forms`); the logit screen
    (logit_screen.py) where its greedy forwards cost less with it, timed once per machine and
    model at FP32_ROW_BUCKETS rows (kept on disk); drafts capped (`GoodputCap`) on the measured
    costs of the forwards it runs. The screen is tried only where oneDNN runs bf16 calls on packed
    weights (`exact_linear.packed_bf16_runs`) and the output layer is an fp32 `Linear` without
    bias. With the screen on, drafts are capped on the screened costs, which decodes faster than
    capping on the unscreened ones (docs/architecture-core.md, Measurements: logit screen)."""
    backend = replace(FP32_CPU, linear=Fp32Forms(fp32_forms(model)))
    head = getattr(model, "lm_head", None)
    if not (packed_bf16_runs() and llama.supports(model) and isinstance(head, torch.nn.Linear)
            and head.bias is None and head.weight.dtype == torch.float32):
        return replace(backend, draft_cost=fp32_step_cost(model))
    screened = replace(backend, name=f"{backend.name}+logit-screen", screen=LogitScreen(head.weight))
    costs = _measured(model, LOGIT_SCREEN_COSTS, [backend, screened], list(FP32_ROW_BUCKETS))
    if sum(costs[screened.name].values()) < sum(costs[backend.name].values()):
        return replace(screened, name=backend.name, draft_cost=StepCost(costs[screened.name]))
    return replace(backend, draft_cost=StepCost(costs[backend.name]))  # the screen's bf16 copy goes with `screened`


def bf16_form_costs(model) -> dict[str, float]:
    """Seconds of verify forwards of AFFORDABILITY_ROWS rows (summed) in the exact bf16 forms,
    `plain` and, where oneDNN runs bf16 calls on packed weights, `plain-packed`: {name: s}
    (measured once on this machine, kept on disk; docs/architecture-core.md, Measurements:
    calibration times)."""
    measured = _measured(model, EXACT_VS_PLAIN, [EXACT_BF16, *plain_forms(model.dtype)], list(AFFORDABILITY_ROWS))
    return {name: sum(per_rows.values()) for name, per_rows in measured.items()}


def exact_is_affordable(model) -> bool:
    """Whether the exact bf16 forms cost at most EXACT_OVERHEAD more than plain forwards at
    AFFORDABILITY_ROWS rows on this machine (`bf16_form_costs`)."""
    return _exact_within_overhead(bf16_form_costs(model))


def _exact_within_overhead(costs: dict[str, float]) -> bool:
    return costs[EXACT_BF16.name] <= (1 + EXACT_OVERHEAD) * costs[PLAIN.name]
