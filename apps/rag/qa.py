"""Question answering over passages: retrieve, prompt, decode with reference drafting, cite.

    qa = RagQA("corpus.idx")                      # or RagQA.from_loaded(model, tokenizer, index)
    answer = qa.ask("Who commanded Apollo 11?")  # retrieve k passages, then answer from them
    answer = qa.answer(question, ["passage one", "passage two"])  # caller-given passages

Passages are numbered from 1 everywhere, as the prompt shows them to the model: `[n]` citations,
`Answer.citations`, the passage number of `Answer.spans`, and `Answer.passages[n - 1]`.
Decoding is greedy and lossless: the drafter and the prefix cache change the speed, not the text.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Sequence, Union

from specsuite.core import (Drafter, Generation, NoDrafter, PrefixCache, PromptLookupDrafter, TextPiece,
                            eos_token_ids, generate, stream)
from specsuite.core.models import DEFAULT_MODEL, load_model
from specsuite.core.prefix_cache import lossless_by_default

from .drafter import ReferenceDrafter
from .prompt import rag_prompt_ids

if TYPE_CHECKING:
    from specsuite.retrieval import Passage, PassageIndex

DRAFTERS = ("reference", "prompt-lookup", "none")
DEFAULT_PREFIX_CACHE_BYTES = 1 << 30
PassageLike = Union["Passage", str]
Scored = tuple[PassageLike, Union[float, None]]  # a passage and its retrieval score (None: given by the caller)

_CITATION = re.compile(r"\[(\d+(?:\s*[,;]\s*\d+)*)\]")
_WORD = re.compile(r"\w+")


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


def copied_spans(text: str, passages: Sequence[str], min_words: int = 4) -> list[tuple[int, int, int]]:
    """(start, end, passage number) of the parts of `text` that appear verbatim in a passage:
    greedy, leftmost-longest runs of at least `min_words` words (compared case-insensitively,
    ignoring punctuation and spacing between words)."""
    words = list(_WORD.finditer(text))
    keys = [w.group().lower() for w in words]
    sources = [[w.lower() for w in _WORD.findall(p)] for p in passages]
    starts: dict[tuple[str, ...], list[tuple[int, int]]] = {}  # first words -> (passage, word index)
    for number, seq in enumerate(sources, 1):
        for j in range(len(seq) - min_words + 1):
            starts.setdefault(tuple(seq[j: j + min_words]), []).append((number, j))
    spans, i = [], 0
    while i + min_words <= len(keys):
        best, best_number = 0, 0
        for number, j in starts.get(tuple(keys[i: i + min_words]), ()):
            seq, n = sources[number - 1], min_words
            while i + n < len(keys) and j + n < len(seq) and keys[i + n] == seq[j + n]:
                n += 1
            if n > best:
                best, best_number = n, number
        if best:
            spans.append((words[i].start(), words[i + best - 1].end(), best_number))
            i += best
        else:
            i += 1
    return spans


@dataclass
class Answer:
    text: str
    passages: list[Scored]
    citations: list[int]  # passage numbers cited as [n], in order of first citation
    stats: dict[str, Any]
    spans: list[tuple[int, int, int]]  # (start, end, passage number): text[start:end] is copied from it
    question: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "question": self.question, "answer": self.text, "citations": self.citations,
            "passages": [{"number": n, "score": score, **passage_json(p)}
                         for n, (p, score) in enumerate(self.passages, 1)],
            "spans": [{"start": s, "end": e, "passage": n} for s, e, n in self.spans],
            "stats": self.stats,
        }


class RagQA:
    """Answers questions from retrieved (or given) passages with one causal LM.

    index_dir: a saved PassageIndex (None: only `answer`/`stream_answer` with given passages).
    drafter: "reference" (copy from the passages), "prompt-lookup" or "none" (plain decoding).
    prefix_cache_bytes: budget of the prompt KV cache shared across calls (0 turns it off); a
        follow-up question over the same passages then only computes the question's tokens.
        Default (None): 1 GiB in fp32, off in other dtypes, where the cached prompt's rows can round
        otherwise than a whole prefill and flip a later token (see the README's *Exactness*).
    """

    def __init__(self, index_dir: str | None = None, model: str = DEFAULT_MODEL, drafter: str = "reference",
                 prefix_cache_bytes: int | None = None, max_new_tokens: int = 256, dtype: str | None = None) -> None:
        index = None
        if index_dir is not None:
            from specsuite.retrieval import PassageIndex

            index = PassageIndex.load(index_dir)
        loaded, tokenizer = load_model(model, dtype=dtype)
        self._setup(loaded, tokenizer, index, drafter, prefix_cache_bytes, max_new_tokens)

    @classmethod
    def from_loaded(cls, model, tokenizer, index: "PassageIndex | None" = None, drafter: str = "reference",
                    prefix_cache_bytes: int | None = None, max_new_tokens: int = 256) -> "RagQA":
        """A RagQA over an already loaded model, tokenizer and index (tests, notebooks)."""
        qa = cls.__new__(cls)
        qa._setup(model, tokenizer, index, drafter, prefix_cache_bytes, max_new_tokens)
        return qa

    def _setup(self, model, tokenizer, index, drafter: str, prefix_cache_bytes: int | None,
               max_new_tokens: int) -> None:
        if drafter not in DRAFTERS:
            raise ValueError(f"unknown drafter {drafter!r}; use one of {', '.join(DRAFTERS)}")
        self.model, self.tokenizer, self.index = model, tokenizer, index
        self.drafter, self.max_new_tokens = drafter, max_new_tokens
        if prefix_cache_bytes is None:
            prefix_cache_bytes = DEFAULT_PREFIX_CACHE_BYTES if lossless_by_default(model) else 0
        self.prefix_cache = PrefixCache(model.config, max_bytes=prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        self.eos = sorted(eos_token_ids(model, tokenizer))
        self._lock = threading.Lock()  # one generation at a time: the model and cache are shared

    # -- the steps --------------------------------------------------------------------------------

    def retrieve(self, question: str, k: int = 5) -> list[tuple["Passage", float]]:
        if self.index is None:
            raise ValueError("this RagQA has no passage index; pass passages to answer() instead")
        return self.index.search(question, k)

    def make_drafter(self, passages: Sequence[str]) -> Drafter:
        if self.drafter == "reference":
            return ReferenceDrafter.for_passages(self.tokenizer, passages)
        return PromptLookupDrafter() if self.drafter == "prompt-lookup" else NoDrafter()

    def _generate(self, prompt: list[int], drafter: Drafter, on_step=None) -> Generation:
        with self._lock:
            return generate(self.model, prompt, drafter, max_new_tokens=self.max_new_tokens, eos_token_id=self.eos,
                            on_step=on_step, prefix_cache=self.prefix_cache)

    def _finish(self, question: str, scored: list[Scored], generation: Generation,
                extra: dict[str, Any]) -> Answer:
        text = self.tokenizer.decode(generation.tokens, skip_special_tokens=True).strip()
        bodies = [passage_body(p) for p, _ in scored]
        s = generation.stats
        stats = {**extra, "model": getattr(self.model, "name_or_preset", None), "drafter": self.drafter, "finish_reason": generation.finish_reason,
                 "ttft_s": round(s.prefill_s, 4),
                 "tokens_per_s": round(s.new_tokens / s.total_s, 2) if s.total_s else 0.0, **s.as_dict()}
        return Answer(text, scored, parse_citations(text, len(scored)), stats, copied_spans(text, bodies), question)

    def _request(self, question: str, scored: list[Scored]) -> tuple[list[int], Drafter]:
        bodies = [passage_body(p) for p, _ in scored]
        return rag_prompt_ids(self.tokenizer, question, bodies), self.make_drafter(bodies)

    def _complete(self, question: str, scored: list[Scored], extra: dict[str, Any]) -> Answer:
        return self._finish(question, scored, self._generate(*self._request(question, scored)), extra)

    def _stream(self, question: str, scored: list[Scored], extra: dict[str, Any]) -> Iterator[TextPiece | Answer]:
        for item in stream(functools.partial(self._generate, *self._request(question, scored)), self.tokenizer):
            yield item if isinstance(item, TextPiece) else self._finish(question, scored, item, extra)

    def _retrieve_timed(self, question: str, k: int) -> tuple[list[Scored], dict[str, Any]]:
        start = time.perf_counter()
        scored = list(self.retrieve(question, k))
        return scored, {"retrieval_s": round(time.perf_counter() - start, 4)}

    # -- the API --------------------------------------------------------------------------------

    def answer(self, question: str, passages: Sequence[PassageLike | Scored]) -> Answer:
        """Answer from caller-given passages (strings, Passages, or (passage, score) pairs)."""
        return self._complete(question, _as_scored(passages), {})

    def ask(self, question: str, k: int = 5) -> Answer:
        """Retrieve the `k` passages nearest to the question, then answer from them."""
        return self._complete(question, *self._retrieve_timed(question, k))

    def stream_answer(self, question: str, passages: Sequence[PassageLike | Scored]) -> Iterator[TextPiece | Answer]:
        """Like `answer`, yielding TextPieces as they are decoded, then the Answer."""
        return self._stream(question, _as_scored(passages), {})

    def stream_ask(self, question: str, k: int = 5) -> Iterator[TextPiece | Answer]:
        """Like `ask`, yielding TextPieces as they are decoded, then the Answer."""
        return self._stream(question, *self._retrieve_timed(question, k))


def _as_scored(passages: Sequence[PassageLike | Scored]) -> list[Scored]:
    return [p if isinstance(p, tuple) else (p, None) for p in passages]
