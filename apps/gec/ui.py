"""The grammar-correction web UI: the correction streams in, showing which text the model only
had to confirm (copied from an accepted draft) and which it wrote itself; then the word-level edits
and the speed of the call.

The app also serves a plain JSON endpoint for programs:

    from gradio_client import Client
    Client("http://127.0.0.1:7860/").predict("She go to school yesterday .", api_name="/correct")

A bad request (an empty text, one over the token limit, a wrong type, one whose estimated cost
exceeds the time budget) is refused at once with a `gr.Error` naming the problem (gradio_client
raises it as an AppError), and a request that runs past the time budget ends with one, waiting
included. Events run concurrently, so a refusal never waits behind another request. With a batch
size above 1 the corrections of concurrent users decode together in one running batch
(`BatchServer`); with 1 they take turns on the model (a lock) on the exact path, streamed.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from dataclasses import replace
from html import escape

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # before gradio is imported: no phoning home

import gradio as gr

from specsuite.apps.limits import DEFAULT_TIME_BUDGET_S, Deadline, InputError, TimeBudgetExceeded, admit, check_limit
from specsuite.apps.serving import batch_server as serving
from specsuite.apps.serving.batch_server import UI_THREADS, BatchServer, wait
from specsuite.core import TextPiece
from specsuite.core.scheduler.engine import BatchEngine, EngineConfig, engine_supports

from .corrector import Correction, Corrector, demo_sentences
from .limits import check_source

DRAFT_STYLE = "background:#dbeafe;border-radius:3px"  # light blue: confirmed in one verify pass
DEL_STYLE = "color:#b91c1c;background:#fee2e2;text-decoration:line-through"
INS_STYLE = "color:#15803d;background:#dcfce7;text-decoration:none"
BOX_STYLE = "white-space:pre-wrap;line-height:1.7;font-size:1.05em;padding:.5em 0"

LEGEND = (f'<span style="{DRAFT_STYLE}">highlighted</span>: copied from an accepted draft (many tokens per '
          "model step); plain: written by the model one token per step.")


def origin_html(pieces: list[TextPiece]) -> str:
    """The correction so far, draft-accepted pieces highlighted."""
    spans = "".join(f'<span style="{DRAFT_STYLE}">{escape(p.text)}</span>' if p.from_draft and p.text.strip()
                    else escape(p.text) for p in pieces)
    return f'<div style="{BOX_STYLE}">{spans}</div><p style="font-size:.85em;opacity:.75">{LEGEND}</p>'


def diff_html(correction: Correction) -> str:
    """The source with the edits in place: deletions struck through in red, insertions in green."""
    source, out, pos = correction.source, [], 0
    for edit in correction.edits:
        out.append(escape(source[pos:edit.src_start]))
        if edit.src:
            out.append(f'<del style="{DEL_STYLE}">{escape(edit.src)}</del>')
        if edit.tgt:
            # Keep inserted words apart from their neighbours, which the source spacing cannot do.
            before = " " if edit.src or (edit.src_start and not source[edit.src_start - 1].isspace()) else ""
            after = " " if not edit.src and source[edit.src_end:edit.src_end + 1].strip() else ""
            out.append(f'{before}<ins style="{INS_STYLE}">{escape(edit.tgt)}</ins>{after}')
        pos = edit.src_end
    out.append(escape(source[pos:]))
    summary = f"{len(correction.edits)} edit{'s' * (len(correction.edits) != 1)}"
    return f'<div style="{BOX_STYLE}">{"".join(out)}</div><p style="font-size:.85em;opacity:.75">{summary}</p>'


def stats_html(correction: Correction) -> str:
    s = correction.stats
    rows = [
        ("tokens/step", f"{s['tokens_per_step']:.2f}"),
        ("acceptance rate", f"{s['acceptance_rate']:.0%} of {s['drafted_tokens']} drafted tokens"),
        ("forward passes", f"{s['forward_passes']} for {s['new_tokens']} new tokens"),
        ("estimated speedup", f"{s['estimated_speedup']:.2f}x vs plain decoding" if s["estimated_speedup"] else "n/a"),
        ("time", f"{s['total_s']:.2f} s ({s['prefill_s']:.2f} s to the first token)"),
    ]
    if correction.truncated:
        rows.append(("warning", "the correction was cut at the token limit"))
    cells = "".join(f"<tr><th style='text-align:left;padding-right:1em'>{escape(k)}</th><td>{escape(v)}</td></tr>"
                    for k, v in rows)
    note = ("<p style='font-size:.85em;opacity:.75'>The speedup is an estimate: our prefill plus one timed "
            "one-token step per new token, over the actual time.</p>")
    return f"<table>{cells}</table>{note}"


def correction_json(correction: Correction) -> dict:
    """What the `correct` endpoint returns (the fields of a batch job's record)."""
    return {"source": correction.source, "correction": correction.text,
            "edits": [e.to_dict() for e in correction.edits], "stats": correction.stats,
            "truncated": correction.truncated}


def build_app(corrector: Corrector, time_budget_s: float | None = DEFAULT_TIME_BUDGET_S, batch_size: int = 1,
              warm_up: bool = False) -> gr.Blocks:
    """The Blocks app around one loaded corrector, with the `correct` API endpoint.
    time_budget_s: seconds a request may take (None: no limit), waiting for the model included.
    batch_size: concurrent corrections decoded together (1: one at a time, exact and streamed).
    warm_up: run one short correction first (kernel checks, weight packing, the step cost), so the
    first visitor does not pay for them."""
    check_limit(time_budget_s, "the time budget")
    model = threading.Lock()  # batch size 1: one correction at a time; others wait within their budget
    server = None
    if batch_size > 1 and engine_supports(corrector.model):
        engine = BatchEngine(corrector.model, EngineConfig(batch_size, prefix=corrector.instruction, backend=corrector.backend),
                             eos_token_id=corrector.eos)
        server = BatchServer(engine)

    def corrections(text: object) -> Iterator[TextPiece | Correction]:
        """The correction of `text` within the time budget (streamed at batch size 1);
        InputError (OverBudgetError included) or TimeBudgetExceeded."""
        deadline = Deadline(time_budget_s)
        check_source(corrector, text)  # refused here, before waiting for the model
        segments = corrector.segments(text)
        requests = [corrector._request(s.text) for s in segments if s.text]
        admit(corrector.model, corrector.prompt_tokens(requests), deadline, corrector.backend)
        if server is not None:
            yield _batched(text, segments, requests, deadline)
            return
        deadline.acquire(model)
        try:
            items = corrector.stream(text)
            try:
                for item in items:
                    deadline.check()
                    yield item
            finally:
                # Left early: the generation stops at its next step. That step may still run
                # beside the next request's start: harmless, the model is only read.
                items.close()
        finally:
            model.release()

    def _batched(text: str, segments: list, requests: list, deadline: Deadline) -> Correction:
        futures = [server.submit(replace(r, on_step=deadline.on_step()), deadline) for r in requests]
        try:
            generations = iter([wait(f, deadline) for f in futures])
        finally:
            for f in futures:
                f.cancel()  # a segment failed or ran out of time: the queued others never start
        correction = corrector._finish(text, segments, [next(generations) if s.text else None for s in segments])
        # Its segments shared each forward with other users': a per-call speedup estimate means nothing.
        correction.stats["estimated_speedup"] = None
        return correction

    if warm_up:
        serving.warm_up("one short correction", lambda: list(corrections(demo_sentences()[0])))

    def run(text: str) -> Iterator[tuple[str, str, str]]:
        pieces: list[TextPiece] = []
        try:
            for item in corrections(text):
                if isinstance(item, TextPiece):
                    pieces.append(item)
                    yield origin_html(pieces), "", "<p>correcting…</p>"
                else:
                    yield origin_html(pieces), diff_html(item), stats_html(item)
        except (InputError, TimeBudgetExceeded) as e:
            raise gr.Error(str(e), print_exception=False) from None

    def correct(text: str) -> dict:
        """Correct `text`: source, correction, edits (spans of source and correction), stats, truncated."""
        try:
            *_, final = corrections(text)
        except (InputError, TimeBudgetExceeded) as e:
            raise gr.Error(str(e), print_exception=False) from None
        return correction_json(final)

    with gr.Blocks(title="specsuite · grammar correction") as app:
        gr.Markdown("## Grammar correction\nSpeculative decoding drafted from the text itself: unchanged "
                    "words cost one model step for many tokens.")
        source = gr.Textbox(label="Text to correct", lines=5, elem_id="gec-input",
                            placeholder="Type or paste text with mistakes…")
        button = gr.Button("Correct", variant="primary", elem_id="gec-correct")
        gr.Examples([[s] for s in demo_sentences()], inputs=source, elem_id="gec-examples")
        gr.Markdown("### Correction")
        output = gr.HTML(elem_id="gec-output")
        gr.Markdown("### Edits")
        diff = gr.HTML(elem_id="gec-diff")
        gr.Markdown("### Speed")
        stats = gr.HTML(elem_id="gec-stats")
        # No concurrency limit: a request is checked (and a bad one refused) at once, not behind a
        # running one; the corrections themselves share the batch or take turns on the model.
        button.click(run, inputs=source, outputs=[output, diff, stats], concurrency_limit=None)
        gr.api(correct, api_name="correct", concurrency_limit=None)
    return app


def launch(corrector: Corrector, host: str = "127.0.0.1", port: int = 7860, share: bool = False,
           prevent_thread_lock: bool = False, time_budget_s: float | None = DEFAULT_TIME_BUDGET_S,
           batch_size: int = 1, auth=None) -> gr.Blocks:
    """Build the app, warm it up, and serve it (blocking unless `prevent_thread_lock`); returns the
    app. auth: Gradio's login check (`limits.gradio_auth`), None for none."""
    app = build_app(corrector, time_budget_s, batch_size, warm_up=True)
    app.queue().launch(server_name=host, server_port=port, share=share, prevent_thread_lock=prevent_thread_lock,
                       max_threads=UI_THREADS, auth=auth)
    return app
