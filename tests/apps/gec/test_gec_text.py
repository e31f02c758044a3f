"""Text plumbing of the GEC app: word edits, segmentation, GLEU."""

import math
import random
from pathlib import Path

import pytest

from specsuite.apps.gec.edits import Edit, word_diff
from specsuite.apps.gec.gleu import (
    corpus_gleu, gleu_from_stats, read_tokenized, reference_choices, sentence_gleu, sentence_stats, tokenize,
)
from specsuite.apps.gec.segment import Segment, join_segments, split_segments, split_sentences

JFLEG = Path("/work/shared/data/jfleg")


def words(text: str) -> int:
    return len(text.split())


# ---- edits ------------------------------------------------------------------------------

def test_no_edits_for_equal_words_even_if_whitespace_differs():
    assert word_diff("He goes  home.", "He goes home.\n") == []


def test_replace_insert_delete_offsets():
    src, tgt = "He go to the the school", "He goes to the school today"
    edits = word_diff(src, tgt)
    assert [(e.kind, e.src, e.tgt) for e in edits] == [
        ("replace", "go", "goes"), ("delete", "the", ""), ("insert", "", "today"),
    ]
    replace, delete, insert = edits
    assert (replace.src_start, replace.src_end, replace.tgt_start, replace.tgt_end) == (3, 5, 3, 7)
    assert delete.tgt_start == delete.tgt_end
    assert insert.src_start == insert.src_end == len(src)  # appended after the last word
    assert insert.tgt_start == tgt.index("today")


def test_insert_points_at_the_following_word():
    (edit,) = word_diff("I like cats", "I really like cats")
    assert edit.kind == "insert" and edit.src_start == edit.src_end == 2
    assert (edit.tgt_start, edit.tgt_end, edit.tgt) == (2, 8, "really")


def test_adjacent_changed_words_form_one_edit():
    (edit,) = word_diff("She have went there", "She has gone there")
    assert (edit.src, edit.tgt, edit.kind) == ("have went", "has gone", "replace")


def test_edit_spans_slice_both_texts():
    rng = random.Random(1)
    vocab = ["a", "the", "cat", "dogs", "run", "ran", ",", "."]
    for _ in range(200):
        src = " ".join(rng.choice(vocab) for _ in range(rng.randint(0, 12)))
        tgt = "  ".join(rng.choice(vocab) for _ in range(rng.randint(0, 12)))
        for e in word_diff(src, tgt):
            assert src[e.src_start:e.src_end] == e.src and tgt[e.tgt_start:e.tgt_end] == e.tgt
            assert e.src or e.tgt


def test_long_texts_do_not_junk_frequent_words():
    src = " ".join(["the cat sat on the mat ."] * 60)
    tgt = src.replace("sat", "sits", 1)
    (edit,) = word_diff(src, tgt)
    assert (edit.src, edit.tgt, edit.src_start) == ("sat", "sits", 8)


def test_edit_to_dict_has_kind():
    assert Edit(0, 0, 0, 3, "", "The").to_dict() == {
        "src_start": 0, "src_end": 0, "tgt_start": 0, "tgt_end": 3, "src": "", "tgt": "The", "kind": "insert",
    }


# ---- segments ---------------------------------------------------------------------------

TRICKY = [
    "",
    "   \n\t \n",
    "One sentence.",
    "  Leading and trailing.  \n",
    "First paragraph. Still first.\n\nSecond one!\r\n\r\n\tIndented third?   \n\n\n",
    "line one\nline two\u2028line three\x0bfour",
    "Dr. Smith met Mr. Jones in the U.S. yesterday. They talked, e.g. about cats. Then they left.  Bye!",
]


@pytest.mark.parametrize("text", TRICKY)
@pytest.mark.parametrize("budget", [1, 3, 8, 1000])
def test_join_of_uncorrected_segments_is_the_input(text, budget):
    segments = split_segments(text, words, budget)
    assert join_segments(segments, [s.text for s in segments]) == text
    for s in segments:
        assert s.text == s.text.strip() and "\n" not in s.text and "\r" not in s.text
        assert words(s.text) <= budget
    assert all(s.lead == "" for s in segments[1:])


def test_whitespace_only_text_is_one_empty_segment():
    assert split_segments(" \n ", words, 10) == [Segment(" \n ", "", "", 0)]


def test_sentences_respect_abbreviations_and_quotes():
    line = 'Dr. Smith met Mr. J. Jones in the U.S. and said "Stop!" Then e.g. cats ran. Why? "Because."'
    sentences = [line[a:b] for a, b in split_sentences(line)]
    assert sentences == [
        'Dr. Smith met Mr. J. Jones in the U.S. and said "Stop!"',
        "Then e.g. cats ran.",
        "Why?",
        '"Because."',
    ]


