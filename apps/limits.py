"""Limits on one request to an app: input checks that fail fast with a clear message, before any
model work; admission by cost (what a request costs on this machine, estimated from the measured
step cost, against its time budget); and a time budget after which the request ends with an error
and frees the model.

Each app has one validation place built on these checks (`RagQA.validate`, `gec.limits.check_source`),
used by its web UI, its API endpoint, its Python API and its CLI; `admit` is called where the
prompt is known, before it is queued for the model (docs/serving.md)."""

from __future__ import annotations

import argparse
import functools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

DEFAULT_TIME_BUDGET_S = 180.0  # per web request, waiting for the model included
MAX_K = 50  # passages per question
# A question is not a book: the longest question the RAG app takes by default (--max-question-tokens).
MAX_QUESTION_TOKENS = 1000
# A text longer than this many characters per allowed token is refused without tokenizing it
# (natural text averages ~4 characters a token), so a huge input costs nothing to refuse.
MAX_CHARS_PER_TOKEN = 16


class InputError(ValueError):
    """A request refused before any model work; the message says why, for the user."""


class OverBudgetError(InputError):
    """A request whose estimated cost on this machine exceeds its time budget, refused before it
    is queued for the model (the OpenAI-style server maps it to HTTP 408)."""


class TimeBudgetExceeded(TimeoutError):
    """A request ran past its time budget; its generation stops at its next step."""


def _show(value: object, width: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def check_text(value: object, what: str, count_tokens: Callable[[str], int] | None = None,
               max_tokens: int | None = None) -> str:
    """`value` if it is a non-blank string of at most `max_tokens` tokens (by `count_tokens`; without
    it, only the character bound, e.g. in a CLI before the model loads), else InputError naming
    `what` ("text", "question") and the limit."""
    if not isinstance(value, str):
        raise InputError(f"the {what} must be a string, got {type(value).__name__}: {_show(value)}")
    if not value.strip():
        raise InputError(f"the {what} is empty" if not value else f"the {what} is only whitespace")
    if max_tokens is None:
        return value
    max_chars = max_tokens * MAX_CHARS_PER_TOKEN
    if len(value) > max_chars:
        raise InputError(f"the {what} is too long: {len(value):,} characters; the limit is {max_tokens:,} tokens "
                         f"(at most {max_chars:,} characters)")
    if count_tokens is not None and (n := count_tokens(value)) > max_tokens:
        raise InputError(f"the {what} is too long: {n:,} tokens; the limit is {max_tokens:,} tokens")
    return value


def check_k(k: object, max_k: int = MAX_K) -> int:
    """The number of passages as an int in 1..max_k (a whole float, as a UI slider sends, counts)."""
    whole = isinstance(k, int) or (isinstance(k, float) and k.is_integer())
    if isinstance(k, bool) or not whole:
        raise InputError(f"k (passages to retrieve) must be a whole number from 1 to {max_k}, got {_show(k)}")
    if not 1 <= k <= max_k:
        raise InputError(f"k (passages to retrieve) must be from 1 to {max_k}, got {int(k):,}")
    return int(k)


def check_limit(value: float | None, what: str) -> float | None:
    """A configured limit: None (no limit) or a positive number."""
    if value is not None and not value > 0:
        raise ValueError(f"{what} must be positive, got {value}")
    return value


def time_budget_arg(text: str) -> float | None:
    """argparse type of `--time-budget`: seconds, 0 for no limit (None)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0 (0: no limit), got {text!r}")
    return value or None


def token_limit_arg(text: str) -> int:
    """argparse type of a token limit: a positive integer."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of tokens, got {text!r}")
    return int(text)


_STEP_COST_LOCK = threading.Lock()


def step_cost(model, backend) -> Callable[[int], float] | None:
    """Seconds of one engine forward by its rows on this machine, for this model on `backend` (the
    one the app computes with: another backend's cost would misjudge every request) (`StepCost`: the core measures it
    once per machine, model, dtype and backend and keeps it on disk), or None where the batched
    engine does not run the model. The apps' one adapter to the core's measurement."""
    with _STEP_COST_LOCK:  # the first callers at once (a server's first burst) wait for one measurement
        return _step_cost(model, _ByLabel(backend, backend.label))


@dataclass(frozen=True)
class _ByLabel:
    """A backend as a cache key: by its label (a Backend holds unhashable parts)."""

    backend: object = field(compare=False)
    label: str


@functools.lru_cache(maxsize=8)
def _step_cost(model, backend: _ByLabel) -> Callable[[int], float] | None:
    from specsuite.core.scheduler.engine import BatchEngine, EngineConfig, engine_supports

    if not engine_supports(model):
        return None
    return BatchEngine(model, EngineConfig(1, backend=backend.backend)).budget.cost  # the measurement (or its checked kept copy)


