"""The GEC app on the real small model: exactness against HF greedy, the corrector, the CLI."""

import copy
import json

import pytest
import torch

from specsuite.apps.gec import corrector as corrector_module
from specsuite.apps.gec.corrector import Correction, Corrector
from specsuite.apps.gec.drafter import CopyDrafter
from specsuite.apps.gec.prompt import gec_prompt_ids, instruction_cache
from specsuite.cli import main as specsuite_main
from specsuite.core.model.backend import choose_backend
from specsuite.core.kernels.int8_linear import int8_pays, int8_runs
from specsuite.core import PromptLookupDrafter, TextPiece, eos_token_ids, generate

pytestmark = pytest.mark.real_model

MAX_NEW = 24  # enough to cover copies, rejections and EOS inside drafts; the CPU is slow


@pytest.fixture(scope="module")
def sentences(shared_data):
    path = shared_data / "jfleg/dev.src"
    if not path.exists():
        pytest.skip(f"no JFLEG data at {path}")
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return lines[:8]


@pytest.fixture(scope="module")
def hf_greedy(smollm2_fp32, sentences):
    """HF's plain greedy output per sentence: the reference every drafter must reproduce."""
    model, tok = smollm2_fp32
    eos = sorted(eos_token_ids(model, tok))
    out = []
    for text in sentences:
        ids = gec_prompt_ids(tok, text)
        x = torch.tensor([ids])
        y = model.generate(x, do_sample=False, max_new_tokens=MAX_NEW,
                           eos_token_id=eos, pad_token_id=eos[0], temperature=None, top_p=None, top_k=None)
        out.append(y[0, len(ids):].tolist())
    return out


def test_correct_gives_consistent_edits(smollm2):
    corrector = Corrector.from_loaded(*smollm2, max_new_tokens=20)
    source = "She go to the school every days by bus."
    c = corrector.correct(source)
    assert isinstance(c, Correction) and c.source == source and c.text == c.text.strip()
    rebuilt = source
    for e in reversed(c.edits):  # apply the edits back to front: offsets stay valid
        assert source[e.src_start:e.src_end] == e.src and c.text[e.tgt_start:e.tgt_end] == e.tgt
        rebuilt = rebuilt[:e.src_start] + f" {e.tgt} " + rebuilt[e.src_end:]
    assert rebuilt.split() == c.text.split()
    s = c.stats
    assert s["segments"] == 1 and s["new_tokens"] > 0 and s["forward_passes"] >= 1
    assert 0 <= s["acceptance_rate"] <= 1 and s["estimated_speedup"] > 0
    assert s["tokens_per_step"] == pytest.approx(s["new_tokens"] / s["forward_passes"], abs=1e-3)


def test_stream_keeps_paragraphs_and_whitespace(smollm2):
    corrector = Corrector.from_loaded(*smollm2, max_new_tokens=6)
    text = "  I has a apple.\n\n\tShe go home yesterday.\n"
    items = list(corrector.stream(text))
    final = items.pop()
    assert isinstance(final, Correction) and all(isinstance(p, TextPiece) for p in items)
    assert "".join(p.text for p in items) == final.text
    assert final.stats["segments"] == 2
    # The layout between and around segments comes from the source, untouched.
    assert items[0] == TextPiece("  ", False) and items[-1] == TextPiece("\n", False)
    assert TextPiece("\n\n\t", False) in items
    assert final.text.startswith("  ") and final.text.endswith("\n") and "\n\n\t" in final.text


def test_blank_or_oversized_text_is_refused_before_the_model(smollm2):
    from specsuite.apps.limits import InputError

    corrector = Corrector.from_loaded(*smollm2)
    with pytest.raises(InputError, match="only whitespace"):
        corrector.correct(" \n\n ")
    with pytest.raises(InputError, match="must be a string"):
        next(corrector.stream(None))
    corrector.max_input_tokens = 5  # configurable, as `specsuite gec ui --max-input-tokens` does
    with pytest.raises(InputError, match="limit is 5 tokens"):
        corrector.correct("She go to school yesterday and we was late .")


