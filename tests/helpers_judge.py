"""A SCRIPTED judge server for the RULER tests: real HTTP on 127.0.0.1, canned (not model) answers.

`ScriptedJudge` is a FastAPI app whose POST /v1/chat/completions answers from a queue of
`Reply`s (or from `responder`, a function of the request body, when a test needs answers that
depend on the prompt) and records every request body. Replies can carry top logprobs (what the
weighted and pairwise modes read), an HTTP error status, or a delay (for timeouts). Tests reach
it through the real clients: the `openai` client for `base_url` judges, LiteLLM otherwise.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from art_core.server import serve_in_thread
from autorl.judge import JudgeConfig


@dataclass
class Reply:
    """One canned answer of the scripted judge: a message, or an HTTP error."""

    content: str = ""
    status: int = 200
    finish_reason: str = "stop"
    top_logprobs: dict[str, float] | None = None
    """The alternatives {token: logprob} at the first answer token, returned as OpenAI `logprobs`
    when the request asked for them (the first key is the sampled token when `content` is "")."""
    delay_s: float = 0.0
    """Seconds to wait before answering (for client timeouts)."""


def logprob_reply(**top: float) -> Reply:
    """A one-token answer whose alternatives are `top` ({token: logprob}); the first is sampled."""
    return Reply(content=next(iter(top)), top_logprobs=dict(top))


def _logprobs(reply: Reply) -> dict[str, Any] | None:
    if reply.top_logprobs is None:
        return None
    token = reply.content or next(iter(reply.top_logprobs))
    alternatives = [{"token": t, "logprob": lp, "bytes": None} for t, lp in reply.top_logprobs.items()]
    entry = {"token": token, "logprob": reply.top_logprobs.get(token, -9.0), "bytes": None}
    return {"content": [{**entry, "top_logprobs": alternatives}], "refusal": None}


@dataclass
class ScriptedJudge:
    """What the scripted judge server answers (a queue) and what it was asked (every request body)."""

    url: str = ""
    replies: deque[Reply] = field(default_factory=deque)
    requests: list[dict[str, Any]] = field(default_factory=list)
    reject_response_format: bool = False
    """Behave like a server without structured outputs: 400 to any request with response_format."""
    reject_prefix_items: bool = False
    """Behave like OpenAI's strict mode: 400 to a response_format schema that uses `prefixItems`."""
    responder: Callable[[dict[str, Any]], Reply] | None = None
    """When set, answers every request from its body instead of from `replies`."""
    model: str = "scripted"
    """A name unique to this server, so no test sees another's cached answers."""

    def script(self, *replies: str | Reply) -> None:
        self.replies.extend(r if isinstance(r, Reply) else Reply(r) for r in replies)

    def _refusal(self, body: dict[str, Any]) -> JSONResponse | None:
        fmt = body.get("response_format")
        if self.reject_response_format and fmt:
            return error(400, "response_format 'json_schema' is not supported", "response_format")
        if self.reject_prefix_items and fmt and "prefixItems" in json.dumps(fmt):
            return error(400, "Invalid schema: 'prefixItems' is not permitted", "response_format")
        return None

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> JSONResponse:
            body = await request.json()
            self.requests.append(body)
            refusal = self._refusal(body)
            if refusal is not None:
                return refusal
            if self.responder is not None:
                reply = self.responder(body)
            elif self.replies:
                reply = self.replies.popleft()
            else:
                return error(500, "the scripted judge has no answer left", None)
            if reply.delay_s:
                await asyncio.sleep(reply.delay_s)
            if reply.status != 200:
                return error(reply.status, f"scripted error {reply.status}", None)
            message = {"role": "assistant", "content": reply.content}
            choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": reply.finish_reason}
            if body.get("logprobs"):
                choice["logprobs"] = _logprobs(reply)
            return JSONResponse(
                {
                    "id": "chatcmpl-scripted",
                    "object": "chat.completion",
                    "created": 0,
                    "model": body["model"],
                    "choices": [choice],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                }
            )

        return app


def error(status: int, message: str, param: str | None) -> JSONResponse:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}
    return JSONResponse(body, status_code=status)


_server_numbers = itertools.count()


def judge_fixtures() -> tuple[Any, Any]:
    """The `scripted_judge_server` and `transport` fixtures, for a test module to bind by name:
    `scripted_judge_server, transport = judge_fixtures()`."""

    @pytest.fixture(name="scripted_judge_server")
    def scripted_judge_server() -> Iterator[ScriptedJudge]:
        """A SCRIPTED judge (not a model): a real HTTP server answering from `ScriptedJudge.replies`."""
        judge = ScriptedJudge(model=f"scripted-{next(_server_numbers)}")
        handle = serve_in_thread(judge.app())
        judge.url = handle.url + "/v1"
        yield judge
        handle.stop()

    @pytest.fixture(name="transport", params=["openai", "litellm"])
    def transport(request: pytest.FixtureRequest) -> str:
        """Each test runs through the `openai` client and through LiteLLM."""
        return str(request.param)

    return scripted_judge_server, transport


def judge_for(server: ScriptedJudge, transport: str, **settings: Any) -> JudgeConfig:
    """A JudgeConfig reaching the scripted server through the `openai` client or through LiteLLM."""
    settings.setdefault("retry_backoff_s", 0.0)
    if transport == "openai":
        return JudgeConfig(model=server.model, base_url=server.url, api_key="x", **settings)
    extra = {"api_base": server.url, "api_key": "x", **settings.pop("extra_params", {})}
    return JudgeConfig(model=f"openai/{server.model}", extra_params=extra, **settings)


def user_text(request: dict[str, Any]) -> str:
    """The text of the last user message of a recorded request."""
    return str([m for m in request["messages"] if m["role"] == "user"][-1]["content"])
