"""The one place that decides whether a text may be corrected: `Corrector.correct` and `stream`
(hence the Python API, the web UI and its `correct` endpoint) call `check_source`; the batch job
turns the same cases into error records."""

from __future__ import annotations

from typing import Any

from specsuite.apps.limits import check_text


def input_limit(corrector: Any) -> int:
    """The most tokens a text may have: `corrector.max_input_tokens` where set (e.g. by
    `specsuite gec ui --max-input-tokens`), else the corrector's segment limit `context_limit`,
    which fits the model's context with the answer budget (as in the batch job)."""
    return getattr(corrector, "max_input_tokens", None) or corrector.context_limit


def check_source(corrector: Any, text: object) -> str:
    """`text` if it can be corrected; else InputError: not a string, blank, or over the limit."""
    return check_text(text, "text", corrector.count_tokens, input_limit(corrector))
