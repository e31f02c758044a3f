"""Training examples for the task specialists, read from the formats corrections and QA data come in.

GEC: BEA-2019 M2 files (annotator 0's edits applied), parallel source/target files, JSONL
`{"source", "target"}`. RAG: JSONL `{"question", "passages", "answer"}`, and QED's
`.jsonlines` (Natural Questions with their gold paragraph), made into that shape with other
paragraphs as distractors. A malformed line is a `DataError` naming its file and line: a file is
never skipped in silence.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from specsuite.retrieval.documents import jsonl_records


class DataError(ValueError):
    """A training file that cannot be read as its format says; the message names file and line."""


@dataclass(frozen=True)
class GecPair:
    source: str
    target: str


@dataclass(frozen=True)
class RagExample:
    question: str
    passages: tuple[str, ...]
    answer: str


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    try:
        with open(path, encoding="utf-8") as f:
            yield from enumerate(f, 1)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 ({e})") from None


def _json_records(path: Path) -> Iterator[tuple[int, dict]]:
    try:
        yield from jsonl_records(path, DataError)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 ({e})") from None


def _text(record: dict, key: str, where: str) -> str:
    value = record.get(key)
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: needs a non-empty string {key!r}")
    return value.strip()


# ---- GEC -----------------------------------------------------------------------------------------

_HYPHEN = re.compile(r"(?<=\w) - (?=\w)")


def read_m2(path: Path, annotator: int = 0) -> list[GecPair]:
    """Sentences of an M2 file with `annotator`'s edits applied ("noop" edits leave them as they are)."""
    pairs: list[GecPair] = []
    source: list[str] | None = None
    edits: list[tuple[int, int, str]] = []
    start_line = 0

    def close() -> None:
        if source is None:
            return
        target = list(source)
        for start, end, text in sorted(edits, reverse=True):  # right to left: offsets stay valid
            target[start:end] = text.split()
        # W&I's tokenizer splits hyphenated words ("medium - sized"); JFLEG and plain text keep them.
        join = lambda words: _HYPHEN.sub("-", " ".join(words))
        pairs.append(GecPair(join(source), join(target)))

    for n, line in _lines(path):
        line = line.rstrip("\n")
        if line.startswith("S "):
            close()
            source, edits, start_line = line[2:].split(), [], n
        elif line.startswith("A "):
            if source is None:
                raise DataError(f"{path}:{n}: an edit line before any 'S ' sentence line")
            fields = line[2:].split("|||")
            try:
                start, end = map(int, fields[0].split())
                kind, text, who = fields[1], fields[2], int(fields[5])
            except (ValueError, IndexError):
                raise DataError(f"{path}:{n}: not an M2 edit line ('A start end|||type|||text|||...|||annotator')") from None
            if not 0 <= start <= end <= len(source) and start != -1:
                raise DataError(f"{path}:{n}: edit span {start} {end} outside the {len(source)}-token sentence "
                                f"of line {start_line}")
            if who == annotator and kind != "noop" and start >= 0:
                edits.append((start, end, "" if text == "-NONE-" else text))
        elif line.strip():
            raise DataError(f"{path}:{n}: neither an 'S ' sentence nor an 'A ' edit line")
        else:
            close()
            source = None
    close()
    return pairs


def read_parallel(source_path: Path, target_path: Path) -> list[GecPair]:
    """Line-aligned source and target files."""
    sources, targets = list(_lines(source_path)), list(_lines(target_path))
    if len(sources) != len(targets):
        raise DataError(f"{source_path} has {len(sources)} lines, {target_path} {len(targets)}: not line-aligned")
    pairs = []
    for (n, s), (_, t) in zip(sources, targets):
        if not s.strip() or not t.strip():
            raise DataError(f"{source_path}:{n} / {target_path}:{n}: an empty line")
        pairs.append(GecPair(s.strip(), t.strip()))
    return pairs


def read_gec_jsonl(path: Path) -> list[GecPair]:
    return [GecPair(_text(r, "source", f"{path}:{n}"), _text(r, "target", f"{path}:{n}")) for n, r in _json_records(path)]


def read_gec(paths: Sequence[str | Path], targets: Sequence[str | Path] = ()) -> list[GecPair]:
    """GEC pairs from `.m2` and `.jsonl` files, and from each source file of `paths` paired with
    the file of `targets` at the same place (parallel text)."""
    paths = [Path(p) for p in paths]
    for p in paths + [Path(t) for t in targets]:
        if not p.is_file():
            raise DataError(f"no such file: {p}")
    pairs: list[GecPair] = []
    plain = [p for p in paths if p.suffix not in (".m2", ".jsonl")]
    if len(plain) != len(targets):
        raise DataError(f"{len(plain)} parallel source file(s) but {len(targets)} --targets file(s): give one "
                        f"target file for each source file that is not .m2 or .jsonl")
    for p in paths:
        if p.suffix == ".m2":
            pairs += read_m2(p)
        elif p.suffix == ".jsonl":
            pairs += read_gec_jsonl(p)
    for s, t in zip(plain, targets):
        pairs += read_parallel(s, Path(t))
    return pairs