def estimate_s(model, prompt_tokens: int, backend, answer_tokens: int = 1) -> float | None:
    """What a request costs on this machine alone on the model, at one token per step: its
    prompt's rows in one forward, then one one-row step per further answer token. None: no
    measurement. With the default of one answer token it is a lower bound (an answer may end at
    once), which `admit` uses: its answer budget is what it may take, not what it will."""
    cost = step_cost(model, backend)
    if cost is None:
        return None
    return cost(max(1, prompt_tokens)) + max(0, answer_tokens - 1) * cost(1)


def admit(model, prompt_tokens: int, deadline: "Deadline", backend) -> None:
    """Refuse (OverBudgetError, naming the estimate and the budget) a request whose prompt alone
    cannot be read within what is left of its time budget on this machine (`estimate_s`); called
    before it is queued, before any model work."""
    left = deadline.remaining()
    if left is None:
        return
    estimate = estimate_s(model, prompt_tokens, backend)
    if estimate is not None and estimate > left:
        raise OverBudgetError(
            f"this request would take at least {estimate:.1f} s on this machine (its prompt of {prompt_tokens:,} "
            f"tokens alone), more than the {left:.1f} s left of its time budget of {deadline.budget_s:g} s: "
            "send a shorter input")


class Deadline:
    """The time by which a request must end, `budget_s` seconds after it is made (None: never)."""

    def __init__(self, budget_s: float | None) -> None:
        self.budget_s = check_limit(budget_s, "the time budget")
        self._end = None if budget_s is None else time.monotonic() + budget_s

    def remaining(self) -> float | None:
        return None if self._end is None else max(0.0, self._end - time.monotonic())

    def expired(self) -> bool:
        return self._end is not None and time.monotonic() >= self._end

    def check(self) -> None:
        """Raise TimeBudgetExceeded once the time is up."""
        if self.expired():
            raise self.exceeded()

    def exceeded(self) -> TimeBudgetExceeded:
        """The error of a request that ran past its time budget."""
        return TimeBudgetExceeded(f"the request ran past its time budget of {self.budget_s:g} s and was stopped")

    def queued(self, need_s: float | None = None) -> TimeBudgetExceeded:
        """The error of a request whose time budget ended while it waited for the model, or whose
        time left is less than the `need_s` seconds it would take at least."""
        if need_s is None:
            return TimeBudgetExceeded(f"the model was busy with other requests for the whole time budget of "
                                      f"{self.budget_s:g} s; try again later")
        return TimeBudgetExceeded(f"the model was busy with other requests: the {self.remaining():.1f} s left of the "
                                  f"time budget of {self.budget_s:g} s are less than this request needs (at least "
                                  f"{need_s:.1f} s on this machine); try again later")

    def acquire(self, lock: threading.Lock) -> None:
        """Take `lock` (the model, busy with another request), waiting at most the time left."""
        left = self.remaining()
        if not lock.acquire(timeout=-1 if left is None else left):
            raise self.queued()

    def on_step(self, inner: Callable | None = None) -> Callable:
        """A `generate(on_step=...)` callback that calls `inner`, then ends the generation (by
        raising) once the time is up: the model stops at the step after the deadline."""
        def step(tokens: list[int], flags: list[bool]) -> None:
            if inner is not None:
                inner(tokens, flags)
            self.check()

        return step


API_KEY_ENV = "SPECSUITE_API_KEY"
API_KEY_HELP = (f"the key callers must present (API: 'Authorization: Bearer KEY'; browsers: any user name with "
                f"KEY as password); default ${API_KEY_ENV}; none: open to whoever reaches the port")


def api_key(given: str | None) -> str | None:
    """The key an app asks for: the option's, else $SPECSUITE_API_KEY's, else None (no key)."""
    return given or os.environ.get(API_KEY_ENV) or None


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def allowed_hosts(text: str | None, bind: str) -> list[str] | None:
    """The Host names a server answers to (None: any), from `--allowed-hosts` ("a,b", "*": any);
    by default the loopback names when bound to loopback (so a web page cannot reach it through a
    rebound DNS name), any otherwise."""
    if text is None:
        return list(LOOPBACK) if bind in LOOPBACK else None
    names = [name.strip().lower() for name in text.split(",") if name.strip()]
    return None if "*" in names else names


def host_name(header: str) -> str:
    """The name of a Host header, without its port ("[::1]:8000" -> "::1")."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def exposure_warning(host: str, key: str | None) -> str | None:
    """A warning for an app bound beyond this machine without a key: anyone on the network can use it."""
    if key or host in LOOPBACK:
        return None
    return (f"warning: listening on {host} without an API key: anyone who can reach this port can run the model "
            f"and read what it serves; set --api-key or ${API_KEY_ENV}")


def gradio_auth(key: str | None):
    """Gradio's `auth` for a standalone UI: the key as the password (any user name); None: no login."""
    if not key:
        return None
    import hmac

    return lambda _user, password: hmac.compare_digest(str(password).encode(), key.encode())


SHARE_WARNING = ("warning: --share makes this app public: anyone with the gradio.live link can use it and "
                 "run the model on this machine while it runs")
