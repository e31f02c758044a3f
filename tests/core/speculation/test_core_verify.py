"""Verification (core/speculation/verify.py) on hand-made logits: the tree attention mask, greedy verification, `top_two`."""

from __future__ import annotations

import pytest
import torch

from specsuite.core import Draft
from specsuite.core.speculation.verify import tree_attention_mask, verify_greedy


def _rows(mask):
    return [[int(v) for v in row] for row in mask[0, 0]]


def test_tree_attention_mask_small_tree():
    d = Draft([10, 11, 12, 13], [-1, 0, 0, 1])  # node 0 with children 1 and 2; node 3 under node 1
    m = tree_attention_mask(d, past=2)
    assert m.shape == (1, 1, 5, 7) and m.dtype == torch.bool
    assert _rows(m) == [
        # past  root  n0 n1 n2 n3
        [1, 1, 1, 0, 0, 0, 0],  # root
        [1, 1, 1, 1, 0, 0, 0],  # node 0
        [1, 1, 1, 1, 1, 0, 0],  # node 1
        [1, 1, 1, 1, 0, 1, 0],  # node 2: not its sibling
        [1, 1, 1, 1, 1, 0, 1],  # node 3: root, 0, 1, itself
    ]


def test_tree_attention_mask_with_extra_rows():
    d = Draft([10, 11, 12], [-1, -1, 1])  # two roots' children; node 2 under node 1
    m = tree_attention_mask(d, past=1, extra=2)
    assert m.shape == (1, 1, 6, 7)
    assert _rows(m) == [
        # past x0 x1 root n0 n1 n2
        [1, 1, 0, 0, 0, 0, 0],  # extra 0
        [1, 1, 1, 0, 0, 0, 0],  # extra 1
        [1, 1, 1, 1, 0, 0, 0],  # root
        [1, 1, 1, 1, 1, 0, 0],  # node 0
        [1, 1, 1, 1, 0, 1, 0],  # node 1
        [1, 1, 1, 1, 0, 1, 1],  # node 2
    ]


def test_tree_attention_mask_of_a_chain_is_causal():
    m = tree_attention_mask(Draft.chain([1, 2, 3]), past=3, extra=1)
    assert torch.equal(m[0, 0], torch.ones(5, 8, dtype=torch.bool).tril(3))


def logits_with_argmax(best: list[int], vocab: int = 10, gap: float = 1.0) -> torch.Tensor:
    """Rows whose argmax is `best[i]`, beating the runner-up (the next index) by `gap`."""
    rows = torch.zeros(len(best), vocab)
    for i, b in enumerate(best):
        rows[i, b] = 2.0
        rows[i, (b + 1) % vocab] = 2.0 - gap
    return rows


def test_verify_greedy_chain():
    d = Draft.chain([5, 7, 9])
    assert verify_greedy(d, logits_with_argmax([5, 7, 3, 0])) == ([0, 1], 3)
    assert verify_greedy(d, logits_with_argmax([5, 7, 9, 4])) == ([0, 1, 2], 4)
    assert verify_greedy(d, logits_with_argmax([1, 7, 9, 4])) == ([], 1)


def test_verify_greedy_tree_follows_the_matching_child():
    d = Draft.from_paths([[1, 2], [1, 3], [4]])  # tokens [1, 2, 3, 4], parents [-1, 0, 0, -1]
    assert (d.tokens, d.parents) == ([1, 2, 3, 4], [-1, 0, 0, -1])
    assert verify_greedy(d, logits_with_argmax([1, 3, 0, 6, 0])) == ([0, 2], 6)
    assert verify_greedy(d, logits_with_argmax([1, 2, 8, 0, 0])) == ([0, 1], 8)
    assert verify_greedy(d, logits_with_argmax([4, 0, 0, 0, 7])) == ([3], 7)
    assert verify_greedy(d, logits_with_argmax([1, 5, 0, 0, 0])) == ([0], 5)
    assert verify_greedy(d, logits_with_argmax([9, 0, 0, 0, 0])) == ([], 9)


def test_verify_greedy_exact_tie_takes_the_first_index_like_generate():
    logits = torch.zeros(2, 10)
    logits[0, [3, 6]] = 1.0
    logits[1, 2] = 1.0
    assert verify_greedy(Draft.chain([6]), logits) == ([], 3)
    assert verify_greedy(Draft.chain([3]), logits) == ([0], 2)


def test_verify_greedy_tie_margin_stops_before_an_unsure_row():
    d = Draft.chain([5, 7, 9])
    near = logits_with_argmax([5, 7, 9, 4], gap=1.0)
    near[1, 8] = near[1, 7] - 0.05  # row 1 (after node 0) is a near-tie
    assert verify_greedy(d, near) == ([0, 1, 2], 4)  # no margin: trusted
    assert verify_greedy(d, near, tie_margin=0.01) == ([0, 1, 2], 4)
    assert verify_greedy(d, near, tie_margin=0.1) == ([0], None)  # recompute after node 0
    root_tie = logits_with_argmax([5, 7, 3, 0], gap=0.05)
    assert verify_greedy(d, root_tie, tie_margin=0.1) == ([], None)


def test_verify_greedy_tie_margin_in_a_tree():
    d = Draft.from_paths([[1, 2], [1, 3]])
    logits = logits_with_argmax([1, 3, 0, 6])
    logits[3, 7] = logits[3, 6] - 0.01  # the row after node 2 is unsure
    assert verify_greedy(d, logits, tie_margin=0.1) == ([0, 2], None)
    assert verify_greedy(d, logits, tie_margin=0.001) == ([0, 2], 6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [96, 1024, 151936])
def test_top_two_equals_argmax_and_topk_with_ties(dtype, vocab):
    from specsuite.core.speculation.verify import top_two

    gen = torch.Generator().manual_seed(vocab)
    for trial in range(30):
        logits = (torch.randn(5, vocab, generator=gen) * 4).to(dtype)
        if trial % 2:  # exact ties of the maximum, in one block or across blocks
            spots = torch.randint(0, vocab, (3,), generator=gen)
            logits[:, spots] = logits.max() + 1
            if trial % 4 == 1:
                logits[:, spots[0] // 128 * 128 + 1 if vocab > 256 else 0] = logits.max()
        best, first, second = top_two(logits)
        ref = logits.float().topk(2, dim=-1).values
        assert torch.equal(best, logits.argmax(-1)), trial
        assert torch.equal(first, ref[:, 0]) and torch.equal(second, ref[:, 1]), trial