_DETOKENIZE = [(re.compile(r" ([.,!?;:%)\]}])"), r"\1"), (re.compile(r"([(\[{$]) "), r"\1"),
               (re.compile(r" (n't|'s|'re|'ve|'ll|'d|'m)\b", re.I), r"\1"), (re.compile(r" ' "), "' ")]


def detokenize(text: str) -> str:
    """Undo the space-before-punctuation of tokenized corpora (M2, JFLEG, QED), so that a model
    trained on both forms keeps the form of whatever text it is given."""
    for pattern, repl in _DETOKENIZE:
        text = pattern.sub(repl, text)
    return text.replace("`` ", '"').replace(" ''", '"').replace("-LRB- ", "(").replace(" -RRB-", ")")


def mix_gec(pairs: Sequence[GecPair], unchanged_share: float = 0.2, detokenized_share: float = 0.5,
            seed: int = 0) -> list[GecPair]:
    """The pairs with edits, plus unchanged sentences up to `unchanged_share` of the result (a
    correct text comes back as it is), a `detokenized_share` of them in plain text; shuffled."""
    rng = random.Random(seed)
    edited = [p for p in pairs if p.source != p.target]
    same = [p for p in pairs if p.source == p.target]
    rng.shuffle(same)
    keep = int(len(edited) * unchanged_share / (1 - unchanged_share)) if unchanged_share < 1 else len(same)
    out = edited + same[:keep]
    out = [GecPair(detokenize(p.source), detokenize(p.target)) if rng.random() < detokenized_share else p for p in out]
    rng.shuffle(out)
    return out


# ---- RAG -----------------------------------------------------------------------------------------

def read_rag_jsonl(path: Path) -> list[RagExample]:
    out = []
    for n, r in _json_records(path):
        where = f"{path}:{n}"
        passages = r.get("passages")
        if not isinstance(passages, list) or not passages or not all(isinstance(p, str) and p.strip() for p in passages):
            raise DataError(f"{where}: needs 'passages', a non-empty list of non-empty strings")
        out.append(RagExample(_text(r, "question", where), tuple(passages), _text(r, "answer", where)))
    return out


def _normalized_question(q: str) -> str:
    return " ".join(re.sub(r"\W+", " ", q.lower()).split())


def _window(words: Sequence[str], size: int, rng: random.Random, holding: tuple[int, int] = (0, 0)) -> tuple[int, int]:
    """A random run of `size` words of `words` (all of them if fewer) that holds `holding`."""
    lo = max(0, holding[1] - size)
    hi = max(lo, min(holding[0], len(words) - size))
    start = rng.randint(lo, hi)
    return start, min(start + size, len(words))


def read_qed(paths: Sequence[str | Path], exclude_questions: Iterable[str] = (), distractors: tuple[int, int] = (2, 4),
             passage_words: int = 100, max_quote_words: int = 30, seed: int = 0) -> list[RagExample]:
    """QED examples (Natural Questions with their gold Wikipedia paragraph and answer span) as RAG
    examples shaped like retrieval results: `passage_words`-word windows of Wikipedia (as
    Spec-Bench's and DPR's passages are), the gold one among other questions' windows at a random
    place. The answer is the sentence that holds the span, inside the window and cut to
    `max_quote_words` around it, followed by its passage's [n]. Questions in `exclude_questions`
    (an evaluation set) are dropped."""
    excluded = {_normalized_question(q) for q in exclude_questions}
    rows = []
    for path in map(Path, paths):
        for n, r in _json_records(path):
            try:
                paragraph, question = r["paragraph_text"], r["question_text"]
                spans, starts = r["answer_spans"], r["sentence_starts"]
            except KeyError as e:
                raise DataError(f"{path}:{n}: not a QED record (no {e.args[0]!r})") from None
            if spans and _normalized_question(question) not in excluded:
                rows.append((question, paragraph, spans[0], starts))
    rng = random.Random(seed)
    out = []
    for question, paragraph, (a, b), starts in rows:
        words = paragraph.split(" ")
        word_at = lambda char: paragraph.count(" ", 0, char)  # noqa: E731 - QED's tokens are space-separated
        first, end = word_at(a), word_at(max(b - 1, a)) + 1
        sentences = sorted({word_at(c) for c in starts})
        s0 = max((w for w in sentences if w <= first), default=0)
        s1 = min((w for w in sentences if w >= end), default=len(words))
        w0, w1 = _window(words, passage_words, rng, (first, end))
        before, answer, after = words[max(s0, w0):first], words[first:end], words[end:min(s1, w1)]
        room = max(max_quote_words - len(answer), 0)
        after = after[:max(room // 2, room - len(before))]
        before = before[max(len(before) - (room - len(after)), 0):]
        quote = detokenize(" ".join(before + answer + after)).rstrip(" .")
        passages = []
        for _ in range(rng.randint(*distractors)):
            other = rows[rng.randrange(len(rows))][1].split(" ")
            passages.append(detokenize(" ".join(other[slice(*_window(other, passage_words, rng))])))
        at = rng.randint(0, len(passages))
        passages.insert(at, detokenize(" ".join(words[w0:w1])))
        out.append(RagExample(question[:1].upper() + question[1:] + "?", tuple(passages), f"{quote} [{at + 1}]."))
    return out
