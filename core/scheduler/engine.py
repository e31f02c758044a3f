"""The decoding loop: many sequences in one forward, each with its own draft.

`BatchEngine` keeps up to `batch_size` sequences in flight over a KV store (`core/scheduler/kv.py`: the
preallocated `SlotStore` by default; `generate()` runs it with one sequence in a `CacheStore`, the
model's own cache). One step (`run`):

1. admit waiting requests into free slots (`store.admit`; their prompt after what the store holds
   becomes "fresh" tokens: a new sequence's prefill runs in the same forward as the others' decode
   steps);
2. each sequence's drafter proposes (`Sequence.propose`); a draft cap chosen from the measured cost
   of a forward by its row count (`StepCost`) and each slot's acceptance so far trims the drafts
   (`DraftBudget`);
3. ONE forward over every slot's [fresh tokens, draft nodes] (`store.forward`, `core/model/forward.py`);
4. verify each slot's draft (greedy or speculative sampling) and commit (`Sequence.settle`), keep
   the accepted path's KV (`store.keep`, the one rollback `kv.keep_path`);
5. retire finished sequences (`store.release`); their slots take the next requests.

Driven by `add_request` / `step` / `abort` (a server's loop, `apps/serving/batch_server.py`), or by `run`, a
loop over `step` that feeds it from an iterable (the jobs, `generate()`).

In the slots, greedy output equals each sequence's own greedy decoding up to the rounding of
different row counts (a near-tie may flip, as in HF's batched `generate()`). Llama-family models
(`forward.ARCHITECTURES`) with full attention.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..model import forward
from ..model.calibration import slot_step_cost
from ..speculation.draft import Draft
from ..model.backend import Backend
from ..speculation.draft_budget import DraftBudget, DraftPolicy, StepCost
from .kv import KVStore, SlotStore
from .prefix_cache import PrefixCache
from .sequence import Generation, Request, Sequence, context_length, eos_token_ids
from ..speculation.verify import top_two


def engine_supports(model) -> bool:
    """Whether `BatchEngine` runs this model in slots (Llama-family decoders with full attention)."""
    return forward.supports(model)


@dataclass
class EngineConfig:
    """How an engine runs. batch_size: sequences in flight. kv_budget_bytes: sequences wait for a
    slot rather than grow the KV cache beyond this. prefix: token ids most prompts start with,
    whose KV is computed once and copied into each slot. backend: how the forwards are computed
    (None: `choose_backend(model)`, chosen once by the engine). draft_budget: cap every step's
    drafts by the measured step cost and each slot's acceptance (`DraftBudget`; False: every
    draft whole). policy: each sequence's own draft policy (`generate()` runs its backend's).
    prefix_cache: prompts' KV kept across requests (a `PrefixCache`; see `SlotStore`)."""

    batch_size: int = 16
    kv_budget_bytes: int = 4 << 30
    prefix: list[int] | None = None
    backend: Backend | None = None
    draft_budget: bool = True
    policy: DraftPolicy = DraftPolicy()
    prefix_cache: PrefixCache | None = None

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")


