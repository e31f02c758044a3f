"""`specsuite bench peers`: our GEC engine and the CPU engines people deploy instead, side by side.

On the first N sentences of a file, the same GEC prompt token ids (`gec_prompt_ids`), greedy, at
most `max_new_tokens` new tokens, 2 threads, one engine at a time:

- `specsuite_one`: `generate()` one sentence at a time with copy drafts (what `gec correct
  --exact` runs; its backend is named in the report: `exact-bf16` is token for token plain
  greedy decoding, tested against HF `generate()`), the reference every row is compared with;
- `specsuite_batchB`: the batched engine with B sequences in flight (what `gec correct` runs);
- the peers of `../shared/anchors/` where they are installed (its README sets them up): llama.cpp's
  `llama-server` (`llamacpp_npP`, with `_ngram-simple`: its n-gram speculation) with P parallel
  slots, and OpenVINO GenAI's continuous batching (`ov_...`, plain and with prompt lookup) with B
  requests in flight. Each runs through the anchors' own script, as a subprocess, on the same ids.

Prints one table: sentences/s, new tokens/s, how many outputs are the reference's tokens, and our
best figure against each row. A peer that is not installed is named with the command that sets it up.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ANCHORS_CACHE = Path.home() / ".cache" / "specsuite-anchors"


def _ours(model_name: str, sentences: list[str], max_new_tokens: int, batch_sizes: list[int],
          dtype: str | None) -> tuple[dict[str, dict], dict[str, list[list[int]]], set[int], str]:
    """Our engine's runs: {config: figures}, {config: output token ids}, the EOS ids, the backend."""
    import torch

    from specsuite.bench_batch import WARMUP, GecRuns
    from specsuite.core.backend import choose_backend
    from specsuite.models import load_model

    model, tok = load_model(model_name, dtype=dtype)
    backend = choose_backend(model)
    ours = GecRuns(model, tok, sentences, max_new_tokens, backend)
    runs = {"specsuite_one": ours.one, **{f"specsuite_batch{b}": ours.batched(b) for b in batch_sizes}}
    figures, outputs = {}, {}
    everything = list(range(len(sentences)))
    for name, run in runs.items():
        run(everything[:WARMUP])  # kernel checks, weight packing, the step cost: paid once, as by a running service
        start = time.perf_counter()
        outputs[name] = run(everything)
        figures[name] = _figures(time.perf_counter() - start, outputs[name])
    figures["specsuite_one"]["backend"] = backend.label
    figures["torch_threads"] = torch.get_num_threads()
    return figures, outputs, set(ours.eos), backend.label


def _figures(seconds: float, outputs: list[list[int]]) -> dict:
    new = sum(map(len, outputs))
    return {"s": round(seconds, 3), "sent_per_s": round(len(outputs) / seconds, 3), "new_tokens": new,
            "tok_per_s": round(new / seconds, 2)}


