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
counts (a near-tie may flip, as in HF's batched `generate()`); `generate()` remains the exact
one-sequence path. Llama-family models (Llama, Qwen2) with full attention.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from . import decoder_forward
from .draft import Draft, Drafter, NoDrafter
from .exact_attention import block_rows
from .generate import Generation, GenerationStats, context_length, eos_token_ids
from .verify import Sampling, top_two, tree_attention_mask, verify_greedy, verify_sample, warp


@dataclass
class Request:
    """One sequence to decode. `drafter` None: no drafts for it."""

    prompt: list[int]
    drafter: Drafter | None = None
    max_new_tokens: int = 256
    sampling: Sampling | None = None
    generator: torch.Generator | None = None


@dataclass
class _Slot:
    """A sequence in flight. The cache holds `length` tokens; `fresh` follow them (the last one is
    the root of the next draft)."""

    index: int  # the request's number in the input
    request: Request
    drafter: Drafter
    eos: set[int]
    length: int
    fresh: list[int]
    seq: list[int]
    new: list[int] = field(default_factory=list)
    from_draft: list[bool] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)
    start: float = 0.0
    accepted: int = 0  # drafted tokens accepted / offered so far, for the draft budget
    offered: int = 0

    @property
    def room(self) -> int:
        return self.request.max_new_tokens - len(self.new)


class StepCost:
    """Seconds of one engine forward by its number of rows (piecewise linear between measured
    points, linear beyond the last one). Measured once per machine, model and dtype and cached on
    disk (`measure`), so the draft budget follows this machine's kernels, not constants."""

    def __init__(self, points: dict[int, float]) -> None:
        if not points or min(points) < 1:
            raise ValueError("StepCost needs costs for row counts >= 1")
        self.rows = sorted(points)
        self.secs = [points[r] for r in self.rows]

    def __call__(self, rows: int) -> float:
        r, s = self.rows, self.secs
        if rows <= r[0] or len(r) == 1:
            return s[0] * max(rows, 1) / r[0] if rows > r[0] else s[0]
        for i in range(1, len(r)):
            if rows <= r[i]:
                return s[i - 1] + (s[i] - s[i - 1]) * (rows - r[i - 1]) / (r[i] - r[i - 1])
        return s[-1] + (s[-1] - s[-2]) * (rows - r[-1]) / (r[-1] - r[-2])

    @classmethod
    def measure(cls, engine: "BatchEngine", rows: Iterable[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256),
                reps: int = 3, cache_dir: str | Path | None = None) -> "StepCost":
        """Time the engine's forward over `rows` rows (one slot after 64 cached tokens, median of
        `reps`), or read an earlier measurement of the same machine, model and dtype."""
        rows = sorted(set(rows))
        path = _cost_file(engine.model, cache_dir)
        if path is not None and path.exists():
            try:
                saved = {int(k): float(v) for k, v in json.loads(path.read_text())["seconds"].items()}
                if set(rows) <= set(saved):
                    return cls({r: saved[r] for r in rows})
            except (ValueError, KeyError, TypeError):
                pass  # unreadable: measure again
        vocab = min(engine.model.config.vocab_size, 32000)
        gen = torch.Generator().manual_seed(0)
        context = 64
        times: dict[int, list[float]] = {r: [] for r in rows}
        engine._ensure(1, context + max(rows))
        for rep in range(reps + 1):  # the first round warms up
            for r in rows:
                ids = torch.randint(0, vocab, (context + r,), generator=gen).tolist()
                slot = _Slot(-1, Request(ids), NoDrafter(), set(), length=context, fresh=ids[context:], seq=ids)
                t0 = time.perf_counter()
                engine._step_forward([slot], [None], logits_rows=1)
                if rep:
                    times[r].append(time.perf_counter() - t0)
        cost = cls({r: sorted(t)[len(t) // 2] for r, t in times.items()})
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"seconds": dict(zip(map(str, cost.rows), cost.secs))}))
        return cost


def _cost_file(model, cache_dir: str | Path | None) -> Path | None:
    """Where the step cost of this model, dtype, machine and thread count is kept (None: nowhere)."""
    if cache_dir is None:
        if os.environ.get("SPECSUITE_NO_COST_CACHE"):
            return None
        cache_dir = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specsuite" / "step_cost"
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    except OSError:
        cpu = ""
    name = getattr(model.config, "_name_or_path", "") or model.config.model_type
    key = f"{name}|{model.dtype}|{model.device}|{cpu}|{torch.get_num_threads()}|{torch.__version__}"
    return Path(cache_dir) / (hashlib.sha1(key.encode()).hexdigest()[:16] + ".json")


