"""Task adapters: LoRA weights trained for one app on one base model, merged into it at load.

Merging (W += alpha/rank * B @ A, in fp32, then back to the model's dtype) leaves a plain model:
every backend (exact, int8, batched) and every exactness guarantee applies to the merged weights
as to any others, and greedy decoding means the merged model's greedy decoding. An adapter names
the base it was trained on by a fingerprint; another base is refused.

The adapters shipped with specsuite live in `specsuite/adapters/<task>-<preset>/` (weights,
`adapter.json`, a model card with the data's licences); the apps use the one for their task and
preset unless told `adapter="none"`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

ADAPTER_WEIGHTS = "adapter.safetensors"
ADAPTER_CONFIG = "adapter.json"
SHIPPED = Path(__file__).resolve().parent / "adapter_weights"
NONE = "none"


class AdapterError(ValueError):
    """An adapter that cannot be used with this model (missing, malformed, or for another base)."""


def base_fingerprint(model_dir: Path) -> str:
    """What identifies a base model: a preset's sha256 (of its weights' package), else the sha256
    of the directory's config.json and weights' index/size (cheap, and changes with the weights)."""
    marker = Path(model_dir) / "specsuite-preset.json"
    if marker.is_file():
        sha = json.loads(marker.read_text()).get("sha256")
        if sha:
            return f"preset-sha256:{sha}"
    digest = hashlib.sha256((Path(model_dir) / "config.json").read_bytes())
    for weights in sorted(Path(model_dir).glob("*.safetensors")):
        digest.update(f"{weights.name}:{weights.stat().st_size}".encode())
    return f"dir-sha256:{digest.hexdigest()}"


def shipped_adapter(task: str, model: str) -> Path | None:
    """The adapter shipped for `task` on preset `model`, or None where there is none."""
    path = SHIPPED / f"{task}-{model}"
    return path if (path / ADAPTER_CONFIG).is_file() else None


def resolve_adapter(adapter: str | Path | None, task: str, model: str) -> Path | None:
    """`adapter` as the apps take it: "auto" (or None) the shipped one for this task and model if
    any, "none" the base model alone, else a folder written by `specsuite train`."""
    if adapter is None or adapter == "auto":
        return shipped_adapter(task, str(model))
    if adapter == NONE:
        return None
    path = Path(adapter).expanduser()
    if not (path / ADAPTER_CONFIG).is_file() or not (path / ADAPTER_WEIGHTS).is_file():
        raise AdapterError(f"{adapter!r} is not an adapter folder (no {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}); "
                           f"use 'auto', 'none' or a folder written by `specsuite train`")
    return path


def describe_adapter(adapter: str | Path | None, task: str, model: str) -> str:
    """How reports name the adapter the apps would merge: its folder, or "none"."""
    path = resolve_adapter(adapter, task, model)
    return str(path.relative_to(SHIPPED.parent) if path and path.is_relative_to(SHIPPED.parent) else path or NONE)


def read_adapter_config(path: Path) -> dict:
    try:
        return json.loads((Path(path) / ADAPTER_CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise AdapterError(f"{path}: unreadable {ADAPTER_CONFIG} ({e})") from None


def merge_adapter(model, path: Path, base: str, task: str | None = None) -> dict:
    """Add the LoRA deltas of the adapter at `path` into `model`'s weights, in place; returns its
    config. `base`: the loaded model's `base_fingerprint`; `task`: the app asking, checked too."""
    import torch
    from safetensors.torch import load_file

    config = read_adapter_config(path)
    if config.get("base_fingerprint") != base:
        raise AdapterError(f"the adapter {path} was trained on {config.get('base_model')!r} "
                           f"({config.get('base_fingerprint')}), not on this model ({base}); use --adapter none "
                           f"or an adapter trained on this model")
    if task and config.get("task") != task:
        raise AdapterError(f"the adapter {path} is for {config.get('task')!r}, not {task!r}")
    weights = load_file(str(Path(path) / ADAPTER_WEIGHTS))
    modules = dict(model.named_modules())
    scale = float(config["alpha"]) / int(config["rank"])
    with torch.no_grad():
        for key in sorted(k for k in weights if k.endswith(".lora_A")):
            name = key.removesuffix(".lora_A")
            if name not in modules or f"{name}.lora_B" not in weights:
                raise AdapterError(f"{path}: {name} is not a layer of this model, or has no lora_B")
            weight = modules[name].weight
            delta = weights[f"{name}.lora_B"].float() @ weights[key].float()
            if delta.shape != weight.shape:
                raise AdapterError(f"{path}: {name} delta {tuple(delta.shape)} != weight {tuple(weight.shape)}")
            weight.copy_((weight.float() + scale * delta).to(weight.dtype))
    return config