def _peer(python: str, script: Path, args: list[str], out: Path) -> tuple[dict[str, dict], dict[str, list[list[int]]]]:
    """Run an anchors script under `python`; its JSON lines and each configuration's output token ids."""
    proc = subprocess.run([python, str(script), *args, "--out", str(out)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{script.name} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    figures = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            figures.update(json.loads(line))
    outputs = {}
    for name in figures:
        path = out / f"{name}.jsonl"
        if path.is_file():
            outputs[name] = [json.loads(line).get("tokens") or [] for line in path.read_text().splitlines()]
    return figures, outputs


def run_peers(model_name: str, data: Path, n: int, max_new_tokens: int = 128, parallel: list[int] = (1, 64),
              anchors: Path = Path("../shared/anchors"), dtype: str | None = None) -> dict:
    """The report: every configuration's figures and its outputs' agreement with `specsuite_one`.
    parallel: requests in flight: 1 is one at a time, each larger count is our batch size and the
    peers' parallel slots (llama-server) or requests in flight (OpenVINO)."""
    from specsuite.apps.gec import prompt
    from specsuite.bench_batch import read_sentences
    from specsuite.models import resolve_model_path

    sentences = read_sentences(data, n)
    figures, outputs, eos, backend = _ours(model_name, sentences, max_new_tokens, [p for p in parallel if p > 1], dtype)
    report = {"model": model_name, "n": len(sentences), "max_new_tokens": max_new_tokens, "reference": "specsuite_one",
              "reference_backend": backend, "torch_threads": figures.pop("torch_threads"), "configs": figures,
              "missing": {}}
    small = ",".join(map(str, parallel))
    models_dir = resolve_model_path(model_name)  # the tokenizer of the prompt ids
    gguf, server = ANCHORS_CACHE / f"{model_name}.gguf", ANCHORS_CACHE / "llama.cpp/build/bin/llama-server"
    ov_python, ov_model = ANCHORS_CACHE / "ov-venv/bin/python", ANCHORS_CACHE / f"ov-{model_name}-fp16"
    with tempfile.TemporaryDirectory() as tmp:
        if server.is_file() and gguf.is_file() and (anchors / "llamacpp_anchor.py").is_file():
            got, outs = _peer(sys.executable, anchors / "llamacpp_anchor.py",
                              [str(data), str(len(sentences)), "--server", str(server), "--gguf", str(gguf),
                               "--parallel", small, "--spec", "ngram-simple", "--max-new-tokens", str(max_new_tokens),
                               "--tokenizer", str(models_dir), "--prompt-py", prompt.__file__], Path(tmp) / "llamacpp")
            figures.update(got)
            outputs.update(outs)
        else:
            report["missing"]["llama-server"] = f"bash {anchors / 'setup_llama_server.sh'} (builds it, joins the 0.5B GGUF)"
        if ov_python.is_file() and ov_model.is_dir() and (anchors / "ov_anchor.py").is_file():
            got, outs = _peer(str(ov_python), anchors / "ov_anchor.py",  # under its own venv
                              [str(data), str(len(sentences)), "--model", str(ov_model), "--batch", small,
                               "--prompt-lookup", "--max-new-tokens", str(max_new_tokens),
                               "--tokenizer", str(models_dir), "--prompt-py", prompt.__file__], Path(tmp) / "ov")
            figures.update(got)
            outputs.update(outs)
        else:
            report["missing"]["OpenVINO GenAI"] = f"bash {anchors / 'setup_openvino.sh'} (its venv and the IR of the preset)"
    reference = [_strip(t, eos) for t in outputs["specsuite_one"]]
    for name, out in outputs.items():
        figures[name]["identical_to_reference"] = sum(_strip(t, eos) == r for t, r in zip(out, reference))
    ours = {k: v["sent_per_s"] for k, v in figures.items() if k.startswith("specsuite")}
    best_one, best_batch = ours["specsuite_one"], max(ours.values())
    for name, f in figures.items():
        if not name.startswith("specsuite"):
            one_at_a_time = f.get("parallel", f.get("batch", 0)) == 1
            f["ours_vs_this"] = round((best_one if one_at_a_time else best_batch) / f["sent_per_s"], 2)
    return report


def _strip(tokens: list[int], eos: set[int]) -> list[int]:
    """Token ids without the EOS the engines may or may not count at the end."""
    return tokens[:-1] if tokens and tokens[-1] in eos else tokens


def format_peers(report: dict) -> str:
    n = report["n"]
    lines = [f"{'config':<34} {'sent/s':>8} {'tok/s':>8} {'same as ref':>12} {'ours vs this':>13}"]
    for name, f in sorted(report["configs"].items(), key=lambda kv: -kv[1]["sent_per_s"]):
        vs = f"{f['ours_vs_this']:.2f}x" if "ours_vs_this" in f else ""
        lines.append(f"{name:<34} {f['sent_per_s']:>8.2f} {f['tok_per_s']:>8.1f} "
                     f"{f.get('identical_to_reference', 0):>7}/{n:<4} {vs:>13}")
    lines.append(f"ref: specsuite_one ({report['reference_backend']} backend); 'ours vs this': our one-at-a-time "
                 "figure against one-at-a-time peers, our best batch against batched ones")
    lines += [f"not installed: {peer}: {how}" for peer, how in report["missing"].items()]
    return "\n".join(lines)
