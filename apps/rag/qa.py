"""Question answering over passages: retrieve, prompt, decode with reference drafting, cite.

    qa = RagQA("corpus.idx")                      # or RagQA.from_loaded(model, tokenizer, index)
    answer = qa.ask("Who commanded Apollo 11?")  # retrieve k passages, then answer from them
    answer = qa.answer(question, ["passage one", "passage two"])  # caller-given passages

Passages are numbered from 1 everywhere, as the prompt shows them to the model: `[n]` citations,
`Answer.citations`, the passage number of `Answer.claims`, and `Answer.passages[n - 1]`.
Decoding is greedy and lossless: the drafter and the prefix cache change the speed, not the text.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence, Union

from specsuite.apps.batching import decode_in_order
from specsuite.apps.jobs.runner import JobWorker
from specsuite.apps.limits import MAX_QUESTION_TOKENS, Deadline, InputError, admit, check_k, check_limit, check_text
from specsuite.core import (
    DraftModelDrafter, Drafter, Generation, NoDrafter, PrefixCache, PromptLookupDrafter, TextPiece, eos_token_ids,
    generate, stream,
)
from specsuite.apps.serving.batch_server import BatchServer
from specsuite.core.speculation.draft import FallbackDrafter
from specsuite.core.scheduler.engine import BatchEngine, EngineConfig, Request
from specsuite.core.scheduler.sequence import SamplingParams
from specsuite.core.scheduler.generate import context_length
from specsuite.models import DEFAULT_MODEL, load_model, model_name
from specsuite.core.model.backend import Backend, choose_backend

from .drafter import ReferenceDrafter
from .prompt import rag_prompt_ids

if TYPE_CHECKING:
    from specsuite.retrieval import Passage, PassageIndex

from . import DEFAULT_MIN_RELEVANCE, DRAFTERS
DEFAULT_PREFIX_CACHE_BYTES = 1 << 30
PassageLike = Union["Passage", str]
Scored = tuple[PassageLike, Union[float, None]]  # a passage and its retrieval score (None: given by the caller)

_CITATION = re.compile(r"\[(\d+(?:\s*[,;]\s*\d+)*)\]")
_WORD = re.compile(r"\w+")
_SENTENCE = re.compile(r"[^.!?\n]*(?:[.!?]+(?:\s*\[[\d,; ]+\])?|(?=\n)|$)")  # a sentence, with the [n] that follows its end


def passage_body(p: PassageLike) -> str:
    return p if isinstance(p, str) else p.text


def passage_json(p: PassageLike) -> dict[str, Any]:
    if isinstance(p, str):
        return {"text": p}
    return {"id": p.id, "doc_id": p.doc_id, "title": p.title, "source": p.source, "url": p.url, "text": p.text}


def parse_citations(text: str, count: int) -> list[int]:
    """Passage numbers cited as [n] or [n, m] in `text`, in order of first citation; numbers
    outside 1..count (not a passage) are dropped."""
    cited: list[int] = []
    for match in _CITATION.finditer(text):
        for number in map(int, re.findall(r"\d+", match.group(1))):
            if 1 <= number <= count and number not in cited:
                cited.append(number)
    return cited


@dataclass(frozen=True)
class Claim:
    """A part of the answer and the passage text it rests on: `answer.text[start:end]` comes from
    passage `passage`, `passage_body(answer.passages[passage - 1][0])[passage_start:passage_end]`.

    how: "copied": the answer quotes the passage range verbatim (at least `min_words` words), found
    whether or not the model wrote [n]; "cited": the model wrote [n] in a sentence that copies
    nothing from passage n, and the range is the passage sentence sharing the most words with it.
    """

    start: int
    end: int
    passage: int
    passage_start: int
    passage_end: int
    how: str

    def to_json(self) -> dict[str, Any]:
        return {"start": self.start, "end": self.end, "passage": self.passage,
                "passage_start": self.passage_start, "passage_end": self.passage_end, "how": self.how}


def copied_spans(text: str, passages: Sequence[str], min_words: int = 4) -> list[Claim]:
    """The parts of `text` that appear verbatim in a passage, as "copied" claims: greedy,
    leftmost-longest runs of at least `min_words` words (compared case-insensitively, ignoring
    punctuation and spacing between words), with their character range in the passage."""
    words = list(_WORD.finditer(text))
    keys = [w.group().lower() for w in words]
    found = [list(_WORD.finditer(p)) for p in passages]
    sources = [[w.group().lower() for w in f] for f in found]
    starts: dict[tuple[str, ...], list[tuple[int, int]]] = {}  # first words -> (passage, word index)
    for number, seq in enumerate(sources, 1):
        for j in range(len(seq) - min_words + 1):
            starts.setdefault(tuple(seq[j: j + min_words]), []).append((number, j))
    claims, i = [], 0
    while i + min_words <= len(keys):
        best, best_number, best_j = 0, 0, 0
        for number, j in starts.get(tuple(keys[i: i + min_words]), ()):
            seq, n = sources[number - 1], min_words
            while i + n < len(keys) and j + n < len(seq) and keys[i + n] == seq[j + n]:
                n += 1
            if n > best:
                best, best_number, best_j = n, number, j
        if best:
            source = found[best_number - 1]
            claims.append(Claim(words[i].start(), words[i + best - 1].end(), best_number, source[best_j].start(),
                                source[best_j + best - 1].end(), "copied"))
            i += best
        else:
            i += 1
    return claims


def _sentences(text: str) -> list[tuple[int, int]]:
    return [m.span() for m in _SENTENCE.finditer(text) if m.group().strip()]


def _best_sentence(sentence: str, passage: str) -> tuple[int, int]:
    """The range of the sentence of `passage` sharing the most words with `sentence` (the whole
    passage where none shares a word)."""
    want = {w.lower() for w in _WORD.findall(sentence)}
    best, best_span = 0, (0, len(passage))
    for start, end in _sentences(passage):
        shared = len(want & {w.lower() for w in _WORD.findall(passage[start:end])})
        if shared > best:
            best, best_span = shared, (start, end)
    return best_span


def find_claims(text: str, passages: Sequence[str], min_words: int = 4) -> list[Claim]:
    """Claim-level citations of an answer: its copied spans (`copied_spans`), merged with the
    model's own [n] citations ("cited" claims: the answer sentence holding [n], where it copies
    nothing from passage n), in order of their place in the answer."""
    claims = copied_spans(text, passages, min_words)
    for start, end in _sentences(text):
        sentence = text[start:end]
        for n in parse_citations(sentence, len(passages)):
            if any(c.passage == n and start <= c.start < end for c in claims):
                continue
            lead = len(sentence) - len(sentence.lstrip())
            claims.append(Claim(start + lead, start + len(sentence.rstrip()), n,
                                *_best_sentence(_CITATION.sub("", sentence), passages[n - 1]), "cited"))
    return sorted(claims, key=lambda c: (c.start, c.passage))


@dataclass
class Answer:
    text: str
    passages: list[Scored]
    claims: list[Claim]  # the parts of the answer and the passage ranges they rest on (copied or [n])
    stats: dict[str, Any]
    question: str = ""

    @property
    def citations(self) -> list[int]:
        """The passages the answer rests on, copied from or cited as [n], in order of first use."""
        return list(dict.fromkeys(c.passage for c in self.claims))

    @property
    def spans(self) -> list[tuple[int, int, int]]:
        """(start, end, passage number) of the copied parts: text[start:end] is copied from it."""
        return [(c.start, c.end, c.passage) for c in self.claims if c.how == "copied"]

    def to_json(self) -> dict[str, Any]:
        return {
            "question": self.question, "answer": self.text, "citations": self.citations,
            "claims": [c.to_json() for c in self.claims], "spans": [list(s) for s in self.spans],
            "passages": [{"number": n, "score": score, **passage_json(p)}
                         for n, (p, score) in enumerate(self.passages, 1)],
            "stats": self.stats,
        }

    def to_record(self) -> dict[str, Any]:
        """The answer as a record of the bulk job (`specsuite rag answer`)."""
        return {**self.to_json(), "truncated": self.stats.get("finish_reason") in ("length", "context")}


class RagQA:
    """Answers questions from retrieved (or given) passages with one causal LM.

    index_dir: a saved PassageIndex (None: only `answer`/`stream_answer` with given passages).
    drafter: "reference" (copy from the passages), "prompt-lookup" or "none" (plain decoding).
    prefix_cache_bytes: budget of the prompt KV cache shared across calls (0 turns it off); a
        follow-up question over the same passages then only computes the question's tokens.
        Default (None): 1 GiB where the backend keeps a prefix cache lossless (int8, fp32), else
        off: there the cached prompt's rows can round otherwise than a whole prefill and flip a
        later token (see the README's *Exactness*). The batched engine shares it.
    draft_model: a small model with the same tokenizer (a preset name, e.g. "qwen2.5-0.5b" for the
        1.5B target) that drafts where the passages have nothing to copy (`FallbackDrafter`).
    max_question_tokens: the longest question accepted (default: `limits.MAX_QUESTION_TOKENS`, or
        less where the model's context with the answer budget `max_new_tokens` holds less). Every entry point checks its input first (`validate`):
        a bad question or k is an InputError before any model work.
    backend: a `choose_backend` kind: "fast" (default: int8 where this CPU runs it fast, else "auto";
        int8's prefix cache is lossless, so questions over the same passages skip their prefill),
        "auto" (the model's own numerics), "exact", "plain", or "int8" (answers are int8 greedy
        decoding's, not the model's own).
    adapter: "auto" (the RAG adapter shipped for this preset, if any), "none" (the base model),
        or a folder written by `specsuite train rag`; merged into the weights at load.
    min_relevance: `ask` keeps, of its k retrieved passages, those scoring at least this share of
        the best one's (default 0.5; 0: all k). Caller-given passages are always all used.
    """

    def __init__(self, index_dir: str | None = None, model: str = DEFAULT_MODEL, drafter: str = "reference",
                 prefix_cache_bytes: int | None = None, max_new_tokens: int = 256, dtype: str | None = None,
                 max_question_tokens: int | None = None, batch_size: int = 1, draft_model: str | None = None,
                 backend: str = "fast", adapter: str | None = "auto",
                 min_relevance: float = DEFAULT_MIN_RELEVANCE) -> None:
        index = None
        if index_dir is not None:
            from specsuite.retrieval import PassageIndex

            index = PassageIndex.load(index_dir)
        loaded, tokenizer = load_model(model, dtype=dtype, adapter=adapter, task="rag")
        small = load_model(draft_model, dtype=loaded.dtype)[0] if draft_model else None
        self._setup(loaded, tokenizer, index, drafter, prefix_cache_bytes, max_new_tokens, max_question_tokens,
                    batch_size, small, choose_backend(loaded, backend), min_relevance)

    @classmethod
    def from_loaded(cls, model, tokenizer, index: "PassageIndex | None" = None, drafter: str = "reference",
                    prefix_cache_bytes: int | None = None, max_new_tokens: int = 256,
                    max_question_tokens: int | None = None, batch_size: int = 1, draft_model=None,
                    backend: Backend | str | None = None, min_relevance: float = DEFAULT_MIN_RELEVANCE) -> "RagQA":
        """A RagQA over an already loaded model, tokenizer, index and draft model (tests, notebooks);
        backend: one already chosen for the model, or a kind for `choose_backend` (None: "auto")."""
        qa = cls.__new__(cls)
        qa._setup(model, tokenizer, index, drafter, prefix_cache_bytes, max_new_tokens, max_question_tokens,
                  batch_size, draft_model,
                  backend if isinstance(backend, Backend) else choose_backend(model, backend or "auto"), min_relevance)
        return qa

    def _setup(self, model, tokenizer, index, drafter: str, prefix_cache_bytes: int | None,
               max_new_tokens: int, max_question_tokens: int | None, batch_size: int, draft_model,
               backend: Backend, min_relevance: float) -> None:
        if drafter not in DRAFTERS:
            raise ValueError(f"unknown drafter {drafter!r}; use one of {', '.join(DRAFTERS)}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if not 0 <= min_relevance <= 1:
            raise ValueError(f"min_relevance must be between 0 and 1, got {min_relevance!r}")
        self.min_relevance = min_relevance
        # batch_size > 1: concurrent calls join one running batch (BatchServer) instead of taking
        # turns; each answer is then greedy up to the rounding of batched rows (a near-tie may flip).
        self.batch_size = batch_size
        self._server: BatchServer | None = None
        self.model, self.tokenizer, self.index, self.backend = model, tokenizer, index, backend
        self.drafter, self.max_new_tokens, self.draft_model = drafter, max_new_tokens, draft_model
        self.context = context_length(model)
        if self.max_new_tokens >= self.context:
            raise ValueError(f"max_new_tokens ({max_new_tokens}) leaves no room in the model's context ({self.context})")
        self.max_question_tokens = int(check_limit(max_question_tokens, "max_question_tokens")
                                       or min(MAX_QUESTION_TOKENS, self.context - max_new_tokens))
        if prefix_cache_bytes is None:
            prefix_cache_bytes = DEFAULT_PREFIX_CACHE_BYTES if backend.lossless_prefix_cache else 0
        self.prefix_cache = PrefixCache(model.config, max_bytes=prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        self.eos = sorted(eos_token_ids(model, tokenizer))
        self._lock = threading.Lock()  # one generation at a time: the model and cache are shared
        self._retrieve_lock = threading.Lock()

    # -- the steps --------------------------------------------------------------------------------

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def validate(self, question: object, k: object = None) -> tuple[str, int | None]:
        """The question and k (None: not asked for) if they can be answered, else InputError: the
        one check of every entry point (Python API, CLI, web UI and its `ask` endpoint)."""
        question = check_text(question, "question", self.count_tokens, self.max_question_tokens)
        return question, None if k is None else check_k(k)

    def retrieve(self, question: str, k: int = 5) -> list[tuple["Passage", float]]:
        """The k passages nearest to the question, best first, less those under `min_relevance`."""
        from specsuite.retrieval import relevant

        if self.index is None:
            raise ValueError("this RagQA has no passage index; pass passages to answer() instead")
        # One search at a time: concurrent callers' searches would each run the embedding model's
        # and faiss's threads on the same cores as the batch's forward, many times oversubscribed.
        with self._retrieve_lock:
            return relevant(self.index.search(question, k), self.min_relevance)

    def make_drafter(self, passages: Sequence[str]) -> Drafter:
        if self.drafter == "reference":
            drafter = ReferenceDrafter.for_passages(self.tokenizer, passages)
        else:
            drafter = PromptLookupDrafter() if self.drafter == "prompt-lookup" else NoDrafter()
        if self.draft_model is None:
            return drafter
        return FallbackDrafter(drafter, DraftModelDrafter(self.draft_model))

    def _generate(self, prompt: list[int], drafter: Drafter, deadline: Deadline, on_step=None) -> Generation:
        admit(self.model, len(prompt), deadline, self.backend)  # OverBudgetError before any model work
        if self.batch_size > 1:
            request = Request(prompt, drafter, SamplingParams(self.max_new_tokens), on_step=deadline.on_step(on_step))
            return self._batch_server().run(request, deadline)
        deadline.acquire(self._lock)  # waits for another request's generation, within the budget
        try:
            deadline.check()
            return generate(self.model, prompt, drafter, max_new_tokens=self.max_new_tokens, eos_token_id=self.eos,
                            on_step=deadline.on_step(on_step), prefix_cache=self.prefix_cache, backend=self.backend)
        finally:
            self._lock.release()

    def _batch_server(self) -> BatchServer:
        with self._lock:
            if self._server is None:
                config = EngineConfig(self.batch_size, backend=self.backend, prefix_cache=self.prefix_cache)
                self._server = BatchServer(BatchEngine(self.model, config, eos_token_id=self.eos))
            return self._server

    def job_worker(self, k: int = 5, batch_size: int = 16) -> JobWorker:
        """This app as the worker of a bulk job over a file of questions (`apps/jobs/runner.py`)."""
        return JobWorker(functools.partial(self.answer_each, k=k, batch_size=batch_size), self.count_tokens,
                         self.max_question_tokens)

    def answer_each(self, questions: Iterable[str], k: int = 5, batch_size: int = 16) -> Iterator[Answer | Exception]:
        """Answers to `questions` (read lazily) from their `k` retrieved passages, in order,
        decoded together in the batched engine; a question that fails gives its exception (for
        bulk jobs: `specsuite rag answer`)."""
        k = check_k(k)

        def plan(question: str) -> tuple[tuple[str, list[Scored], dict[str, Any]], list[Request]]:
            question, _ = self.validate(question)
            scored, extra = self._retrieve_timed(question, k)
            prompt, drafter = self._request(question, scored)
            return (question, scored, extra), [Request(prompt, drafter, SamplingParams(self.max_new_tokens))]

        def finish(asked: tuple[str, list[Scored], dict[str, Any]], generations: list[Generation]) -> Answer:
            question, scored, extra = asked
            return self._finish(question, scored, generations[0], extra)

        engine = BatchEngine(self.model, EngineConfig(batch_size, backend=self.backend), eos_token_id=self.eos)
        return decode_in_order(engine, questions, plan, finish)

    def _finish(self, question: str, scored: list[Scored], generation: Generation,
                extra: dict[str, Any]) -> Answer:
        text = self.tokenizer.decode(generation.tokens, skip_special_tokens=True).strip()
        bodies = [passage_body(p) for p, _ in scored]
        s = generation.stats
        stats = {**extra, "model": model_name(self.model), "drafter": self.drafter, "finish_reason": generation.finish_reason,
                 "ttft_s": round(s.prefill_s, 4),
                 "tokens_per_s": round(s.new_tokens / s.total_s, 2) if s.total_s else 0.0, **s.as_dict()}
        return Answer(text, scored, find_claims(text, bodies), stats, question)

    def _request(self, question: str, scored: list[Scored]) -> tuple[list[int], Drafter]:
        bodies = [passage_body(p) for p, _ in scored]
        prompt = rag_prompt_ids(self.tokenizer, question, bodies)
        if len(prompt) + self.max_new_tokens > self.context:
            raise InputError(f"the question and its {len(bodies)} passages take {len(prompt):,} tokens; with the "
                             f"answer budget of {self.max_new_tokens:,} tokens the model's context of "
                             f"{self.context:,} holds {self.context - self.max_new_tokens:,}: ask a shorter "
                             "question or use fewer passages")
        return prompt, self.make_drafter(bodies)

    def _complete(self, question: str, scored: list[Scored], extra: dict[str, Any], deadline: Deadline) -> Answer:
        return self._finish(question, scored, self._generate(*self._request(question, scored), deadline), extra)

    def _stream(self, question: str, scored: list[Scored], extra: dict[str, Any],
                deadline: Deadline) -> Iterator[TextPiece | Answer]:
        run = functools.partial(self._generate, *self._request(question, scored), deadline)
        for item in stream(run, self.tokenizer):
            yield item if isinstance(item, TextPiece) else self._finish(question, scored, item, extra)

    def _retrieve_timed(self, question: str, k: int) -> tuple[list[Scored], dict[str, Any]]:
        start = time.perf_counter()
        scored = list(self.retrieve(question, k))
        return scored, {"retrieval_s": round(time.perf_counter() - start, 4)}

    # -- the API --------------------------------------------------------------------------------
    # Each entry point validates its input first (InputError). time_budget_s: seconds the call may
    # take, waiting for another call's generation included; past it, TimeBudgetExceeded ends the
    # generation at its next step (None: no limit).

    def answer(self, question: str, passages: Sequence[PassageLike | Scored], *,
               time_budget_s: float | None = None) -> Answer:
        """Answer from caller-given passages (strings, Passages, or (passage, score) pairs)."""
        deadline = Deadline(time_budget_s)
        question, _ = self.validate(question)
        return self._complete(question, _as_scored(passages), {}, deadline)

    def ask(self, question: str, k: int = 5, *, time_budget_s: float | None = None) -> Answer:
        """Retrieve the `k` passages nearest to the question (less those under `min_relevance`),
        then answer from them."""
        deadline = Deadline(time_budget_s)
        question, k = self.validate(question, k)
        return self._complete(question, *self._retrieve_timed(question, k), deadline)

    def stream_answer(self, question: str, passages: Sequence[PassageLike | Scored], *,
                      time_budget_s: float | None = None) -> Iterator[TextPiece | Answer]:
        """Like `answer`, yielding TextPieces as they are decoded, then the Answer."""
        deadline = Deadline(time_budget_s)
        question, _ = self.validate(question)
        return self._stream(question, _as_scored(passages), {}, deadline)

    def stream_ask(self, question: str, k: int = 5, *, time_budget_s: float | None = None) -> Iterator[TextPiece | Answer]:
        """Like `ask`, yielding TextPieces as they are decoded, then the Answer."""
        deadline = Deadline(time_budget_s)
        question, k = self.validate(question, k)
        return self._stream(question, *self._retrieve_timed(question, k), deadline)


def _as_scored(passages: Sequence[PassageLike | Scored]) -> list[Scored]:
    return [p if isinstance(p, tuple) else (p, None) for p in passages]
