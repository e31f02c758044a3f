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


def path_to(draft, tokens: list[int]) -> list[int]:
    """The nodes of `draft` that spell `tokens` from the root (what the target accepted)."""
    path: list[int] = []
    for t in tokens:
        parent = path[-1] if path else -1
        path.append(next(i for i, (u, p) in enumerate(zip(draft.tokens, draft.parents)) if p == parent and u == t))
    return path


def test_an_accepted_branch_moves_the_pointer_to_its_source_position():
    # The word after 11..15 is 20 21 30, which occurs twice: the output's tokens alone do not say
    # where it copies from (no unique n-gram, too far for the window), the accepted branch does.
    source = [10, 11, 12, 13, 14, 15, 20, 21, 30, 40, 20, 21, 30, 41]
    d = CopyDrafter(source, end_tokens=[END], word_starts=[0, 1, 6, 7, 8, 9, 10, 11, 12, 13])
    d.reset(PROMPT)
    draft = d.propose(PROMPT + [10, 77], 64)
    assert [p[:3] for p in paths(draft)] == [[12, 13, 14], [11, 12, 13], [20, 21, 30]]
    d.update(draft, path_to(draft, [20, 21]))  # the "word replaced" branch, from source index 6
    assert (d.pos, d.synced) == (8, True)
    # The target's own next token goes on copying there.
    assert paths(d.propose(PROMPT + [10, 77, 20, 21, 30], 64)) == [[40, 20, 21, 30, 41, END]]


def test_the_pointer_follows_a_branch_of_a_cut_draft():
    d = drafter()  # the loop may cut a tree to fewer nodes (renumbering them) before verifying it
    cut = d.propose(PROMPT + [10, 77], 64).limit_size(3)
    assert cut.tokens == [12, 11, 20]
    d.update(cut, [2])  # the "word replaced" root: source index 4
    assert (d.pos, d.synced) == (5, True)
    assert paths(d.propose(PROMPT + [10, 77, 20, 21], 64)) == [[22, 23, END]]
