"""`specsuite train` and task adapters: the data readers, the LoRA loop (loss falls, checkpoint,
resume after kill -9), and merging at load (the merged model is the LoRA model; greedy with drafts
is the merged model's greedy; another base is refused)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import hf_greedy, prompts, tiny_model
from safetensors.torch import save_file

from specsuite.adapters import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, SHIPPED, AdapterError, base_fingerprint,
                                merge_adapter, resolve_adapter)
from specsuite.core import PromptLookupDrafter, generate
from specsuite.training.data import DataError, GecPair, detokenize, mix_gec, read_gec, read_m2, read_qed

M2 = """S She go to school yesterday .
A 1 2|||R:VERB:TENSE|||went|||REQUIRED|||-NONE-|||0
A 1 2|||R:VERB|||goes|||REQUIRED|||-NONE-|||1

S It is a medium size city .
A 3 4|||R:OTHER|||medium - sized|||REQUIRED|||-NONE-|||0
A 4 5|||U:NOUN||||||REQUIRED|||-NONE-|||0

S This is fine .
A -1 -1|||noop|||-NONE-|||REQUIRED|||-NONE-|||0
"""


def test_m2_applies_the_first_annotators_edits(tmp_path):
    path = tmp_path / "a.m2"
    path.write_text(M2)
    assert read_m2(path) == [GecPair("She go to school yesterday .", "She went to school yesterday ."),
                             GecPair("It is a medium size city .", "It is a medium-sized city ."),
                             GecPair("This is fine .", "This is fine .")]


@pytest.mark.parametrize("text,line", [
    (M2.replace("A 1 2|||R:VERB:TENSE|||went", "A one 2|||R:VERB:TENSE|||went"), 2),
    (M2.replace("S This is fine .", "This is fine ."), 9),
    ("A 0 1|||R|||x|||REQUIRED|||-NONE-|||0\n", 1),
    (M2.replace("A 3 4|||", "A 3 40|||"), 6),
])
def test_a_malformed_m2_line_is_an_error_naming_it(tmp_path, text, line):
    path = tmp_path / "bad.m2"
    path.write_text(text)
    with pytest.raises(DataError, match=f"bad.m2:{line}:"):
        read_m2(path)


def test_jsonl_and_parallel_inputs(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"source": "a b", "target": "a c"}\n\n{"source": "x", "target": "x"}\n')
    assert read_gec([good]) == [GecPair("a b", "a c"), GecPair("x", "x")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"source": "a", "target": "b"}\n{"source": "a"}\n')
    with pytest.raises(DataError, match="bad.jsonl:2: needs a non-empty string 'target'"):
        read_gec([bad])
    bad.write_text('{"source": "a", "target": "b"}\n{"source": "a", \n')
    with pytest.raises(DataError, match="bad.jsonl:2: not valid JSON"):
        read_gec([bad])
    src, tgt = tmp_path / "s.txt", tmp_path / "t.txt"
    src.write_text("He go .\nOK .\n")
    tgt.write_text("He goes .\nOK .\n")
    assert read_gec([src], [tgt]) == [GecPair("He go .", "He goes ."), GecPair("OK .", "OK .")]
    tgt.write_text("He goes .\n")
    with pytest.raises(DataError, match="not line-aligned"):
        read_gec([src], [tgt])
    with pytest.raises(DataError, match="target file"):
        read_gec([src])


def test_mixing_keeps_a_share_of_unchanged_sentences():
    pairs = [GecPair(f"a{i} , b", f"c{i} , b") for i in range(80)] + [GecPair(f"s{i} .", f"s{i} .") for i in range(80)]
    mixed = mix_gec(pairs, unchanged_share=0.2, detokenized_share=0.5)
    assert len(mixed) == 100 and sum(p.source == p.target for p in mixed) == 20
    edited = [p for p in mixed if p.source != p.target]
    plain = sum(" ," not in p.source for p in edited)
    assert 20 < plain < 60 and all((" ," in p.source) == (" ," in p.target) for p in edited)
    assert detokenize("He said , \" no \" ( twice ) . It 's 5 % .") == "He said, \" no \" (twice). It's 5%."


def test_qed_examples_cite_their_gold_passage_and_skip_evaluation_questions(tmp_path):
    def row(i: int) -> dict:
        text = f"Paragraph {i} opens . The answer is gold{i} here , it says ."
        at = text.index("gold")
        return {"paragraph_text": text, "question_text": f"what is question {i}", "answer_spans": [[at, at + 6]],
                "answer_text": [f"gold{i}"], "sentence_starts": [0, text.index("The")]}

    rows = [row(i) for i in range(10, 16)]
    path = tmp_path / "qed.jsonlines"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    examples = read_qed([path], exclude_questions=["What is question 12?"])
    assert len(examples) == 5
    for e in examples:
        i = e.question.split()[-1].rstrip("?")
        cited = int(e.answer.rsplit("[", 1)[1].rstrip("]."))
        assert f"gold{i}" in e.passages[cited - 1] and f"gold{i}" in e.answer
        assert e.answer.startswith(f"The answer is gold{i} here, it says") and 2 <= len(e.passages) <= 5
    path.write_text('{"question_text": "q"}\n')
    with pytest.raises(DataError, match="qed.jsonlines:1: not a QED record"):
        read_qed([path])


# ---- merging ---------------------------------------------------------------------------------

def _saved_tiny(tmp_path: Path, seed: int = 0) -> Path:
    path = tmp_path / f"base{seed}"
    tiny_model("llama", seed=seed).save_pretrained(path)
    return path


def _random_adapter(path: Path, model, base: str, task: str = "gec", rank: int = 4) -> Path:
    torch.manual_seed(1)
    weights = {}
    for name, module in model.named_modules():
        if name.endswith(("q_proj", "v_proj", "down_proj")):
            weights[f"{name}.lora_A"] = torch.randn(rank, module.in_features) * 0.3
            weights[f"{name}.lora_B"] = torch.randn(module.out_features, rank) * 0.3
    path.mkdir()
    save_file(weights, str(path / ADAPTER_WEIGHTS))
    (path / ADAPTER_CONFIG).write_text(json.dumps({"task": task, "base_model": "tiny", "base_fingerprint": base,
                                                   "rank": rank, "alpha": 2 * rank}))
    return path


def test_a_merged_adapter_is_the_lora_model_and_greedy_with_drafts_is_its_greedy(tmp_path):
    from peft import LoraConfig, get_peft_model

    base_dir = _saved_tiny(tmp_path)
    model = tiny_model("llama")  # the weights saved in base_dir
    adapter = _random_adapter(tmp_path / "adapter", model, base_fingerprint(base_dir))
    merged = tiny_model("llama")
    merge_adapter(merged, adapter, base_fingerprint(base_dir), "gec")

    lora = get_peft_model(tiny_model("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    from safetensors.torch import load_file

    state = {f"base_model.model.{k.rsplit('.lora_', 1)[0]}.lora_{k.rsplit('.lora_', 1)[1]}.default.weight": v
             for k, v in load_file(str(adapter / ADAPTER_WEIGHTS)).items()}
    missing = lora.load_state_dict(state, strict=False)
    assert not missing.unexpected_keys
    ids = torch.tensor([prompts(1, seed=3)[0]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, lora(ids).logits, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(merged(ids).logits, tiny_model("llama")(ids).logits, atol=1e-2)
    for prompt in prompts(4, seed=5):
        out = generate(merged, prompt, PromptLookupDrafter(), max_new_tokens=16)
        assert out.tokens == hf_greedy(merged, prompt, 16)


def test_an_adapter_for_another_base_or_task_is_refused(tmp_path):
    base_dir, other_dir = _saved_tiny(tmp_path, 0), _saved_tiny(tmp_path, 1)
    (other_dir / "config.json").write_text((other_dir / "config.json").read_text().replace('"hidden_act"', '"x": 1, "hidden_act"'))
    model = tiny_model("llama")
    adapter = _random_adapter(tmp_path / "adapter", model, base_fingerprint(base_dir))
    assert base_fingerprint(base_dir) != base_fingerprint(other_dir)
    with pytest.raises(AdapterError, match="not on this model"):
        merge_adapter(model, adapter, base_fingerprint(other_dir), "gec")
    with pytest.raises(AdapterError, match="is for 'gec', not 'rag'"):
        merge_adapter(model, adapter, base_fingerprint(base_dir), "rag")
    with pytest.raises(AdapterError, match="not an adapter folder"):
        resolve_adapter(str(tmp_path), "gec", "x")
    assert resolve_adapter("none", "gec", "qwen2.5-1.5b") is None
    assert resolve_adapter("auto", "gec", "smollm2-135m") is None  # no adapter shipped for it


def test_every_shipped_adapter_names_its_base_and_licences():
    shipped = [p for p in SHIPPED.iterdir() if (p / ADAPTER_CONFIG).is_file()] if SHIPPED.is_dir() else []
    for path in shipped:
        config = json.loads((path / ADAPTER_CONFIG).read_text())
        task, model = path.name.split("-", 1)
        assert config["task"] == task and config["base_model"] == model
        assert config["base_fingerprint"].startswith("preset-sha256:")
        assert (path / ADAPTER_WEIGHTS).stat().st_size < 40 << 20
        card = (path / "README.md").read_text()
        assert "licen" in card.lower() and config["base_fingerprint"].split(":")[1] in card
        assert resolve_adapter("auto", task, model) == path


# ---- the training command, on the smollm2-135m preset --------------------------------------------

def _pairs_file(tmp_path: Path, n: int = 100, bad_line: int | None = None) -> Path:
    path = tmp_path / "pairs.jsonl"
    words = ["cat", "dog", "bird", "fish", "horse"]
    lines = []
    for i in range(n):
        w = words[i % len(words)]
        lines.append(json.dumps({"source": f"He have {i} {w} .", "target": f"He has {i} {w}s ."}))
    if bad_line:
        lines[bad_line - 1] = '{"source": "broken"'
    path.write_text("\n".join(lines) + "\n")
    return path


def _train_cmd(data: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "specsuite.cli", "train", "gec", "--model", "smollm2-135m", "--data", str(data),
            "--out", str(out), "--batch-size", "4", "--dev", "8", "--lr", "1e-3", "--max-minutes", "2", *extra]


def test_train_reports_a_malformed_line_with_its_number(tmp_path):
    proc = subprocess.run(_train_cmd(_pairs_file(tmp_path, 20, bad_line=7), tmp_path / "out"), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "pairs.jsonl:7: not valid JSON" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_train_lowers_the_loss_checkpoints_and_resumes_after_kill(tmp_path, smollm2):
    data, out = _pairs_file(tmp_path), tmp_path / "adapter"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    first = subprocess.Popen(_train_cmd(data, out, "--checkpoint-minutes", "0.01", "--epochs", "3"), env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not (out / "checkpoint.pt").exists():
        assert first.poll() is None and time.monotonic() < deadline, "no checkpoint was written"
        time.sleep(0.2)
    time.sleep(3)  # a few more steps and checkpoints
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert not (out / ADAPTER_WEIGHTS).exists()
    saved_step = torch.load(out / "checkpoint.pt", weights_only=False)["state"]["step"]
    assert saved_step > 0

    proc = subprocess.run(_train_cmd(data, out, "--checkpoint-minutes", "0.01", "--epochs", "3"), env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-2000:]
    resumed = int(proc.stderr.split("resuming from")[1].split("step ")[1].split()[0])
    assert resumed >= saved_step
    figures = json.loads(proc.stdout)
    assert figures["steps"] > resumed
    dev = figures["dev"]
    assert dev["adapter"]["loss"] < 0.7 * dev["base"]["loss"]
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert config["task"] == "gec" and config["base_fingerprint"].startswith("preset-sha256:")

    # the adapter loads through the apps' path, and changes what the model says
    from specsuite.apps.gec.corrector import Corrector

    tuned = Corrector("smollm2-135m", adapter=str(out), batch_size=1)
    base = Corrector.from_loaded(*smollm2, batch_size=1)
    fixed, unchanged = tuned.correct("He have 3 fish ."), base.correct("He have 3 fish .")
    assert fixed.text.startswith("He has 3 fish") and fixed.text != unchanged.text


def test_top_layers_trains_the_last_blocks_alone(tmp_path):
    """`--top-layers N`: LoRA weights on the last N blocks only (the blocks below run forward only),
    the loss still falls, and the adapter merges like any other."""
    from safetensors.torch import load_file

    from specsuite.models import load_model, resolve_model_path
    from specsuite.training.lora import TrainConfig, train

    out = tmp_path / "adapter"
    config = TrainConfig(task="gec", model="smollm2-135m", out=str(out), batch_size=4, dev_examples=8, lr=1e-3,
                         epochs=2, top_layers=2)
    figures = train(config, read_gec([_pairs_file(tmp_path, 60)]), log=lambda _: None)
    assert figures["dev"]["adapter"]["loss"] < 0.7 * figures["dev"]["base"]["loss"]
    model, _ = load_model("smollm2-135m", dtype="fp32")
    last = model.config.num_hidden_layers - 1
    layers = {int(k.split("layers.")[1].split(".")[0]) for k in load_file(str(out / ADAPTER_WEIGHTS))}
    assert layers == {last - 1, last}
    assert "of the last 2 blocks" in (out / "README.md").read_text()
    merge_adapter(model, out, base_fingerprint(resolve_model_path("smollm2-135m")), "gec")
    proc = subprocess.run(_train_cmd(_pairs_file(tmp_path, 20), tmp_path / "x", "--top-layers", "99"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "error: --top-layers 99: the model has" in proc.stderr