def test_no_split_before_lowercase_or_inside_numbers():
    assert split_sentences("It costs 3.50 dollars. and more") == [(0, 31)]


def test_sentences_are_grouped_within_budget_and_never_across_lines():
    text = "A b c. D e. F g h i.\nJ k. L m."
    segments = split_segments(text, words, 5)
    assert [(s.text, s.trail, s.paragraph) for s in segments] == [
        ("A b c. D e.", " ", 0), ("F g h i.", "\n", 0), ("J k. L m.", "", 1),
    ]


def test_line_within_budget_is_one_segment_even_with_many_sentences():
    text = "One. Two. Three."
    assert [s.text for s in split_segments(text, words, 3)] == [text]


def test_overlong_sentence_is_cut_at_words_and_overlong_word_at_characters():
    text = "one two three four five six seven " + "x" * 25
    chars = len  # a "token" per character
    segments = split_segments(text, chars, 10)
    assert join_segments(segments, [s.text for s in segments]) == text
    assert all(1 <= len(s.text) <= 10 for s in segments)
    assert [s.text for s in segments][:4] == ["one two", "three four", "five six", "seven"]
    assert [s.text for s in segments][4:] == ["x" * 10, "x" * 10, "x" * 5]
    assert segments[-2].trail == ""  # pieces of one word join without a space


def test_join_puts_corrections_in_place():
    text = "  he go home.\n\nshe are here.  "
    segments = split_segments(text, words, 100)
    fixed = [s.text[0].upper() + s.text[1:] for s in segments]
    assert join_segments(segments, fixed) == "  He go home.\n\nShe are here.  "
    with pytest.raises(ValueError):
        join_segments(segments, fixed[:1])


# ---- GLEU -------------------------------------------------------------------------------

SRC = "a b c d e f".split()
REF = "a b c d e g".split()


def test_hypothesis_equal_to_its_reference_scores_one():
    assert corpus_gleu([SRC], [[REF]], [REF]).mean == pytest.approx(1.0)


