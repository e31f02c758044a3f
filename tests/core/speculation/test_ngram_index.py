"""NgramIndex and CopiedDraft, the pieces the copying drafters share (no model)."""

from specsuite.core.speculation.prompt_lookup import CopiedDraft, NgramIndex


def test_a_growing_list_is_indexed_as_it_grows():
    index, tokens = NgramIndex(2), [5, 6, 7]
    index.extend(tokens)
    assert index.positions([6, 7]) == []  # nothing follows 6 7 yet
    tokens += [5, 6]
    index.extend(tokens)
    assert index.positions([6, 7]) == [(0, 3)]
    assert index.positions([5, 6]) == [(0, 2)]  # the first occurrence only (max_positions=1)
    assert index.lookup(tokens) == ((0, 2), 2)  # the longest suffix: 5 6, then 7
    assert index.lookup([1, 2]) is None


def test_several_sources_up_to_max_positions():
    index = NgramIndex(3, max_positions=2)
    for source, tokens in enumerate([[1, 2, 3], [9, 1, 2, 4], [1, 2, 5]]):
        index.extend(tokens, source)
    assert index.positions([1, 2]) == [(0, 2), (1, 3)]  # the first two of three
    assert index.positions([9, 1, 2]) == [(1, 3)]


def test_keep_last_and_a_complete_list():
    index = NgramIndex(1, keep="last", max_positions=2)
    index.extend([4, 4, 4, 4], complete=True)  # its end counts: 4 ends the list
    assert index.positions([4]) == [(0, 4), (0, 3)]


def test_copied_draft_knows_where_each_node_came_from():
    # Two continuations sharing their first token: from source 0 at 10, from source 1 at 20.
    copied = CopiedDraft([((0, 10), [7, 8, 9]), ((1, 20), [7, 5])])
    draft = copied.draft
    assert draft.tokens == [7, 8, 9, 5] and draft.parents == [-1, 0, 1, 0]
    assert copied.origins_of(draft, [0]) == [(0, 10), (1, 20)]
    assert copied.origins_of(draft, [0, 3]) == [(1, 21)]
    cut = draft.limit_depth(2)  # renumbers: 7 8 5
    assert copied.origins_of(cut, [0, 2]) == [(1, 21)]
    assert copied.origins_of(draft, []) == []
