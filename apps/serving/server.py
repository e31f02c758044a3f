"""The OpenAI-compatible server (`specsuite serve`): one loaded model, ONE running batch
(`BatchServer`) shared by every endpoint, the apps behind the chat-completions protocol.

    POST /v1/chat/completions   model: specsuite-gec | specsuite-rag | the model's name
    GET  /v1/models
    /gec, /rag                  the apps' Gradio UIs

The apps' rules apply unchanged: GEC's `check_source`, `RagQA.validate`, a time budget per
request (`Deadline`: 408 past it), and a bound on requests in the server (429 beyond it).
`ChatService` turns a checked request (`openai_api.ChatRequest`) into a `Reply`; the batch jobs
build their OpenAI Batch output lines from the apps' results with the same `openai_api` functions."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import dataclasses
import hmac
import json
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import anyio.to_thread
import torch
from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from specsuite.apps import limits
from specsuite.apps.serving import openai_api as api
from specsuite.apps.gec.corrector import Corrector
from specsuite.apps.gec.limits import check_source
from specsuite.apps.limits import (Deadline, InputError, OverBudgetError, TimeBudgetExceeded, admit, check_limit,
                                   check_text)
from specsuite.apps.rag.qa import RagQA
from specsuite.apps.serving.metrics import Metrics
from specsuite.apps.serving.batch_server import BatchServer, wait
from specsuite.core import Generation, PromptLookupDrafter, Sampling
from specsuite.core.scheduler.engine import BatchEngine, EngineConfig, Request
from specsuite.core.scheduler.sequence import SamplingParams
from specsuite.core.scheduler.generate import context_length
from specsuite.core.scheduler.streaming import StreamClosed
from specsuite import models

DEFAULT_BATCH_SIZE = 16
DEFAULT_MAX_QUEUE = 64  # requests waiting for a slot of the batch beyond those decoding
DISCONNECT_POLL_S = 0.5  # how often a waiting reply checks that its caller is still there
DEFAULT_CHAT_TOKENS = 256  # a plain chat's answer budget when the request sets no max_tokens


class QueueFull(RuntimeError):
    """The server holds as many requests as it admits: try again later (429)."""


class UnknownModel(LookupError):
    """No such model on this server (404)."""


@dataclass
class Plan:
    """A request as the batch runs it: its sequences, how their tokens read as text so far (for
    streaming), and how the finished generations make the reply."""

    requests: list[Request]
    partial: Callable[[list[list[int]], list[bool]], str]
    finish: Callable[[list[Generation]], api.Reply]
    prompt_tokens: int | None = None  # what reading the prompts costs (None: all their tokens)


class ChatService:
    """The apps on one model behind the chat-completions protocol, every request in one batch."""

    def __init__(self, corrector: Corrector, qa: RagQA, batch_size: int = DEFAULT_BATCH_SIZE,
                 time_budget_s: float | None = None, max_queue: int = DEFAULT_MAX_QUEUE,
                 model_name: str | None = None) -> None:
        self.corrector, self.qa, self.tokenizer = corrector, qa, corrector.tokenizer
        self.model = corrector.model
        self.model_name = model_name or models.model_name(self.model)
        self.time_budget_s = check_limit(time_budget_s, "the time budget")
        # GEC's instruction is the shared prefix: computed once, copied into each GEC slot.
        engine = BatchEngine(self.model, EngineConfig(batch_size, prefix=corrector.instruction, backend=corrector.backend),
                             eos_token_id=corrector.eos, tokenizer=self.tokenizer)
        self.batch = BatchServer(engine)
        qa._server = self.batch  # the RAG UI's requests join the same batch (RagQA with batch_size > 1)
        self.max_requests, self.batch_size = batch_size + max_queue, batch_size
        self.metrics = Metrics()
        self._held = 0
        self._lock = threading.Lock()

    @classmethod
    def from_loaded(cls, model, tokenizer, index=None, batch_size: int = DEFAULT_BATCH_SIZE, backend: str = "auto",
                    **options) -> ChatService:
        """backend: a `choose_backend` kind (the `serve` command: "fast", or "exact" with --exact)."""
        corrector = Corrector.from_loaded(model, tokenizer, batch_size=batch_size, backend=backend)
        qa = RagQA.from_loaded(model, tokenizer, index, batch_size=max(2, batch_size), backend=corrector.backend)
        return cls(corrector, qa, batch_size, **options)

    @property
    def models(self) -> list[str]:
        return [api.GEC_MODEL, *([api.RAG_MODEL] if self.qa.index is not None else []), self.model_name]

    # ---- admission ---------------------------------------------------------------------------

    def admit(self) -> Callable[[], None]:
        """Take one of the server's request places, or QueueFull; returns the place's release,
        which gives it back once however many paths call it (done, error, cancel, disconnect)."""
        with self._lock:
            if self._held >= self.max_requests:
                raise QueueFull(f"the server holds {self._held} requests, its limit; try again later")
            self._held += 1
        released = threading.Event()

        def release() -> None:
            with self._lock:
                if not released.is_set():
                    released.set()
                    self._held -= 1

        return release

    @property
    def held(self) -> int:
        """Request places taken now."""
        return self._held

    # ---- plans -------------------------------------------------------------------------------

    def plan(self, req: api.ChatRequest) -> Plan:
        """The request's sequences, checked by the app's own rules (InputError), before any model work."""
        if req.model == api.GEC_MODEL:
            plan = self._plan_gec(req)
        elif req.model == api.RAG_MODEL and self.qa.index is not None:
            plan = self._plan_rag(req)
        elif req.model == self.model_name:
            plan = self._plan_chat(req)
        else:
            raise UnknownModel(f"the model {req.model!r} does not exist; this server has {', '.join(self.models)}")
        sampling = Sampling(req.temperature, top_p=req.top_p) if req.temperature else None
        generator = torch.Generator().manual_seed(req.seed) if sampling and req.seed is not None else None
        plan.requests = [dataclasses.replace(r, params=SamplingParams(
                             min(r.params.max_new_tokens, req.max_tokens or r.params.max_new_tokens),
                             sampling, generator, tuple(req.stop), req.ignore_eos)) for r in plan.requests]
        store = self.batch.engine.store
        for r in plan.requests:  # refused now, not after the batch drained for it
            if not store.fits(len(r.prompt) + r.params.max_new_tokens):
                raise InputError(f"this request needs {len(r.prompt) + r.params.max_new_tokens:,} tokens of KV cache, more "
                                 f"than the server's KV budget of {store.kv_budget_bytes / 2**30:.1f} GiB holds for one "
                                 "sequence: ask for fewer max_tokens or send a shorter input")
        return plan

    def _plan_gec(self, req: api.ChatRequest) -> Plan:
        text = check_source(self.corrector, req.last_user_text)
        segments = self.corrector.segments(text)
        parts = [s for s in segments if s.text]

        def partial(tokens: list[list[int]], done: list[bool]) -> str:
            # The text up to the first unfinished segment's correction so far.
            text, pos = "", 0
            for segment in segments:
                text += segment.lead
                if segment.text:
                    text += self._text(tokens[pos])
                    if not done[pos]:
                        return text
                    pos += 1
                text += segment.trail
            return text

        def finish(generations: list[Generation]) -> api.Reply:
            decoded = iter(generations)
            return api.reply_of(self.corrector._finish(text, segments, [next(decoded) if s.text else None
                                                                         for s in segments]))

        requests = [self.corrector._request(s.text) for s in parts]
        return Plan(requests, partial, finish, self.corrector.prompt_tokens(requests))

    def _plan_rag(self, req: api.ChatRequest) -> Plan:
        question, k = self.qa.validate(req.last_user_text, req.k or 5)
        scored, extra = self.qa._retrieve_timed(question, k)
        prompt, drafter = self.qa._request(question, scored)

        def finish(generations: list[Generation]) -> api.Reply:
            return api.reply_of(self.qa._finish(question, scored, generations[0], extra))

        request = Request(prompt, drafter, SamplingParams(self.qa.max_new_tokens))
        return Plan([request], lambda tokens, done: self._text(tokens[0]), finish)

    def _plan_chat(self, req: api.ChatRequest) -> Plan:
        check_text(req.last_user_text, "message")
        prompt = list(self.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True,
                                                         return_dict=True)["input_ids"])
        budget = req.max_tokens or DEFAULT_CHAT_TOKENS
        if len(prompt) + budget > (context := context_length(self.model)):
            raise InputError(f"the messages take {len(prompt):,} tokens; with max_tokens {budget:,} they do not fit "
                             f"the model's context of {context:,} tokens")

        def finish(generations: list[Generation]) -> api.Reply:
            g = generations[0]
            s = g.stats
            stats = {**s.as_dict(), "prompt_tokens": s.prompt_tokens, "new_tokens": s.new_tokens}
            return api.Reply(self._text(g.tokens), "length" if g.finish_reason in ("length", "context") else "stop", stats)

        return Plan([Request(prompt, PromptLookupDrafter(), SamplingParams(budget))],
                    lambda tokens, done: self._text(tokens[0]), finish)

    def _text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True).strip()

    # ---- running -----------------------------------------------------------------------------

    def _submit(self, plan: Plan, deadline: Deadline, on_step: Callable[[int, list[int]], None] | None = None):
        """Every sequence of the plan into the batch, after the cost check (OverBudgetError); their Futures."""
        admit(self.model, plan.prompt_tokens or sum(len(r.prompt) for r in plan.requests), deadline,
              self.corrector.backend)
        futures = []
        for i, request in enumerate(plan.requests):
            inner = None if on_step is None else (lambda tokens, flags, i=i: on_step(i, tokens))
            futures.append(self.batch.submit(dataclasses.replace(request, on_step=deadline.on_step(inner)), deadline))
        return futures

    def _wait(self, futures, deadline: Deadline) -> list[Generation]:
        return [wait(future, deadline) for future in futures]

    def complete(self, req: api.ChatRequest, plan: Plan, deadline: Deadline,
                 gone: threading.Event | None = None) -> api.Reply:
        """The reply; once `gone` is set (the caller went away), its sequences end at their next step."""
        def on_step(i: int, tokens: list[int]) -> None:
            if gone.is_set():
                raise StreamClosed("the client went away")

        futures = self._submit(plan, deadline, None if gone is None else on_step)
        return _cut_at_stop(plan.finish(self._wait(futures, deadline)), req.stop)

    def stream(self, req: api.ChatRequest, plan: Plan, deadline: Deadline) -> Iterator[str | api.Reply]:
        """The content's deltas as the batch decodes it, then the Reply. Closing the iterator ends
        the sequences at their next step."""
        tokens: list[list[int]] = [[] for _ in plan.requests]
        steps: queue.Queue[int] = queue.Queue()
        closed = threading.Event()

        def on_step(i: int, new: list[int]) -> None:
            if closed.is_set():
                raise StreamClosed("the client closed the stream")
            tokens[i] += new
            steps.put(i)

        futures = self._submit(plan, deadline, on_step)
        hold = max((len(s) for s in req.stop), default=0)  # a stop string may still be forming
        sent = ""
        try:
            while not all(f.done() for f in futures):
                try:
                    steps.get(timeout=0.05)
                except queue.Empty:
                    if deadline.remaining() == 0:
                        break  # _wait reports the timeout; the sequences end at their next step
                    continue
                # An incomplete character decodes as U+FFFD: held back until its bytes are all there.
                text = plan.partial([list(t) for t in tokens], [f.done() for f in futures])
                text = _cut(text, req.stop).rstrip("\ufffd")
                text = text[: len(text) - hold] if hold else text
                if len(text) > len(sent) and text.startswith(sent):
                    yield text[len(sent):]
                    sent = text
            reply = _cut_at_stop(plan.finish(self._wait(futures, deadline)), req.stop)
            if len(reply.content) > len(sent) and reply.content.startswith(sent):
                yield reply.content[len(sent):]
            yield reply
        finally:
            closed.set()


def _cut(text: str, stop: list[str]) -> str:
    ends = [text.find(s) for s in stop if s in text]
    return text[: min(ends)] if ends else text


def _cut_at_stop(reply: api.Reply, stop: list[str]) -> api.Reply:
    """The reply without the stop string the generation ended on (OpenAI leaves it out)."""
    content = _cut(reply.content, stop)
    return reply if content == reply.content else dataclasses.replace(reply, content=content, finish_reason="stop")


# ---- the HTTP app ----------------------------------------------------------------------------

STATUS = {OverBudgetError: 408, InputError: 400, UnknownModel: 404, TimeBudgetExceeded: 408, QueueFull: 429}


def _status(e: Exception) -> int | None:
    return next((code for kind, code in STATUS.items() if isinstance(e, kind)), None)


def presented_key(authorization: str) -> str | None:
    """The key an Authorization header carries: a Bearer token (API clients), or the password of
    Basic credentials (what a browser sends for the mounted UIs after its login prompt)."""
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() == "bearer":
        return value.strip()
    if scheme.lower() == "basic":
        try:
            return base64.b64decode(value.strip(), validate=True).decode().partition(":")[2]
        except (binascii.Error, UnicodeDecodeError):
            return None
    return None


class Gate:
    """ASGI middleware that answers a request with `refuse(request)` where that is not None. Plain
    ASGI: Starlette's BaseHTTPMiddleware would hide a caller's disconnect from the routes."""

    def __init__(self, app, refuse: Callable[[HttpRequest], Response | None]):
        self.app, self.refuse = app, refuse

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and (response := self.refuse(HttpRequest(scope))) is not None:
            await response(scope, receive, send)
        else:
            await self.app(scope, receive, send)


def create_app(service: ChatService, ui: bool = True, api_key: str | None = None,
               allowed_hosts: list[str] | None = None):
    """The FastAPI app over `service`; with `ui`, the GEC and RAG Gradio apps at /gec and /rag.
    api_key: every route asks for it (a Bearer token; the UIs also take it as a browser's Basic
    password); None: open, for loopback use. allowed_hosts: the Host names it answers to (400
    otherwise; `limits.allowed_hosts`); None: any."""

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        # Each admitted request holds a worker thread while it waits for the batch: room for all of
        # them and some, so the light routes and the next requests' checks never queue behind them.
        limiter = anyio.to_thread.current_default_thread_limiter()
        limiter.total_tokens = max(limiter.total_tokens, service.max_requests + 16)
        yield

    app = FastAPI(title="specsuite", description=__doc__, lifespan=lifespan)
    replica = uuid.uuid4().hex[:12]  # names the process that answered, behind a load balancer or Ray Serve

    def fail(status: int, message: str, **headers: str) -> JSONResponse:
        return JSONResponse(api.error(status, message), status_code=status, headers=headers or None)

    def wrong_host(http: HttpRequest) -> Response | None:
        name = limits.host_name(http.headers.get("host", ""))
        if name not in allowed_hosts:
            return fail(400, f"this server does not answer to the host {name!r} (--allowed-hosts)")
        return None

    def wrong_key(http: HttpRequest) -> Response | None:
        if http.url.path == "/health":  # for load balancers and supervisors: says nothing served
            return None
        key = presented_key(http.headers.get("authorization", ""))
        if key is None or not hmac.compare_digest(key.encode(), api_key.encode()):
            # Basic makes a browser ask for the key (as the password) on the UIs; clients send Bearer.
            challenge = {} if http.url.path.startswith("/v1/") else {"WWW-Authenticate": 'Basic realm="specsuite"'}
            return fail(401, "a valid API key is needed: send 'Authorization: Bearer <key>'", **challenge)
        return None

    if api_key:
        app.add_middleware(Gate, refuse=wrong_key)
    if allowed_hosts is not None:
        app.add_middleware(Gate, refuse=wrong_host)  # added last: checked first

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "specsuite"}
                                           for m in service.models]}

    @app.get("/health")
    async def health() -> JSONResponse:
        if (failure := service.batch.failure) is not None:  # until a request is answered again
            return JSONResponse({"status": "failed", "error": str(failure), "replica": replica}, status_code=503)
        return JSONResponse({"status": "ready", "models": service.models, "replica": replica})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(service.metrics.render(service.held, service.max_requests, service.batch_size),
                                 media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        start = time.monotonic()
        response, model, stats = await answer(http, start)
        response.headers["x-specsuite-replica"] = replica
        if not isinstance(response, StreamingResponse):  # a stream counts itself when it ends
            service.metrics.request(model, response.status_code, time.monotonic() - start, stats)
        return response

    async def answer(http: HttpRequest, start: float) -> tuple[Response, str, dict | None]:
        """The response, the model asked for ("" where unknown) and the reply's stats (None if none)."""
        deadline = Deadline(service.time_budget_s)  # from the request's arrival: retrieval and waiting count
        # Only JSON: a cross-site form or text/plain POST (a "simple" request browsers send without
        # asking) never reaches the model.
        if http.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
            return fail(415, "the request body must be JSON with 'Content-Type: application/json'"), "", None
        raw = bytearray()
        async for piece in http.stream():  # read no more than the limit, whatever Content-Length says
            raw += piece
            if len(raw) > api.MAX_BODY_BYTES:
                return fail(400, f"the request body is over {api.MAX_BODY_BYTES:,} bytes"), "", None
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return fail(400, f"the request body is not JSON: {e}"), "", None
        model = str(body.get("model", "")) if isinstance(body, dict) else ""
        try:
            req = api.parse_chat_request(body)
            release = service.admit()
        except Exception as e:  # noqa: BLE001 - mapped to its status below
            if (status := _status(e)) is None:
                raise
            return fail(status, str(e), **({"Retry-After": "1"} if status == 429 else {})), model, None
        streaming = False
        try:
            plan = await run_in_threadpool(service.plan, req)  # the app's checks; retrieval for RAG
            if not req.stream:
                gone = threading.Event()  # a caller gone while its reply is made frees its slot at the next step
                work = asyncio.ensure_future(run_in_threadpool(service.complete, req, plan, deadline, gone))
                while not (await asyncio.wait([work], timeout=DISCONNECT_POLL_S))[0]:
                    if await http.is_disconnected():
                        gone.set()
                if gone.is_set():
                    work.exception()  # retrieved: its error is the caller's going
                    return fail(499, "the client closed the connection"), model, None
                reply = work.result()
                return JSONResponse(api.completion(reply, req.model)), model, reply.stats
            # The stream's own `finally` gives the place back; the background task too, for a
            # caller gone before the stream's first byte (its generator then never starts).
            streaming = True
            events = _events(service, req, plan, deadline, release, start)
            return (StreamingResponse(events, media_type="text/event-stream", background=BackgroundTask(release)),
                    model, None)
        except Exception as e:  # noqa: BLE001
            status = _status(e)
            return fail(status or 500, str(e) if status else f"{type(e).__name__}: {e}"), model, None
        finally:  # also on cancellation (a caller gone while waiting), which is no Exception
            if not streaming:
                release()

    if ui:
        import gradio as gr

        from specsuite.apps.gec import ui as gec_ui
        from specsuite.apps.rag import ui as rag_ui

        gr.mount_gradio_app(app, gec_ui.build_app(service.corrector, service.time_budget_s), path="/gec")
        if service.qa.index is not None:
            gr.mount_gradio_app(app, rag_ui.build_app(service.qa, time_budget_s=service.time_budget_s), path="/rag")
    return app


