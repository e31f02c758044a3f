"""Shared fixtures, and the markers they imply: a test that uses a fixture of MARKED_FIXTURES,
directly or through another fixture, gets its marker (`-m "not real_model"` selects the fast tests)."""

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from specsuite.core import Draft, Drafter, DraftPolicy, choose_backend

from specsuite.core.scheduler import kv

MARKED_FIXTURES = {"smollm2": "real_model", "smollm2_fp32": "real_model", "browser_page": "browser"}


def pytest_collection_modifyitems(items):
    for item in items:
        for name in set(MARKED_FIXTURES) & set(getattr(item, "fixturenames", ())):
            item.add_marker(MARKED_FIXTURES[name])

# The repository's root: the tests sit in folders mirroring the code, so paths start from here.
REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The evaluation data in ../shared/data (skips when it is not there)."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"no shared data at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the smollm2-135m preset, loaded once per session in the default dtype.

    Provisioning it downloads ~100 MB on first use; skips if that fails (offline, no cache)."""
    from specsuite.models import ProvisioningError, load_model

    try:
        return load_model("smollm2-135m")
    except ProvisioningError as e:
        pytest.skip(f"smollm2-135m is not available: {e}")


@pytest.fixture(scope="session")
def smollm2_fp32():
    """smollm2-135m in fp32, for token-for-token exactness against HF greedy on real text, on any
    CPU. (bf16 exactness rests on kernel rounding rules checked at run time, see exact_linear.py:
    it is tested in test_core_real_model.py and measured on qwen2.5-0.5b by `specsuite bench`.)"""
    from specsuite.models import ProvisioningError, load_model

    try:
        return load_model("smollm2-135m", dtype="fp32")
    except ProvisioningError as e:
        pytest.skip(f"smollm2-135m is not available: {e}")


CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def free_port() -> int:
    """A free TCP port on the loopback interface, for an app under test."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_process(log: Path, *flags: str, timeout: float = 180):
    """`specsuite serve FLAGS` as its own process on a free port, once its /health answers 200:
    (process, base URL). The caller ends the process."""
    import os
    import subprocess
    import sys
    import time

    import httpx

    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "specsuite.cli", "serve", "--port", str(port), *flags],
                                stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the server did not start:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


@pytest.fixture(scope="module")
def browser_page():
    """A page in Debian's headless chromium driven by Playwright (never a downloaded browser).
    Skips when chromium is missing, except on CI (CI set), where that is a failure."""
    import os

    if not CHROMIUM.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium package")
        pytest.skip(f"{CHROMIUM} is not installed")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser.new_page()
        finally:
            browser.close()


# ---- tiny random models for the core's tests (imported by them: `from conftest import ...`) ----

VOCAB = 96


CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config}

# Qwen2.5-0.5B's linear shapes (out, in, bias): q/o, k/v, gate/up, down
QWEN_LINEARS = [(896, 896, True), (128, 896, True), (4864, 896, False), (896, 4864, False)]


def tiny_model(kind: str = "llama", attn: str = "sdpa", seed: int = 0, vocab: int = VOCAB,
               max_positions: int = 256, init: float = 0.3):
    """A 2-layer, 32-wide random model in fp32. A large initializer_range gives peaked, varied
    next-token distributions (the default 0.02 makes every logit nearly equal)."""
    torch.manual_seed(seed)
    config = CONFIGS[kind](
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max_positions, initializer_range=init,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32).eval()
    assert model.config._attn_implementation == attn
    return model


_MODELS: dict = {}


def model_for(kind: str = "llama", attn: str = "sdpa", seed: int = 0, **kw):
    key = (kind, attn, seed, tuple(sorted(kw.items())))
    if key not in _MODELS:
        _MODELS[key] = tiny_model(kind, attn, seed, **kw)
    return _MODELS[key]


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def policy(model, **changes) -> DraftPolicy:
    """The draft policy `generate()` runs `model` with by default (its backend's), with `changes`;
    a ladder of draft_sizes replaces the backend's measured step cost."""
    if "draft_sizes" in changes:
        changes.setdefault("draft_cost", None)
    return replace(choose_backend(model).policy, **changes)


def prompts(count: int, seed: int, vocab: int = VOCAB, lengths=(1, 24)) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        p = [rng.randrange(vocab) for _ in range(rng.randint(*lengths))]
        if len(p) > 6 and rng.random() < 0.5:  # repeated text gives prompt lookup something to copy
            p = p + p[: rng.randint(2, len(p))]
        out.append(p)
    return out


class OracleTreeDrafter(Drafter):
    """Knows the true greedy continuation; proposes trees that mix the true path (of random depth,
    sometimes corrupted after a few tokens) with wrong branches, the true branch in random sibling
    order, so that accepted paths are often not the first laid-out nodes."""

    name = "oracle"

    def __init__(self, prompt: list[int], truth: list[int], seed: int, vocab: int = VOCAB,
                 depth: tuple[int, int] = (1, 8), branches: int = 3, corrupt: float = 0.25,
                 ignore_max_depth: bool = False) -> None:
        self.prompt, self.truth, self.rng, self.vocab = prompt, truth, random.Random(seed), vocab
        self.depth, self.branches, self.corrupt, self.ignore_max_depth = depth, branches, corrupt, ignore_max_depth
        self.accepted = self.drafted = self.proposals = 0

    def reset(self, prompt, sampling=None) -> None:
        assert list(prompt) == self.prompt

    def propose(self, tokens, max_depth):
        rng = self.rng
        done = len(tokens) - len(self.prompt)
        # The loop only ever extends the sequence with the true greedy tokens.
        assert tokens[: len(self.prompt)] == self.prompt and tokens[len(self.prompt):] == self.truth[:done]
        depth = rng.randint(*self.depth)
        if not self.ignore_max_depth:
            depth = min(depth, max_depth)
        true = self.truth[done: done + depth]
        if not true:
            return None
        if len(true) > 1 and rng.random() < self.corrupt:  # partially right: a wrong token after a few
            cut = rng.randrange(1, len(true))
            true = true[:cut] + [(true[cut] + 1 + rng.randrange(self.vocab - 1)) % self.vocab]
        paths = [true]
        for _ in range(rng.randint(0, self.branches)):
            cut = rng.randrange(len(true))
            wrong = (true[cut] + 1 + rng.randrange(self.vocab - 1)) % self.vocab
            paths.append(true[:cut] + [wrong] + [rng.randrange(self.vocab) for _ in range(rng.randint(0, 4))])
        rng.shuffle(paths)
        self.proposals += 1
        return Draft.from_paths(paths)

    def update(self, draft, path):
        self.accepted += len(path)
        self.drafted += len(draft) if draft else 0


@pytest.fixture
def keep_path_spy(monkeypatch):
    """Counts cache compactions that keep a path other than the first laid-out nodes."""
    calls = {"non_prefix": 0, "total": 0}
    real = kv.keep_path

    def spy(tensors, base, path):
        calls["total"] += 1
        if path != list(range(len(path))):
            calls["non_prefix"] += 1
        return real(tensors, base, path)

    monkeypatch.setattr(kv, "keep_path", spy)
    return calls
