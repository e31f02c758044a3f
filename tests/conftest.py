"""Shared fixtures, and the markers they imply: a test that uses a fixture of MARKED_FIXTURES,
directly or through another fixture, gets its marker (`-m "not real_model"` selects the fast tests)."""

from pathlib import Path

import pytest

MARKED_FIXTURES = {"smollm2": "real_model", "smollm2_fp32": "real_model", "browser_page": "browser"}


def pytest_collection_modifyitems(items):
    for item in items:
        for name in set(MARKED_FIXTURES) & set(getattr(item, "fixturenames", ())):
            item.add_marker(MARKED_FIXTURES[name])

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


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