def _events(service: ChatService, req: api.ChatRequest, plan: Plan, deadline: Deadline,
            release: Callable[[], None], start: float) -> Iterator[bytes]:
    """The server-sent events of a streamed completion (run by Starlette in a worker thread)."""
    id_, created = api.completion_id(), int(time.time())
    status, stats = 200, None
    try:
        yield api.sse(api.chunk(id_, req.model, created, {"role": "assistant", "content": ""}))
        for item in service.stream(req, plan, deadline):
            if isinstance(item, str):
                yield api.sse(api.chunk(id_, req.model, created, {"content": item}))
                continue
            stats = item.stats
            yield api.sse(api.chunk(id_, req.model, created, {}, item.finish_reason, **item.extras,
                                    speculation=api.speculation(item.stats)))
            if req.include_usage:
                yield api.sse(api.chunk(id_, req.model, created, usage=api.usage(item.stats)))
    except Exception as e:  # noqa: BLE001 - after the first byte the status is sent: the error is an event
        status = _status(e) or 500
        yield api.sse(api.error(status, str(e) if status != 500 else f"{type(e).__name__}: {e}"))
    finally:
        release()
        service.metrics.request(req.model, status, time.monotonic() - start, stats)
    yield api.sse("[DONE]")


def loading_app(model: str):
    """What the port answers while the model loads: 503 to every request."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "5"})

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    def loading(path: str) -> JSONResponse:
        return JSONResponse(api.error(503, f"the server is loading {model}; try again shortly"), status_code=503,
                            headers={"Retry-After": "5"})

    return app