def test_truncation_is_reported(smollm2):
    c = Corrector.from_loaded(*smollm2, max_new_tokens=2).correct("I has a apple.")
    assert c.truncated and c.stats["new_tokens"] == 2


def test_the_fluent_style_asks_with_its_own_instruction(smollm2):
    model, tok = smollm2
    fluent = Corrector.from_loaded(model, tok, style="fluent")
    prompt = fluent._request("She like it.").prompt
    assert prompt == gec_prompt_ids(tok, "She like it.", "fluent") != gec_prompt_ids(tok, "She like it.")
    assert prompt[: len(fluent.instruction)] == fluent.instruction != Corrector.from_loaded(model, tok).instruction


def test_bad_drafter_or_backend_name_is_rejected(smollm2):
    with pytest.raises(ValueError, match="unknown drafter"):
        Corrector.from_loaded(*smollm2, drafter="magic")
    with pytest.raises(ValueError, match="unknown backend"):  # before any model is loaded
        Corrector(model="no-such-model", backend="turbo")


def test_cli_correct_writes_error_records(smollm2, tmp_path, monkeypatch, capsys):
    def load_shared(name, dtype=None, adapter=None, task=None):  # the CLI asks for the preset; hand it the loaded one
        assert (name, adapter, task) == ("smollm2-135m", "auto", "gec")
        return smollm2

    monkeypatch.setattr(corrector_module, "load_model", load_shared)
    src = tmp_path / "in.txt"
    src.write_bytes(b"I has a apple.\n\xff\xfe broken\nShe go home.\n")
    out = tmp_path / "out.jsonl"
    code = specsuite_main(["gec", "correct", str(src), "-o", str(out), "--model", "smollm2-135m",
                           "--max-new-tokens", "6"])
    assert code == 1
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["line"] for r in records] == [1, 2, 3]
    assert "invalid UTF-8" in records[1]["error"]
    assert records[0]["source"] == "I has a apple." and records[0]["correction"] and "error" not in records[2]
    assert "3 lines: 2 corrected, 1 errors" in capsys.readouterr().out


def test_cli_missing_input_is_a_usage_error(tmp_path, capsys):
    code = specsuite_main(["gec", "correct", str(tmp_path / "nope.txt"), "-o", str(tmp_path / "o.jsonl")])
    assert code == 2 and capsys.readouterr().err.startswith("error: no such file")


# Last in the file: the slowest tests. Each drafter must leave the output exactly HF's.
DRAFTERS = {
    # Long drafts (the whole rest of the source, trees after an edit) and short chains.
    "copy-long": lambda tok, text, end: CopyDrafter.for_text(tok, text, end_tokens=end, max_tokens=64, overrun=64),
    "copy-short": lambda tok, text, end: CopyDrafter.for_text(tok, text, end_tokens=end, max_tokens=2, branches=1),
    "prompt-lookup": lambda tok, text, end: PromptLookupDrafter(),
}


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_drafted_generation_equals_hf_greedy(smollm2_fp32, sentences, hf_greedy, name):
    model, tok = smollm2_fp32
    corrector = Corrector.from_loaded(model, tok)
    for text, expected in zip(sentences, hf_greedy):
        g = generate(model, gec_prompt_ids(tok, text), DRAFTERS[name](tok, text, corrector.end_tokens),
                     max_new_tokens=MAX_NEW, eos_token_id=corrector.eos)
        assert g.tokens == expected, f"{name} differs from HF greedy on {text!r}"
        assert len(g.from_draft) == len(g.tokens)


