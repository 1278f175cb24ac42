"""Rollout capture over HTTP (see `art_core.capture`): chat completions recorded under a rollout id.

A chat completion sent with an `X-Rollout-Id` header, or to the rollout-scoped base URL
`/rollouts/{id}/v1`, is recorded under that id (`recorded_completion`, plain or streamed: a stream
is recorded before its last choice's last chunk is sent). The record is built from the answered
choices' messages and token records (`ChatChoice`), not from the JSON sent. `GET /rollouts/{id}/records` reads the
records and `DELETE /rollouts/{id}` returns and forgets them. An invalid id is a 400
(`invalid_rollout_id`).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response

from art_core.capture import (
    ROLLOUT_ID_HEADER,
    CallRecord,
    InvalidRolloutIdError,
    RecordedChoice,
    RolloutRecorder,
    RolloutRecords,
    validate_rollout_id,
)
from art_core.server.chat_completion import chat_completion
from art_core.server.chat_stream import streamed_completion
from art_core.server.errors import APIError, JSONResponse
from art_core.server.openai_format import ChatChoice, ChatCompletionRequest, model_list
from art_core.server.router import ModelRouter


def checked_rollout_id(rollout_id: str | None, where: str) -> str | None:
    """`rollout_id` validated (None stays None); APIError 400 naming the header or the path otherwise."""
    if rollout_id is None:
        return None
    try:
        return validate_rollout_id(rollout_id)
    except InvalidRolloutIdError as exc:
        param = ROLLOUT_ID_HEADER if where == "header" else "rollout_id"
        raise APIError(400, str(exc), param=param, code="invalid_rollout_id") from exc


async def recorded_completion(
    router: ModelRouter, recorder: RolloutRecorder, req: ChatCompletionRequest, rollout_id: str | None
) -> Response:
    """`chat_completion` (or its stream), recorded under `rollout_id` when one is given."""
    seq, arrived = recorder.next_seq(), time.perf_counter()

    def record(choices: list[ChatChoice]) -> None:
        if rollout_id is not None:
            messages = [m.model_dump(exclude_unset=True) for m in req.messages]
            seconds = round(time.perf_counter() - arrived, 6)
            recorded = [
                RecordedChoice(message=dict(c.message), turn=c.turn.model_copy(update={"seconds": seconds}))
                for c in choices
            ]
            record = CallRecord(
                seq=seq, model=req.model, messages=messages, tools=req.tools, choices=recorded
            )
            recorder.record(rollout_id, record)

    if req.stream:
        return await streamed_completion(router, req, record, rollout_id)
    choices, response = await chat_completion(router, req, rollout_id)
    record(choices)
    return JSONResponse(response)


def records_response(body: RolloutRecords) -> JSONResponse:
    """The records as JSON. Requests are recorded as sent, lone surrogates (a client's unpaired
    `\\ud800` escapes) included; pydantic's JSON mode refuses those inside tool schemas, so such
    records are dumped as Python values and `JSONResponse` writes the surrogates as escapes."""
    try:
        return JSONResponse(body.model_dump(mode="json"))
    except UnicodeEncodeError:
        return JSONResponse(body.model_dump(mode="python"))


def install_rollout_routes(app: FastAPI, router: ModelRouter, recorder: RolloutRecorder) -> None:
    """`/rollouts/{id}/v1/...` (an OpenAI base URL that records), plus reading and freeing records."""

    @app.post("/rollouts/{rollout_id}/v1/chat/completions")
    async def rollout_chat_completions(rollout_id: str, body: ChatCompletionRequest) -> Response:
        checked = checked_rollout_id(rollout_id, "path")
        return await recorded_completion(router, recorder, body, checked)

    @app.get("/rollouts/{rollout_id}/v1/models")
    async def rollout_models(rollout_id: str) -> dict[str, Any]:
        checked_rollout_id(rollout_id, "path")
        return model_list(router.model_names())

    @app.get("/rollouts/{rollout_id}/records")
    async def rollout_records(rollout_id: str) -> JSONResponse:
        checked = checked_rollout_id(rollout_id, "path") or rollout_id
        return records_response(RolloutRecords(rollout_id=checked, records=recorder.peek(checked)))

    @app.delete("/rollouts/{rollout_id}")
    async def forget_rollout(rollout_id: str) -> JSONResponse:
        checked = checked_rollout_id(rollout_id, "path") or rollout_id
        return records_response(RolloutRecords(rollout_id=checked, records=recorder.pop(checked)))


__all__ = ["checked_rollout_id", "install_rollout_routes", "recorded_completion"]