class BatchEngine:
    """Decodes many requests with continuous batching (see the module docstring), as `config` says.

    store: where the sequences' KV lives (default: a `SlotStore` of the config's prefix, KV budget
    and backend). cost: the step cost curve of the slots (default: measured once per machine and
    model, `calibration.slot_step_cost`). eos_token_id None: `eos_token_ids(model, tokenizer)`;
    the tokenizer also finds requests' stop strings."""

    def __init__(self, model, config: EngineConfig = EngineConfig(), *, eos_token_id: int | Iterable[int] | None = None,
                 tokenizer=None, cost: StepCost | None = None, store: KVStore | None = None) -> None:
        self.model, self.config, self.tokenizer = model, config, tokenizer
        self.store = SlotStore(model, config.prefix, config.kv_budget_bytes, config.backend, config.prefix_cache) if store is None else store
        if eos_token_id is None:
            self.eos = eos_token_ids(model, tokenizer)
        else:
            self.eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
        self.context = context_length(model)
        self.vocab = model.get_output_embeddings().weight.shape[0]
        self.forward_passes = 0
        self.reset()
        self.budget = DraftBudget(cost or self.measure_step_cost()) if config.draft_budget else None

    @property
    def batch_size(self) -> int:
        """Sequences in flight at most (the config's: set `config` to change it between runs)."""
        return self.config.batch_size

    def measure_step_cost(self, rows: Iterable[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256), reps: int = 3,
                          cache_dir: str | Path | None = None) -> StepCost:
        """The slots' step cost (`calibration.slot_step_cost`)."""
        return slot_step_cost(self.store, self.batch_size, rows, reps, cache_dir)

    # ---- the steppable engine: add_request, step, abort ------------------------------------

    def add_request(self, request: Request) -> int:
        """Queue `request` for the next step with a free slot; its id, by which `step` reports it."""
        request_id = next(self._ids)
        self.waiting.append((request_id, request))
        return request_id

    def abort(self, request_id: int) -> bool:
        """Drop a waiting request, or end a decoding one now (its slot takes another at the next
        step); it is never reported. False where the engine does not hold it (ended, or unknown)."""
        for entry in self.waiting:
            if entry[0] == request_id:
                self.waiting.remove(entry)
                return True
        for i, seq in enumerate(self.slots):
            if seq is not None and seq.index == request_id:
                self._retire(i, None)
                return True
        return False

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting) or self.in_flight > 0

    @property
    def in_flight(self) -> int:
        """Sequences decoding now."""
        return self._in_flight

    def reset(self) -> None:
        """Forget every request, waiting or decoding (a fresh engine, its KV store and counts kept)."""
        self.slots, self.waiting, self._in_flight, self._ids = [], deque(), 0, itertools.count()

    @torch.inference_mode()
    def step(self) -> list[tuple[int, Generation | Exception]]:
        """One step of the batch (the module docstring's 1-5). The requests that ended in it, as
        (id, Generation), or (id, the exception that ended it: a bad prompt, a drafter or
        `on_step` that raised); the others go on."""
        ended = self._admit_waiting()
        active = [i for i, s in enumerate(self.slots) if s is not None]
        drafts: list[Draft | None] = []
        for i in active:  # 2. draft
            try:
                drafts.append(self.slots[i].propose(self.vocab))
            except Exception as e:  # noqa: BLE001
                ended.append(self._retire(i, e))
                drafts.append(None)
        drafts = [d for i, d in zip(active, drafts) if self.slots[i] is not None]
        active = [i for i in active if self.slots[i] is not None]
        if not active:
            return ended
        live = [self.slots[i] for i in active]
        if self.budget is not None and any(d is not None for d in drafts):
            cap = self.budget.cap(sum(len(s.fresh) for s in live), drafts,
                                  [self.budget.rate(s.accepted, s.offered) for s in live])
            drafts = [None if d is None or cap == 0 else d.limit_size(cap) for d in drafts]
        # 3. one forward, 4. verify and commit
        t0 = time.perf_counter()
        logits = self.store.forward(live, drafts, active)
        self.forward_passes += 1
        sizes = [1 + (len(d) if d is not None else 0) for d in drafts]
        best = top_two(logits)[0].tolist()  # every row's argmax in one call (greedy verification)
        for i, seq, draft, rows, first in zip(active, live, drafts, logits.split(sizes),
                                              itertools.accumulate([0, *sizes])):
            try:
                base = seq.length + len(seq.fresh)  # the store's index of draft node 0
                prefill = seq.prefilling
                path = seq.settle(draft, rows, best[first: first + len(rows)], self.store.plain_steps,
                                  time.perf_counter() - t0)
                self.store.keep(i, seq, base, path or [], prefill and path is not None)
            except Exception as e:  # noqa: BLE001 - e.g. on_step ended it (a time budget, a closed stream)
                ended.append(self._retire(i, e))
                continue
            if seq.finish is not None:  # 5. retire
                ended.append(self._retire(i, seq.result()))
        return ended

    def run(self, requests: Iterable[Request]) -> Iterator[tuple[int, Generation | Exception]]:
        """Decode `requests` (read lazily, as slots free up) from a fresh engine; yields (request
        number, Generation or Exception, as `step`) as each sequence ends, in ending order."""
        self.reset()
        source = iter(requests)
        while True:
            while self.in_flight + len(self.waiting) < self.batch_size:
                if (request := next(source, None)) is None:
                    break
                self.add_request(request)
            if not self.has_unfinished_requests():
                return
            yield from self.step()

    # ---- admission and retirement ----------------------------------------------------------

    def _admit_waiting(self) -> list[tuple[int, Exception]]:
        """1. admit: waiting requests into free slots, in order, while the store has room (a request
        over the KV budget waits, and those behind it, until a sequence ends). The refused ones."""
        refused = []
        while self.waiting and self.in_flight < self.batch_size:
            request_id, request = self.waiting[0]
            try:
                if not self._admit(request_id, request):
                    break
            except Exception as e:  # noqa: BLE001 - one bad request must not stop the others
                refused.append((request_id, e))
            self.waiting.popleft()
        return refused

    def _retire(self, i: int, result: Generation | Exception | None) -> tuple[int, Generation | Exception | None]:
        request_id = self.slots[i].index
        self.slots[i] = None
        self.store.release(i)
        self._in_flight -= 1
        return request_id, result

    def _admit(self, request_id: int, request: Request) -> bool:
        """Put `request` into a free slot; False where the store has no room for it now."""
        prompt, params = list(request.prompt), request.params
        if not prompt:
            raise ValueError("the prompt is empty")
        if params.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need the engine's tokenizer")
        if len(prompt) >= self.context:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the model's context is {self.context}")
        slots = self.slots
        if not self.in_flight:
            slots.clear()  # an empty batch: its slots are made anew, sized by what comes in
        free = next((i for i, s in enumerate(slots) if s is None), len(slots))
        cached = self.store.admit(free, prompt, min(params.max_new_tokens, self.context - len(prompt)),
                                  slots=len(slots), in_flight=self.in_flight, batch_size=self.batch_size)
        if cached is None:
            return False
        seq = Sequence(request_id, request, self.eos, self.context, cached, self.store.name, self.config.policy,
                       self.tokenizer)
        if free == len(slots):
            slots.append(seq)
        else:
            slots[free] = seq
        self._in_flight += 1
        return True



def generate_many(model, requests: list[Request], config: EngineConfig = EngineConfig(), **options) -> list[Generation]:
    """Decode `requests` with a `BatchEngine`; the generations in input order (an error raises)."""
    out: dict[int, Generation] = {}
    for index, result in BatchEngine(model, config, **options).run(requests):
        if isinstance(result, Exception):
            raise result
        out[index] = result
    return [out[i] for i in range(len(requests))]
