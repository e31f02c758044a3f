"""`specsuite bench peers`: our GEC engine and the CPU engines people deploy instead, side by side.

On the first N sentences of a file, the same GEC prompt token ids (`gec_prompt_ids`), greedy, at
most `max_new_tokens` new tokens, 2 threads, one engine at a time:

- `specsuite_one`: `generate()` one sentence at a time with copy drafts (what `gec correct
  --batch-size 1` runs; its backend is named in the report and is token for token that backend's
  own greedy decoding: `exact-bf16` plain greedy's, `int8` int8 greedy's), the reference every row
  is compared with;
- `specsuite_batchB`: the batched engine with B sequences in flight (what `gec correct` runs);
- the peers of the anchors folder (`--anchors`, e.g. `../shared/anchors/`) where they are installed (its README sets them up): llama.cpp's
  `llama-server` (`llamacpp_npP`, with `_ngram-simple`: its n-gram speculation) with P parallel
  slots, and OpenVINO GenAI's continuous batching (`ov_...`, plain and with prompt lookup) with B
  requests in flight, on each IR set up (fp16 weights; int8 weights: `..._int8-ir`). Each runs
  through the anchors' own script, as a subprocess, on the same ids.

Prints one table per round: sentences/s, new tokens/s, how many outputs are the reference's tokens,
and our best figure against each row of the same round (rounds alternate the engines, as this
machine's speed drifts by tens of percent within half an hour). `deciding_only` runs only each
peer's configurations our ratios are taken against. A peer that is not installed is named with the
command that sets it up.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ANCHORS_CACHE = Path.home() / ".cache" / "specsuite-anchors"
OV_WEIGHTS = ("fp16", "int8")  # the IRs `setup_openvino.sh` exports (configs of the int8 one end in _int8-ir)


def _our_runs(model_name: str, sentences: list[str], max_new_tokens: int, batch_sizes: list[int],
              dtype: str | None, backend_kind: str = "fast") -> tuple[dict, set[int], str, int]:
    """Our engine's configurations {name: run}, each warmed up, the EOS ids, the backend's label and
    torch's threads."""
    import torch

    from specsuite.bench.batch import WARMUP, GecRuns
    from specsuite.core.model.backend import choose_backend
    from specsuite.models import load_model

    model, tok = load_model(model_name, dtype=dtype)
    backend = choose_backend(model, backend_kind)
    ours = GecRuns(model, tok, sentences, max_new_tokens, backend)
    runs = {"specsuite_one": ours.one, **{f"specsuite_batch{b}": ours.batched(b) for b in batch_sizes}}
    for run in runs.values():
        run(list(range(min(WARMUP, len(sentences)))))  # kernel checks, weight packing, the step cost: paid once, as by a running service
    return runs, set(ours.eos), backend.label, torch.get_num_threads()


def _time_ours(runs: dict, n: int) -> tuple[dict[str, dict], dict[str, list[list[int]]]]:
    """One timed pass of each of our configurations over the n sentences."""
    figures, outputs = {}, {}
    everything = list(range(n))
    for name, run in runs.items():
        start = time.perf_counter()
        outputs[name] = run(everything)
        figures[name] = _figures(time.perf_counter() - start, outputs[name])
    return figures, outputs


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


def _peer_calls(parallel: list[int], deciding_only: bool) -> list[tuple[list[str], list[str]]]:
    """(llama-server arguments, OpenVINO arguments) of each pair of peer calls. All configurations:
    one call each. deciding_only: only the configurations our ratios are taken against, which were
    each peer's fastest in every run so far: its speculation one at a time, its plain batches."""
    one, batches = [p for p in parallel if p == 1], ",".join(str(p) for p in parallel if p > 1)
    if not deciding_only:
        every = ",".join(map(str, parallel))
        return [(["--parallel", every, "--spec", "ngram-simple"], ["--batch", every, "--prompt-lookup"])]
    calls = [(["--parallel", "1", "--spec", "ngram-simple", "--no-baseline"],
              ["--batch", "1", "--prompt-lookup", "--no-baseline"])] if one else []
    return calls + ([(["--parallel", batches], ["--batch", batches])] if batches else [])


