"""The GEC web UI in a real browser: Debian's chromium driven by Playwright, the app in-process."""

import os

import pytest
from conftest import free_port

os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"  # before gradio is imported

pytestmark = [pytest.mark.browser, pytest.mark.real_model]


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
def page(browser_page):
    return browser_page


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


def test_text_over_the_limit_is_refused_with_the_limit_named(app_url, page):
    from playwright.sync_api import expect

    page.goto(app_url, wait_until="networkidle")
    page.locator("#gec-input textarea").fill("She go to school yesterday . " * 1000)  # 29,000 characters
    page.locator("#gec-correct").click()
    expect(page.get_by_text("the limit is 1,024 tokens").first).to_be_visible(timeout=10_000)
    assert "school" not in page.locator("#gec-output").inner_text()  # nothing was corrected
