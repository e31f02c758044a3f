"""Continuous batching with per-sequence drafts: many sequences in one forward, one shared prefix.

`generate()` decodes one sequence and spends spare rows of a forward on its draft. For many
sequences the rows are better spent on other sequences, and drafts only while a step is still
cheap. The engine keeps up to `batch_size` sequences in flight, each in a slot of a KV cache
preallocated per layer (slots x heads x positions x dim, written at each slot's own positions, a
rejected draft simply overwritten by the next step, as gpt-fast does). One step:

1. admit waiting requests into free slots (their prompt after the shared prefix becomes "fresh"
   tokens, as in `generate()`'s prefill: a new sequence's prefill runs in the same forward as the
   others' decode steps);
2. each slot's drafter proposes; a draft cap chosen from the measured cost of a forward by its row
   count (`StepCost`) and each slot's acceptance so far trims the drafts (`DraftBudget`);
3. ONE forward over every slot's [fresh tokens, draft nodes], packed into one row list for the
   linear layers (no padding) and padded per slot only for attention (a bool mask per slot: its
   cached positions, causal fresh rows, and tree ancestors for draft nodes);
4. verify each slot's draft (greedy or speculative sampling), keep the accepted path's KV;
5. retire finished sequences; their slots take the next requests.

Greedy output equals each sequence's own greedy decoding up to the rounding of different row
counts (a near-tie may flip, as in HF's batched `generate()`). Llama-family models (Llama, Qwen2)
with full attention.

`run` is the one decoding loop of the project: `generate()` runs it with one sequence whose KV is
the model's own cache, each forward computed by the model's backend (`core.backend`: bit for bit
plain greedy decoding's rounding; any architecture), by overriding the three store methods
(`_admit_kv`, `_forward`, `_keep`).
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from . import decoder_forward
from .draft import Draft
from .draft_budget import DraftBudget, StepCost, cost_file
from .backend import backend_for
from .sequence import Generation, Request, Sequence, context_length, eos_token_ids
from .verify import top_two, tree_attention_mask


@dataclass
class _Rows:
    """What a forward needs of a sequence: its cached length and the fresh tokens after it."""

    length: int
    fresh: list[int]


def engine_supports(model) -> bool:
    """Whether `BatchEngine` runs this model (Llama-family decoders with full attention)."""
    return decoder_forward.supports(model)


class BatchEngine:
    """Decodes many requests with continuous batching (see the module docstring).

    batch_size: sequences in flight. prefix: token ids most prompts start with (GEC's instruction),
    whose KV is computed once and copied into each slot. kv_budget_bytes: sequences wait for a slot
    rather than grow the cache beyond this. cost: the step cost curve (default: measured once per
    machine and model, see `StepCost.measure`); draft_budget=False turns the cap off (every draft
    whole)."""

    def __init__(self, model, batch_size: int = 16, *, eos_token_id: int | Iterable[int] | None = None,
                 prefix: list[int] | None = None, kv_budget_bytes: int = 4 << 30,
                 cost: StepCost | None = None, draft_budget: bool = True) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not engine_supports(model):
            raise ValueError(f"the batched engine runs Llama-family decoders with full attention, not "
                             f"{model.config.model_type!r} ({model.config._attn_implementation})")
        self._start(model, batch_size, eos_token_id)
        self.kv_budget_bytes = kv_budget_bytes
        config = model.config
        self.layers = model.model.layers[: config.num_hidden_layers]
        attn = self.layers[0].self_attn
        self.kv_heads = config.num_key_value_heads
        self.head_dim = attn.head_dim
        self.token_bytes = 2 * len(self.layers) * self.kv_heads * self.head_dim * model.dtype.itemsize
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.prefix: list[int] = []
        self.prefix_kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        if prefix:
            self._compute_prefix(list(prefix))
        if draft_budget:
            self.budget = DraftBudget(cost or self.measure_step_cost())

    def _start(self, model, batch_size: int, eos_token_id: int | Iterable[int] | None, tokenizer=None) -> None:
        """What the loop (`run`) needs, whatever the store. eos_token_id None: `eos_token_ids`."""
        self.model, self.batch_size = model, batch_size
        if eos_token_id is None:
            self.eos = eos_token_ids(model, tokenizer)
        else:
            self.eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
        self.context = context_length(model)
        self.vocab = model.get_output_embeddings().weight.shape[0]
        self.forward_passes = 0
        self._in_flight = 0
        self.budget: DraftBudget | None = None

    def measure_step_cost(self, rows: Iterable[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256), reps: int = 3,
                          cache_dir: str | Path | None = None) -> StepCost:
        """Time decode steps of `rows` rows as a batch runs them (up to 32 slots, each a root token
        and a chain draft, every row's logits, after 64 cached tokens; median of `reps`), or read an
        earlier measurement of the same machine, model, dtype and backend (`cost_file`)."""
        rows = sorted(set(rows))
        path = cost_file(self.model, cache_dir, measure=f"engine:{backend_for(self.model).name}")
        if (kept := StepCost.load(path, rows)) is not None:
            return kept
        vocab = min(self.model.config.vocab_size, 32000)
        gen = torch.Generator().manual_seed(0)
        context, most = 64, 32
        times: dict[int, list[float]] = {r: [] for r in rows}
        self._ensure(min(max(rows), most), context + max(rows))
        for rep in range(reps + 1):  # the first round warms up
            for r in rows:
                count = min(r, most)
                slots, drafts = [], []
                for k in range(count):
                    per = r // count + (k < r % count)  # rows of this slot
                    ids = torch.randint(0, vocab, (context + per,), generator=gen).tolist()
                    slots.append(_Rows(context, ids[context:context + 1]))
                    drafts.append(Draft.chain(ids[context + 1:]) if per > 1 else None)
                t0 = time.perf_counter()
                self._step_forward(slots, drafts)
                if rep:
                    times[r].append(time.perf_counter() - t0)
        cost = StepCost({r: sorted(t)[len(t) // 2] for r, t in times.items()})
        cost.save(path)
        return cost

    # ---- the cache -------------------------------------------------------------------------

    @torch.inference_mode()
    def _ensure(self, slots: int, positions: int) -> None:
        """Grow the cache to at least `slots` slots of `positions` positions (kept contents).
        Both grow by doubling (slots up to the batch size and the KV budget): each growth copies
        the whole cache, and growing one slot at a time took 0.74 s of an 11.5 s job (64 JFLEG
        sentences, batch 32, profiled)."""
        have_s = self.keys[0].shape[0] if self.keys else 0
        have_p = self.keys[0].shape[2] if self.keys else 0
        if slots <= have_s and positions <= have_p:
            return
        p = have_p if positions <= have_p else max(positions, 2 * have_p, 128)
        fit = self.kv_budget_bytes // (p * self.token_bytes)
        s = have_s if slots <= have_s else max(slots, min(2 * have_s, self.batch_size, fit))
        shape = (s, self.kv_heads, p, self.head_dim)
        for i in range(len(self.layers)):
            for store in (self.keys, self.values):
                new = torch.zeros(shape, dtype=self.model.dtype, device=self.model.device)
                if i < len(store):
                    new[:have_s, :, :have_p] = store[i]
                    store[i] = new
                else:
                    store.append(new)

    def _compute_prefix(self, prefix: list[int]) -> None:
        # Followed by filler rows up to PREFIX_ROWS: a prefix's KV does not depend on what follows
        # it, but in bf16 its rounding depends on the call's row count, and a short call (the GEC
        # instruction alone: 55 rows) rounds otherwise than a whole prompt's prefill (measured on
        # Qwen2.5-0.5B in bf16, 48 JFLEG sentences: 44 outputs equal to HF greedy with the
        # instruction in a 55-row call, 47 with 128 rows, 48 without a shared prefix).
        rows = prefix + (prefix * PREFIX_ROWS)[: max(0, PREFIX_ROWS - len(prefix))]
        self._ensure(1, len(rows) + 1)
        self._step_forward([_Rows(0, rows)], [None], logits_rows=1)
        self.prefix = prefix
        self.prefix_kv = [(k[0, :, : len(prefix)].clone(), v[0, :, : len(prefix)].clone())
                          for k, v in zip(self.keys, self.values)]

    # ---- one forward over all slots --------------------------------------------------------

    @torch.inference_mode()
    def _step_forward(self, slots: list[_Rows | Sequence], drafts: list[Draft | None], logits_rows: int | None = None,
                      where: list[int] | None = None) -> torch.Tensor:
        """One forward over every slot's [fresh tokens, draft nodes]. `where[i]`: the cache slot of
        `slots[i]` (default i). Returns the logits, slot after slot, of its root (last fresh
        token) and each draft node (`logits_rows`=1: the root only): (rows, vocab)."""
        model, device = self.model, self.model.device
        where = list(range(len(slots))) if where is None else where
        ids, positions, slot_of_row, write_at, wanted = [], [], [], [], []
        masks, pasts = [], []
        for s, (slot, draft) in enumerate(zip(slots, drafts)):
            nodes = draft.tokens if draft is not None else []
            f = len(slot.fresh)
            first = len(ids)
            ids += slot.fresh + nodes
            positions += list(range(slot.length, slot.length + f))
            positions += [slot.length + f - 1 + d for d in (draft.depths if draft is not None else [])]
            slot_of_row += [where[s]] * (f + len(nodes))
            write_at += list(range(slot.length, slot.length + f + len(nodes)))
            wanted += list(range(first + f - 1, first + f + (len(nodes) if logits_rows is None else 0)))
            pasts.append(slot.length)
            # who sees whom among the slot's own new rows (its cached positions are seen by all)
            if draft is not None:
                masks.append(tree_attention_mask(draft, 0, f - 1)[0, 0])
            else:
                masks.append(torch.ones(f, f, dtype=torch.bool).tril())
        n = len(ids)
        groups = _attention_groups(masks, pasts, where, device, model.dtype)
        to_dev = lambda t: t.to(device)  # noqa: E731
        ids_t = to_dev(torch.tensor([ids]))
        pos_t = to_dev(torch.tensor([positions]))
        slot_t, write_t = to_dev(torch.tensor(slot_of_row)), to_dev(torch.tensor(write_at))
        body = model.model
        rotate = sys.modules[type(model).__module__].apply_rotary_pos_emb
        # Every row is a block row: the linear layers take the backend's kernel for a whole block
        # (exact_linear's fp32 kernels on the CPU, plain F.linear in bf16), or all take its draft
        # rows' kernel where that is cheaper (`plain-packed`: packed weights).
        backend = backend_for(model)
        with backend.rows(n if backend.engine_block else 0, n):
            x = body.embed_tokens(ids_t)
            cos, sin = body.rotary_emb(x, pos_t)
            for i, layer in enumerate(self.layers):
                attn = layer.self_attn
                h = layer.input_layernorm(x)
                xq = attn.q_proj(h).view(1, n, -1, self.head_dim).transpose(1, 2)
                xk = attn.k_proj(h).view(1, n, -1, self.head_dim).transpose(1, 2)
                xv = attn.v_proj(h).view(1, n, -1, self.head_dim).transpose(1, 2)
                xq, xk = rotate(xq, xk, cos, sin)
                self.keys[i][slot_t, :, write_t] = xk[0].transpose(0, 1)
                self.values[i][slot_t, :, write_t] = xv[0].transpose(0, 1)
                heads = xq.shape[1]
                rows = xq[0].transpose(0, 1)  # (n, heads, dim)
                out = rows.new_empty(n, heads * self.head_dim)
                for g in groups:
                    keys, values = self.keys[i][g.slots, :, : g.width], self.values[i][g.slots, :, : g.width]
                    query = rows[g.pad].view(g.count, g.q, heads, self.head_dim).transpose(1, 2)
                    o = F.scaled_dot_product_attention(query, keys, values, attn_mask=g.mask, scale=attn.scaling,
                                                       enable_gqa=heads != self.kv_heads)
                    out[g.rows] = o.transpose(1, 2).reshape(g.count * g.q, -1)[g.flat]
                x = x + attn.o_proj(out[None])
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            logits = model.lm_head(body.norm(x[:, to_dev(torch.tensor(wanted))]))[0]
        return logits

    # ---- decoding --------------------------------------------------------------------------

    def run(self, requests: Iterable[Request | None]) -> Iterator[tuple[int, Generation | Exception]]:
        """Decode `requests` (read lazily, as slots free up); yields (request number, Generation)
        as each sequence finishes, in finishing order. A request that fails (an empty prompt, a
        drafter or `on_step` that raises) yields its exception instead; the others go on.
        A None from `requests` means "nothing new now" (a live queue, see `BatchServer`): the
        sequences in flight step on, and the next step asks again (with none in flight, the
        source should block until it has a request)."""
        source = iter(requests)
        self._in_flight = 0  # one run at a time per engine; an abandoned run's slots are gone
        slots: list[Sequence | None] = []
        held: Request | None = None  # read, but over the KV budget: admitted once a slot frees
        count = 0  # requests read
        open_ = True
        with torch.inference_mode():
            while True:
                # 1. admit
                while (held is not None or open_) and self.in_flight < self.batch_size:
                    if held is None:
                        request = next(source, _END)
                        if request is _END or request is None:
                            open_ = request is None
                            break
                        held, count = request, count + 1
                    try:
                        admitted = self._admit(count - 1, held, slots)
                    except Exception as e:  # noqa: BLE001 - one bad request must not stop the others
                        yield count - 1, e
                        held = None
                        continue
                    if not admitted:  # over the KV budget: wait for a sequence to finish
                        break
                    held = None
                active = [i for i, s in enumerate(slots) if s is not None]
                if not active:
                    if held is None and not open_:
                        return
                    continue
                # 2. draft
                drafts: list[Draft | None] = []
                for i in active:
                    try:
                        drafts.append(slots[i].propose(self.vocab))
                    except Exception as e:  # noqa: BLE001
                        yield from self._retire(slots, i, e)
                        drafts.append(None)
                drafts = [d for i, d in zip(active, drafts) if slots[i] is not None]
                active = [i for i in active if slots[i] is not None]
                if not active:
                    continue
                live = [slots[i] for i in active]
                if self.budget is not None and any(d is not None for d in drafts):
                    cap = self.budget.cap(sum(len(s.fresh) for s in live), drafts, [self.budget.rate(s.accepted, s.offered) for s in live])
                    drafts = [None if d is None or cap == 0 else d.limit_size(cap) for d in drafts]
                # 3. one forward, 4. verify and commit
                t0 = time.perf_counter()
                logits = self._forward(live, drafts, active)
                self.forward_passes += 1
                sizes = [1 + (len(d) if d is not None else 0) for d in drafts]
                best = top_two(logits)[0].tolist()  # every row's argmax in one call (greedy verification)
                for i, seq, draft, rows, first in zip(active, live, drafts, logits.split(sizes),
                                                      itertools.accumulate([0, *sizes])):
                    try:
                        base = seq.length + len(seq.fresh)  # the store's index of draft node 0
                        prefill = seq.prefilling
                        path = seq.settle(draft, rows, best[first: first + len(rows)], self.plain_steps,
                                          time.perf_counter() - t0)
                        self._keep(i, seq, base, path or [], prefill and path is not None)
                    except Exception as e:  # noqa: BLE001 - e.g. on_step ended it (a time budget, a closed stream)
                        yield from self._retire(slots, i, e)
                        continue
                    if seq.finish is not None:  # 5. retire
                        yield from self._retire(slots, i, seq.result())

    @property
    def in_flight(self) -> int:
        """Sequences decoding now."""
        return self._in_flight

    def _retire(self, slots: list[Sequence | None], i: int, result: Generation | Exception):
        index = slots[i].index
        slots[i] = None
        self._in_flight -= 1
        yield index, result

    def _admit(self, index: int, request: Request, slots: list[Sequence | None]) -> bool:
        """Put `request` into a free slot; False where the store has no room for it now."""
        prompt = list(request.prompt)
        if not prompt:
            raise ValueError("the prompt is empty")
        if request.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        if len(prompt) >= self.context:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the model's context is {self.context}")
        free = next((i for i, s in enumerate(slots) if s is None), len(slots))
        cached = self._admit_kv(free, prompt, min(request.max_new_tokens, self.context - len(prompt)), len(slots))
        if cached is None:
            return False
        seq = Sequence(index, request, self.eos, self.context, cached, self.backend_name)
        if free == len(slots):
            slots.append(seq)
        else:
            slots[free] = seq
        self._in_flight += 1
        return True

    # ---- the store: the preallocated cache -------------------------------------------------

    backend_name = "batch"
    plain_steps = False  # no row is computed as plain one-token decoding computes it

    def _admit_kv(self, slot: int, prompt: list[int], max_new: int, slots: int) -> int | None:
        """Make room for a sequence in cache slot `slot` (of `slots` made so far) and copy the
        shared prefix's KV into it; returns how many prompt tokens it holds, None where the KV
        budget has no room now."""
        need = len(prompt) + max_new + 64  # room for the last step's draft rows
        in_use = max(slots, slot + 1)
        have_p = self.keys[0].shape[2] if self.keys else 0
        if in_use * max(need, have_p) * self.token_bytes > self.kv_budget_bytes:
            if self.in_flight:
                return None
            raise ValueError(f"a sequence of {need} tokens does not fit the KV budget of {self.kv_budget_bytes} bytes")
        self._ensure(in_use, need)
        cached = len(self.prefix) if len(prompt) > len(self.prefix) and prompt[: len(self.prefix)] == self.prefix else 0
        for (k, v), keys, values in zip(self.prefix_kv if cached else [], self.keys, self.values):
            keys[slot, :, :cached] = k
            values[slot, :, :cached] = v
        return cached

    def _forward(self, seqs: list[Sequence], drafts: list[Draft | None], slots: list[int]) -> torch.Tensor:
        """One forward over every sequence's [fresh tokens, draft nodes]: (rows, vocab) logits."""
        return self._step_forward(seqs, drafts, where=slots)

    def _keep(self, slot: int, seq: Sequence, base: int, path: list[int], prefilled: bool) -> None:
        """After a step: the accepted `path`'s KV (written from `base` on) is kept at `base`.. (a
        rejected draft is overwritten by the next step)."""
        if path != list(range(len(path))):  # a tree path: move its nodes' KV behind the fresh tokens
            src = torch.tensor([base + p for p in path], device=self.model.device)
            dst = torch.arange(base, base + len(path), device=self.model.device)
            for store in (self.keys, self.values):
                for layer in store:
                    layer[slot, :, dst] = layer[slot, :, src]


_END = object()
PREFIX_ROWS = 128  # the shared prefix is computed in a call of at least this many rows (see _compute_prefix)
LONG_ROWS = 16  # slots with more rows (a prompt being prefilled) attend in a call of their own


@dataclass
class _AttentionGroup:
    """Slots whose rows attend in one padded call: `count` slots x `q` query rows x `width` keys."""

    slots: slice | torch.Tensor  # their cache slots (a slice where contiguous: a view, no copy)
    count: int
    q: int
    width: int
    mask: torch.Tensor  # (count, 1, q, width) additive: 0 where a row attends, the dtype's min elsewhere
    pad: torch.Tensor  # (count * q,) padded query row -> packed row
    flat: torch.Tensor  # the padded indices of the real rows, in packed order
    rows: torch.Tensor  # the packed rows of these slots


def _attention_groups(masks: list[torch.Tensor], pasts: list[int], where: list[int],
                      device: torch.device, dtype: torch.dtype) -> list[_AttentionGroup]:
    """The attention calls of a step. masks[s]: (rows, rows) bool, which of slot s's new rows see
    which; every row also sees the slot's `pasts[s]` cached positions. Padding every slot to the
    longest one's rows would make a step with one prompt being prefilled pay attention for ~30
    rows in every slot: short and long slots attend apart."""
    starts = [0]
    for m in masks:
        starts.append(starts[-1] + m.shape[0])
    groups = []
    for members in ([s for s, m in enumerate(masks) if m.shape[0] <= LONG_ROWS],
                    [s for s, m in enumerate(masks) if m.shape[0] > LONG_ROWS]):
        if not members:
            continue
        count, q = len(members), max(masks[s].shape[0] for s in members)
        width = max(pasts[s] + masks[s].shape[0] for s in members)
        past = torch.tensor([pasts[s] for s in members])
        mask = (torch.arange(width)[None, None, :] < past[:, None, None]).expand(count, q, width).clone()
        pad = torch.zeros(count, q, dtype=torch.long)
        real = torch.zeros(count, q, dtype=torch.bool)
        for j, s in enumerate(members):
            rows = masks[s].shape[0]
            mask[j, :rows, pasts[s]: pasts[s] + rows] = masks[s]
            mask[j, rows:, 0] = True  # padding rows attend somewhere (no NaN); their output is dropped
            pad[j, :rows] = torch.arange(starts[s], starts[s] + rows)
            real[j, :rows] = True
        cache = [where[s] for s in members]
        contiguous = cache == list(range(cache[0], cache[0] + count))
        groups.append(_AttentionGroup(
            slots=slice(cache[0], cache[0] + count) if contiguous else torch.tensor(cache, device=device),
            # An additive mask: CPU sdpa converts a bool mask at every call (~2x the time of the call)
            count=count, q=q, width=width, pad=pad.reshape(-1).to(device),
            mask=torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, torch.finfo(dtype).min)[:, None].to(device),
            flat=(torch.arange(count)[:, None] * q + torch.arange(q)[None, :])[real].to(device),
            rows=torch.cat([torch.arange(starts[s], starts[s + 1]) for s in members]).to(device)))
    return groups


def generate_many(model, requests: list[Request], batch_size: int = 16, **options) -> list[Generation]:
    """Decode `requests` with a `BatchEngine`; the generations in input order (an error raises)."""
    out: dict[int, Generation] = {}
    for index, result in BatchEngine(model, batch_size, **options).run(requests):
        if isinstance(result, Exception):
            raise result
        out[index] = result
    return [out[i] for i in range(len(requests))]
