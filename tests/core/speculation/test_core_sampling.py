"""Speculative sampling is lossless: the tokens it emits are distributed exactly as plain sampling.

The exact target distribution of the first two tokens is enumerated (vocabulary of 8) from the
model's own probabilities, warped by Hugging Face's logits processors (independent of
`core.verify.warp`). Empirical distributions of seeded runs are compared with it by total
variation (TV) distance and a chi-square test. Negative controls (deliberately wrong samplers) show
the same statistics do catch a biased sampler.

Tolerances. An exact sampler's TV distance from the truth is itself random, with mean about
floor = 0.5 * sum_x sqrt(2 p(x) (1 - p(x)) / (pi N)) (p: the exact distribution, N samples), and
rarely above 2.3x that (simulated: the 99.9th percentile, 12-token distributions). So:
- the TV of each one-token marginal (first token; second token) must stay below
  max(0.05, 3 * floor); the tests keep that bound <= 0.07 by their choice of N and model;
- the TV of the joint of both tokens (V * V = 64 cells) below max(0.1, 2 * floor);
- a Pearson chi-square test of the joint must give p > 1e-3.
A negative control must break a marginal bound and get chi-square p < 1e-6.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from transformers import (
    AutoModelForCausalLM, LlamaConfig, LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper,
    TopPLogitsWarper,
)

from specsuite.core import Draft, Drafter, DraftModelDrafter, generate, Sampling, SamplingParams
from specsuite.core.speculation.verify import verify_sample, warp
from conftest import policy

steps_mod = importlib.import_module("specsuite.core.scheduler.sequence")  # where the loop verifies each step

V = 8
PROMPT = [3, 1, 4, 1, 5, 2, 6, 5]
MARGINAL_TOLERANCE = 0.05  # TV of the first-token and of the second-token marginal, at least
JOINT_TOLERANCE = 0.1  # TV of the joint of both, at least
MIN_P_VALUE = 1e-3  # chi-square on the joint: an exact sampler fails this one time in a thousand


# ---- statistics ----------------------------------------------------------------------------

def hf_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """(rows, vocab) logits -> probabilities, through HF's own warpers (as `generate(do_sample=True)`)."""
    procs = [TemperatureLogitsWarper(sampling.temperature)]
    if sampling.top_k:
        procs.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1:
        procs.append(TopPLogitsWarper(sampling.top_p))
    scores = LogitsProcessorList(procs)(torch.zeros(logits.shape[0], 1, dtype=torch.long), logits.float().clone())
    return scores.softmax(-1)


def empirical(pairs: list[tuple[int, int]], vocab: int = V) -> torch.Tensor:
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    for a, b in pairs:
        counts[a, b] += 1
    return counts


def tv(counts: torch.Tensor, exact: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - exact.double()).abs().sum())


