"""The RAG web app, launched in-process on the small model and a demo-corpus index: the JSON
"ask" endpoint through gradio_client, and the page itself in Debian's chromium (Playwright)."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import pytest
from conftest import free_port

from specsuite.apps.rag.qa import RagQA
from specsuite.apps.rag.ui import answer_html, build_app, passages_html

DEMO_CORPUS = Path(__file__).resolve().parents[1] / "demos" / "corpus"
QUESTION = "Who was the commander of Apollo 11?"


@pytest.fixture(scope="module")
def app_url(smollm2):
    from specsuite.retrieval import Embedder, PassageIndex, load_documents

    index = PassageIndex.build(load_documents([DEMO_CORPUS]), Embedder("minilm-l6"))
    qa = RagQA.from_loaded(*smollm2, index, max_new_tokens=16)
    app = build_app(qa, k=3)
    port = free_port()
    app.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    yield f"http://127.0.0.1:{port}/"
    app.close()


def test_answer_html_links_copied_spans_and_citations():
    text = "It landed <here> in the Sea of Tranquility [2] {x}."
    start = text.index("in the Sea")
    html = answer_html(text, [(start, start + len("in the Sea of Tranquility"), 2)], 2)
    assert '<a class="copied" href="#passage-2"' in html and ">in the Sea of Tranquility</a>" in html
    assert '<a class="cite" href="#passage-2">[2]</a>' in html
    assert "&lt;here&gt;" in html and "{" not in html  # escaped, braces included (Handlebars)
    assert 'id="passage-1"' in passages_html([("a passage", 0.5)]) and "score 0.500" in passages_html([("p", 0.5)])


def test_api_ask_endpoint(app_url):
    from gradio_client import Client

    result = Client(app_url, verbose=False).predict(QUESTION, 3, api_name="/ask")
    assert result["question"] == QUESTION and result["answer"]
    assert len(result["passages"]) == 3 and result["passages"][0]["doc_id"].endswith("apollo-11.md")
    assert all(p["number"] == n for n, p in enumerate(result["passages"], 1))
    assert result["stats"]["new_tokens"] > 0 and isinstance(result["citations"], list)


@pytest.mark.browser
def test_ask_in_the_browser(app_url, browser_page):
    from playwright.sync_api import expect

    page = browser_page
    page.goto(app_url)
    page.locator("#question textarea").fill(QUESTION)
    page.locator("#ask").click()
    expect(page.locator("#passages #passage-1")).to_be_visible(timeout=60_000)
    expect(page.locator("#passages #passage-3")).to_contain_text("score")
    expect(page.locator("#stats")).to_contain_text("new_tokens", timeout=60_000)
    answer = page.locator("#answer .answer-text")
    expect(answer).not_to_be_empty()
    for link in page.locator("#answer a.copied").all():  # each highlight points at a shown passage
        expect(page.locator(link.get_attribute("href"))).to_have_count(1)
