"""GLEU for grammatical error correction, as computed by JFLEG's `eval/gleu.py`.

A re-implementation of the multi-reference GLEU of Napoles et al. (ACL 2015, revised
2016; github.com/keisks/jfleg, eval/gleu.py, 2016-11-04), the metric of the JFLEG
leader board. Per sentence and n-gram order k = 1..4 the statistics are

    numerator_k   = max(|H & R| - |H & (S \\ R)|, 0)   (clipped n-gram counts)
    denominator_k = max(len(h) + 1 - k, 0)

with H, R, S the k-gram multisets of hypothesis, one reference and source, and S \\ R the
source n-grams (with their counts) whose n-gram does not occur in R at all: n-grams the
reference changed and the hypothesis kept are penalised. Corpus GLEU sums the statistics
over sentences and is exp(min(0, 1 - r/c) + mean_k log(num_k / den_k)), 0 if any sum is 0.

With several references, each of `iterations` rounds picks one reference per sentence at
random, and the score is the mean (std, normal 95% interval) over rounds. The random
choices are those of the original, a Python 2 script: round j seeds `random.seed(101 * j)`
and draws `randint(0, refs - 1)` once per sentence in order; Python 2's randint is
`int(random() * refs)`, which is emulated here because Python 3's randint draws differently
from the same seed.

Differences, none of which change a score the original computes: the order n is honoured
(the original fixes it at 4), and the interval of a zero std is (mean, mean) instead of
scipy's NaNs.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

import numpy as np

Tokens = Sequence[str]


@dataclass(frozen=True)
class GleuResult:
    """GLEU in [0, 1] (the JFLEG leader board prints 100x), over the reference-sampling rounds."""

    mean: float
    std: float
    ci: tuple[float, float]


def tokenize(line: str) -> list[str]:
    """Split like the original's Python 2 `line.split()` on bytes: ASCII whitespace only.

    Python 3's str.split() would also split on no-break and other Unicode spaces.
    """
    return [t.decode("utf-8") for t in line.encode("utf-8").split()]


def read_tokenized(path: str | Path) -> list[list[str]]:
    """One tokenized sentence per line of a UTF-8 file."""
    with open(path, encoding="utf-8", newline="\n") as f:
        return [tokenize(line) for line in f]


def _ngrams(tokens: Tokens, k: int) -> Counter:
    return Counter(tuple(tokens[i:i + k]) for i in range(len(tokens) + 1 - k))


def sentence_stats(source: Tokens, reference: Tokens, hypothesis: Tokens, n: int = 4) -> list[int]:
    """[len(h), len(r), num_1, den_1, ..., num_n, den_n] for one hypothesis and one reference."""
    stats = [len(hypothesis), len(reference)]
    for k in range(1, n + 1):
        h, r, s = _ngrams(hypothesis, k), _ngrams(reference, k), _ngrams(source, k)
        # The original's get_ngram_diff: drop every source n-gram the reference has at all.
        s_not_r = Counter({g: c for g, c in s.items() if g not in r})
        stats.append(max(sum((h & r).values()) - sum((h & s_not_r).values()), 0))
        stats.append(max(len(hypothesis) + 1 - k, 0))
    return stats


def gleu_from_stats(stats: Sequence[int], smooth: bool = False) -> float:
    """GLEU of summed statistics; `smooth` (used for sentence scores) turns zeros into ones."""
    if smooth:
        stats = [s if s != 0 else 1 for s in stats]
    if any(s == 0 for s in stats):
        return 0.0
    c, r = stats[0], stats[1]
    precisions = list(zip(stats[2::2], stats[3::2]))
    log_precision = sum(math.log(num / den) for num, den in precisions) / len(precisions)
    return math.exp(min(0.0, 1 - r / c) + log_precision)


def _summary(scores: Sequence[float]) -> GleuResult:
    """The original's get_gleu_stats: mean, population std, normal 95% interval."""
    mean, std = float(np.mean(scores)), float(np.std(scores))
    half = NormalDist().inv_cdf(0.975) * std
    return GleuResult(mean, std, (mean - half, mean + half))


def reference_choices(num_sentences: int, num_refs: Sequence[int], iterations: int, seed: int = 0) -> np.ndarray:
    """(iterations, sentences) reference indices, drawn as the original's Python 2 run does.

    Round j seeds with `seed + 101 * j` (seed=0 is the original).
    """
    choices = np.empty((iterations, num_sentences), dtype=np.int64)
    for j in range(iterations):
        rng = random.Random(seed + 101 * j)
        # Python 2 randint(0, k - 1) == int(random() * k); the original uses one k for all
        # sentences (the number of reference files).
        choices[j] = [int(rng.random() * num_refs[i]) for i in range(num_sentences)]
    return choices


def corpus_gleu(
    sources: Sequence[Tokens],
    references: Sequence[Sequence[Tokens]],
    hypotheses: Sequence[Tokens],
    n: int = 4,
    iterations: int = 500,
    seed: int = 0,
) -> GleuResult:
    """Corpus GLEU of tokenized `hypotheses`; `references[i]` holds the references of sentence i.

    With the JFLEG dev/test files (4 references each) and the defaults this gives the
    numbers of `python gleu.py -r ref0..3 -s src --hyp hyp`.
    """
    if not (len(sources) == len(references) == len(hypotheses)):
        raise ValueError(
            f"{len(sources)} sources, {len(references)} reference sets, {len(hypotheses)} hypotheses"
        )
    if any(len(refs) == 0 for refs in references):
        raise ValueError("every sentence needs at least one reference")
    width = max((len(refs) for refs in references), default=1)
    # stats[i, r]: statistics of sentence i against its reference r (computed once, not per round).
    stats = np.zeros((len(hypotheses), width, 2 + 2 * n), dtype=np.int64)
    for i, (src, refs, hyp) in enumerate(zip(sources, references, hypotheses)):
        for r, ref in enumerate(refs):
            stats[i, r] = sentence_stats(src, ref, hyp, n)
    choices = reference_choices(len(hypotheses), [len(refs) for refs in references], iterations, seed)
    sums = stats[np.arange(len(hypotheses)), choices].sum(axis=1)  # (iterations, 2 + 2n)
    return _summary([gleu_from_stats(row.tolist()) for row in sums])


def sentence_gleu(source: Tokens, references: Sequence[Tokens], hypothesis: Tokens, n: int = 4) -> GleuResult:
    """The original's per-sentence score (`--sent`): smoothed GLEU against each reference, summarised."""
    return _summary([gleu_from_stats(sentence_stats(source, ref, hypothesis, n), smooth=True) for ref in references])


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m specsuite.apps.gec.gleu -r REF... -s SRC --hyp HYP...` (the original's arguments)."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref", "-r", nargs="+", required=True, help="reference file(s)")
    parser.add_argument("--src", "-s", required=True, help="source file")
    parser.add_argument("--hyp", nargs="+", required=True, help="hypothesis file(s)")
    parser.add_argument("-n", type=int, default=4, help="n-gram order")
    parser.add_argument("--iter", type=int, default=500, help="reference-sampling rounds")
    args = parser.parse_args(argv)
    sources = read_tokenized(args.src)
    references = [list(refs) for refs in zip(*(read_tokenized(p) for p in args.ref), strict=True)]
    for path in args.hyp:
        result = corpus_gleu(sources, references, read_tokenized(path), n=args.n, iterations=args.iter)
        lo, hi = result.ci
        print(f"{path}\tGLEU {result.mean:f}\tstd {result.std:f}\t95% CI ({lo:.3f},{hi:.3f})")


if __name__ == "__main__":
    main()
