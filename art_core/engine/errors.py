"""The errors an inference engine raises (`TorchEngine`, `VLLMEngine`); `art_core.server.errors` maps them to HTTP.

Re-exported by `art_core.engine.torch.engine`.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine rejects before queueing it (the caller's fault: HTTP 400)."""


class ContextLengthError(InvalidRequestError):
    """The prompt does not fit in the model's context window (with room for one new token)."""


class UnknownAdapterError(KeyError):
    """A request named an adapter the engine has not loaded."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown adapter"


class EngineClosedError(RuntimeError):
    """The engine was closed (or its worker died); it serves no more requests."""


class ReplicaDownError(EngineClosedError):
    """The replica serving a request (`engine.replicas`) died after it had streamed tokens, so it
    could not be retried; the other replicas serve on."""


class NoLiveReplicaError(EngineClosedError):
    """Every replica is down (or the replicated engine was closed)."""


class EngineOverloadedError(RuntimeError):
    """Admitting the request would put more than `EngineConfig.max_queued_rows` rows in the engine.

    Nothing was queued; send it again after `retry_after_s` seconds (the server answers HTTP 429
    with a `Retry-After` header), send fewer requests at once, or raise `max_queued_rows`.
    """

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        """Whole seconds after which the rows ahead should have made room (see `art_core.engine.admission`)."""

    def __reduce__(self) -> tuple[type, tuple[str, int]]:  # pickles (a replica process sends it back)
        return (type(self), (str(self), self.retry_after_s))
