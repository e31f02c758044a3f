"""The RAG web app: ask a question, watch the answer stream in with the parts copied from the
passages highlighted and linked to them, and see the passages and the call's stats.

The app also serves a plain JSON endpoint for programs:

    from gradio_client import Client
    Client("http://127.0.0.1:7861/").predict("Who commanded Apollo 11?", 5, api_name="/ask")

A bad request (an empty or too long question, k outside 1..50, a wrong type) is refused at once
with a `gr.Error` naming the problem (gradio_client raises it as an AppError), and a request that
runs past the time budget ends with one. Events run concurrently, so a refusal never waits behind
another request; the generations themselves take turns on the model (RagQA's lock).
"""

from __future__ import annotations

import html
import re
import time
from typing import Any, Iterator, Sequence

import gradio as gr

from specsuite.apps.limits import DEFAULT_TIME_BUDGET_S, InputError, TimeBudgetExceeded, check_limit
from specsuite.core import TextPiece

from .qa import RagQA, Scored, copied_spans, passage_body

# Scoped to each HTML component by Gradio (css_template).
CSS = """
a.copied { background: #fff3b0; color: inherit; text-decoration: none; border-radius: 3px; padding: 0 1px; }
a.copied:hover { background: #ffe066; }
a.cite { font-weight: 600; text-decoration: none; }
.passage { margin: 0 0 0.8em; padding: 0.5em 0.7em; border-left: 3px solid #ccc; }
.passage.cited { border-left-color: #f0b400; }
.passage .meta { font-size: 0.85em; opacity: 0.75; margin-bottom: 0.3em; }
.hint { opacity: 0.6; }
"""
_CITATION = re.compile(r"\[(\d+)\]")


def _escape(text: str) -> str:
    # Braces too: the HTML component's template is rendered with Handlebars.
    return html.escape(text).replace("{", "&#123;").replace("}", "&#125;")


def _plain(text: str, count: int) -> str:
    """Escaped text whose [n] citations link to passage n."""
    def link(m: re.Match) -> str:
        n = int(m.group(1))
        return f'<a class="cite" href="#passage-{n}">[{n}]</a>' if 1 <= n <= count else m.group(0)

    return _CITATION.sub(link, _escape(text))


def answer_html(text: str, spans: Sequence[tuple[int, int, int]], count: int) -> str:
    """The answer with each copied span as a highlighted link to its passage."""
    out, pos = [], 0
    for start, end, n in spans:
        out.append(_plain(text[pos:start], count))
        out.append(f'<a class="copied" href="#passage-{n}" data-passage="{n}" title="copied from passage [{n}]">'
                   f"{_escape(text[start:end])}</a>")
        pos = end
    out.append(_plain(text[pos:], count))
    return '<div class="answer-text">' + "".join(out).replace("\n", "<br>") + "</div>"


def passages_html(scored: Sequence[Scored], cited: Sequence[int] = ()) -> str:
    items = []
    for n, (p, score) in enumerate(scored, 1):
        title = p if isinstance(p, str) else (p.title or p.doc_id)
        meta = [f"<b>[{n}]</b>"] + ([] if isinstance(p, str) else [_escape(title)])
        if score is not None:
            meta.append(f"score {score:.3f}")
        items.append(f'<div id="passage-{n}" class="passage{" cited" if n in cited else ""}">'
                     f'<div class="meta">{" · ".join(meta)}</div>'
                     f'<div class="text">{_escape(passage_body(p))}</div></div>')
    return "".join(items) or '<p class="hint">No passages.</p>'


def build_app(qa: RagQA, k: int = 5, time_budget_s: float | None = DEFAULT_TIME_BUDGET_S) -> gr.Blocks:
    """The Gradio app over `qa`; elem_ids: question, k, ask, answer, passages, stats.
    time_budget_s: seconds a request may take (None: no limit), waiting for the model included."""
    check_limit(time_budget_s, "the time budget")

    def run(question: str, k: float) -> Iterator[tuple[Any, Any, Any]]:
        try:
            start = time.perf_counter()
            question, k = qa.validate(question, k)
            scored = list(qa.retrieve(question, k))
            retrieval_s = round(time.perf_counter() - start, 4)
            bodies = [passage_body(p) for p, _ in scored]
            yield '<p class="hint">Answering…</p>', passages_html(scored), {}
            # What is left of the request's budget after the retrieval.
            left = None if time_budget_s is None else max(1e-3, time_budget_s - (time.perf_counter() - start))
            text = ""
            for item in qa.stream_answer(question, scored, time_budget_s=left):
                if isinstance(item, TextPiece):
                    text += item.text
                    yield answer_html(text, copied_spans(text, bodies), len(scored)), gr.skip(), gr.skip()
                else:
                    yield (answer_html(item.text, item.spans, len(scored)), passages_html(scored, item.citations),
                           {"retrieval_s": retrieval_s, **item.stats})
        except (InputError, TimeBudgetExceeded) as e:
            raise gr.Error(str(e), print_exception=False) from None

    def ask(question: str, k: int = 5) -> dict:
        """Answer `question` from the `k` nearest passages: answer, citations, passages, spans, stats."""
        try:
            return qa.ask(question, k, time_budget_s=time_budget_s).to_json()
        except (InputError, TimeBudgetExceeded) as e:
            raise gr.Error(str(e), print_exception=False) from None

    with gr.Blocks(title="specsuite · RAG") as app:
        gr.Markdown("## Ask your documents\nAnswers are drafted from the retrieved passages; "
                    "highlighted parts are copied from a passage (click to jump to it).")
        with gr.Row():
            question = gr.Textbox(label="Question", elem_id="question", scale=5, lines=1,
                                  placeholder="e.g. Who commanded Apollo 11?")
            passages_k = gr.Slider(1, 10, value=k, step=1, label="Passages", elem_id="k", scale=1)
        button = gr.Button("Ask", variant="primary", elem_id="ask")
        answer = gr.HTML(elem_id="answer", css_template=CSS, padding=True)
        with gr.Row():
            with gr.Column(scale=3):
                gr.Markdown("### Passages")
                passages = gr.HTML(elem_id="passages", css_template=CSS)
            with gr.Column(scale=2):
                stats = gr.JSON(label="Stats", elem_id="stats")
        # No concurrency limit: a request is checked (and a bad one refused) at once, not behind a
        # running one; generations take turns on the model in RagQA, each within its time budget.
        for event in (button.click, question.submit):
            event(run, [question, passages_k], [answer, passages, stats], api_visibility="undocumented",
                  concurrency_limit=None)
        gr.api(ask, api_name="ask", concurrency_limit=None)
    return app
