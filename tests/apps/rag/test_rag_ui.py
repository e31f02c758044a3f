"""The RAG web app, launched in-process on the small model and a demo-corpus index: the JSON
"ask" endpoint through gradio_client, and the page itself in Debian's chromium (Playwright)."""

from __future__ import annotations

import os
import re

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import pytest
from conftest import REPO, free_port

from specsuite.apps.rag.qa import RagQA, find_claims
from specsuite.apps.rag.ui import answer_html, build_app, passages_html, stats_html

DEMO_CORPUS = REPO / "demos" / "corpus"
QUESTION = "Where did the Apollo 11 crew launch from?"  # answered by copying the corpus (in fp32)


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


@pytest.fixture(scope="module")
def app_url(smollm2_fp32):
    from specsuite.retrieval import Embedder, PassageIndex, load_documents

    index = PassageIndex.build(load_documents([DEMO_CORPUS]), Embedder("minilm-l6"))
    # fp32: the same answer on every CPU (see conftest), one that copies from the corpus
    qa = RagQA.from_loaded(*smollm2_fp32, index, max_new_tokens=16, min_relevance=0)  # k passages shown, as asked
    app = build_app(qa, k=3)
    port = free_port()
    app.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    yield f"http://127.0.0.1:{port}/"
    app.close()


def test_answer_html_links_copied_spans_to_the_highlighted_passage_text():
    passages = ["Apollo 11 landed in 1969.", "It landed <here> in the Sea of Tranquility {x} after a long trip."]
    text = "It landed <here> in the Sea of Tranquility [2] {x}."
    claims = find_claims(text, passages)
    assert [c.how for c in claims] == ["copied"]
    html = answer_html(text, claims, 2)
    anchor = f"cite-2-{passages[1].index('It landed')}"
    assert f'<a class="copied" href="#{anchor}"' in html and ">It landed &lt;here&gt; in the Sea of Tranquility</a>" in html
    assert '<a class="cite" href="#passage-2">[2]</a>' in html
    assert "{" not in html  # escaped, braces included (Handlebars)
    shown = passages_html([(p, 0.5) for p in passages], claims)
    assert f'<mark id="{anchor}" class="cited-span">It landed &lt;here&gt; in the Sea of Tranquility</mark>' in shown
    assert 'id="passage-1" class="passage"' in shown and 'class="passage cited"' in shown
    assert "score 0.500" in shown and "<mark" not in shown.split('id="passage-2"')[0]


def test_stats_are_a_table():
    stats = {"model": "m", "drafter": "reference", "new_tokens": 12, "total_s": 1.5, "tokens_per_s": 8.0,
             "ttft_s": 0.25, "retrieval_s": 0.01, "tokens_per_step": 2.4, "acceptance_rate": 0.5,
             "prompt_tokens": 300, "cached_prompt_tokens": 200, "finish_reason": "eos"}
    html = stats_html(stats)
    assert html.startswith('<table class="stats">') and "<th>tokens</th><td>12 in 1.50 s (8.0 tokens/s)</td>" in html
    assert "300 tokens, 200 from the prefix cache" in html


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
    expect(page.locator("#stats table.stats")).to_contain_text("tokens/forward pass", timeout=60_000)
    answer = page.locator("#answer .answer-text")
    expect(answer).not_to_be_empty()
    links = page.locator("#answer a.copied").all()
    assert links, "the answer copies from a passage (the smollm2 answer copies the corpus)"
    for link in links:  # each highlight links to the passage text it copies, highlighted there
        target = page.locator(f"#passages mark{link.get_attribute('href')}")
        expect(target).to_have_count(1)
        assert " ".join(words(link.inner_text())) in " ".join(words(target.inner_text()))
    links[0].click()
    expect(page.locator("#passages mark.cited-span:target")).to_have_count(1)