class DraftBudget:
    """How many draft nodes each slot may verify in the next step: the cap that maximises the
    expected new tokens per second of the whole step (goodput, as in SmartSpec).

    A slot whose drafts were accepted at rate `a` so far expects sum(a^i, i = 1..c) extra tokens
    from c nodes; the step costs `cost(rows)`. Few sequences in flight: long drafts are nearly
    free. A full batch: the extra rows cost more than they bring, and the cap drops to 0."""

    CAPS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32)

    def __init__(self, cost: StepCost, prior: float = 0.7) -> None:
        self.cost, self.prior = cost, prior

    def cap(self, fresh_rows: int, drafts: list[Draft | None], rates: list[float]) -> int:
        best, best_rate = 0, -1.0
        for c in self.CAPS:
            rows = fresh_rows
            gain = float(len(drafts))
            for d, a in zip(drafts, rates):
                k = min(c, len(d)) if d is not None else 0
                rows += k
                gain += a * (1 - a ** k) / (1 - a) if a < 1 else k
            rate = gain / self.cost(rows)
            if rate > best_rate * 1.0001:  # ties: the smaller cap
                best, best_rate = c, rate
            if all(d is None or len(d) <= c for d in drafts):
                break
        return best

    def rate(self, slot: _Slot) -> float:
        """Acceptance rate of the slot's drafts so far, starting from the prior (clamped below 1)."""
        return min(0.98, (slot.accepted + 4 * self.prior) / (slot.offered + 4))


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
        self.model, self.batch_size, self.kv_budget_bytes = model, batch_size, kv_budget_bytes
        if eos_token_id is None:
            self.eos = eos_token_ids(model)
        else:
            self.eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
        config = model.config
        self.layers = model.model.layers[: config.num_hidden_layers]
        attn = self.layers[0].self_attn
        self.kv_heads = config.num_key_value_heads
        self.head_dim = attn.head_dim
        self.context = context_length(model)
        self.token_bytes = 2 * len(self.layers) * self.kv_heads * self.head_dim * model.dtype.itemsize
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.forward_passes = 0
        self.prefix: list[int] = []
        self.prefix_kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        if prefix:
            self._compute_prefix(list(prefix))
        self.budget = None
        if draft_budget:
            self.budget = DraftBudget(cost or StepCost.measure(self))

    # ---- the cache -------------------------------------------------------------------------

    @torch.inference_mode()
    def _ensure(self, slots: int, positions: int) -> None:
        """Grow the cache to at least `slots` slots of `positions` positions (kept contents)."""
        have_s = self.keys[0].shape[0] if self.keys else 0
        have_p = self.keys[0].shape[2] if self.keys else 0
        if slots <= have_s and positions <= have_p:
            return
        s = max(slots, have_s)
        p = have_p if positions <= have_p else max(positions, 2 * have_p, 128)
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
        self._ensure(1, len(prefix) + 1)
        slot = _Slot(-1, Request(prefix), NoDrafter(), set(), length=0, fresh=prefix, seq=prefix)
        self._step_forward([slot], [None], logits_rows=1)
        self.prefix = prefix
        self.prefix_kv = [(k[0, :, : len(prefix)].clone(), v[0, :, : len(prefix)].clone())
                          for k, v in zip(self.keys, self.values)]

    # ---- one forward over all slots --------------------------------------------------------

    @torch.inference_mode()
    def _step_forward(self, slots: list[_Slot], drafts: list[Draft | None], logits_rows: int | None = None,
                      where: list[int] | None = None) -> list[torch.Tensor]:
        """One forward over every slot's [fresh tokens, draft nodes]. `where[i]`: the cache slot of
        `slots[i]` (default i). Returns per slot its (1 + nodes, vocab) logits: the root (last
        fresh token) and each node (`logits_rows`=1: the root only)."""
        model, device = self.model, self.model.device
        where = list(range(len(slots))) if where is None else where
        ids, positions, slot_of_row, write_at, wanted = [], [], [], [], []
        masks, lengths = [], []
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
            lengths.append(slot.length + f + len(nodes))
            if draft is not None:
                masks.append(tree_attention_mask(draft, slot.length, f - 1)[0, 0])
            else:
                masks.append(torch.ones(f, slot.length + f, dtype=torch.bool).tril(slot.length))
        n, a = len(ids), len(slots)
        q = max(m.shape[0] for m in masks)
        width = max(lengths)
        mask = torch.zeros(a, 1, q, width, dtype=torch.bool)
        pad = torch.zeros(a, q, dtype=torch.long)  # padded attention row -> packed row
        real = torch.zeros(a, q, dtype=torch.bool)
        row = 0
        for s, m in enumerate(masks):
            rows, cols = m.shape
            mask[s, 0, :rows, :cols] = m
            mask[s, 0, rows:, 0] = True  # padding rows attend somewhere (no NaN); their output is dropped
            pad[s, :rows] = torch.arange(row, row + rows)
            real[s, :rows] = True
            row += rows
        flat = (torch.arange(a)[:, None] * q + torch.arange(q)[None, :])[real]  # packed row -> padded index
        to_dev = lambda t: t.to(device)  # noqa: E731
        ids_t = to_dev(torch.tensor([ids]))
        pos_t = to_dev(torch.tensor([positions]))
        slot_t, write_t = to_dev(torch.tensor(slot_of_row)), to_dev(torch.tensor(write_at))
        cache_slots = to_dev(torch.tensor(where))
        mask, pad, flat = to_dev(mask), to_dev(pad.reshape(-1)), to_dev(flat)
        body = model.model
        rotate = sys.modules[type(model).__module__].apply_rotary_pos_emb
        # block_rows(n, n): every row is a block row; the linear layers take the fastest plain kernel
        # for the row count (exact_linear's fp32 kernels on the CPU, plain F.linear in bf16).
        with block_rows(n, n):
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
                keys = self.keys[i][cache_slots, :, :width]
                values = self.values[i][cache_slots, :, :width]
                heads = xq.shape[1]
                query = xq[0].transpose(0, 1)[pad].view(a, q, heads, self.head_dim).transpose(1, 2)
                out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=attn.scaling,
                                                     enable_gqa=heads != self.kv_heads)
                out = out.transpose(1, 2).reshape(a * q, heads * self.head_dim)[flat]
                x = x + attn.o_proj(out[None])
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            logits = model.lm_head(body.norm(x[:, to_dev(torch.tensor(wanted))]))[0]
        self.forward_passes += 1
        per_slot = [1 + (len(d) if d is not None and logits_rows is None else 0) for d in drafts]
        return list(logits.split(per_slot))

    # ---- decoding --------------------------------------------------------------------------

    def run(self, requests: Iterable[Request]) -> Iterator[tuple[int, Generation | Exception]]:
        """Decode `requests` (read lazily, as slots free up); yields (input index, Generation) as
        each sequence finishes, in finishing order. A request that cannot run (an empty prompt, a
        drafter that raises) yields its exception instead; the others go on."""
        waiting = enumerate(requests)
        slots: list[_Slot | None] = []
        done_reading = False
        with torch.inference_mode():
            while True:
                # 1. admit
                while not done_reading and (sum(s is not None for s in slots) < self.batch_size):
                    item = next(waiting, None)
                    if item is None:
                        done_reading = True
                        break
                    index, request = item
                    try:
                        slot = self._admit(index, request, slots)
                    except Exception as e:  # noqa: BLE001 - one bad request must not stop the others
                        yield index, e
                        continue
                    if slot is None:  # over the KV budget: wait for a sequence to finish
                        waiting = _push_back(item, waiting)
                        break
                active = [i for i, s in enumerate(slots) if s is not None]
                if not active:
                    if done_reading:
                        return
                    continue
                # 2. draft
                live = [slots[i] for i in active]
                drafts: list[Draft | None] = []
                failed: list[tuple[int, Exception]] = []
                for i, slot in zip(active, live):
                    try:
                        drafts.append(self._propose(slot))
                    except Exception as e:  # noqa: BLE001
                        failed.append((i, e))
                        drafts.append(None)
                for i, e in failed:
                    yield slots[i].index, e
                    slots[i] = None
                keep = [k for k, i in enumerate(active) if slots[i] is not None]
                active, live, drafts = [active[k] for k in keep], [live[k] for k in keep], [drafts[k] for k in keep]
                if not active:
                    continue
                if self.budget is not None and any(d is not None for d in drafts):
                    cap = self.budget.cap(sum(len(s.fresh) for s in live), drafts, [self.budget.rate(s) for s in live])
                    drafts = [None if d is None or cap == 0 else d.limit_size(cap) for d in drafts]
                # 3. one forward, 4. verify and commit
                t0 = time.perf_counter()
                logits = self._step_forward(live, drafts, where=active)
                for i, slot, draft, rows in zip(active, live, drafts, logits):
                    finished = self._commit(slot, draft, rows, i, time.perf_counter() - t0)
                    if finished:  # 5. retire
                        slot.stats.new_tokens = len(slot.new)
                        slot.stats.total_s = time.perf_counter() - slot.start
                        yield slot.index, Generation(slot.new, slot.from_draft, finished, slot.stats)
                        slots[i] = None

    def _admit(self, index: int, request: Request, slots: list[_Slot | None]) -> _Slot | None:
        prompt = list(request.prompt)
        if not prompt:
            raise ValueError("the prompt is empty")
        if request.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        if len(prompt) >= self.context:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the model's context is {self.context}")
        max_new = min(request.max_new_tokens, self.context - len(prompt))
        need = len(prompt) + max_new + 64  # room for the last step's draft rows
        free = next((i for i, s in enumerate(slots) if s is None), len(slots))
        in_use = max(len(slots), free + 1)
        have_p = self.keys[0].shape[2] if self.keys else 0
        if in_use * max(need, have_p) * self.token_bytes > self.kv_budget_bytes:
            if any(s is not None for s in slots):
                return None
            raise ValueError(f"a sequence of {need} tokens does not fit the KV budget of {self.kv_budget_bytes} bytes")
        self._ensure(in_use, need)
        cached = len(self.prefix) if len(prompt) > len(self.prefix) and prompt[: len(self.prefix)] == self.prefix else 0
        for (k, v), keys, values in zip(self.prefix_kv if cached else [], self.keys, self.values):
            keys[free, :, :cached] = k
            values[free, :, :cached] = v
        drafter = request.drafter or NoDrafter()
        drafter.reset(prompt, request.sampling)
        slot = _Slot(index, Request(prompt, drafter, max_new, request.sampling, request.generator), drafter,
                     self.eos, length=cached, fresh=prompt[cached:], seq=list(prompt),
                     stats=GenerationStats(prompt_tokens=len(prompt), cached_prompt_tokens=cached),
                     start=time.perf_counter())
        if free == len(slots):
            slots.append(slot)
        else:
            slots[free] = slot
        return slot

    def _propose(self, slot: _Slot) -> Draft | None:
        if slot.room <= 1:
            return None
        draft = slot.drafter.propose(slot.seq, slot.room - 1)
        if draft is None:
            return None
        draft = draft.limit_depth(slot.room - 1)
        if not len(draft):
            return None
        vocab = self.model.get_output_embeddings().weight.shape[0]
        if max(draft.tokens) >= vocab or min(draft.tokens) < 0:
            raise ValueError(f"drafter {slot.drafter.name!r} proposed token ids outside the vocabulary")
        return draft

    def _commit(self, slot: _Slot, draft: Draft | None, logits: torch.Tensor, cache_slot: int,
                step_s: float) -> str | None:
        """Verify the slot's draft, keep the accepted path's KV, append the new tokens. Returns
        the finish reason, or None while the sequence goes on."""
        sampling = slot.request.sampling
        if draft is None:
            path = []
            if sampling is None:
                nxt = int(top_two(logits[:1])[0])
            else:
                nxt = int(torch.multinomial(warp(logits[:1], sampling)[0], 1, generator=slot.request.generator))
        elif sampling is None:
            path, nxt = verify_greedy(draft, logits)
        else:
            path, nxt = verify_sample(draft, logits, sampling, slot.request.generator)
        base = slot.length + len(slot.fresh)  # cache index of draft node 0
        if path != list(range(len(path))):  # a tree path: move its nodes' KV behind the fresh tokens
            src = torch.tensor([base + p for p in path], device=self.model.device)
            dst = torch.arange(base, base + len(path), device=self.model.device)
            for store in (self.keys, self.values):
                for layer in store:
                    layer[cache_slot, :, dst] = layer[cache_slot, :, src]
        n = len(draft) if draft is not None else 0
        prefill = not slot.new
        slot.length = base + len(path)
        slot.stats.forward_passes += 1
        slot.stats.drafted.append(n)
        slot.stats.accepted.append(len(path))
        if prefill:
            slot.stats.prefill_s = time.perf_counter() - slot.start
        else:
            slot.stats.verify_s += step_s
        if n:
            slot.offered += min(n, max(draft.depths))
            slot.accepted += len(path)
        slot.drafter.update(len(path), n)
        step = [draft.tokens[i] for i in path] + [nxt]
        flags = [True] * len(path) + [False]
        finish = None
        for i, t in enumerate(step):  # an EOS inside the accepted draft ends the sequence there
            if t in slot.eos:
                step, flags, finish = step[: i + 1], flags[: i + 1], "eos"
                break
        slot.seq += step
        slot.new += step
        slot.from_draft += flags
        slot.fresh = [nxt]
        if finish is None and slot.room <= 0:
            finish = "length" if len(slot.seq) < self.context else "context"
        return finish


def _push_back(item, rest: Iterator) -> Iterator:
    yield item
    yield from rest


def generate_many(model, requests: list[Request], batch_size: int = 16, **options) -> list[Generation]:
    """Decode `requests` with a `BatchEngine`; the generations in input order (an error raises)."""
    out: dict[int, Generation] = {}
    for index, result in BatchEngine(model, batch_size, **options).run(requests):
        if isinstance(result, Exception):
            raise result
        out[index] = result
    return [out[i] for i in range(len(requests))]
