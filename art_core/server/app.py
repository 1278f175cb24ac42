"""The OpenAI-compatible HTTP server's app: `create_app` assembles it, `serve_in_thread` runs it.

Routes: `/v1/chat/completions` (plain and `stream: true`), `/v1/models`, `/health`, and the
rollout routes. Every choice also carries the exact tokens it came from (`prompt_token_ids`,
`token_ids`, `token_logprobs`, `served_model`). The parts, each with its own contract: `router`
(which engine serves a name), `openai_format` (request and response bodies), `chat_completion`
(one request, end to end), `chat_stream` (its SSE form: streamed content equals plain content),
`rollout_routes` (capture), `errors` (OpenAI's error shape and status codes) and `middleware`
(API key, requests in flight). Left out: engines (`art_core.engine`) and model hosting
(`art_core.host`). Overload, streaming and recording are described in docs/architecture.md.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response

from art_core.capture import ROLLOUT_ID_HEADER, RolloutRecorder
from art_core.server.errors import install_error_handlers
from art_core.server.middleware import (
    MAX_BODY_BYTES,
    MAX_CONCURRENT_REQUESTS,
    BodySizeLimit,
    ConcurrencyLimit,
    require_api_key,
)
from art_core.server.openai_format import ChatCompletionRequest, model_list
from art_core.server.rollout_routes import checked_rollout_id, install_rollout_routes, recorded_completion
from art_core.server.router import ModelRouter


def create_app(
    router: ModelRouter,
    *,
    api_key: str | None = None,
    recorder: RolloutRecorder | None = None,
    max_concurrent_requests: int = MAX_CONCURRENT_REQUESTS,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> FastAPI:
    """The FastAPI app; with `api_key`, every route needs `Authorization: Bearer <api_key>`.

    `recorder` keeps the rollout records (a fresh one when None); it is also `app.state.recorder`.
    Past `max_concurrent_requests` HTTP requests in flight, others get 503 (`ConcurrencyLimit`); a
    request body over `max_body_bytes` gets 413 (`BodySizeLimit`). Order: the API key is checked
    first, then requests in flight, then the body's size.
    """
    if max_concurrent_requests < 1:
        raise ValueError(f"max_concurrent_requests must be >= 1, got {max_concurrent_requests}")
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    app = FastAPI(title="art_core OpenAI-compatible server")
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)  # added first, so it runs last
    app.add_middleware(ConcurrencyLimit, limit=max_concurrent_requests)
    install_error_handlers(app)
    recorder = recorder if recorder is not None else RolloutRecorder()
    app.state.recorder = recorder
    if api_key is not None:
        require_api_key(app, api_key)  # added last, so it runs first: a refused request is not counted

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return model_list(router.model_names())

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        rollout_id = checked_rollout_id(request.headers.get(ROLLOUT_ID_HEADER), "header")
        return await recorded_completion(router, recorder, body, rollout_id)

    install_rollout_routes(app, router, recorder)
    return app


# -- serving in a thread ------------------------------------------------------------------------


@dataclass
class ServerHandle:
    """A server running in a daemon thread."""

    url: str
    """Base URL, e.g. "http://127.0.0.1:8123" (the OpenAI base_url is url + "/v1")."""
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self, timeout: float = 10.0) -> None:
        """Ask uvicorn to exit and wait for its thread."""
        self.server.should_exit = True
        self.thread.join(timeout)


KEEP_ALIVE_S = 75
"""Idle keep-alive of our servers' connections (`art serve`, `serve_in_thread`): longer than HTTP clients keep idle ones (httpx,
so the openai client: 5 s), so a client never reuses a connection that the server is closing at
the same moment. uvicorn's default is also 5 s; with equal timeouts a request sent ~5 s after the
previous one races the close (suspected cause of one APIConnectionError in scripts/gpu_check.py,
right after a 4.9 s train step; not reproduced in isolation)."""


def serve_in_thread(
    app: FastAPI, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0
) -> ServerHandle:
    """Run `app` with uvicorn in a daemon thread (its own event loop); returns once it accepts connections.

    port 0 picks a free port (the socket is bound here, so the port is known before uvicorn starts).
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound_port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="off", timeout_keep_alive=KEEP_ALIVE_S)
    )
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name=f"uvicorn-{bound_port}", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"the server on {host}:{bound_port} stopped during startup (see the log)")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError(f"the server on {host}:{bound_port} did not start within {timeout} s")
        time.sleep(0.01)
    shown = f"[{host}]" if ":" in host else host
    return ServerHandle(url=f"http://{shown}:{bound_port}", server=server, thread=thread)


__all__ = ["KEEP_ALIVE_S", "ServerHandle", "create_app", "serve_in_thread"]
