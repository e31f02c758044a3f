"""LoRA fine-tuning of a preset on the apps' own prompts, on the CPU, in a time budget.

The loop is plain: encode every example as (the app's prompt, the answer, the end of turn), hold
back a dev split, cut the rest into batches of similar length, then step through them with AdamW
on the LoRA weights only (peft), loss on the answer tokens alone. A checkpoint (LoRA weights,
optimizer, position) is written atomically every few minutes; a new run with the same output
folder resumes from it, also after `kill -9`. At the end the adapter is written in the shape
`specsuite.adapters` merges at load, and the dev split is scored with and without it.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from tqdm.auto import tqdm

from specsuite.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, base_fingerprint
from specsuite.core.scheduler.sequence import turn_end_token

# Every linear layer of a Qwen2/Llama block: LoRA on all of them learns a task best for its size.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CHECKPOINT = "checkpoint.pt"


class TrainError(ValueError):
    """A run that cannot start as asked (its settings, its data, its checkpoint): the command says why."""


@dataclass
class TrainConfig:
    task: str  # "gec" or "rag": which app's prompt the examples are put in
    model: str  # the base: a preset or a local model directory
    out: str  # the adapter's folder (the checkpoint lives there until the run ends)
    rank: int = 8
    alpha: float = 16.0
    lr: float = 2e-4
    warmup_steps: int = 10
    batch_size: int = 8
    epochs: float = 1.0
    max_minutes: float | None = None
    checkpoint_minutes: float = 5.0
    dev_examples: int = 64
    max_tokens: int = 1024  # longer examples are dropped (and counted)
    seed: int = 0
    dtype: str | None = None  # None: bf16 autocast where the CPU computes bf16, else fp32
    targets: tuple[str, ...] = LORA_TARGETS
    top_layers: int | None = None  # LoRA on the last N blocks only (None: all of them)
    data: list[str] = field(default_factory=list)  # for the model card


@dataclass
class Encoded:
    ids: list[int]
    prompt_len: int  # the first prompt_len ids carry no loss


def encode(task: str, tokenizer, end_token: int, examples: Sequence) -> list[Encoded]:
    """Each example in its app's prompt, followed by its answer and the end-of-turn token."""
    if task == "gec":
        from specsuite.apps.gec.prompt import gec_prompt_ids

        pairs = [(gec_prompt_ids(tokenizer, e.source), e.target) for e in examples]
    elif task == "rag":
        from specsuite.apps.rag.prompt import rag_prompt_ids

        pairs = [(rag_prompt_ids(tokenizer, e.question, e.passages), e.answer) for e in examples]
    else:
        raise ValueError(f"unknown task {task!r}; use gec or rag")
    out = []
    for prompt, answer in pairs:
        target = tokenizer(answer, add_special_tokens=False)["input_ids"] + [end_token]
        out.append(Encoded(list(prompt) + list(target), len(prompt)))
    return out


def batches(examples: Sequence[Encoded], batch_size: int, seed: int) -> list[list[int]]:
    """Indices of `examples` in batches of similar length (little padding), in a seeded random order."""
    rng = random.Random(seed)
    order = list(range(len(examples)))
    rng.shuffle(order)
    out = []
    pool = batch_size * 32
    for i in range(0, len(order), pool):
        chunk = sorted(order[i:i + pool], key=lambda j: len(examples[j].ids))
        out += [chunk[k:k + batch_size] for k in range(0, len(chunk), batch_size)]
    rng.shuffle(out)
    return out