def run_peers(model_name: str, data: Path, n: int, anchors: Path, max_new_tokens: int = 128,
              parallel: list[int] = (1, 64), dtype: str | None = None, rounds: int = 1,
              deciding_only: bool = False, backend: str = "fast") -> dict:
    """The report: for each round, every configuration's figures and its outputs' agreement with that
    round's `specsuite_one`, and our figures against each peer's of the same round.
    parallel: requests in flight: 1 is one at a time, each larger count is our batch size and the
    peers' parallel slots (llama-server) or requests in flight (OpenVINO). rounds: our engine, then
    each peer, again and again: the machine's speed drifts over minutes, so a ratio is only taken
    between figures of one round. backend: our engine's (`core.backend.choose_backend` kind; with
    "int8" the reference is int8 greedy decoding, which every row is compared with)."""
    from specsuite.apps.gec import prompt
    from specsuite.bench.batch import read_sentences
    from specsuite.models import resolve_model_path

    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    sentences = read_sentences(data, n)
    runs, eos, backend, threads = _our_runs(model_name, sentences, max_new_tokens, [p for p in parallel if p > 1], dtype,
                                            backend)
    report = {"model": model_name, "n": len(sentences), "max_new_tokens": max_new_tokens, "reference": "specsuite_one",
              "reference_backend": backend, "torch_threads": threads, "rounds": [], "missing": {}}
    models_dir = resolve_model_path(model_name)  # the tokenizer of the prompt ids
    gguf, server = ANCHORS_CACHE / f"{model_name}.gguf", ANCHORS_CACHE / "llama.cpp/build/bin/llama-server"
    # OpenVINO's IRs with fp16 and int8 weights: either may be the faster (int8 on CPUs without bf16)
    ov_python = ANCHORS_CACHE / "ov-venv/bin/python"
    ov_models = {w: m for w in OV_WEIGHTS if (m := ANCHORS_CACHE / f"ov-{model_name}-{w}").is_dir()}
    has_llama = server.is_file() and gguf.is_file() and (anchors / "llamacpp_anchor.py").is_file()
    has_ov = ov_python.is_file() and bool(ov_models) and (anchors / "ov_anchor.py").is_file()
    if not has_llama:
        report["missing"]["llama-server"] = f"bash {anchors / 'setup_llama_server.sh'} (builds it, joins the 0.5B GGUF)"
    if not has_ov:
        report["missing"]["OpenVINO GenAI"] = f"bash {anchors / 'setup_openvino.sh'} (its venv and the IR of the preset)"
    common = ["--max-new-tokens", str(max_new_tokens), "--tokenizer", str(models_dir), "--prompt-py", prompt.__file__]
    for _ in range(rounds):
        figures, outputs = _time_ours(runs, len(sentences))
        with tempfile.TemporaryDirectory() as tmp:
            for k, (llama_args, ov_args) in enumerate(_peer_calls(parallel, deciding_only)):
                if has_llama:
                    got, outs = _peer(sys.executable, anchors / "llamacpp_anchor.py",
                                      [str(data), str(len(sentences)), "--server", str(server), "--gguf", str(gguf),
                                       *llama_args, *common], Path(tmp) / f"llamacpp{k}")
                    figures.update(got)
                    outputs.update(outs)
                for weights, ov_model in ov_models.items() if has_ov else ():  # under its own venv
                    got, outs = _peer(str(ov_python), anchors / "ov_anchor.py",
                                      [str(data), str(len(sentences)), "--model", str(ov_model), *ov_args, *common],
                                      Path(tmp) / f"ov{k}-{weights}")
                    suffix = "" if weights == "fp16" else f"_{weights}-ir"
                    figures.update({c + suffix: f for c, f in got.items()})
                    outputs.update({c + suffix: o for c, o in outs.items()})
        report["rounds"].append(_compare(figures, outputs, eos))
    return report


def _compare(figures: dict[str, dict], outputs: dict[str, list[list[int]]], eos: set[int]) -> dict[str, dict]:
    """A round's figures with each configuration's outputs compared with `specsuite_one`'s, and our
    one-at-a-time figure against each one-at-a-time peer, our best batch against each batched one."""
    reference = [_strip(t, eos) for t in outputs["specsuite_one"]]
    for name, out in outputs.items():
        figures[name]["identical_to_reference"] = sum(_strip(t, eos) == r for t, r in zip(out, reference))
    ours = {k: v["sent_per_s"] for k, v in figures.items() if k.startswith("specsuite")}
    best_one, best_batch = ours["specsuite_one"], max(ours.values())
    for name, f in figures.items():
        if not name.startswith("specsuite"):
            one_at_a_time = f.get("parallel", f.get("batch", 0)) == 1
            f["ours_vs_this"] = round((best_one if one_at_a_time else best_batch) / f["sent_per_s"], 2)
    return figures


def _strip(tokens: list[int], eos: set[int]) -> list[int]:
    """Token ids without the EOS the engines may or may not count at the end."""
    return tokens[:-1] if tokens and tokens[-1] in eos else tokens


def format_peers(report: dict) -> str:
    n, lines = report["n"], []
    for r, configs in enumerate(report["rounds"], 1):
        if len(report["rounds"]) > 1:
            lines.append(f"round {r} of {len(report['rounds'])}")
        lines.append(f"{'config':<34} {'sent/s':>8} {'tok/s':>8} {'same as ref':>12} {'ours vs this':>13}")
        for name, f in sorted(configs.items(), key=lambda kv: -kv[1]["sent_per_s"]):
            vs = f"{f['ours_vs_this']:.2f}x" if "ours_vs_this" in f else ""
            lines.append(f"{name:<34} {f['sent_per_s']:>8.2f} {f['tok_per_s']:>8.1f} "
                         f"{f.get('identical_to_reference', 0):>7}/{n:<4} {vs:>13}")
    lines.append(f"ref: specsuite_one ({report['reference_backend']} backend); 'ours vs this': our one-at-a-time "
                 "figure against one-at-a-time peers, our best batch against batched ones, within a round")
    lines += [f"not installed: {peer}: {how}" for peer, how in report["missing"].items()]
    return "\n".join(lines)
