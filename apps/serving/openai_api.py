"""The OpenAI chat-completions protocol, as pure functions: parse and check a request body, shape a
response, a streamed chunk, an error, and the lines of an OpenAI Batch file. The server
(`apps/serving/server.py`) and the batch jobs (`apps/jobs/runner.py`) both build their answers here, so a request
gets the same response body over HTTP and in a batch file.

Models: `specsuite-gec` (the last user message is the text to correct; extra `edits`),
`specsuite-rag` (the last user message is the question; extra `citations`, `passages`, `spans`),
or the served model's own name (any chat, prompt-lookup drafts)."""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from specsuite.apps.limits import InputError, check_k

GEC_MODEL, RAG_MODEL = "specsuite-gec", "specsuite-rag"
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 4  # as OpenAI: at most 4 stop sequences
# Bounds checked before any model work, so that no request costs more to refuse than to read:
MAX_BODY_BYTES = 1 << 20
MAX_MESSAGES = 256
MAX_CHARS = 200_000  # all messages' characters together: beyond any served model's context
MAX_STOP_CHARS = 64
MAX_TOKENS_CAP = 4096  # the longest reply a request may ask for
MAX_SEED = 2**63 - 1
BATCH_URL = "/v1/chat/completions"
# Record fields of an app's result that are not extras of the response (they are its content,
# `usage` or `speculation`).
_NOT_EXTRAS = ("source", "correction", "answer", "question", "stats", "truncated")


@dataclass(frozen=True)
class ChatRequest:
    """A checked chat-completions request. temperature None or 0: greedy decoding."""

    model: str
    messages: list[dict[str, str]]
    stream: bool = False
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    k: int | None = None  # specsuite-rag: passages to retrieve (an extra body field)
    include_usage: bool = False  # stream_options.include_usage: a last chunk with `usage`
    ignore_eos: bool = False  # an extra body field, as vLLM's: go on to max_tokens past the end token

    @property
    def last_user_text(self) -> str:
        """The text the apps work on: the content of the last user message."""
        for message in reversed(self.messages):
            if message["role"] == "user":
                return message["content"]
        raise InputError("the messages have no user message")


def _number(body: dict, name: str, lo: float, hi: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not lo <= value <= hi:
        raise InputError(f"'{name}' must be a number from {lo:g} to {hi:g}, got {value!r}")
    return float(value)


def _content(message: Any, i: int) -> dict[str, str]:
    if not isinstance(message, dict):
        raise InputError(f"messages[{i}] must be an object, got {type(message).__name__}")
    role = message.get("role")
    if role not in ROLES:
        raise InputError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text ones are understood
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise InputError(f"messages[{i}].content: only text parts are supported")
        content = "".join(p["text"] for p in content)
    if content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise InputError(f"messages[{i}].content must be a string, got {type(content).__name__}")
    return {"role": role, "content": content}


def parse_chat_request(body: Any) -> ChatRequest:
    """The request in `body` (a decoded JSON body), or InputError saying what is wrong with it.
    The apps check the text itself (blank, too long) when they take it."""
    if not isinstance(body, dict):
        raise InputError(f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InputError("'model' is required: specsuite-gec, specsuite-rag or the served model's name")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InputError("'messages' must be a non-empty list of {role, content} objects")
    if len(messages) > MAX_MESSAGES:
        raise InputError(f"{len(messages):,} messages: at most {MAX_MESSAGES} are taken")
    messages = [_content(m, i) for i, m in enumerate(messages)]
    if (chars := sum(len(m["content"]) for m in messages)) > MAX_CHARS:
        raise InputError(f"the messages hold {chars:,} characters: at most {MAX_CHARS:,} are taken")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InputError(f"'stream' must be true or false, got {stream!r}")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                   or not 1 <= max_tokens <= MAX_TOKENS_CAP):
        raise InputError(f"'max_tokens' must be an integer from 1 to {MAX_TOKENS_CAP}, got {max_tokens!r}")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stop, list) or len(stop) > MAX_STOP
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop)):
        raise InputError(f"'stop' must be a string or a list of at most {MAX_STOP} strings of 1 to {MAX_STOP_CHARS} "
                         f"characters")
    n = body.get("n", 1)
    if n != 1:
        raise InputError(f"only n=1 is supported, got {n!r}")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED):
        raise InputError(f"'seed' must be an integer from 0 to {MAX_SEED}, got {seed!r}")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InputError("'stream_options' must be an object")
    k = body.get("k")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise InputError(f"'ignore_eos' must be true or false, got {ignore_eos!r}")
    temperature, top_p = _number(body, "temperature", 0.0, 2.0), _number(body, "top_p", 0.0, 1.0)
    if top_p == 0:  # only the most likely token is left: greedy decoding
        temperature, top_p = None, 1.0
    return ChatRequest(
        model=model, messages=messages, stream=stream, max_tokens=max_tokens,
        temperature=temperature, top_p=1.0 if top_p is None else top_p,
        stop=list(stop), seed=seed, k=None if k is None else check_k(k),
        include_usage=bool(options.get("include_usage")), ignore_eos=ignore_eos,
    )