def collate(examples: Sequence[Encoded], pad_id: int, multiple: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids, attention mask, labels) padded on the right to a `multiple` of tokens (few
    distinct shapes: every new one costs the CPU kernels memory they keep); labels -100 outside
    the answers."""
    width = -(-max(len(e.ids) for e in examples) // multiple) * multiple
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e.ids)
        ids[row, :n] = torch.tensor(e.ids)
        mask[row, :n] = 1
        labels[row, e.prompt_len:n] = ids[row, e.prompt_len:n]
    return ids, mask, labels


def shared_prefix(batch: Sequence[Encoded]) -> int:
    """How many leading ids every example of `batch` shares, stopping before the first answer's
    last prompt token (whose output predicts that answer's first token)."""
    first, n = batch[0].ids, min(e.prompt_len for e in batch) - 1
    for e in batch[1:]:
        n = next((i for i in range(n) if e.ids[i] != first[i]), n)
    return max(n, 0)


def answer_loss(model, batch: Sequence[Encoded], pad_id: int, autocast: bool) -> tuple[torch.Tensor, int, int]:
    """Mean cross-entropy over the answer tokens of `batch`; also how many there are and how many
    the model's argmax gets right.

    The prefix the examples share (the app's instruction: most of a GEC prompt) is computed once
    and its keys and values broadcast to every row, gradients included, instead of once a row;
    the output layer runs on the answer positions alone (its vocabulary is most of a small
    model's cost per position)."""
    from transformers import DynamicCache

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder, head = base.model, base.lm_head
    p = shared_prefix(batch)
    ids, mask, labels = collate([Encoded(e.ids[p:], e.prompt_len - p) for e in batch], pad_id)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        cache = None
        if p:
            cache = DynamicCache(config=base.config)
            decoder(input_ids=torch.tensor([batch[0].ids[:p]]), past_key_values=cache, use_cache=True)
            for layer in cache.layers:
                layer.keys = layer.keys.expand(len(batch), -1, -1, -1)
                layer.values = layer.values.expand(len(batch), -1, -1, -1)
            mask = torch.cat([torch.ones((len(batch), p), dtype=mask.dtype), mask], dim=1)
        hidden = decoder(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=cache is not None)
        target = labels[:, 1:]
        keep = target != -100
        logits = head(hidden.last_hidden_state[:, :-1][keep]).float()
    loss = torch.nn.functional.cross_entropy(logits, target[keep])
    return loss, int(keep.sum()), int((logits.argmax(-1) == target[keep]).sum())


def _lr_scale(step: int, progress: float, warmup: int) -> float:
    """Linear warm-up, then linear decay to a tenth over the run (progress: the larger of the
    share of steps and of the time budget done)."""
    return min(1.0, (step + 1) / warmup) * max(0.1, 1.0 - progress)


def _return_freed_memory() -> None:
    """Make glibc hand every block of 4 MiB or more back to the system when it is freed. Batches
    of different lengths allocate activations of ever new sizes; the default (heap up to 32 MiB,
    a threshold that rises) let a 1.5B run's memory creep from 8 to 24 GB in 90 steps, killed."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    m_mmap_threshold, m_arena_max = -3, -8
    libc.mallopt(m_mmap_threshold, 4 << 20)
    libc.mallopt(m_arena_max, 2)


def _rss_gb() -> float:
    """This process's resident memory (Linux; 0 elsewhere): shown with the progress."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError):
        return 0.0


def _save_atomic(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def lora_state(model) -> dict[str, torch.Tensor]:
    """The LoRA weights, named `<module path>.lora_A|lora_B` as `specsuite.adapters` reads them."""
    out = {}
    for name, tensor in model.state_dict().items():
        if ".lora_A." in name or ".lora_B." in name:
            module, kind = name.split(".lora_")
            module = module.removeprefix("base_model.model.")
            out[f"{module}.lora_{kind.split('.')[0]}"] = tensor.detach().to(torch.float32).contiguous()
    return out


@dataclass
class DevScore:
    loss: float
    token_accuracy: float
    tokens: int


def score(model, examples: Sequence[Encoded], pad_id: int, autocast: bool, batch_size: int) -> DevScore:
    total, tokens, right = 0.0, 0, 0
    with torch.no_grad():
        for i in range(0, len(examples), batch_size):
            loss, n, k = answer_loss(model, examples[i:i + batch_size], pad_id, autocast)
            total, tokens, right = total + float(loss) * n, tokens + n, right + k
    return DevScore(total / max(tokens, 1), right / max(tokens, 1), tokens)


def train(config: TrainConfig, examples: Sequence, log: Callable[[str], None] = print) -> dict:
    """Fine-tune `config.model` on `examples` (GecPair or RagExample) and write the adapter to
    `config.out`; returns the model card's figures. Resumes from `config.out`'s checkpoint."""
    from peft import LoraConfig, get_peft_model

    from specsuite.models import default_dtype, load_model, resolve_model_path

    _return_freed_memory()
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = out / CHECKPOINT
    autocast = (config.dtype or ("bf16" if default_dtype() == torch.bfloat16 else "fp32")) == "bf16"
    # The frozen base in bf16 where autocast computes in bf16 anyway (half the memory, no cast a
    # step); the LoRA weights stay fp32 (peft's default), so their updates are not rounded away.
    model, tok = load_model(config.model, dtype="bf16" if autocast else "fp32")
    base = base_fingerprint(resolve_model_path(config.model))
    end = turn_end_token(model, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else end

    encoded = encode(config.task, tok, end, examples)
    too_long = sum(len(e.ids) > config.max_tokens for e in encoded)
    encoded = [e for e in encoded if len(e.ids) <= config.max_tokens]
    if len(encoded) < 2:
        raise TrainError(f"{len(encoded)} usable examples ({too_long} over --max-tokens {config.max_tokens}): too few to train")
    rng = random.Random(config.seed)
    order = list(range(len(encoded)))
    rng.shuffle(order)
    n_dev = min(config.dev_examples, len(encoded) // 5)
    dev = [encoded[i] for i in order[:n_dev]]
    train_set = [encoded[i] for i in order[n_dev:]]
    epoch_batches = batches(train_set, config.batch_size, config.seed)
    total_steps = max(1, math.ceil(len(epoch_batches) * config.epochs))

    model.config.use_cache = False
    blocks = model.config.num_hidden_layers
    if config.top_layers is not None and not 1 <= config.top_layers <= blocks:
        raise TrainError(f"--top-layers {config.top_layers}: the model has {blocks} blocks")
    # LoRA on the last blocks only: the blocks below run without autograd (nothing there needs a
    # gradient), so a step costs their forward alone, not forward and backward.
    layers = list(range(blocks - config.top_layers, blocks)) if config.top_layers else None
    model = get_peft_model(model, LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=0.0,
                                             target_modules=list(config.targets), layers_to_transform=layers,
                                             task_type="CAUSAL_LM"))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    state = {"step": 0, "elapsed_s": 0.0, "tokens": 0, "losses": []}
    if checkpoint.exists():
        saved = torch.load(checkpoint, weights_only=False)
        # the budget and the checkpoint interval may change between runs; nothing else may
        # (a checkpoint from before a setting existed has that setting's default)
        saved_config = asdict(TrainConfig(**saved["config"]))
        if saved_config != asdict(config) | {k: saved_config[k] for k in ("max_minutes", "checkpoint_minutes")}:
            raise TrainError(f"{checkpoint} is from a run with other settings; use another --out or delete it")
        model.load_state_dict(saved["lora"], strict=False)
        optimizer.load_state_dict(saved["optimizer"])
        state = saved["state"]
        log(f"resuming from {checkpoint}: step {state['step']} of {total_steps}, "
            f"{state['elapsed_s'] / 60:.1f} min trained")

    def save_checkpoint() -> None:
        lora = {k: v for k, v in model.state_dict().items() if "lora_" in k}
        _save_atomic({"config": asdict(config), "lora": lora, "optimizer": optimizer.state_dict(), "state": state},
                     checkpoint)

    budget_s = config.max_minutes * 60 if config.max_minutes else math.inf
    log(f"{len(train_set)} training examples ({too_long} over {config.max_tokens} tokens dropped), {n_dev} held back "
        f"for dev; {total_steps} steps of {config.batch_size}; LoRA rank {config.rank} on {', '.join(config.targets)} "
        f"of {f'the last {config.top_layers} of {blocks}' if layers else f'all {blocks}'} blocks; "
        f"{'bf16 autocast' if autocast else 'fp32'}")
    model.train()
    last_save = time.monotonic()
    bar = tqdm(total=total_steps, initial=state["step"], unit="step", dynamic_ncols=True, desc=f"train {config.task}")
    run_start, run_start_elapsed = time.monotonic(), state["elapsed_s"]
    while state["step"] < total_steps and state["elapsed_s"] < budget_s:
        step = state["step"]
        epoch, at = divmod(step, len(epoch_batches))
        if epoch:  # each later pass in another order (a function of the step alone: resumable)
            epoch_batches = batches(train_set, config.batch_size, config.seed + epoch)
        batch = [train_set[i] for i in epoch_batches[at]]
        progress = max(step / total_steps, state["elapsed_s"] / budget_s)
        for group in optimizer.param_groups:
            group["lr"] = config.lr * _lr_scale(step, progress, config.warmup_steps)
        loss, _, _ = answer_loss(model, batch, pad, autocast)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state["step"] += 1
        state["tokens"] += sum(len(e.ids) for e in batch)
        state["losses"].append(round(loss.detach().item(), 4))
        state["elapsed_s"] = run_start_elapsed + time.monotonic() - run_start
        recent = state["losses"][-20:]
        left_s = min(budget_s - state["elapsed_s"], (total_steps - state["step"]) * state["elapsed_s"] / state["step"])
        bar.set_postfix_str(f"loss {sum(recent) / len(recent):.3f}, {state['tokens'] / state['elapsed_s']:.0f} tok/s, "
                            f"ETA {max(left_s, 0) / 60:.0f} min, {_rss_gb():.1f} GB")
        bar.update(1)
        if time.monotonic() - last_save > config.checkpoint_minutes * 60:
            save_checkpoint()
            last_save = time.monotonic()
    bar.close()
    save_checkpoint()

    model.eval()
    trained = score(model, dev, pad, autocast, config.batch_size)
    with model.disable_adapter():
        before = score(model, dev, pad, autocast, config.batch_size)
    figures = {
        "steps": state["step"], "planned_steps": total_steps, "examples_seen": state["step"] * config.batch_size,
        "train_examples": len(train_set), "train_minutes": round(state["elapsed_s"] / 60, 1),
        "tokens_per_s": round(state["tokens"] / max(state["elapsed_s"], 1e-9), 1),
        "first_loss": state["losses"][0] if state["losses"] else None,
        "last_loss": round(sum(state["losses"][-20:]) / max(len(state["losses"][-20:]), 1), 4),
        "dev": {"examples": n_dev, "base": asdict(before), "adapter": asdict(trained)},
    }
    write_adapter(out, lora_state(model), config, base, figures | {"autocast_bf16": autocast})
    log(f"dev ({n_dev} held-back examples): answer loss {before.loss:.3f} -> {trained.loss:.3f}, "
        f"token accuracy {before.token_accuracy:.1%} -> {trained.token_accuracy:.1%}")
    return figures


def write_adapter(out: Path, weights: dict[str, torch.Tensor], config: TrainConfig, base: str, figures: dict) -> None:
    from safetensors.torch import save_file

    meta = {"task": config.task, "base_model": config.model, "base_fingerprint": base, "rank": config.rank,
            "alpha": config.alpha, "targets": list(config.targets), "top_layers": config.top_layers, "data": config.data,
            "training": {k: getattr(config, k) for k in ("lr", "batch_size", "epochs", "max_minutes", "seed",
                                                           "max_tokens")},
            "figures": figures}
    # bf16 halves the file; the merge adds B @ A in fp32 to weights that are bf16 or rounded anyway.
    weights = {k: v.to(torch.bfloat16) for k, v in weights.items()}
    save_file(weights, str(out / (ADAPTER_WEIGHTS + ".tmp")))
    os.replace(out / (ADAPTER_WEIGHTS + ".tmp"), out / ADAPTER_WEIGHTS)
    (out / ADAPTER_CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
    (out / "README.md").write_text(model_card(meta))


def model_card(meta: dict) -> str:
    """The adapter's card: what it was trained from, how, and what the held-back dev split says."""
    f, dev = meta["figures"], meta["figures"]["dev"]
    data = "\n".join(f"- `{d}`" for d in meta["data"]) or "- (not recorded)"
    return (f"# {meta['task']} adapter for {meta['base_model']}\n\n"
            f"LoRA (rank {meta['rank']}, alpha {meta['alpha']:g}) on {', '.join(meta['targets'])}"
            f"{f' of the last {top} blocks' if (top := meta.get('top_layers')) else ''}, trained with "
            f"`specsuite train {meta['task']}` and merged into the base weights at load.\n\n"
            f"- base model: `{meta['base_model']}`, {meta['base_fingerprint']}\n"
            f"- training: {f['steps']} steps of {meta['training']['batch_size']} examples ({f['examples_seen']:,} "
            f"examples seen of {f['train_examples']:,}), {f['train_minutes']} min, {f['tokens_per_s']} tokens/s, "
            f"{'bf16 autocast' if f.get('autocast_bf16') else 'fp32'}, lr {meta['training']['lr']}\n"
            f"- training loss: {f['first_loss']} (first step) -> {f['last_loss']} (last 20 steps)\n"
            f"- held-back dev split ({dev['examples']} examples): answer loss {dev['base']['loss']:.3f} -> "
            f"{dev['adapter']['loss']:.3f}, token accuracy {dev['base']['token_accuracy']:.1%} -> "
            f"{dev['adapter']['token_accuracy']:.1%} (base -> adapter)\n\n"
            f"## Data\n\n{data}\n")