def chi_square_p(counts: torch.Tensor, exact: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells expecting < 5 counts are pooled into one."""
    n = counts.sum()
    obs, exp = counts.flatten(), exact.double().flatten() * n
    big = exp >= 5
    o = torch.cat([obs[big], obs[~big].sum()[None]])
    e = torch.cat([exp[big], exp[~big].sum()[None]])
    if e[-1] < 5:  # too little to stand alone: fold the pool into the smallest big cell
        i = int(torch.argmin(e[:-1]))
        o[i] += o[-1]
        e[i] += e[-1]
        o, e = o[:-1], e[:-1]
    stat = float(((o - e) ** 2 / e).sum())
    df = len(o) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def floor(exact: torch.Tensor, n: float) -> float:
    """Expected TV distance of n exact samples from `exact` (normal approximation per cell)."""
    p = exact.double().flatten()
    return float(0.5 * (2 * p * (1 - p) / (torch.pi * n)).sqrt().sum())


def check(counts: torch.Tensor, exact: torch.Tensor) -> tuple[bool, bool, float, str]:
    """(marginals within bounds, joint within bounds, chi-square p, a description)."""
    n = float(counts.sum())
    first_tol = max(MARGINAL_TOLERANCE, 3 * floor(exact.sum(1), n))
    second_tol = max(MARGINAL_TOLERANCE, 3 * floor(exact.sum(0), n))
    joint_tol = max(JOINT_TOLERANCE, 2 * floor(exact, n))
    first, second, joint = tv(counts.sum(1), exact.sum(1)), tv(counts.sum(0), exact.sum(0)), tv(counts, exact)
    p = chi_square_p(counts, exact)
    msg = (f"N={n:.0f}: TV first {first:.4f} (bound {first_tol:.3f}), second {second:.4f} (bound {second_tol:.3f}), "
           f"joint {joint:.4f} (bound {joint_tol:.3f}); chi-square p {p:.2g}")
    return first < first_tol and second < second_tol, joint < joint_tol, p, msg


def assert_matches(counts: torch.Tensor, exact: torch.Tensor) -> None:
    n = float(counts.sum())
    assert 3 * max(floor(exact.sum(1), n), floor(exact.sum(0), n)) <= 0.07, "too few samples for a tight bound"
    marginals_ok, joint_ok, p, msg = check(counts, exact)
    assert marginals_ok and joint_ok and p > MIN_P_VALUE, msg


def assert_differs(counts: torch.Tensor, exact: torch.Tensor) -> None:
    marginals_ok, _, p, msg = check(counts, exact)
    assert not marginals_ok and p < 1e-6, f"the wrong sampler went unnoticed: {msg}"


def test_statistics_accept_exact_samplers_and_reject_a_shifted_one():
    """Calibration of the checks: exact multinomial draws stay within every TV bound (100 runs over
    flat and peaked distributions) and, as they should, rarely fail the chi-square test (expected
    0.1 of 100); a source that makes one first token 1.5x as likely fails."""
    g = torch.Generator().manual_seed(0)
    chi_square_failures = 0
    for scale in (1.5, 2.0, 3.0, 4.0):
        exact = torch.softmax(torch.randn(V * V, generator=g, dtype=torch.float64) * scale, 0).reshape(V, V)
        for _ in range(25):
            draws = torch.multinomial(exact.flatten(), 2000, replacement=True, generator=g)
            marginals_ok, joint_ok, p, msg = check(torch.bincount(draws, minlength=V * V).reshape(V, V).double(), exact)
            assert marginals_ok and joint_ok, msg
            chi_square_failures += p <= MIN_P_VALUE
    assert chi_square_failures <= 2
    first = exact.sum(1)
    x = int((first * (1 - first)).argmax())  # the token where a shift shows most
    shifted = exact.clone()
    shifted[x] *= 1.5
    shifted /= shifted.sum()
    counts = torch.bincount(torch.multinomial(shifted.flatten(), 2000, replacement=True, generator=g),
                            minlength=V * V).reshape(V, V).double()
    assert_differs(counts, exact)


# ---- warp matches Hugging Face's logits processors -------------------------------------------

@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.7), Sampling(top_k=5),
                                      Sampling(top_p=0.8), Sampling(temperature=1.3, top_k=7, top_p=0.9),
                                      Sampling(top_k=1), Sampling(top_p=0.01)])
def test_warp_equals_hf_warpers(sampling):
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1)) * 3
    assert torch.allclose(warp(logits, sampling), hf_probs(logits, sampling), atol=1e-6)


@pytest.mark.parametrize("kwargs", [{"temperature": 0}, {"temperature": -1}, {"top_p": 0}, {"top_p": 1.5},
                                    {"top_k": -1}])
def test_bad_sampling_settings_are_rejected(kwargs):
    with pytest.raises(ValueError):
        Sampling(**kwargs)


# ---- verify_sample alone: two tokens from hand-made target conditionals ----------------------

class Target:
    """A made-up target over V tokens: root logits L0 and, per first token t, logits T[t] of the second."""

    def __init__(self, seed: int, sampling: Sampling, scale: float = 2.0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.L0 = torch.randn(V, generator=g) * scale
        self.T = torch.randn(V, V, generator=g) * scale
        self.sampling = sampling
        p1 = hf_probs(self.L0[None], sampling)[0]
        self.second = hf_probs(self.T, sampling)  # P(t2 | t1)
        self.exact = p1[:, None] * self.second  # joint of the first two tokens

    def logits(self, draft: Draft) -> torch.Tensor:
        """Rows [root, node_0, ...]: after a depth-1 node t the target's logits are T[t]; deeper rows
        (the third token) do not matter here."""
        rows = [self.L0] + [self.T[t] if d == 1 else torch.zeros(V) for t, d in zip(draft.tokens, draft.depths)]
        return torch.stack(rows)

    def two_tokens(self, draft: Draft, g: torch.Generator, sampler=verify_sample) -> tuple[int, int]:
        path, nxt = sampler(draft, self.logits(draft), self.sampling, g)
        toks = [draft.tokens[i] for i in path] + [nxt]
        if len(toks) < 2:  # what the next step of the loop does: sample from the target
            toks.append(int(torch.multinomial(self.second[toks[0]], 1, generator=g)))
        return toks[0], toks[1]


def accept_all(draft, logits, sampling, generator=None):
    """WRONG: takes the first child at every level, then samples from the target."""
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(draft.parents):
        kids.setdefault(p, []).append(i)
    path, node = [], -1
    while kids.get(node):
        node = kids[node][0]
        path.append(node)
    row = path[-1] + 1 if path else 0
    return path, int(torch.multinomial(warp(logits[row][None], sampling)[0], 1, generator=generator))


def no_residual(draft, logits, sampling, generator=None):
    """WRONG (a classic bug): after rejecting the draft, resamples from p instead of norm(max(p - q, 0))."""
    p_all = warp(logits, sampling)
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(draft.parents):
        kids.setdefault(p, []).append(i)
    path, row, node = [], 0, -1
    while True:
        p = p_all[row]
        for child in kids.get(node, []):
            x = draft.tokens[child]
            q = draft.probs[child] if draft.probs is not None else torch.eye(V)[x]
            if torch.rand((), generator=generator) * q[x] < p[x]:
                path.append(child)
                row, node = child + 1, child
                break
        else:
            return path, int(torch.multinomial(p, 1, generator=generator))


def _fixed_tree(target: Target) -> Draft:
    """A deterministic tree: the likeliest first token with its likeliest second; the third
    likeliest first token with its 2nd and 6th likeliest seconds; an unlikely first token alone.
    The likeliest branch is not laid out first."""
    order = target.exact.sum(1).argsort(descending=True).tolist()
    a, c, e = order[0], order[2], order[-2]
    b = target.exact[a].argmax().item()
    d1, d2 = target.exact[c].argsort(descending=True)[[1, 5]].tolist()
    return Draft.from_paths([[c, d1], [e], [a, b], [c, d2]])


SAMPLINGS = [Sampling(), Sampling(temperature=0.8, top_k=5, top_p=0.9)]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["t1", "topk-topp"])
def test_verify_sample_deterministic_tree_preserves_the_distribution(sampling):
    target = Target(seed=2, sampling=sampling)
    draft = _fixed_tree(target)
    g = torch.Generator().manual_seed(3)
    counts = empirical([target.two_tokens(draft, g) for _ in range(4000)])
    assert_matches(counts, target.exact)
    # the controls: the same statistics catch the two wrong samplers (fewer samples suffice)
    assert_differs(empirical([target.two_tokens(draft, g, accept_all) for _ in range(1000)]), target.exact)
    assert_differs(empirical([target.two_tokens(draft, g, no_residual) for _ in range(1000)]), target.exact)


def test_verify_sample_probabilistic_chain_preserves_the_distribution():
    """Drafts sampled from a draft distribution q (fresh each trial), q given with the draft."""
    sampling = Sampling()
    target = Target(seed=4, sampling=sampling)
    g = torch.Generator().manual_seed(5)
    q_first = torch.softmax(torch.randn(V, generator=g) * 2, 0)
    q_second = torch.softmax(torch.randn(V, V, generator=g) * 2, -1)  # q(x2 | x1)

    def draft() -> Draft:
        x1 = int(torch.multinomial(q_first, 1, generator=g))
        x2 = int(torch.multinomial(q_second[x1], 1, generator=g))
        return Draft.chain([x1, x2], torch.stack([q_first, q_second[x1]]))

    assert_matches(empirical([target.two_tokens(draft(), g) for _ in range(4000)]), target.exact)
    assert_differs(empirical([target.two_tokens(draft(), g, accept_all) for _ in range(1000)]), target.exact)
    assert_differs(empirical([target.two_tokens(draft(), g, no_residual) for _ in range(1000)]), target.exact)


# ---- the whole loop with a tiny random model --------------------------------------------------

def tiny_model(seed: int, init: float = 0.4):
    """A 1-layer random Llama over V tokens, fp32 (one layer: thousands of runs must stay fast);
    initializer_range sets how peaked it is."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         initializer_range=init, tie_word_embeddings=False, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)  # first token: probabilities ~0.51, 0.29, 0.14, ...


@pytest.fixture(scope="module")
def small():
    return tiny_model(seed=1)


def exact_two_tokens(model, sampling: Sampling) -> torch.Tensor:
    """P(t2, t3 | PROMPT), summed over the first token t1, by enumeration: the first draft is
    verified after the first token (the prefill has none). (V, V) float64."""
    with torch.inference_mode():
        p1 = hf_probs(model(torch.tensor([PROMPT])).logits[0, -1:], sampling)[0]
        p2 = hf_probs(model(torch.tensor([PROMPT + [t] for t in range(V)])).logits[:, -1], sampling)
        batch = torch.tensor([PROMPT + [t1, t2] for t1 in range(V) for t2 in range(V)])
        p3 = hf_probs(model(batch).logits[:, -1], sampling).reshape(V, V, V)
    return (p1[:, None, None] * p2[:, :, None] * p3).sum(0).double()


class FixedDrafter(Drafter):
    def __init__(self, draft: Draft) -> None:
        self.draft = draft

    def propose(self, tokens, max_depth):
        # The same draft at the first step after the prefill; none after it, as only t2, t3 are scored.
        return self.draft if len(tokens) == len(PROMPT) + 1 else None


def run_many(model, drafter_factory, sampling: Sampling, n: int, seed: int, prefill_draft: int = 0):
    """The empirical joint of the two tokens the scored step yields, and its accepted draft tokens:
    the first step after the prefill (t2, t3), or with `prefill_draft` the prefill itself (t1, t2)."""
    g = torch.Generator().manual_seed(seed)
    at = 0 if prefill_draft else 1
    pairs, accepted = [], []
    for _ in range(n):
        # four tokens, so that the scored step may accept a draft two deep; the whole draft,
        # uncapped (draft_sizes=()), is verified
        out = generate(model, PROMPT, drafter_factory(), SamplingParams(4, sampling, g), eos_token_id=[],
                       policy=policy(model, draft_sizes=(), prefill_draft=prefill_draft))
        pairs.append((out.tokens[at], out.tokens[at + 1]))
        accepted.append(out.stats.accepted[at])
    return empirical(pairs), accepted


def _e2e_draft(exact: torch.Tensor, chain: bool) -> Draft:
    """A chain from the second most likely first token (rejections happen often), or a tree: that
    chain, the third token with its likeliest and least likely successor, and a first token that
    top-k/top-p exclude (a drafted token the target cannot pick)."""
    order = exact.sum(1).argsort(descending=True).tolist()
    a, c = order[1], order[2]
    b = exact[a].argsort(descending=True)[1].item()
    if chain:
        return Draft.chain([a, b])
    return Draft.from_paths([[a, b], [c, exact[c].argmax().item()], [c, exact[c].argmin().item()], [order[-1]]])


@pytest.mark.parametrize("chain,sampling", [(True, Sampling()), (False, Sampling(temperature=0.9, top_k=5, top_p=0.9))],
                         ids=["chain-t1", "tree-topk-topp"])
def test_generate_with_a_fixed_draft_preserves_the_distribution(model, chain, sampling):
    exact = exact_two_tokens(model, sampling)
    draft = _e2e_draft(exact, chain)
    counts, accepted = run_many(model, lambda: FixedDrafter(draft), sampling, 1500, seed=6)
    assert_matches(counts, exact)
    assert accepted.count(0) > 100 and accepted.count(2) > 20  # rejections and two-deep acceptances


def test_generate_with_a_draft_model_preserves_the_distribution(model, small):
    sampling = Sampling()
    exact = exact_two_tokens(model, sampling)
    draft_gen = torch.Generator().manual_seed(7)
    counts, accepted = run_many(
        model, lambda: DraftModelDrafter(small, max_tokens=2, initial_tokens=2, generator=draft_gen),
        sampling, 1500, seed=8)
    assert_matches(counts, exact)
    assert accepted.count(0) > 100 and accepted.count(2) > 100


def test_a_draft_verified_in_the_prefill_preserves_the_distribution(model):
    """The prefill's forward verifies a draft too (fp32 on the CPU by default): the joint of the
    first two tokens is still the target's."""
    sampling = Sampling()
    with torch.inference_mode():
        p1 = hf_probs(model(torch.tensor([PROMPT])).logits[0, -1:], sampling)[0]
        p2 = hf_probs(model(torch.tensor([PROMPT + [t] for t in range(V)])).logits[:, -1], sampling)
    exact = (p1[:, None] * p2).double()
    a = int(p1.argsort(descending=True)[1])  # the second likeliest first token: often rejected
    draft = Draft.chain([a, int(p2[a].argmax())])

    class PrefillDrafter(Drafter):
        def propose(self, tokens, max_depth):
            return draft if len(tokens) == len(PROMPT) else None

    counts, accepted = run_many(model, PrefillDrafter, sampling, 1500, seed=9, prefill_draft=2)
    assert_matches(counts, exact)
    assert accepted.count(0) > 100 and accepted.count(2) > 100


def test_negative_control_a_wrong_sampler_in_the_loop_is_caught(model, monkeypatch):
    sampling = Sampling()
    exact = exact_two_tokens(model, sampling)
    first = exact.sum(1)
    x = int((first * (1 - first)).argmax())  # no_residual over-samples the drafted x by p(x)(1 - p(x))
    draft = Draft.chain([x, int(exact[x].argmax())])
    monkeypatch.setattr(steps_mod, "verify_sample", no_residual)
    counts, _ = run_many(model, lambda: FixedDrafter(draft), sampling, 600, seed=6)
    assert_differs(counts, exact)
