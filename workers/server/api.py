"""The HTTP routes: /v1/completions, /v1/models, /health, /metrics.

A completion request becomes one sub-request per prompt (``ClusterClient.submit``); their events
arrive in one queue as (choice index, event). Non-streaming answers once every choice finished;
streaming sends server-sent events at once, ending in ``data: [DONE]`` (or an error event). Stop strings are found on the
decoded text (``TextStream``): the text is cut there and the request is aborted on its rank. A
client that goes away (streaming or not) aborts its requests, which frees their KV and slots.
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from workers.server import openai_io
from workers.server.admission import LongInt
from workers.server.cluster import ClusterClient, Failure, Tokens, Unavailable
from workers.server.metrics import FrontendMetrics, render
from workers.server.openai_io import ApiError, CompletionParams, Limits
from workers.server.text import Codec, TextStream, codec_for

log = logging.getLogger("adaptive_dist.serve")


@dataclass
class Choice:
    """One prompt's completion as it is assembled."""

    text: TextStream
    prompt_tokens: int
    rid: str
    finish_reason: Optional[str] = None
    ids_sent: int = 0           # token ids already streamed (return_token_ids)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


def create_app(cluster: ClusterClient, metrics: FrontendMetrics) -> FastAPI:
    """The FastAPI application over `cluster`."""
    app = FastAPI(title="adaptive_dist", docs_url=None, redoc_url=None)
    served = cluster.config.model_name
    codecs: dict[str, Codec] = {}

    def codec() -> Codec:
        if "codec" not in codecs:
            codecs["codec"] = codec_for(cluster.model)
        return codecs["codec"]

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

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card: dict[str, Any] = {"id": served, "object": "model", "created": 0,
                                "owned_by": "adaptive_dist"}
        if cluster.model is not None:
            card.update(max_model_len=cluster.model.max_context_len, mode=cluster.model.mode)
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(render(
            metrics, healthy=cluster.healthy, ranks=cluster.world_size,
            ranks_ready=len(cluster.ready), in_flight=len(cluster.trackers),
            loads=cluster.loads(), stats=cluster.stats),
            media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        start = time.perf_counter()
        try:
            body = await _json_body(request)
            try:
                cluster.check_available(0)
            except Unavailable as err:
                raise ApiError(503, err.message, code=err.code) from None
            limits = Limits(cluster.model.max_context_len, cluster.model.vocab_size,
                            cluster.config.dp, cluster.capacity + cluster.config.max_queue)
            params = openai_io.parse_completion(body, served, limits, codec().encode)
            try:
                cluster.check_available(len(params.prompts))
            except Unavailable as err:
                raise ApiError(503, err.message, code=err.code) from None
        except ApiError as err:
            metrics.requests["rejected" if err.status < 500 else "unavailable"] += 1
            raise
        job = _Job(cluster, metrics, codec(), params, start)
        metrics.frontend_pre.observe(time.perf_counter() - start)
        if params.stream:
            return job.stream()
        return await job.complete(request)

    return app


async def _json_body(request: Request) -> Any:
    """The decoded body. An integer literal too long for Python (over 4300 digits) is parsed
    again as an ``admission.LongInt``, so the field that holds it refuses it by name; anything
    else that is not JSON (nesting too deep for the parser too) is a 400 without a field."""
    raw = await request.body()
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
    """One /v1/completions request: its sub-requests, their choices, its response."""

    def __init__(self, cluster: ClusterClient, metrics: FrontendMetrics, codec: Codec,
                 params: CompletionParams, start: float) -> None:
        self.cluster, self.metrics, self.params, self.start = cluster, metrics, params, start
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = openai_io.now()
        self.events: asyncio.Queue = asyncio.Queue()
        self.first_token_at: Optional[float] = None
        seed = params.seed if params.seed is not None else random.randrange(2 ** 31)
        self.choices: list[Choice] = []
        for i, ids in enumerate(params.prompts):
            rid = f"{self.id}-{i}"
            cluster.submit(rid, i, ids, params.max_tokens, params.temperature, params.top_p,
                           seed + i, params.dp_rank, self.events)
            self.choices.append(Choice(TextStream(codec, params.stop), len(ids), rid))
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
        if self.first_token_at is None and event.token_ids:
            self.first_token_at = time.perf_counter()
            self.metrics.ttft.observe(self.first_token_at - self.start)
        if choice.done:
            return index, ""
        if event.finish_reason == "abort":
            self.abort()
            raise ApiError(503, "the request was aborted by the server", code="aborted")
        delta = choice.text.feed(event.token_ids, final=event.finish_reason is not None)
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
        self.metrics.latency.observe(time.perf_counter() - self.start)

    def _usage(self) -> dict[str, int]:
        return openai_io.usage(sum(c.prompt_tokens for c in self.choices),
                               sum(len(c.text.token_ids) for c in self.choices))

    # ---- non-streaming -----------------------------------------------------------------------------
    async def complete(self, request: Request) -> Response:
        async def run() -> None:
            while not self.done:
                await self._next()

        if not await self._until_disconnect(request, run()):
            return Response(status_code=499)
        self._finish_metrics()
        ids = self.params.return_token_ids
        choices = [openai_io.choice(i, c.text.text, c.finish_reason,
                                    c.text.token_ids if ids else None)
                   for i, c in enumerate(self.choices)]
        return JSONResponse(openai_io.completion(self.id, self.params.model, self.created,
                                                 choices, self._usage()))

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

    # ---- streaming --------------------------------------------------------------------------------
    def stream(self) -> Response:
        """Server-sent events; headers go out at once (a queued request may wait for a slot),
        so a failure after this point is an error event in the stream."""
        return StreamingResponse(self._events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def _events(self) -> AsyncIterator[str]:
        sent_final: set[int] = set()
        try:
            while len(sent_final) < len(self.choices):
                chunk = self._chunk(*await self._next(), sent_final)
                if chunk is not None:
                    yield chunk
            self._finish_metrics()
            if self.params.include_usage:
                yield _sse(openai_io.completion(self.id, self.params.model, self.created, [],
                                                self._usage()))
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
        if not delta and not final:
            return None
        if final:
            sent_final.add(index)
        ids = None
        if self.params.return_token_ids:
            ids = choice.text.token_ids[choice.ids_sent:]
            choice.ids_sent = len(choice.text.token_ids)
        return _sse(openai_io.completion(
            self.id, self.params.model, self.created,
            [openai_io.choice(index, delta, choice.finish_reason if final else None, ids)], None))


async def _disconnected(request: Request) -> None:
    """Return when the client closes the connection."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
