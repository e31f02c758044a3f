"""The copy drafter's alignment, on token ids (no model): what it drafts after each kind of edit."""

import pytest

from specsuite.apps.gec.drafter import CopyDrafter

PROMPT = [1, 2, 3]
END = 9
COMMA = 50
# Source words: [10] [11 12 13] [20] [21] [22] [23] (11 12 13: one misspelt word of three tokens)
SOURCE = [10, 11, 12, 13, 20, 21, 22, 23]
WORDS = [0, 1, 4, 5, 6, 7]


def drafter(**kwargs) -> CopyDrafter:
    d = CopyDrafter(SOURCE, end_tokens=[END], word_starts=WORDS, punctuation={COMMA}, **kwargs)
    d.reset(PROMPT)
    return d


def paths(draft) -> list[list[int]]:
    """The draft's root-to-leaf paths, in the order their first nodes are laid out."""
    children = {i: [j for j, p in enumerate(draft.parents) if p == i] for i in range(-1, len(draft))}
    out = []

    def walk(node: int, path: list[int]) -> None:
        kids = children[node]
        if not kids:
            out.append(path)
        for k in kids:
            walk(k, path + [draft.tokens[k]])

    walk(-1, [])
    return out


def test_copying_drafts_the_rest_of_the_source():
    d = drafter()
    assert paths(d.propose(PROMPT + [10, 11], 64)) == [[12, 13, 20, 21, 22, 23, END]]


def test_deletion_resyncs_on_the_next_source_tokens():
    d = drafter()  # the output drops the misspelt word: 10, 20 ...
    assert paths(d.propose(PROMPT + [10, 20], 64)) == [[21, 22, 23, END]]


def test_unanchored_edit_verifies_substitution_insertion_and_replaced_word():
    d = drafter()  # 10, then 77 (a token the source does not have) where 11 12 13 was
    draft = d.propose(PROMPT + [10, 77], 64)
    assert paths(draft) == [  # the likeliest hypothesis drafted longest (branch_tokens)
        [12, 13, 20, 21, 22, 23, END],  # substitution: 77 replaced 11
        [11, 12, 13, 20, 21, 22, 23, END],  # insertion: 77 was added before 11
        [20, 21, 22, 23, END],  # word replaced: 77 is the whole word 11 12 13 rewritten
    ]


def test_after_a_punctuation_mark_the_insertion_branch_goes_first_and_longest():
    d = drafter(branch_tokens=(6, 3, 3))
    draft = d.propose(PROMPT + [10, COMMA], 64)
    assert paths(draft) == [[11, 12, 13, 20, 21, 22], [12, 13, 20], [20, 21, 22]]
    d = drafter(branch_tokens=(6, 3, 3))
    draft = d.propose(PROMPT + [10, 77], 64)
    assert paths(draft) == [[12, 13, 20, 21, 22, 23], [11, 12, 13], [20, 21, 22]]


def test_where_the_next_word_is_one_token_away_the_third_branch_skips_two():
    d = drafter()  # the pointer at 20 (a one-token word): 10 11 12 13, then 77
    draft = d.propose(PROMPT + [10, 11, 12, 13, 77], 64)
    assert [p[0] for p in paths(draft)] == [21, 20, 22]


def test_reanchors_on_a_unique_ngram_after_an_edit():
    d = drafter()  # 10 77 78, then 21 22: a unique bigram of the source
    d.propose(PROMPT + [10, 77], 64)
    assert paths(d.propose(PROMPT + [10, 77, 78, 21, 22], 64)) == [[23, END]]


def test_branch_tokens_must_cover_the_branches():
    with pytest.raises(ValueError, match="branch_tokens"):
        CopyDrafter(SOURCE, branches=3, branch_tokens=(8, 8))
