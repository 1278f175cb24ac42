"""A SCRIPTED stand-in for an LLM endpoint (not a model): a real OpenAI-compatible HTTP server on
127.0.0.1 whose answers come from a queue or a function, for tests that need predictable output
from a generator or a judge. It records every request body. Never the only test of a path: each
path it covers is also run against our real server and model."""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from art_core.server import serve_in_thread
from autorl.judge import JudgeConfig


@dataclass
class Reply:
    """One canned answer: a message (after `delay_s`), or an HTTP error status."""

    content: str = ""
    status: int = 200
    delay_s: float = 0.0


Responder = Callable[[dict[str, Any]], "str | Reply"]


@dataclass
class ScriptedLLM:
    """What the scripted server answers and what it was asked."""

    model: str
    url: str = ""
    replies: deque[Reply] = field(default_factory=deque)
    responder: Responder | None = None
    """Used when the queue is empty: computes the answer from the request body."""
    rejected_formats: set[str] = field(default_factory=set)
    """response_format types answered with a 400, like a provider without that feature."""
    requests: list[dict[str, Any]] = field(default_factory=list)

    def script(self, *replies: str | Reply) -> None:
        self.replies.extend(r if isinstance(r, Reply) else Reply(r) for r in replies)

    def config(self, transport: str = "openai", **settings: Any) -> JudgeConfig:
        """A JudgeConfig reaching this server through the `openai` client or LiteLLM's openai/ route."""
        settings.setdefault("retry_backoff_s", 0.0)
        settings.setdefault("cache", False)
        if transport == "openai":
            return JudgeConfig(model=self.model, base_url=self.url, api_key="x", **settings)
        extra = {"api_base": self.url, "api_key": "x", **settings.pop("extra_params", {})}
        return JudgeConfig(model=f"openai/{self.model}", extra_params=extra, **settings)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> JSONResponse:
            body = await request.json()
            self.requests.append(body)
            kind = (body.get("response_format") or {}).get("type")
            if kind in self.rejected_formats:
                return _error(400, f"response_format {kind!r} is not supported")
            if self.replies:
                reply = self.replies.popleft()
            elif self.responder is not None:
                answer = self.responder(body)
                reply = answer if isinstance(answer, Reply) else Reply(answer)
            else:
                return _error(500, "the scripted server has no answer left")
            if reply.delay_s:
                await asyncio.sleep(reply.delay_s)
            if reply.status != 200:
                return _error(reply.status, f"scripted error {reply.status}")
            message = {"role": "assistant", "content": reply.content}
            return JSONResponse(
                {
                    "id": "chatcmpl-scripted",
                    "object": "chat.completion",
                    "created": 0,
                    "model": body["model"],
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                }
            )

        return app


def _error(status: int, message: str) -> JSONResponse:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
    return JSONResponse(body, status_code=status)


_numbers = itertools.count()


@contextmanager
def scripted_server(role: str) -> Iterator[ScriptedLLM]:
    """A scripted `role` ("generator", "judge") server, stopped on exit; its model name is unique."""
    llm = ScriptedLLM(model=f"scripted-{role}-{next(_numbers)}")
    handle = serve_in_thread(llm.app())
    llm.url = handle.url + "/v1"
    try:
        yield llm
    finally:
        handle.stop()
