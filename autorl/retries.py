"""Asking a judge or a model again: which transport errors are worth a retry, and the one loop that
retries them and re-asks an invalid answer with a correction.

`ask_with_retries` is shared by `judge.ask_judge` (RULER's JSON scores), `label_probs.ask_label_probs`
(one-token label probabilities) and `structured.ask_structured` (any JSON object); each gives it the
call, what makes an answer acceptable, the correction to send after an invalid one and the error to
raise when every attempt failed. Transport errors (HTTP status, connection, timeout) are retried
after a backoff when they may pass (no status, 408/409/429, 5xx); any other ends the loop. Left out:
sending the request (`judge.complete`) and caching answers (`judge`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

RETRYABLE_STATUS = frozenset({408, 409, 429})
"""4xx statuses worth retrying (timeouts, conflicts, rate limits); every 5xx is retried too."""

Messages = list[dict[str, Any]]


class RetrySettings(Protocol):
    """What this module reads of an `autorl.judge.JudgeConfig` (a protocol: `judge` imports this module)."""

    @property
    def model(self) -> str: ...
    @property
    def base_url(self) -> str | None: ...
    @property
    def endpoint(self) -> str | None: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def max_attempts(self) -> int: ...
    @property
    def retry_backoff_s(self) -> float: ...


class Answer(Protocol):
    """What this module reads of an `autorl.judge.JudgeAnswer`."""

    @property
    def text(self) -> str: ...
    @property
    def finish_reason(self) -> str | None: ...


T = TypeVar("T")
A = TypeVar("A", bound=Answer)


def status_code(exc: BaseException) -> int | None:
    """The HTTP status of an openai/LiteLLM error, if it has one."""
    status = getattr(exc, "status_code", None)
    return status if isinstance(status, int) else None


def is_transport_error(exc: BaseException) -> bool:
    """Errors of the call itself (HTTP status, connection, timeout), as opposed to bugs."""
    import openai

    return isinstance(exc, openai.APIError | asyncio.TimeoutError | ConnectionError)


def is_retryable(exc: BaseException) -> bool:
    """A transport error that may pass on retry: no status (connection, timeout), 408/409/429, 5xx."""
    status = status_code(exc)
    return status is None or status >= 500 or status in RETRYABLE_STATUS


def describe_transport_error(exc: BaseException, config: RetrySettings) -> str:
    """One line about a failed call, with a hint where one helps."""
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    status = status_code(exc)
    if status == 404 and config.base_url and not config.base_url.rstrip("/").endswith("/v1"):
        text += (
            f" (base_url {config.base_url!r} does not end in /v1; OpenAI-compatible servers usually need it)"
        )
    elif status == 404:
        text += f" (is {config.model!r} served at {config.endpoint or 'the provider'}?)"
    elif status in (401, 403):
        text += " (check JudgeConfig.api_key)"
    return text


class Rejected(Exception):
    """Raised by an `accept` callback of `ask_with_retries`: the answer is invalid, for `reason`."""


@dataclass
class Attempts:
    """What each call of one ask gave, for the error raised when none was accepted."""

    answers: list[str] = field(default_factory=list)
    """Per call: the raw answer text, or a one-line summary of its transport error."""
    reasons: list[str] = field(default_factory=list)
    """Per call: "attempt n: why it was not accepted"."""
    answered: bool = False
    """Whether the last call was answered (invalidly) rather than failed in transport."""

    @property
    def calls(self) -> int:
        """Calls made so far."""
        return len(self.reasons)

    def add(self, answer: str, reason: str, *, answered: bool) -> None:
        self.answers.append(answer)
        self.reasons.append(f"attempt {self.calls + 1}: {reason}")
        self.answered = answered

    def summary(self) -> str:
        """Every attempt's reason, on one line."""
        return "; ".join(self.reasons)


def cut_off_note(reason: str, answer: Answer, config: RetrySettings) -> str:
    """`reason`, saying so when the answer ended at `max_tokens` (often why it is invalid)."""
    if answer.finish_reason == "length":
        return f"{reason} (the answer was cut off at max_tokens={config.max_tokens})"
    return reason


async def ask_with_retries(
    config: RetrySettings,
    messages: Messages,
    call: Callable[[Messages], Awaitable[A]],
    accept: Callable[[A, Attempts], T],
    *,
    correction: Callable[[str], str],
    fail: Callable[[Attempts], Exception],
    max_attempts: int | None = None,
) -> tuple[T, int]:
    """Call until `accept` takes an answer; returns (what it returned, calls made).

    `call(conversation)` makes one call: with `messages` first, then with each invalid answer and
    `correction(reason)` after them. `accept(answer, attempts_so_far)` raises `Rejected(reason)` for
    an invalid answer (asked again at once); anything else it raises ends the ask. Transport errors
    are retried after `config.retry_backoff_s`, doubled each time, when retryable; a transport
    error that is not ends the loop, and so does the last of `max_attempts` (default
    `config.max_attempts`) calls: then `fail(attempts)` is raised.
    """
    attempts, conversation = Attempts(), messages
    allowed = config.max_attempts if max_attempts is None else max_attempts
    for n in range(1, allowed + 1):
        try:
            answer = await call(conversation)
        except Exception as exc:
            if not is_transport_error(exc):
                raise
            summary = describe_transport_error(exc, config)
            attempts.add(summary, summary, answered=False)
            if not is_retryable(exc):
                break
            if n < allowed:
                await asyncio.sleep(config.retry_backoff_s * 2 ** (n - 1))
            continue
        try:
            return accept(answer, attempts), n
        except Rejected as exc:
            reason = str(exc)
            attempts.add(answer.text, reason, answered=True)
            conversation = [
                *messages,
                {"role": "assistant", "content": answer.text},
                {"role": "user", "content": correction(reason)},
            ]
    raise fail(attempts)
