"""Grammar correction of texts of any length: one model, draft-then-verify decoding.

A text is cut into segments (whole sentences of one line within `context_limit` tokens), each
segment is corrected by greedy draft-then-verify decoding (token for token what plain greedy
decoding writes, only faster), and the corrections are put back into the text's own layout.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass, replace
from importlib import resources

from specsuite.core import Generation, PromptLookupDrafter, TextPiece, eos_token_ids, generate, turn_end_token
from specsuite.core import stream as stream_generation
from specsuite.core.model.backend import KINDS, Backend, choose_backend
from specsuite.core.speculation.draft import Drafter
from specsuite.core.scheduler.engine import BatchEngine, EngineConfig, Request, engine_supports
from specsuite.core.scheduler.sequence import SamplingParams
from specsuite.core.scheduler.generate import context_length
from specsuite.apps.batching import decode_in_order
from specsuite.apps.jobs.runner import JobWorker
from specsuite.models import DEFAULT_MODEL, load_model

from .drafter import CopyDrafter
from .edits import Edit, word_diff
from .limits import check_source
from .prompt import check_style, gec_prompt_ids, instruction_cache, instruction_ids
from .segment import Segment, join_segments, split_segments

DRAFTERS = ("copy", "prompt-lookup", "none")
# Sequences decoded together by correct_many. A step of a full batch is compute-bound on 2 cores
# (the draft budget then drops the drafts), yet larger batches still amortise each step's fixed
# cost and the job's tail: on 128 JFLEG sentences (bf16, AMX CPU) batch 64 made 8.29 sentences/s
# against 7.59 for 32, and 96/128 no more than 64 (an ad-hoc A/B of the engine, alternated in one
# process; `specsuite bench gec-batch` measures given sizes). The KV cache of 64 slots stays
# within the engine's byte budget.
DEFAULT_BATCH_SIZE = 64
MAX_CONTEXT_LIMIT = 1024  # longer segments gain nothing and make one slow step of a batch

# Stats that add up over segments and texts; the rates are derived from them (see combine_stats).
SUMMED_STATS = ("segments", "prompt_tokens", "cached_prompt_tokens", "new_tokens", "forward_passes",
                "drafted_tokens", "accepted_tokens", "prefill_s", "total_s", "estimated_plain_s")


@dataclass
class Correction:
    source: str
    text: str
    edits: list[Edit]
    stats: dict
    truncated: bool  # a segment hit max_new_tokens (or the context): its correction is cut short

    def to_record(self) -> dict:
        """The correction as a record of the batch job (`specsuite gec correct`)."""
        return {"source": self.source, "correction": self.text, "edits": [e.to_dict() for e in self.edits],
                "stats": dict(self.stats or {}), "truncated": bool(self.truncated)}


def correction_worker(**settings) -> JobWorker:
    """The job worker of a `Corrector(**settings)`: a picklable factory, as the Ray job needs."""
    return Corrector(**settings).job_worker()


def demo_sentences() -> list[str]:
    """The example sentences shipped with the package (for `specsuite gec demo` and the UI)."""
    text = resources.files(__package__).joinpath("demo_sentences.txt").read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def combine_stats(parts: Iterable[dict]) -> dict:
    """Sum the additive stats of segments (or of whole corrections) and derive the rates.

    `estimated_speedup` is an ESTIMATE of plain greedy decoding time / actual time: plain time is
    taken as the segment's own prefill plus one one-row step per further token, at the step cost
    measured once per machine and model (`StepCost`). It is not a measurement of plain decoding on
    these texts (run `specsuite bench gec` for that). In a batch, `total_s` is each segment's time
    in flight, shared with the others: the estimate means little there."""
    parts = list(parts)
    out: dict = {key: sum(p.get(key) or 0 for p in parts) for key in SUMMED_STATS}
    for key in ("prefill_s", "total_s", "estimated_plain_s"):
        out[key] = round(out[key], 4)
    out["decode_s"] = round(out["total_s"] - out["prefill_s"], 4)
    out["tokens_per_step"] = round(out["new_tokens"] / out["forward_passes"], 3) if out["forward_passes"] else 0.0
    out["acceptance_rate"] = round(out["accepted_tokens"] / out["drafted_tokens"], 3) if out["drafted_tokens"] else 0.0
    plain, total = out["estimated_plain_s"], out["total_s"]
    out["estimated_speedup"] = round(plain / total, 3) if plain > 0 and total > 0 else None
    return out


class Corrector:
    """Corrects texts with one loaded model; `drafter` is "copy", "prompt-lookup" or "none"."""

    def __init__(self, model: str = DEFAULT_MODEL, drafter: str = "copy", dtype: str | None = None,
                 max_new_tokens: int | None = None, batch_size: int = DEFAULT_BATCH_SIZE,
                 backend: str = "fast", style: str = "minimal", adapter: str | None = "auto") -> None:
        """backend: how the forwards are computed (`core.backend.choose_backend`): "fast" (int8
        where it runs on this CPU, else "auto"), "auto" (the model's own numerics, exact forms
        where affordable), "exact" for output token for token the model's greedy, at the cost of
        speed; "plain": the model's own forward.
        style: "minimal" edits (default) or "fluent" rewriting (`prompt.STYLES`).
        adapter: "auto" (the GEC adapter shipped for this preset, if any), "none" (the base
        model), or a folder written by `specsuite train gec`; merged into the weights at load."""
        _check(drafter, max_new_tokens, batch_size, style, backend)  # before the slow load
        self._setup(*load_model(model, dtype=dtype, adapter=adapter, task="gec"), drafter, max_new_tokens, batch_size,
                    backend, style)

    @classmethod
    def from_loaded(cls, model, tokenizer, drafter: str = "copy", max_new_tokens: int | None = None,
                    batch_size: int = DEFAULT_BATCH_SIZE, backend: str | Backend = "auto",
                    style: str = "minimal") -> Corrector:
        """A corrector on an already loaded (model, tokenizer), e.g. shared between tests; backend:
        a kind as in `__init__`, or a `Backend` already chosen for this model."""
        _check(drafter, max_new_tokens, batch_size, style)  # a backend kind: choose_backend checks it
        self = cls.__new__(cls)
        self._setup(model, tokenizer, drafter, max_new_tokens, batch_size, backend, style)
        return self

    def _setup(self, model, tokenizer, drafter: str, max_new_tokens: int | None, batch_size: int,
               backend: str | Backend, style: str) -> None:
        self.model, self.tokenizer, self.style = model, tokenizer, style
        # chosen once for the model, passed to every forward (generate() and the batched engine)
        self.backend = backend if isinstance(backend, Backend) else choose_backend(model, backend)
        self.drafter, self.max_new_tokens, self.batch_size = drafter, max_new_tokens, batch_size
        self.eos = sorted(eos_token_ids(model, tokenizer))
        self.end_tokens = [turn_end_token(model, tokenizer)]
        # The prompt holds the segment, the reply may be twice as long: a quarter of the context
        # per segment keeps both inside it (1024 tokens for the presets).
        self.context_limit = min(context_length(model) // 4, MAX_CONTEXT_LIMIT)
        self.prefix_cache = instruction_cache(model, self.backend)
        self.instruction = instruction_ids(tokenizer, style)
        self._engine: BatchEngine | None = None  # made on the first batched call
        self._engine_lock = threading.Lock()  # a server's first replies at once make it once

    # ---- public API ------------------------------------------------------------------------

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_tokens(self, requests: list[Request]) -> int:
        """The prompt tokens that reading `requests` costs, what `limits.admit` weighs: the
        instruction they share is read once (and is kept by the prefix cache and the batch)."""
        shared = len(self.instruction)
        return shared + sum(len(r.prompt) - shared for r in requests)

    def job_worker(self) -> JobWorker:
        """This corrector as the worker of a batch job over a file (`apps/jobs/runner.py`)."""
        return JobWorker(self.correct_each, self.count_tokens, self.context_limit)

    def segments(self, text: str) -> list[Segment]:
        return split_segments(text, self.count_tokens, self.context_limit)

    def correct(self, text: str) -> Correction:
        check_source(self, text)  # InputError for a non-string, blank or too long text
        segments = self.segments(text)
        return self._finish(text, segments, [self._generate(s.text) if s.text else None for s in segments])

    def correct_many(self, texts: Iterable[str], batch_size: int | None = None) -> Iterator[Correction]:
        """The corrections of `texts` (read lazily), in order. With a batch size above 1 (default
        `self.batch_size`), the segments of many texts decode together in the batched engine
        (continuous batching, the instruction's KV shared, copy drafts while a step has spare rows);
        with 1, one segment at a time with `generate()` (the exact path: token for token greedy)."""
        for result in self.correct_each(texts, batch_size):
            if isinstance(result, Exception):
                raise result
            yield result

    def correct_each(self, texts: Iterable[str], batch_size: int | None = None) -> Iterator[Correction | Exception]:
        """As `correct_many`, but a text whose correction fails gives its exception, and the
        others go on (for batch jobs)."""
        batch_size = self.batch_size if batch_size is None else batch_size
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if batch_size == 1 or not engine_supports(self.model):
            for text in texts:
                try:
                    yield self.correct(text)
                except Exception as e:  # noqa: BLE001 - reported per text
                    yield e
            return
        yield from self._correct_batched(texts, batch_size)

    def _correct_batched(self, texts: Iterable[str], batch_size: int) -> Iterator[Correction | Exception]:
        engine = self._batch_engine()
        engine.config = replace(engine.config, batch_size=batch_size)

        def plan(text: str) -> tuple[tuple[str, list[Segment]], list[Request]]:
            check_source(self, text)  # as correct() does
            parts = self.segments(text)
            return (text, parts), [self._request(s.text) for s in parts if s.text]

        def finish(planned: tuple[str, list[Segment]], generations: list[Generation]) -> Correction:
            text, parts = planned
            decoded = iter(generations)  # one per non-empty segment, in order
            return self._finish(text, parts, [next(decoded) if s.text else None for s in parts])

        # Every non-empty segment is one request; the longest of the next 2 x batch_size go first.
        return decode_in_order(engine, texts, plan, finish, longest_first=2 * batch_size)

    def _batch_engine(self) -> BatchEngine:
        with self._engine_lock:
            if self._engine is None:
                self._engine = BatchEngine(self.model, EngineConfig(prefix=self.instruction, backend=self.backend),
                                           eos_token_id=self.eos)
            return self._engine

    def _request(self, text: str) -> Request:
        budget = self.max_new_tokens or 2 * self.count_tokens(text) + 16
        return Request(gec_prompt_ids(self.tokenizer, text, self.style), self._make_drafter(text),
                       SamplingParams(budget))

    def stream(self, text: str) -> Iterator[TextPiece | Correction]:
        """TextPieces of the correction as it is decoded (the whitespace between segments comes
        from the source, as from_draft=False pieces), then the final Correction."""
        check_source(self, text)  # InputError for a non-string, blank or too long text
        segments = self.segments(text)
        generations: list[Generation | None] = []
        for seg in segments:
            if seg.lead:
                yield TextPiece(seg.lead, False)
            generations.append((yield from self._stream_segment(seg.text)) if seg.text else None)
            if seg.trail:
                yield TextPiece(seg.trail, False)
        yield self._finish(text, segments, generations)

    # ---- one segment -----------------------------------------------------------------------

    def _make_drafter(self, text: str) -> Drafter | None:
        if self.drafter == "copy":
            return CopyDrafter.for_text(self.tokenizer, text, end_tokens=self.end_tokens)
        if self.drafter == "prompt-lookup":
            return PromptLookupDrafter()
        return None

    def _generate(self, text: str, on_step=None) -> Generation:
        request = self._request(text)
        return generate(self.model, request.prompt, request.drafter, request.params,
                        eos_token_id=self.eos, on_step=on_step, prefix_cache=self.prefix_cache, backend=self.backend)

    def _stream_segment(self, text: str) -> Generator[TextPiece, None, Generation]:
        """The reply's pieces as `str.strip` leaves the reply: leading whitespace dropped, trailing
        whitespace held back until more text follows it. Returns the Generation."""
        held: list[TextPiece] = []
        started = False
        for item in stream_generation(functools.partial(self._generate, text), self.tokenizer):
            if isinstance(item, Generation):
                return item
            piece = item.text if started else item.text.lstrip()
            started = started or bool(piece)
            body = piece.rstrip()
            if body:
                yield from held
                held = []
                yield TextPiece(body, item.from_draft)
            if len(piece) > len(body):
                held.append(TextPiece(piece[len(body):], item.from_draft))
        raise RuntimeError("the generation stream ended without a result")

    def _reply(self, generation: Generation) -> str:
        return self.tokenizer.decode(generation.tokens, skip_special_tokens=True).strip()

    # ---- putting it together ---------------------------------------------------------------

    def _finish(self, source: str, segments: list[Segment], generations: list[Generation | None]) -> Correction:
        text = join_segments(segments, [self._reply(g) if g else "" for g in generations])
        done = [g for g in generations if g is not None]
        return Correction(
            source=source, text=text, edits=word_diff(source, text),
            stats=combine_stats(self._segment_stats(g) for g in done),
            truncated=any(g.finish_reason in ("length", "context") for g in done),
        )

    def _segment_stats(self, g: Generation) -> dict:
        s = g.stats
        # Plain decoding's time, estimated: our own prefill, then one one-row step per further
        # token at the cost `specsuite step-cost` style measurement gives for this machine and
        # model (measured once, cached on disk: see StepCost). An estimate, not a measurement.
        step = self._one_row_step_s()
        plain = s.prefill_s + max(0, s.new_tokens - 1) * step if step else 0.0
        return {"segments": 1, "prompt_tokens": s.prompt_tokens, "cached_prompt_tokens": s.cached_prompt_tokens,
                "new_tokens": s.new_tokens,
                "forward_passes": s.forward_passes, "drafted_tokens": sum(s.drafted),
                "accepted_tokens": sum(s.accepted), "prefill_s": s.prefill_s, "total_s": s.total_s,
                "estimated_plain_s": plain}

    def _one_row_step_s(self) -> float | None:
        """Seconds of a one-row decode step on this machine (the engine's measured step cost), or
        None where the engine does not run this model."""
        if not engine_supports(self.model):
            return None
        return self._batch_engine().budget.cost(1)


def _check(drafter: str, max_new_tokens: int | None, batch_size: int = 1, style: str = "minimal",
           backend: str = "auto") -> None:
    check_style(style)
    if backend not in KINDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {', '.join(KINDS)}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if drafter not in DRAFTERS:
        raise ValueError(f"unknown drafter {drafter!r}; use one of {', '.join(DRAFTERS)}")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