def test_exact_asks_for_the_exact_forward_forms(smollm2):
    """`gec correct --exact` promises the model's greedy output token for token, so its corrector
    computes with the exact backend, not the default `fast` (int8 where it runs) nor `auto` (which
    verifies with plain bf16 calls where the exact forms cost over 15% more). Backends compare by
    label: two choices of the fp32 forms hold distinct (unequal) callables."""
    import argparse

    from specsuite.apps.gec.cli import _corrector

    args = argparse.Namespace(model="smollm2-135m", drafter="copy", dtype=None, max_new_tokens=8, batch_size=4,
                              adapter="none")
    exact = _corrector(argparse.Namespace(**vars(args), exact=True))
    assert exact.batch_size == 1 and exact.backend.label == choose_backend(exact.model, "exact").label
    fast = _corrector(argparse.Namespace(**vars(args), exact=False))
    assert fast.backend.label == choose_backend(fast.model, "fast").label and not hasattr(fast.model, "specsuite_backend")
    assert exact.correct("She go to school yesterday.").text


@pytest.mark.skipif(not (int8_pays() and int8_runs()), reason="oneDNN's int8 kernel is slow or inexact on this CPU")
def test_int8_asks_for_the_int8_backend_one_at_a_time_and_in_batches(smollm2):
    import argparse

    from specsuite.apps.gec.cli import _corrector

    args = argparse.Namespace(model="smollm2-135m", drafter="copy", dtype=None, max_new_tokens=8, batch_size=4,
                              int8=True, adapter="none")
    one = _corrector(argparse.Namespace(**vars(args), exact=True))
    assert one.batch_size == 1 and one.backend.name == "int8"
    batched = _corrector(argparse.Namespace(**vars(args), exact=False))
    assert batched.batch_size == 4 and batched.backend.name == "int8" and batched.backend.packed is not one.backend.packed
    texts = ["She go to school yesterday.", "I has a apple."]
    assert all(c.text for c in batched.correct_many(texts)) and one.correct(texts[0]).text


def test_corrector_reuses_the_instruction_and_keeps_greedy_output(smollm2_fp32, sentences, hf_greedy):
    """In fp32 the corrector keeps the KV of its recent prompts: each sentence after the first
    starts from the cached instruction, and the output is still HF's greedy output. In bf16 no
    cache is kept by default (`Backend.lossless_prefix_cache`)."""
    model, tok = smollm2_fp32
    corrector = Corrector.from_loaded(model, tok, max_new_tokens=MAX_NEW)
    assert corrector.prefix_cache is not None
    for i, (text, expected) in enumerate(zip(sentences, hf_greedy)):
        g = corrector._generate(text)
        assert g.tokens == expected, f"differs from HF greedy on {text!r}"
        assert (g.stats.cached_prompt_tokens > 0) == (i > 0)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    assert instruction_cache(bf16, choose_backend(bf16, "exact")) is None


def test_batched_corrections_equal_hf_greedy_in_fp32(smollm2_fp32, sentences, hf_greedy):
    """The batched engine (correct_many's default) on the real model: each sentence decodes as
    its own greedy decoding (fp32: batch rows differ from one-row steps only in the last bits),
    sentences joining and leaving the batch as they end (batch of 3 for 8 sentences)."""
    model, tok = smollm2_fp32
    corrector = Corrector.from_loaded(model, tok, max_new_tokens=MAX_NEW, batch_size=3)
    expected = [tok.decode(t, skip_special_tokens=True).strip() for t in hf_greedy]
    corrections = list(corrector.correct_many(sentences))
    assert [c.text for c in corrections] == expected
    assert [c.source for c in corrections] == sentences
    assert sum(c.stats["accepted_tokens"] for c in corrections) > 0  # copy drafts were verified in the batch
    assert all(c.stats["cached_prompt_tokens"] > 0 for c in corrections)  # the shared instruction


def test_correct_each_reports_a_bad_text_and_goes_on(smollm2):
    corrector = Corrector.from_loaded(*smollm2, max_new_tokens=8, batch_size=4)
    out = list(corrector.correct_each(["I has a apple.", "   ", "She go home."]))
    assert isinstance(out[1], ValueError) and "whitespace" in str(out[1])
    assert out[0].source == "I has a apple." and out[2].source == "She go home."
    with pytest.raises(ValueError, match="batch_size"):
        Corrector.from_loaded(*smollm2, batch_size=0)
