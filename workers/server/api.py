"""The HTTP routes: /v1/completions, /v1/chat/completions, /v1/models[/{id}], /tokenize,
/detokenize, /health, /metrics.

A completion request becomes one sub-request per choice (``n`` per prompt;
``ClusterClient.submit``); their events arrive in one queue as (choice index, event).
Non-streaming answers once every choice finished; streaming sends server-sent events at once,
ending in ``data: [DONE]`` (or an error event). Stop strings are found on the decoded text
(``TextStream``): the text is cut there and the request is aborted on its rank. A client that
goes away (streaming or not) aborts its requests, which frees their KV and slots. A chat request
is a completion of one prompt: its messages rendered by the model's chat template (``chat``).
With an API key (``--api-key``) every route but /health and /metrics wants
``Authorization: Bearer KEY`` (401 otherwise).

Nothing a request holds may stall the event loop (which answers /health and every stream): a
body over ``--max-body-size`` is refused before it is read (``perimeter.RequestLimits``); a body
over ``INLINE_BYTES`` is decoded, validated and tokenized in a worker thread, at most
``LARGE_BODIES`` at once; chat templates render in worker processes (``render.RenderPool``),
called from a worker thread.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import random
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from workers.server import openai_io
from workers.server.admission import LongInt, shown
from workers.server.chat import TemplateRefusal, load_chat_template
from workers.server.cluster import ClusterClient, Failure, Tokens, Unavailable
from workers.server.metrics import FrontendMetrics, render
from workers.server.openai_io import ApiError, ChatMessage, CompletionParams, Limits, bad
from workers.server.perimeter import RequestLimits
from workers.server.render import RenderPool
from workers.server.text import Codec, Offsets, TextStream, codec_for

log = logging.getLogger("adaptive_dist.serve")

OPEN_PATHS = ("/health", "/metrics")   # answered without the API key
INLINE_BYTES = 256 << 10     # a body up to this size is parsed on the event loop (~ms)
LARGE_BODIES = 2             # larger bodies read and parsed at once (their memory is bounded)


@dataclass
class Choice:
    """One choice's completion as it is assembled."""

    text: TextStream
    prompt_tokens: int
    rid: str
    finish_reason: Optional[str] = None
    ids_sent: int = 0           # token ids already streamed (return_token_ids)
    prompt_ids: list[int] = field(default_factory=list)
    echo: str = ""              # the prompt's text, which precedes the completion (echo)
    echo_sent: bool = False
    logprobs: list = field(default_factory=list)      # wire entries of the generated tokens
    prompt_logprobs: Optional[list] = None            # wire entries of the prompt (echo)
    lp_sent: int = 0            # generated tokens whose logprobs were streamed
    offsets: Optional[Offsets] = None                 # completions' text_offset
    first_at: Optional[float] = None                  # its first tokens arrived
    last_at: Optional[float] = None                   # its latest tokens arrived

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class ApiKeyGuard:
    """ASGI middleware: 401 (OpenAI's error shape) for a request without ``Authorization:
    Bearer KEY``, except on `OPEN_PATHS`. Plain ASGI, so streaming and the disconnect watch of
    the routes see the connection itself."""

    def __init__(self, app: Any, key: str) -> None:
        self.app, self.key = app, f"Bearer {key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("path") not in OPEN_PATHS:
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.key):
                what = "no API key was given" if not given else "the API key is not valid"
                err = ApiError(401, f"{what}: send the header 'Authorization: Bearer <key>' "
                                    f"with the server's --api-key", code="invalid_api_key",
                               kind="invalid_request_error")
                await JSONResponse(err.body(), status_code=401,
                                   headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(cluster: ClusterClient, metrics: FrontendMetrics,
               api_key: Optional[str] = None) -> FastAPI:
    """The FastAPI application over `cluster`; `api_key`: the key every request but /health
    and /metrics must bring (None: none). `app.state.close()` stops its worker threads and
    render processes."""
    app = FastAPI(title="adaptive_dist", docs_url=None, redoc_url=None)
    if api_key:
        app.add_middleware(ApiKeyGuard, key=api_key)
    config = cluster.config
    app.add_middleware(RequestLimits, max_body=config.max_body_size,
                       body_timeout=config.body_timeout,
                       on_reject=lambda status: metrics.http_rejected.update(
                           ["body_too_large" if status == 413 else "body_timeout"]))
    served = config.model_name
    cache: dict[str, Any] = {}
    blocking = ThreadPoolExecutor(max_workers=8, thread_name_prefix="request")
    large_bodies = asyncio.Semaphore(LARGE_BODIES)
    counting = threading.Lock()

    def close() -> None:
        blocking.shutdown(wait=False, cancel_futures=True)
        pool = cache.get("pool")
        if isinstance(pool, RenderPool):
            pool.close()

    app.state.close = close

    def codec() -> Codec:
        if "codec" not in cache:
            cache["codec"] = codec_for(cluster.model)
        return cache["codec"]

    def chat_pool() -> RenderPool:
        """The render pool of the model's template (or --chat-template's); 400 when there is
        none, 500 when it does not compile."""
        with counting:
            if "pool" not in cache:
                try:
                    template = load_chat_template(
                        cluster.model.tokenizer_dir if cluster.model is not None else None,
                        config.chat_template)
                    cache["pool"] = None if template is None else RenderPool(
                        template.source, template.specials, config.chat_template_timeout,
                        max_chars=2 * config.max_body_size)
                except ValueError as err:
                    cache["pool"] = err
            pool = cache["pool"]
        if isinstance(pool, ValueError):
            raise ApiError(500, str(pool), code="chat_template_error")
        if pool is None:
            raise ApiError(400, f"messages: the model {served!r} has no chat template (its "
                                f"tokenizer_config.json has no chat_template); start the server "
                                f"with --chat-template FILE, or use /v1/completions",
                           param="messages", code="no_chat_template")
        return pool

    app.state.warm = lambda: blocking.submit(_warm_pool, chat_pool)

    def render_chat(messages: list[ChatMessage], add_generation_prompt: bool,
                    add_special_tokens: bool = False) -> list[int]:
        """The prompt ids of `messages` (in a worker thread: the render blocks it)."""
        pool = chat_pool()
        try:
            text = pool.render([m.for_template() for m in messages], add_generation_prompt)
        except (OSError, RuntimeError) as err:     # no worker could be started
            raise ApiError(503, f"the chat template worker could not start: {err}",
                           code="chat_template_unavailable") from None
        except TemplateRefusal as err:
            with counting:
                metrics.template_failures[err.kind] += 1
            what = f"the chat template refused them: {err}" if err.kind == "refused" \
                else str(err)
            raise bad("messages", what[:400], code="chat_template_error") from None
        try:
            return codec().encode(text, add_special_tokens)
        except Exception as err:   # e.g. a lone surrogate (JSON allows "\ud800"): no UTF-8
            raise bad("messages", f"the text cannot be encoded ({type(err).__name__}: "
                                  f"{str(err)[:120]})") from None

    async def parsed(request: Request, work: Callable[[Any], Any], offload: bool = False) -> Any:
        """`work(decoded body)`: on the event loop for a small body, else in a worker thread
        (and for a large body, at most `LARGE_BODIES` read and parsed at once)."""
        try:
            length = int(request.headers.get("content-length", ""))
        except ValueError:
            length = None            # chunked: its size is known once it is read
        if length is not None and length <= INLINE_BYTES:
            raw = await request.body()
            if not offload:
                return work(_decode_json(raw))
            return await asyncio.get_running_loop().run_in_executor(
                blocking, lambda: work(_decode_json(raw)))
        async with large_bodies:
            raw = await request.body()
            return await asyncio.get_running_loop().run_in_executor(
                blocking, lambda: work(_decode_json(raw)))

    def limits() -> Limits:
        model = cluster.model
        return Limits(model.max_context_len, model.vocab_size, cluster.config.dp,
                      cluster.capacity + cluster.config.max_queue,
                      tuple(model.eos_token_ids))

    def available(requests: int) -> None:
        try:
            cluster.check_available(requests)
        except Unavailable as err:
            raise ApiError(503, err.message, code=err.code) from None

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, err: ApiError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, err: RequestValidationError) -> JSONResponse:
        first = (err.errors() or [{}])[0]
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return JSONResponse(ApiError(400, f"{param or 'body'}: {first.get('msg', 'invalid')}",
                                     param=param, code="invalid_type").body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, err: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(ApiError(err.status_code, str(err.detail), code="not_found"
                                     if err.status_code == 404 else None).body(),
                            status_code=err.status_code)

    @app.get("/health")
    async def health() -> JSONResponse:
        if cluster.healthy:
            return JSONResponse({"status": "ok", "ranks": cluster.world_size})
        status = "failed" if cluster.failure else "starting"
        return JSONResponse({"status": status, "message": cluster.failure or
                             f"{len(cluster.ready)} of {cluster.world_size} ranks ready"},
                            status_code=503)

    def card() -> dict[str, Any]:
        model = cluster.model
        return openai_io.model_card(served, model.max_context_len if model else None,
                                    model.mode if model else None)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        if model_id != served:
            raise ApiError(404, f"model: {shown(model_id)} does not exist; this server serves "
                                f"{served!r}", param="model", code="model_not_found")
        return JSONResponse(card())

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(render(
            metrics, healthy=cluster.healthy, ranks=cluster.world_size,
            ranks_ready=len(cluster.ready), in_flight=len(cluster.trackers),
            loads=cluster.loads(), stats=cluster.stats, model_name=served),
            media_type="text/plain; version=0.0.4")

    async def generate(request: Request, parse: Callable[[Any, Limits], CompletionParams],
                       chat: bool = False) -> Response:
        start = time.perf_counter()

        def work(body: Any) -> CompletionParams:
            available(0)
            return parse(body, limits())

        try:
            params = await parsed(request, work, offload=chat)
            available(params.choices)
        except ApiError as err:
            metrics.requests["rejected" if err.status < 500 else "unavailable"] += 1
            raise
        job = _Job(cluster, metrics, codec(), params, start)
        metrics.frontend_pre.observe(time.perf_counter() - start)
        if params.stream:
            return job.stream()
        return await job.complete(request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, lambda body, lim: openai_io.parse_completion(
            body, served, lim, codec().encode))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, lambda body, lim: openai_io.parse_chat(
            body, served, lim, render_chat), chat=True)

    def tokenize_work(body: Any) -> list[int]:
        available(0)
        req = openai_io.parse_tokenize(body, served)
        if req.messages is not None:
            return render_chat(req.messages, req.add_generation_prompt, req.add_special_tokens)
        try:
            return codec().encode(req.text, req.add_special_tokens)
        except Exception as err:
            raise bad("prompt", f"the text cannot be encoded ({type(err).__name__}: "
                                f"{str(err)[:120]})") from None

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        ids = await parsed(request, tokenize_work, offload=True)
        return JSONResponse({"count": len(ids), "max_model_len": cluster.model.max_context_len,
                             "tokens": ids, "token_strs": None})

    def detokenize_work(body: Any) -> str:
        available(0)
        ids = openai_io.parse_detokenize(body, served, cluster.model.vocab_size)
        return codec().decode(ids, skip_special_tokens=False)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        return JSONResponse({"prompt": await parsed(request, detokenize_work)})

    return app


