"""The draft tree (core/speculation/draft.py): structure, depth and size limits, the size ladder."""

from __future__ import annotations

import pytest
import torch

from specsuite.core import Draft
from specsuite.core.speculation.draft import SizeLadder


def test_draft_chain_and_depths():
    d = Draft.chain([4, 5, 6])
    assert d.parents == [-1, 0, 1] and d.depths == [1, 2, 3] and d.is_chain and len(d) == 3


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-1, 2, 0], [-2], [-1, 0, 5]])
def test_draft_parents_must_precede_children(parents):
    with pytest.raises(ValueError, match="parent"):
        Draft(list(range(len(parents))), parents)


def test_draft_needs_one_parent_per_token():
    with pytest.raises(ValueError):
        Draft([1, 2], [-1])


def test_from_paths_merges_shared_prefixes():
    d = Draft.from_paths([[1, 2, 3], [1, 2, 4], [1, 5], [6], [1, 2, 3, 7]])
    assert d.tokens == [1, 2, 3, 4, 5, 6, 7]
    assert d.parents == [-1, 0, 1, 1, 0, -1, 2]
    assert d.depths == [1, 2, 3, 3, 2, 1, 4]
    assert not d.is_chain
    assert Draft.from_paths([[3, 4, 5]]).is_chain
    assert len(Draft.from_paths([])) == 0


def test_limit_depth_keeps_a_valid_tree_and_its_probs():
    d = Draft.from_paths([[1, 2, 3], [1, 4], [5, 6, 7, 8]])
    d.probs = torch.arange(len(d), dtype=torch.float32)[:, None].repeat(1, 3)
    assert d.limit_depth(4) is d
    two = d.limit_depth(2)
    # kept nodes in order: 1 (d1), 2 (d2), 4 (d2), 5 (d1), 6 (d2)
    assert two.tokens == [1, 2, 4, 5, 6]
    assert two.parents == [-1, 0, 0, -1, 3]
    assert two.depths == [1, 2, 2, 1, 2]
    old = [d.tokens.index(t) for t in two.tokens]
    assert torch.equal(two.probs[:, 0], torch.tensor(old, dtype=torch.float32))
    one = d.limit_depth(1)
    assert one.tokens == [1, 5] and one.parents == [-1, -1]
    assert len(d.limit_depth(0)) == 0


def test_limit_size_keeps_the_shallowest_nodes_as_a_valid_tree():
    d = Draft.from_paths([[1, 2, 3], [1, 4], [5, 6, 7, 8]])  # nodes 1 2 3 4 5 6 7 8, depths 1 2 3 2 1 2 3 4
    d.probs = torch.arange(len(d), dtype=torch.float32)[:, None].repeat(1, 3)
    assert d.limit_size(8) is d
    four = d.limit_size(4)  # depth 1 (1, 5), then depth 2 in layout order (2, 4)
    assert four.tokens == [1, 2, 4, 5] and four.parents == [-1, 0, 0, -1]
    assert torch.equal(four.probs[:, 0], torch.tensor([0.0, 1.0, 3.0, 4.0]))
    chain = Draft.chain([9, 8, 7, 6, 5])
    assert chain.limit_size(3).tokens == [9, 8, 7] and chain.limit_size(3).is_chain


def test_size_ladder_climbs_on_whole_acceptances_and_drops_on_a_partial_one():
    ladder = SizeLadder((3, 7, 15))
    assert ladder.value == 3
    ladder.update(accepted=3, deepest=3)
    assert ladder.value == 7
    ladder.update(accepted=7, deepest=7)
    ladder.update(accepted=15, deepest=15)
    assert ladder.value == 15  # the top rung holds
    ladder.update(accepted=4, deepest=15)
    assert ladder.value == 3
    with pytest.raises(ValueError):
        SizeLadder((3, 0))