# ---- responses ----------------------------------------------------------------------------

def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def usage(stats: dict) -> dict[str, int]:
    prompt, completion = int(stats.get("prompt_tokens", 0)), int(stats.get("new_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def speculation(stats: dict) -> dict[str, Any]:
    """Our own stats: new tokens per target forward, and the share of drafted tokens accepted."""
    forwards, drafted = int(stats.get("forward_passes", 0)), int(stats.get("drafted_tokens", 0))
    accepted = int(stats.get("accepted_tokens", 0))
    return {"forward_passes": forwards, "drafted_tokens": drafted, "accepted_tokens": accepted,
            "tokens_per_forward": round(stats.get("new_tokens", 0) / forwards, 3) if forwards else 0.0,
            "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0}


@dataclass(frozen=True)
class Reply:
    """What an app made of a request, in the protocol's terms."""

    content: str
    finish_reason: str  # "stop" or "length"
    stats: dict  # prompt_tokens, new_tokens, forward_passes, drafted_tokens, accepted_tokens
    extras: dict = field(default_factory=dict)  # top-level fields next to `choices` (edits, citations, ...)


def reply_of(result: Any) -> Reply:
    """The Reply of an app's result (a `Correction` or an `Answer`): its text, and the fields of its
    job record besides the text and stats as extras."""
    record = result.to_record()
    extras = {k: v for k, v in record.items() if k not in _NOT_EXTRAS}
    return Reply(result.text, "length" if record.get("truncated") else "stop", record.get("stats", {}), extras)


def completion(reply: Reply, model: str, id_: str | None = None) -> dict[str, Any]:
    """A `chat.completion` object."""
    return {
        "id": id_ or completion_id(), "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": reply.content},
                     "logprobs": None, "finish_reason": reply.finish_reason}],
        "usage": usage(reply.stats), "speculation": speculation(reply.stats), **reply.extras,
    }


def chunk(id_: str, model: str, created: int, delta: dict | None = None, finish_reason: str | None = None,
          **extra: Any) -> dict[str, Any]:
    """A `chat.completion.chunk`: one delta of the first (only) choice; with no delta and no
    finish_reason, an empty `choices` (the usage chunk)."""
    choices = [] if delta is None and finish_reason is None else [
        {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish_reason}]
    return {"id": id_, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices, **extra}


def sse(data: dict | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line (`[DONE]` ends the stream)."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode("utf-8")


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 415: "invalid_request_error",
               404: "not_found_error", 408: "timeout_error",
               429: "rate_limit_error", 503: "service_unavailable", 500: "server_error"}


def error(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The OpenAI error object for an HTTP status."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


# ---- OpenAI Batch files -------------------------------------------------------------------

def is_batch_line(obj: Any) -> bool:
    """Whether a decoded input line is an OpenAI Batch request (by its shape)."""
    return isinstance(obj, dict) and "custom_id" in obj and "body" in obj


def batch_request(obj: dict) -> tuple[str, ChatRequest]:
    """(custom_id, request) of an OpenAI Batch input line, or InputError."""
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise InputError("'custom_id' must be a non-empty string")
    if obj.get("method", "POST") != "POST" or obj.get("url") != BATCH_URL:
        raise InputError(f"only POST {BATCH_URL} is supported, got {obj.get('method')} {obj.get('url')}")
    request = parse_chat_request(obj.get("body"))
    if request.stream:
        raise InputError("'stream' cannot be true in a batch file")
    return custom_id, request


def batch_output(custom_id: str | None, status: int, body: dict) -> dict[str, Any]:
    """An OpenAI Batch output line: the response (status and body) of one request; a request that
    failed has its error body in `response` and the message in `error`."""
    failed = status != 200
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": body.get("id", ""), "body": body},
            "error": {"code": body["error"]["type"], "message": body["error"]["message"]} if failed else None}