def _warm_pool(chat_pool: Callable[[], RenderPool]) -> None:
    """Start a render worker once the model is known (a model without a template: nothing)."""
    try:
        chat_pool().warm()
    except ApiError:
        pass


def _decode_json(raw: bytes) -> Any:
    """The decoded body. An integer literal too long for Python (over 4300 digits) is parsed
    again as an ``admission.LongInt``, so the field that holds it refuses it by name; anything
    else that is not JSON (nesting too deep for the parser too) is a 400 without a field."""
    try:
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            raise
        except ValueError:     # "Exceeds the limit (4300 digits) for integer string conversion"
            return json.loads(raw, parse_int=_parse_int)
    except (ValueError, RecursionError) as err:    # JSONDecodeError, UnicodeDecodeError too
        raise ApiError(400, f"the request body is not valid JSON ({str(err)[:200]})",
                       code="invalid_json") from None


def _parse_int(text: str) -> int:
    return int(text) if len(text) <= 4000 else LongInt(text)


class _Job:
    """One completions or chat request: its sub-requests, their choices, its response."""

    def __init__(self, cluster: ClusterClient, metrics: FrontendMetrics, codec: Codec,
                 params: CompletionParams, start: float) -> None:
        self.cluster, self.metrics, self.params, self.start = cluster, metrics, params, start
        self.chat = params.chat
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = openai_io.now()
        self.events: asyncio.Queue = asyncio.Queue()
        self.first_token_at: Optional[float] = None
        seed = params.seed if params.seed is not None else random.randrange(2 ** 31)
        self.codec = codec
        self.choices: list[Choice] = []
        skip = params.skip_special_tokens
        for k in range(params.choices):
            ids = params.prompts[k // params.n]
            rid = f"{self.id}-{k}"
            if params.needs_engine:
                cluster.submit(rid, k, ids, params.engine_max_tokens, params.temperature,
                               params.top_p, seed + k, params.dp_rank, self.events,
                               params.stop_token_ids, params.ignore_eos, **params.sampling())
            else:      # echo with max_tokens 0 and no logprobs: the prompt is the answer
                self.events.put_nowait((k, Tokens([], "length")))
            c = Choice(TextStream(codec, params.stop, params.include_stop_str_in_output, skip,
                                  params.min_tokens), len(ids), rid, prompt_ids=list(ids))
            if params.echo:
                c.echo = codec.decode(ids, skip)
            if params.logprobs is not None and not self.chat:
                c.offsets = Offsets(codec, skip)
                if params.echo:
                    c.offsets.push(ids)
            self.choices.append(c)
        metrics.prompt_tokens += sum(len(p) for p in params.prompts)

    # ---- events ---------------------------------------------------------------------------------
    async def _next(self) -> tuple[int, str]:
        """Apply the next event; (choice index, new text). `ApiError` for a failure."""
        index, event = await self.events.get()
        choice = self.choices[index]
        if isinstance(event, Failure):
            self.abort()
            raise ApiError(event.status, event.message, param=event.param, code=event.code)
        assert isinstance(event, Tokens)
        now = time.perf_counter()
        if self.first_token_at is None and event.token_ids:
            self.first_token_at = now
            self.metrics.ttft.observe(self.first_token_at - self.start)
        if choice.done:
            return index, ""
        if event.finish_reason == "abort":
            self.abort()
            raise ApiError(503, "the request was aborted by the server", code="aborted")
        if event.prompt_logprobs is not None:
            choice.prompt_logprobs = event.prompt_logprobs
        if self.params.max_tokens == 0:
            # echo alone: the ranks made one token for the prompt's logprobs; it is dropped
            if choice.prompt_logprobs is not None or event.finish_reason is not None \
                    or self.params.prompt_logprobs is None:
                choice.finish_reason = "length"
                if event.finish_reason is None:
                    self.cluster.abort(choice.rid)
            return index, ""
        if event.token_ids:
            if choice.first_at is not None:
                self.metrics.itl.observe(now - choice.last_at)
            else:
                choice.first_at = now
            choice.last_at = now
        if event.logprobs is not None:
            choice.logprobs.extend(event.logprobs)
        delta = choice.text.feed(event.token_ids, final=event.finish_reason is not None,
                                 stop_token=event.finish_reason == "stop")
        if choice.text.stopped:
            choice.finish_reason = "stop"
            self.cluster.abort(choice.rid)
        elif event.finish_reason is not None:
            choice.finish_reason = event.finish_reason
        return index, delta

    @property
    def done(self) -> bool:
        return all(c.done for c in self.choices)

    def abort(self) -> None:
        """Abort every unfinished sub-request (client gone, failure)."""
        for c in self.choices:
            if not c.done:
                c.finish_reason = "abort"
                self.cluster.abort(c.rid)

    def _finish_metrics(self) -> None:
        self.metrics.requests["success"] += 1
        self.metrics.completion_tokens += sum(len(c.text.token_ids) for c in self.choices)
        elapsed = time.perf_counter() - self.start
        self.metrics.latency.observe(elapsed)
        self.metrics.e2e.observe(elapsed)
        for c in self.choices:
            n = len(c.text.token_ids)
            if n > 1 and c.first_at is not None:
                self.metrics.tpot.observe((c.last_at - c.first_at) / (n - 1))

    def _logprobs(self, c: Choice, start: int, end: int, with_prompt: bool
                  ) -> Optional[dict[str, Any]]:
        """The `logprobs` object of generated tokens `start .. end` of choice `c` (and, with
        `with_prompt`, of its echoed prompt first); None without logprobs."""
        if self.params.logprobs is None:
            return None
        piece = self.codec.token_bytes
        entries = c.logprobs[start:end]
        if self.chat:
            return openai_io.chat_logprobs(entries, piece)
        ids = c.text.token_ids[start:end]
        at = len(c.prompt_ids) if self.params.echo else 0
        have = len(c.offsets.offsets) - at          # generated tokens with an offset so far
        if have < end:
            c.offsets.push(c.text.token_ids[have:end])
        token_offsets = c.offsets.offsets[at + start:at + end]
        if with_prompt:
            prompt = list(c.prompt_logprobs or [None] * len(c.prompt_ids))
            prompt = prompt[:len(c.prompt_ids)] + [None] * (len(c.prompt_ids) - len(prompt))
            return openai_io.completion_logprobs(
                c.prompt_ids + ids, prompt + entries, c.offsets.offsets[:at] + token_offsets,
                piece)
        return openai_io.completion_logprobs(ids, entries, token_offsets, piece)

    def _usage(self) -> dict[str, int]:
        # a prompt's tokens count once, however many choices it has (as OpenAI counts them)
        return openai_io.usage(sum(len(p) for p in self.params.prompts),
                               sum(len(c.text.token_ids) for c in self.choices))

    def _body(self, choices: list[dict[str, Any]], usage: Optional[dict[str, int]],
              chunk: bool) -> dict[str, Any]:
        if self.chat:
            return openai_io.chat_completion(self.id, self.params.model, self.created, choices,
                                             usage, chunk)
        return openai_io.completion(self.id, self.params.model, self.created, choices, usage)

    # ---- non-streaming ---------------------------------------------------------------------------
    async def complete(self, request: Request) -> Response:
        async def run() -> None:
            while not self.done:
                await self._next()

        if not await self._until_disconnect(request, run()):
            return Response(status_code=499)
        self._finish_metrics()
        ids = self.params.return_token_ids
        make = openai_io.chat_choice if self.chat else openai_io.choice
        choices = [make(i, c.echo + c.text.text, c.finish_reason,
                        c.text.token_ids if ids else None,
                        self._logprobs(c, 0, len(c.text.token_ids), self.params.echo))
                   for i, c in enumerate(self.choices)]
        return JSONResponse(self._body(choices, self._usage(), chunk=False))

    async def _until_disconnect(self, request: Request, work: Any) -> bool:
        """Run `work`; if the client disconnects first, abort and return False."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not task.done():
            task.cancel()
            self.abort()
            self.metrics.requests["client_gone"] += 1
            return False
        error = task.exception()
        if error is not None:
            self.metrics.requests["error"] += 1
            raise error
        return True

    # ---- streaming -------------------------------------------------------------------------------
    def stream(self) -> Response:
        """Server-sent events; headers go out at once (a queued request may wait for a slot),
        so a failure after this point is an error event in the stream."""
        return StreamingResponse(self._events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def _events(self) -> AsyncIterator[str]:
        sent_final: set[int] = set()
        try:
            if self.chat:      # every choice opens with the assistant's role
                yield _sse(self._body([openai_io.chat_delta(i, {"role": "assistant",
                                                                "content": ""}, None)
                                       for i in range(len(self.choices))], None, chunk=True))
            while len(sent_final) < len(self.choices):
                chunk = self._chunk(*await self._next(), sent_final)
                if chunk is not None:
                    yield chunk
            self._finish_metrics()
            if self.params.include_usage:
                yield _sse(self._body([], self._usage(), chunk=True))
            yield "data: [DONE]\n\n"
        except ApiError as err:
            self.metrics.requests["error"] += 1
            yield _sse(err.body())
        finally:
            if not self.done:        # the client went away mid-stream: free its requests
                self.metrics.requests["client_gone"] += 1
            self.abort()

    def _chunk(self, index: int, delta: str, sent_final: set[int]) -> Optional[str]:
        choice = self.choices[index]
        final = choice.done and index not in sent_final
        echo = self.params.echo and not choice.echo_sent
        if not delta and not final and not echo:
            return None
        if echo:     # the prompt (and its logprobs) open the choice's first chunk
            choice.echo_sent = True
            delta = choice.echo + delta
        if final:
            sent_final.add(index)
        ids = None
        if self.params.return_token_ids:
            ids = choice.text.token_ids[choice.ids_sent:]
            choice.ids_sent = len(choice.text.token_ids)
        # the logprobs of the tokens counted since the last chunk (those of `ids`)
        end = len(choice.text.token_ids)
        logprobs = self._logprobs(choice, choice.lp_sent, end, echo)
        choice.lp_sent = end
        finish = choice.finish_reason if final else None
        if self.chat:
            part = openai_io.chat_delta(index, {"content": delta} if delta else {}, finish, ids,
                                        logprobs)
        else:
            part = openai_io.choice(index, delta, finish, ids, logprobs)
        return _sse(self._body([part], None, chunk=True))


async def _disconnected(request: Request) -> None:
    """Return when the client closes the connection."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
