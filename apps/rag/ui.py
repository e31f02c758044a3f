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
from typing import Any, Iterator, Sequence

import gradio as gr

from specsuite.apps.limits import DEFAULT_TIME_BUDGET_S, InputError, TimeBudgetExceeded, check_limit
from specsuite.apps.serving.batch_server import warm_up as warm_up_app
from specsuite.core import TextPiece

from .qa import Claim, RagQA, Scored, passage_body

# Scoped to each HTML component by Gradio (css_template).
CSS = """
a.copied { background: #fff3b0; color: inherit; text-decoration: none; border-radius: 3px; padding: 0 1px; }
a.copied:hover { background: #ffe066; }
a.cite { font-weight: 600; text-decoration: none; }
.passage { margin: 0 0 0.8em; padding: 0.5em 0.7em; border-left: 3px solid #ccc; }
.passage.cited { border-left-color: #f0b400; }
.passage .meta { font-size: 0.85em; opacity: 0.75; margin-bottom: 0.3em; }
mark.cited-span { background: #fff3b0; border-radius: 3px; }
mark.cited-span:target { background: #ffe066; outline: 2px solid #f0b400; }
table.stats th { text-align: left; padding-right: 1em; font-weight: 600; }
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


def _ranges(claims: Sequence[Claim], n: int) -> list[tuple[int, int]]:
    """The passage ranges of passage n that claims rest on, overlapping ones merged."""
    merged: list[list[int]] = []
    for a, b in sorted((c.passage_start, c.passage_end) for c in claims if c.passage == n):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _anchor(claims: Sequence[Claim], claim: Claim) -> str:
    """The id of the highlighted passage range holding `claim`'s source."""
    start = next(a for a, b in _ranges(claims, claim.passage) if a <= claim.passage_start < b)
    return f"cite-{claim.passage}-{start}"


def answer_html(text: str, claims: Sequence[Claim], count: int) -> str:
    """The answer with each copied part as a highlighted link to the passage text it copies."""
    out, pos = [], 0
    for c in claims:
        if c.how != "copied":
            continue
        out.append(_plain(text[pos:c.start], count))
        out.append(f'<a class="copied" href="#{_anchor(claims, c)}" data-passage="{c.passage}" '
                   f'title="copied from passage [{c.passage}]">{_escape(text[c.start:c.end])}</a>')
        pos = c.end
    out.append(_plain(text[pos:], count))
    return '<div class="answer-text">' + "".join(out).replace("\n", "<br>") + "</div>"


def _marked(body: str, claims: Sequence[Claim], n: int) -> str:
    """A passage's text with the ranges the answer rests on highlighted, each an anchor."""
    out, pos = [], 0
    for a, b in _ranges(claims, n):
        out.append(_escape(body[pos:a]))
        out.append(f'<mark id="cite-{n}-{a}" class="cited-span">{_escape(body[a:b])}</mark>')
        pos = b
    return "".join(out) + _escape(body[pos:])


def passages_html(scored: Sequence[Scored], claims: Sequence[Claim] = ()) -> str:
    cited = {c.passage for c in claims}
    items = []
    for n, (p, score) in enumerate(scored, 1):
        title = p if isinstance(p, str) else (p.title or p.doc_id)
        meta = [f"<b>[{n}]</b>"] + ([] if isinstance(p, str) else [_escape(title)])
        if score is not None:
            meta.append(f"score {score:.3f}")
        items.append(f'<div id="passage-{n}" class="passage{" cited" if n in cited else ""}">'
                     f'<div class="meta">{" · ".join(meta)}</div>'
                     f'<div class="text">{_marked(passage_body(p), claims, n)}</div></div>')
    return "".join(items) or '<p class="hint">No passages.</p>'


def stats_html(stats: dict[str, Any]) -> str:
    """The call's stats as a table, like the GEC app's."""
    s = stats
    rows = [
        ("model", f"{s.get('model') or 'n/a'} ({s['drafter']} drafter)"),
        ("tokens", f"{s['new_tokens']} in {s['total_s']:.2f} s ({s['tokens_per_s']} tokens/s)"),
        ("time to first token", f"{s['ttft_s']:.2f} s, retrieval {s.get('retrieval_s', 0):.3f} s"),
        ("tokens/forward pass", f"{s['tokens_per_step']:.2f} ({s['acceptance_rate']:.0%} of drafted tokens accepted)"),
        ("prompt", f"{s['prompt_tokens']} tokens, {s['cached_prompt_tokens']} from the prefix cache"),
        ("finish", str(s["finish_reason"])),
    ]
    cells = "".join(f"<tr><th>{_escape(k)}</th><td>{_escape(v)}</td></tr>" for k, v in rows)
    return f'<table class="stats">{cells}</table>'


# What the app asks itself before it listens: any question retrieves passages from any index.
WARM_UP_QUESTION = "What do these documents say?"


def build_app(qa: RagQA, k: int = 5, time_budget_s: float | None = DEFAULT_TIME_BUDGET_S,
              warm_up: bool = False) -> gr.Blocks:
    """The Gradio app over `qa`; elem_ids: question, k, ask, answer, passages, stats.
    time_budget_s: seconds a request may take (None: no limit), waiting for the model included.
    warm_up: answer one question first, through the same path as the visitors' (kernel checks,
    weight packing, the step cost, the batch's first steps per request), so that the first
    visitor does not pay for them."""
    check_limit(time_budget_s, "the time budget")
    if warm_up:
        warm_up_app("one question", lambda: qa.ask(WARM_UP_QUESTION, k))

    def run(question: str, k: float) -> Iterator[tuple[Any, Any, Any]]:
        try:
            text = ""
            for item in qa.stream_ask(question, k, time_budget_s=time_budget_s):
                if isinstance(item, TextPiece):
                    text += item.text
                    yield answer_html(text, (), 0), gr.skip(), gr.skip()
                else:
                    count = len(item.passages)
                    yield (answer_html(item.text, item.claims, count), passages_html(item.passages, item.claims),
                           stats_html(item.stats))
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
                    "highlighted parts are copied from a passage (click to jump to the passage text they copy).")
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
                gr.Markdown("### Stats")
                stats = gr.HTML(elem_id="stats", css_template=CSS)
        # No concurrency limit: a request is checked (and a bad one refused) at once, not behind a
        # running one; generations take turns on the model in RagQA, each within its time budget.
        for event in (button.click, question.submit):
            event(run, [question, passages_k], [answer, passages, stats], api_visibility="undocumented",
                  concurrency_limit=None)
        gr.api(ask, api_name="ask", concurrency_limit=None)
    return app
