"""`server.errors.http_error`: the one exception-to-HTTP ladder of the OpenAI and the training routes."""

from __future__ import annotations

import pytest

from art_core.engine.errors import (
    ContextLengthError,
    EngineClosedError,
    EngineOverloadedError,
    InvalidRequestError,
    UnknownAdapterError,
)
from art_core.host.routes import api_error
from art_core.models.loading import ModelNotFoundError
from art_core.server.errors import APIError, engine_error, http_error
from art_core.server.router import UnknownModelError
from art_core.storage import StorageFullError


@pytest.mark.parametrize(
    ("exc", "status", "code"),
    [
        (ContextLengthError("too long"), 400, "context_length_exceeded"),
        (UnknownAdapterError("no adapter"), 404, "model_not_found"),
        (UnknownModelError("no model"), 404, "model_not_found"),
        (ModelNotFoundError("no base model"), 400, "model_not_found"),
        (EngineOverloadedError("full", retry_after_s=7), 429, "rate_limit_exceeded"),
        (EngineClosedError("closed"), 503, "service_unavailable"),
        (InvalidRequestError("bad"), 400, None),
        (StorageFullError(28, "No space left on device: step 2 was not committed"), 507, "storage_full"),
        (RuntimeError("bug"), 500, None),
    ],
)
def test_both_route_families_map_typed_errors_alike(exc: Exception, status: int, code: str | None) -> None:
    for mapped in (engine_error(exc), api_error(exc)):
        assert (mapped.status, mapped.code) == (status, code)
    if status in (429, 503):
        assert int(http_error(exc).headers["Retry-After"]) >= 1


def test_a_value_error_is_the_requests_fault_only_on_the_training_routes() -> None:
    assert api_error(ValueError("reward is NaN")).status == 400
    failed = engine_error(ValueError("a bug in the engine"))
    assert failed.status == 500 and failed.message.startswith("generation failed: ValueError")
    own = APIError(418, "teapot")
    assert http_error(own) is own and api_error(own) is own
