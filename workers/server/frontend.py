"""The frontend process: ``python -m workers.server.frontend`` (spawned by rank 0 of ``serve``;
never started by hand). Its configuration (``protocol.FrontendConfig``: the ranks' addresses, the
limits) and the job's secret arrive in its environment (``CONFIG_ENV``, ``channel.SECRET_ENV``),
readable only by this user, never on its command line; its listening socket is the one rank 0
bound (``http_fd``).

It serves HTTP (uvicorn) and runs the cluster client's output pump and watchdog in the same event
loop. It stops when the cluster fails or stops (a rank exits, a rank goes silent, rank 0 is gone,
SIGTERM): every request in flight is answered with an error, new ones get 503 for ``linger_s``,
then uvicorn shuts down. SIGINT is ignored: on a terminal Ctrl-C reaches every process of the job,
and the ranks (rank 0 first) coordinate the shutdown and tell the frontend.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from typing import Iterator, Optional, Sequence

log = logging.getLogger("adaptive_dist.serve")

API_KEY_ENV = "ADAPTIVE_DIST_API_KEY"
"""The API key reaches the frontend in its environment (never on its command line, which every
user of the machine can read); `serve --api-key` puts it there."""


def _server_class():
    import uvicorn

    class FrontendServer(uvicorn.Server):
        """uvicorn without its own signal handlers (the frontend decides when to stop)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return FrontendServer


async def serve(config, secret: str) -> int:
    """Run until the cluster stops; the exit code (0 after an orderly stop)."""
    import functools
    import socket

    import uvicorn

    from workers.server.api import create_app
    from workers.server.channel import JobKey
    from workers.server.cluster import ClusterClient
    from workers.server.metrics import FrontendMetrics
    from workers.server.perimeter import (RateLimitedLog, accept_connections, bind_http,
                                          guarded_protocol, quiet_exhaustion, raise_file_limit)

    import workers.cli  # noqa: F401  (the codec's tokenizer; imports torch: before serving)

    loop = asyncio.get_running_loop()
    raise_file_limit()
    exhausted = RateLimitedLog("cannot accept HTTP connections (out of a system resource)")
    quiet_exhaustion(loop, exhausted)
    metrics = FrontendMetrics()
    cluster = ClusterClient(config, metrics, JobKey(secret))
    app = create_app(cluster, metrics, api_key=os.environ.get(API_KEY_ENV) or None)
    cluster.on_ready.append(app.state.warm)
    if config.failure_fd is not None:     # rank 0 leaves a stuck collective on this byte
        cluster.on_failure.append(lambda: _write_quietly(config.failure_fd, b"!"))
    refused = RateLimitedLog("refusing new HTTP connections at the cap")
    metrics.refused_connections = refused
    metrics.dropped = lambda: {"frontend": cluster.verifier.snapshot(),
                               **{f"rank{r}": d for r, d in sorted(cluster.rank_dropped.items())}}
    protocol = guarded_protocol(config.header_timeout,
                                lambda kind: metrics.http_rejected.update([f"{kind}_timeout"]))
    uconfig = uvicorn.Config(
        app, host=config.host, port=config.port, log_level="warning", lifespan="off",
        timeout_graceful_shutdown=2, access_log=False, http=protocol,
        timeout_keep_alive=config.timeout_keep_alive)
    server = _server_class()(uconfig)
    metrics.open_connections = lambda: len(server.server_state.connections)
    listening = socket.socket(fileno=config.http_fd) if config.http_fd is not None \
        else bind_http(config.host, config.port)
    loop.add_signal_handler(signal.SIGTERM, cluster.sigterm)
    loop.add_signal_handler(signal.SIGINT, lambda: None)
    tasks = [asyncio.ensure_future(cluster.pump()), asyncio.ensure_future(cluster.watchdog())]

    async def accept_when_started() -> None:
        # uvicorn serves no socket itself (`sockets=[]`): this loop accepts, under the cap
        while not server.started:
            await asyncio.sleep(0.02)
        make = functools.partial(uconfig.http_protocol_class, config=uconfig,
                                 server_state=server.server_state,
                                 app_state=server.lifespan.state)
        await accept_connections(listening, make, server.server_state.connections,
                                 config.max_connections, refused, exhausted)

    accepting = asyncio.ensure_future(accept_when_started())

    async def stop_when_asked() -> None:
        await cluster.stopping.wait()
        accepting.cancel()
        server.should_exit = True

    tasks += [accepting, asyncio.ensure_future(stop_when_asked())]
    try:
        await server.serve(sockets=[])
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        listening.close()
        if cluster.failure is None:
            cluster.fail("the HTTP server stopped")
        cluster.close()
        app.state.close()
    return 0 if cluster.orderly else 1


def _write_quietly(fd: int, data: bytes) -> None:
    try:
        os.write(fd, data)
    except OSError:
        pass


def main(argv: Optional[Sequence[str]] = None) -> int:
    from workers.server.channel import SECRET_ENV
    from workers.server.launch import setup_logging
    from workers.server.protocol import CONFIG_ENV, FrontendConfig

    args = list(sys.argv[1:] if argv is None else argv)
    config, secret = os.environ.get(CONFIG_ENV), os.environ.get(SECRET_ENV)
    if args or not config or not secret:
        sys.stderr.write("usage: python -m workers.server.frontend, with its configuration in "
                         f"{CONFIG_ENV} and the job's secret in {SECRET_ENV} (started by "
                         "`python -m adaptive_dist serve`)\n")
        return 2
    setup_logging("frontend")
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # until the event loop takes over
    return asyncio.run(serve(FrontendConfig.from_json(config), secret))


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)   # sockets are closed; skip the interpreter's slow teardown (torch)
