"""The GEC web UI in a real browser: Debian's chromium driven by Playwright, the app in-process."""

import os
import socket
from pathlib import Path

import pytest

os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"  # before gradio is imported

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = [pytest.mark.browser, pytest.mark.real_model]

if not CHROMIUM.exists() and not os.environ.get("CI"):  # on CI a missing browser is a failure
    pytest.skip(f"{CHROMIUM} is not installed", allow_module_level=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_url(smollm2):
    from specsuite.apps.gec.corrector import Corrector
    from specsuite.apps.gec.ui import launch

    # A short budget keeps the CPU test quick; the small model rambles past a sentence anyway.
    corrector = Corrector.from_loaded(*smollm2, max_new_tokens=12)
    port = free_port()
    app = launch(corrector, host="127.0.0.1", port=port, prevent_thread_lock=True)
    yield f"http://127.0.0.1:{port}/"
    app.close()


@pytest.fixture(scope="module")
def page():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        yield browser.new_page()
        browser.close()


def test_example_is_corrected_with_stats(app_url, page):
    from playwright.sync_api import expect

    from specsuite.apps.gec.corrector import demo_sentences

    page.goto(app_url, wait_until="networkidle")
    example = demo_sentences()[0]
    page.locator("#gec-examples").get_by_text(example).first.click()
    expect(page.locator("#gec-input textarea")).to_have_value(example)  # filled asynchronously
    page.locator("#gec-correct").click()
    stats = page.locator("#gec-stats")
    stats.get_by_text("tokens/step").wait_for(timeout=90_000)
    assert stats.get_by_text("estimated speedup").is_visible()
    assert page.locator("#gec-output").inner_text().strip()
    # The edits view shows the source with the changes marked up.
    diff = page.locator("#gec-diff")
    assert diff.get_by_text("edit").count() >= 1