def test_source_as_hypothesis_is_penalised_for_kept_errors():
    # Clipped matches minus matches of source n-grams the reference dropped:
    # 1-grams (5-1)/6, 2-grams (4-1)/5, 3-grams (3-1)/4, 4-grams (2-1)/3; no brevity penalty.
    assert sentence_stats(SRC, REF, SRC) == [6, 6, 4, 6, 3, 5, 2, 4, 1, 3]
    result = corpus_gleu([SRC], [[REF]], [SRC])
    assert result.mean == pytest.approx((4 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25)  # 0.508, where BLEU gives 0.760
    # One reference: every round is the same corpus, so the spread is nil (up to rounding).
    assert result.std == pytest.approx(0, abs=1e-12) and result.ci == pytest.approx((result.mean, result.mean))


def test_brevity_penalty():
    hyp = "a b c d e".split()
    assert corpus_gleu([SRC], [[REF]], [hyp]).mean == pytest.approx(math.exp(1 - 6 / 5))


def test_zero_statistic_gives_zero_unless_smoothed():
    stats = sentence_stats("a b c".split(), "x y z".split(), "a b c".split())
    assert gleu_from_stats(stats) == 0.0
    assert 0 < gleu_from_stats(stats, smooth=True) < 1


def test_corpus_statistics_are_summed_before_the_score():
    # A 3-word sentence has no 4-grams: scored alone it is 0, in a corpus it contributes.
    short = "x y z".split()
    assert corpus_gleu([short], [[short]], [short]).mean == 0.0
    assert corpus_gleu([SRC, short], [[REF], [short]], [REF, short]).mean == pytest.approx(1.0)


def test_reference_choices_follow_python2_randint():
    # random.seed(0) draws 0.844, 0.758, 0.421: Python 2's randint(0, 3) gives 3, 3, 1
    # (int(random() * 4)); Python 3's would give 3, 3, 0.
    choices = reference_choices(3, [4, 4, 4], iterations=2)
    assert choices[0].tolist() == [3, 3, 1]
    rng = random.Random(101)
    assert choices[1].tolist() == [int(rng.random() * 4) for _ in range(3)]


def test_multi_reference_mean_lies_between_single_reference_scores():
    other = "a b c d e f g".split()
    sources, hyps = [SRC] * 5, [REF] * 5
    one = corpus_gleu(sources, [[REF]] * 5, hyps).mean
    two = corpus_gleu(sources, [[other]] * 5, hyps).mean
    both = corpus_gleu(sources, [[REF, other]] * 5, hyps, iterations=50)
    assert min(one, two) < both.mean < max(one, two) and both.std > 0
    assert both.ci[0] < both.mean < both.ci[1]


def test_interval_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    other = "a b c d e f g".split()
    result = corpus_gleu([SRC] * 5, [[REF, other]] * 5, [REF] * 5, iterations=50)
    assert result.ci == pytest.approx(stats.norm.interval(0.95, loc=result.mean, scale=result.std))


def test_sentence_gleu_averages_smoothed_scores_over_references():
    other = "a b c d e f g".split()
    result = sentence_gleu(SRC, [REF, other], REF)
    assert result.mean == pytest.approx((1.0 + gleu_from_stats(sentence_stats(SRC, other, REF), smooth=True)) / 2)


def test_tokenize_splits_on_ascii_whitespace_only():
    assert tokenize(" a\u00a0b\tc \r\n") == ["a\u00a0b", "c"]


def test_length_mismatch_is_an_error():
    with pytest.raises(ValueError):
        corpus_gleu([SRC], [[REF]], [])


@pytest.mark.skipif(not (JFLEG / "dev.src").exists(), reason="JFLEG dev set not in /work/shared/data")
def test_jfleg_dev_source_baseline_matches_the_published_number():
    # github.com/keisks/jfleg README: SOURCE scores 38.21 GLEU on dev.
    sources = read_tokenized(JFLEG / "dev.src")
    references = [list(r) for r in zip(*(read_tokenized(JFLEG / f"dev.ref{k}") for k in range(4)))]
    result = corpus_gleu(sources, references, sources)
    assert round(100 * result.mean, 2) == 38.21


# ---- over-editing ---------------------------------------------------------------------------

def test_word_edits_is_token_levenshtein():
    from specsuite.apps.gec.overedit import word_edits

    assert word_edits("a b c".split(), "a b c".split()) == 0
    assert word_edits("he go to school".split(), "he goes to the school".split()) == 2  # one change, one insert
    assert word_edits([], "a b".split()) == 2 and word_edits("a b".split(), []) == 2


def test_a_paraphrase_is_over_edited_and_a_minimal_correction_is_not():
    from specsuite.apps.gec.overedit import over_edit_rate, over_edited

    src = "I have went to London two years ago .".split()
    refs = ["I went to London two years ago .".split(), "I have been to London .".split()]
    assert not over_edited(src, refs, "I went to London two years ago .".split())
    assert not over_edited(src, refs, src)
    assert over_edited(src, refs, "I have been living in London for two years now .".split())
    assert over_edit_rate([src, src], [refs, refs], [src, "I visited England twice , years ago .".split()]) == 0.5
    assert over_edit_rate([], [], []) == 0.0


def test_prompt_is_the_instruction_of_its_style_then_the_text():
    from specsuite.apps.gec.corrector import Corrector
    from specsuite.apps.gec.prompt import FLUENT, SYSTEM, gec_messages

    assert gec_messages("She like it .") == [{"role": "system", "content": SYSTEM},
                                             {"role": "user", "content": "She like it ."}]
    assert gec_messages("She like it .", "fluent")[0] == {"role": "system", "content": FLUENT} != SYSTEM
    with pytest.raises(ValueError, match="unknown style 'formal'; use one of minimal, fluent"):
        gec_messages("She like it .", "formal")
    with pytest.raises(ValueError, match="unknown style"):  # before any model is loaded
        Corrector(model="no-such-model", style="formal")


@pytest.mark.skipif(not JFLEG.is_dir(), reason="no JFLEG data in ../shared/data")
def test_eval_scores_the_records_of_a_correct_run(tmp_path, capsys):
    """`gec eval --corrections`: a partial `gec correct` output is scored on its lines, no model."""
    import json

    from specsuite.cli import main

    sources = (JFLEG / "dev.src").read_text(encoding="utf-8").splitlines()[:3]
    records = tmp_path / "out.jsonl"  # written out of order, one an error record (scored as its source)
    records.write_text("".join(json.dumps(r) + "\n" for r in [
        {"line": 2, "correction": sources[1]}, {"line": 1, "correction": sources[0]}, {"line": 3, "error": "x"}]))
    refs = [str(JFLEG / f"dev.ref{i}") for i in range(4)]
    assert main(["eval", "gec", "--data", str(JFLEG / "dev.src"), "--refs", *refs, "--corrections", str(records)]) == 0
    out = capsys.readouterr().out
    assert "GLEU on 3 sentences" in out and "rewritten beyond their errors" in out and "0.0%" in out
    lines = out.splitlines()
    assert lines[1].split()[1] == lines[2].split()[3]  # the sources as corrections score as the sources
