"""The judge transport: which model answers, how it is called and cached (retries: `autorl.retries`).

A judge is any LiteLLM model string (`openai/gpt-4.1-mini`, `anthropic/...`, `ollama/...`) or
any OpenAI-compatible server given by `base_url` (our own `art serve`, vLLM, OpenRouter...).
This module only sends chat messages and returns the answer's text; what the messages say and
how the answer is validated belong to `autorl.ruler`.

Structured outputs: the JSON schema is sent as `response_format` (`json_schema`, strict), so a
server with constrained decoding can only answer valid JSON. A server that answers 400 to it
is sent the caller's simpler fallback schema, if any (OpenAI's strict mode rejects the
`prefixItems` of RULER's exact schema but takes its per-item form), then no response_format;
what a judge endpoint (model + URL) refused is not sent to it again in this process (logged at
INFO); the prompt still asks for the same JSON.

Logprobs: `complete(..., top_logprobs=k)` also asks for the k most likely tokens at each answer
position (`JudgeAnswer.top_logprobs`), which the probability-weighted and pairwise RULER modes read.

Caching: answers are cached by `answer_cache_key` (sha256 of the canonical JSON of the model,
the endpoint URL, the messages and the schema), in memory and, with `cache_dir`, on disk as
one JSON file per key (atomic writes). Only answers that passed validation are cached (their raw
text, re-validated when read); failures never are.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

from art_core.atomic import atomic_write_bytes
from autorl.retries import Attempts, Rejected, ask_with_retries, cut_off_note, is_transport_error, status_code

logger = logging.getLogger(__name__)

RESERVED_PARAMS = {
    "model": "JudgeConfig.model",
    "messages": "the judge prompt (built by ruler)",
    "temperature": "JudgeConfig.temperature",
    "max_tokens": "JudgeConfig.max_tokens",
    "response_format": "JudgeConfig.structured_output (set it to False to send no response_format)",
    "base_url": "JudgeConfig.base_url",
}
"""Keys `extra_params` may not hold, and the JudgeConfig field that sets each instead."""

MEMORY_CACHE_SIZE = 4096
"""Judge answers kept in the in-memory cache (least recently used ones are dropped)."""


@dataclass(frozen=True)
class JudgeConfig:
    """Which model judges and how it is called. A plain string `s` means `JudgeConfig(model=s)`."""

    model: str
    """A LiteLLM model string ("openai/gpt-4.1-mini", "anthropic/...", "ollama/...") or, when
    `base_url` is set, the model name at that OpenAI-compatible server (e.g. "judge", "agent-001")."""
    base_url: str | None = None
    """An OpenAI-compatible base URL (usually ending in /v1); when set, calls go through the
    `openai` AsyncOpenAI client instead of LiteLLM."""
    api_key: str | None = None
    """The key for `base_url` (or for LiteLLM); None sends "none" to `base_url` and lets LiteLLM
    read its usual environment variables."""
    temperature: float = 0.0
    """Sampling temperature of the judge."""
    max_tokens: int = 2048
    """Longest answer; an answer cut off here is invalid JSON (the error says so)."""
    max_attempts: int = 3
    """Calls per judgement: one call plus retries on invalid answers (invalid JSON, wrong count,
    unknown/duplicate/missing ids, scores outside 0..1, missing fields) and on transport errors
    (connection errors, timeouts, 408/409/429/5xx). Other 4xx answers fail at once."""
    retry_backoff_s: float = 1.0
    """Seconds to wait before retrying after a transport error, doubled each time (not after an
    invalid answer: that retry is sent at once, with the reason it was invalid)."""
    structured_output: bool = True
    """Send `response_format` json_schema (strict) so servers with constrained decoding return
    valid JSON; a server that rejects it with a 400 is asked again without it."""
    cache: bool = True
    """Cache validated answers by prompt hash, in memory and (with `cache_dir`) on disk."""
    cache_dir: Path | None = None
    """Folder of the on-disk JSON cache (one file per prompt hash, atomic writes); None = memory only."""
    explanation_max_chars: int | None = None
    """Add `maxLength` to the explanation in the answer schema. Small local judges under constrained
    decoding can repeat themselves inside a string until `max_tokens`; a bound ends it. Leave None for
    providers whose strict structured outputs reject `maxLength` (OpenAI)."""
    extra_params: Mapping[str, Any] = field(default_factory=dict)
    """Passed through to `litellm.acompletion` or `AsyncOpenAI.chat.completions.create`
    (e.g. {"api_base": url, "api_key": key} for LiteLLM, {"timeout": 60}, {"reasoning_effort": "low"})."""

    def __post_init__(self) -> None:
        if self.explanation_max_chars is not None and self.explanation_max_chars < 1:
            raise ValueError(f"explanation_max_chars must be >= 1 or None, got {self.explanation_max_chars}")
        if not isinstance(self.model, str) or not self.model.strip():
            raise ValueError("JudgeConfig.model must be a non-empty model name, e.g. 'openai/gpt-4.1-mini'")
        if self.base_url is not None and not self.base_url.startswith(("http://", "https://")):
            raise ValueError(
                f"JudgeConfig.base_url must be an http(s) URL such as 'http://127.0.0.1:8000/v1', got {self.base_url!r}"
            )
        if not (0.0 <= self.temperature <= 2.0):
            raise ValueError(f"JudgeConfig.temperature must be in [0, 2], got {self.temperature}")
        if self.max_tokens < 1:
            raise ValueError(f"JudgeConfig.max_tokens must be >= 1, got {self.max_tokens}")
        if self.max_attempts < 1:
            raise ValueError(f"JudgeConfig.max_attempts must be >= 1 (one call), got {self.max_attempts}")
        if not (self.retry_backoff_s >= 0 and math.isfinite(self.retry_backoff_s)):
            raise ValueError(f"JudgeConfig.retry_backoff_s must be >= 0, got {self.retry_backoff_s}")
        for key, instead in RESERVED_PARAMS.items():
            if key in self.extra_params:
                raise ValueError(f"JudgeConfig.extra_params may not set {key!r}: use {instead}")
        if self.api_key is not None and "api_key" in self.extra_params:
            raise ValueError("api_key is given both as JudgeConfig.api_key and in extra_params; keep one")
        if self.cache_dir is not None and not isinstance(self.cache_dir, Path):
            object.__setattr__(self, "cache_dir", Path(self.cache_dir))
        object.__setattr__(self, "extra_params", MappingProxyType(dict(self.extra_params)))

    @property
    def endpoint(self) -> str | None:
        """The URL the judge is reached at (`base_url`, or LiteLLM's `api_base`), if any."""
        return self.base_url or self.extra_params.get("api_base")


LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "0.0.0.0"})
"""Hosts whose judge counts as local (`is_local_judge`)."""

LOCAL_LITELLM_PREFIXES = ("ollama/", "ollama_chat/", "lm_studio/", "llamafile/")
"""LiteLLM providers that serve models on the user's own machine."""


def is_local_judge(config: JudgeConfig) -> bool:
    """Whether the judge runs on this machine: its URL's host is a loopback name, or its LiteLLM
    provider is a local runtime (`LOCAL_LITELLM_PREFIXES`). Such judges are usually small models."""
    from urllib.parse import urlsplit

    if config.endpoint:
        return (urlsplit(config.endpoint).hostname or "") in LOCAL_HOSTS
    return config.model.startswith(LOCAL_LITELLM_PREFIXES)


def as_judge_config(judge: JudgeConfig | str) -> JudgeConfig:
    """`judge` itself, or `JudgeConfig(model=judge)` for a plain model string."""
    if isinstance(judge, JudgeConfig):
        return judge
    if isinstance(judge, str):
        return JudgeConfig(model=judge)
    raise TypeError(f"judge must be a JudgeConfig or a model string, got {type(judge).__name__}")


class JudgeError(RuntimeError):
    """The judge could not give a valid judgement.

    `attempts` holds, per call, the raw answer text or a one-line summary of the exception.
    """

    def __init__(
        self, message: str, attempts: Sequence[str] = (), calls: int | None = None, errors: int | None = None
    ) -> None:
        super().__init__(message)
        self.attempts: list[str] = list(attempts)
        self.calls: int = len(self.attempts) if calls is None else calls
        """Judge calls made before giving up."""
        self.errors: int = self.calls if errors is None else errors
        """Those of the calls that gave no usable answer."""


class JudgeResponseError(JudgeError):
    """The judge answered, but its answer was invalid (after all attempts); the message says why."""


@dataclass(frozen=True)
class JudgeAnswer:
    """The text of one judge answer and why it ended (`stop`, `length`...)."""

    text: str
    finish_reason: str | None = None
    top_logprobs: tuple[dict[str, float], ...] | None = None
    """Asked with `top_logprobs=k`: per answer token, its k most likely tokens and their log-probs
    (None when the endpoint returned no logprobs)."""


# -- transport ----------------------------------------------------------------------------------

_NO_STRUCTURED_OUTPUT: set[tuple[str, str | None]] = set()
"""Judge endpoints (model, URL) that answered 400 to response_format in this process."""


def response_format(schema: Mapping[str, Any]) -> dict[str, Any]:
    """OpenAI's strict json_schema `response_format` around `schema`."""
    return {"type": "json_schema", "json_schema": {"name": "ruler_scores", "schema": schema, "strict": True}}


def _request_params(fmt: dict[str, Any] | None, top_logprobs: int | None) -> dict[str, Any]:
    params: dict[str, Any] = {}
    if fmt is not None:
        params["response_format"] = fmt
    if top_logprobs is not None:
        params["logprobs"] = True
        params["top_logprobs"] = top_logprobs
    return params


async def _send_openai(
    config: JudgeConfig, messages: list[dict[str, Any]], params: dict[str, Any]
) -> JudgeAnswer:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(
        base_url=config.base_url, api_key=config.api_key or "none", max_retries=0
    ) as client:
        response = await client.chat.completions.create(  # type: ignore[call-overload]
            model=config.model,
            messages=messages,  # type: ignore[arg-type]
            temperature=config.temperature,
            max_tokens=config.max_tokens,
            **params,
            **config.extra_params,
        )
    return _answer(response)


async def _send_litellm(
    config: JudgeConfig, messages: list[dict[str, Any]], params: dict[str, Any]
) -> JudgeAnswer:
    import litellm  # imported here: it takes seconds

    params = {"max_retries": 0, **config.extra_params, **params}
    if config.api_key is not None:
        params["api_key"] = config.api_key
    response = await litellm.acompletion(
        model=config.model,
        messages=messages,
        temperature=config.temperature,
        max_tokens=config.max_tokens,
        **params,
    )
    return _answer(response)


def _field(value: Any, name: str) -> Any:
    return value.get(name) if isinstance(value, dict) else getattr(value, name, None)


def _top_logprobs(choice: Any) -> tuple[dict[str, float], ...] | None:
    """Per answer token, {token: logprob} of its top alternatives (openai and LiteLLM objects alike)."""
    content = _field(_field(choice, "logprobs"), "content")
    if not content:
        return None
    out = []
    for entry in content:
        top = {
            str(_field(t, "token")): float(_field(t, "logprob")) for t in _field(entry, "top_logprobs") or ()
        }
        token = _field(entry, "token")
        if token is not None:
            top.setdefault(str(token), float(_field(entry, "logprob")))
        out.append(top)
    return tuple(out)


def _answer(response: Any) -> JudgeAnswer:
    if not response.choices:
        return JudgeAnswer("", "no choices")
    choice = response.choices[0]
    return JudgeAnswer(
        choice.message.content or "", getattr(choice, "finish_reason", None), _top_logprobs(choice)
    )


_NO_EXACT_SCHEMA: set[tuple[str, str | None]] = set()
"""Judge endpoints that answered 400 to a primary schema but took its fallback (OpenAI's strict
mode rejects `prefixItems`, for one); they are sent the fallback directly."""


def _refused(exc: Exception) -> bool:
    return is_transport_error(exc) and status_code(exc) == 400


async def complete(
    config: JudgeConfig,
    messages: list[dict[str, Any]],
    schema: Mapping[str, Any] | None,
    *,
    fallback_schema: Mapping[str, Any] | None = None,
    top_logprobs: int | None = None,
) -> JudgeAnswer:
    """One judge call (no retries), with the schema as response_format when the endpoint takes it.

    `schema=None` sends no response_format. An endpoint that answers 400 to `schema` is sent
    `fallback_schema` (when given) and then no response_format; what it refused is remembered for
    this process. `top_logprobs=k` asks for the k most likely tokens at each answer position
    (`JudgeAnswer.top_logprobs`). Raises the transport's own errors (openai/LiteLLM exceptions);
    see `is_transport_error`.
    """
    send = _send_openai if config.base_url else _send_litellm
    key = (config.model, config.endpoint)
    schemas = [s for s in (schema, fallback_schema) if s is not None]
    if key in _NO_EXACT_SCHEMA and fallback_schema is not None:
        schemas = [fallback_schema]
    if not config.structured_output or key in _NO_STRUCTURED_OUTPUT:
        schemas = []
    for k, candidate in enumerate(schemas):
        try:
            answer = await send(config, messages, _request_params(response_format(candidate), top_logprobs))
        except Exception as exc:
            if not _refused(exc):
                raise
            last = k == len(schemas) - 1
            logger.info(
                "judge %s at %s answered 400 to response_format json_schema (%s); asking again %s",
                config.model,
                config.endpoint or "its provider",
                str(exc).replace("\n", " ")[:300],
                "without it, and not sending it to this judge again" if last else "with a simpler schema",
            )
            continue
        if k > 0:
            _NO_EXACT_SCHEMA.add(key)
        return answer
    answer = await send(config, messages, _request_params(None, top_logprobs))
    if schemas:
        _NO_STRUCTURED_OUTPUT.add(key)
    return answer


# -- asking -------------------------------------------------------------------------------------

T = TypeVar("T")


async def ask_judge(
    config: JudgeConfig,
    messages: list[dict[str, Any]],
    schema: Mapping[str, Any],
    *,
    parse: Callable[[str], T],
    correction: Callable[[str], str],
    fallback_schema: Mapping[str, Any] | None = None,
) -> tuple[T, int]:
    """Ask until `parse` accepts an answer (up to `max_attempts` calls); returns (parsed, calls made).

    `parse` raises JudgeResponseError for an invalid answer; the next call then continues the
    conversation with that answer and `correction(reason)`. Transport errors are retried after a
    backoff when retryable (connection, timeout, 408/409/429/5xx) and end the loop otherwise.
    A cached answer (raw text, re-parsed) returns with 0 calls. Raises JudgeResponseError when
    the last attempt was answered invalidly, JudgeError when it failed in transport.
    """
    key = answer_cache_key(config, messages, schema)
    cached = cache_get(config, key)
    if isinstance(cached, str):
        try:
            return parse(cached), 0
        except JudgeResponseError as exc:
            logger.warning("ignoring a cached judge answer that no longer parses (%s)", exc)

    def accept(answer: JudgeAnswer, _: Attempts) -> T:
        try:
            parsed = parse(answer.text)
        except JudgeResponseError as exc:
            raise Rejected(cut_off_note(str(exc), answer, config)) from None
        cache_put(config, key, answer.text)
        return parsed

    def fail(attempts: Attempts) -> JudgeError:
        error = JudgeResponseError if attempts.answered else JudgeError
        what = "gave no valid answer" if attempts.answered else "could not be called"
        return error(
            f"judge {config.model} {what} in {attempts.calls} attempt(s): {attempts.summary()}",
            attempts.answers,
        )

    return await ask_with_retries(
        config,
        messages,
        lambda conversation: complete(config, conversation, schema, fallback_schema=fallback_schema),
        accept,
        correction=correction,
        fail=fail,
    )


# -- cache --------------------------------------------------------------------------------------

_MEMORY_CACHE: OrderedDict[str, Any] = OrderedDict()


def canonical_json(value: Any) -> str:
    """Compact, key-sorted JSON (the input of the cache hash)."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)


def answer_cache_key(
    config: JudgeConfig, messages: Sequence[Mapping[str, Any]], schema: Mapping[str, Any]
) -> str:
    """sha256 of the canonical JSON of the model, the endpoint URL, the messages and the schema."""
    payload = {"model": config.model, "endpoint": config.endpoint, "messages": messages, "schema": schema}
    return hashlib.sha256(canonical_json(payload).encode("utf-8")).hexdigest()


def clear_memory_cache() -> None:
    """Forget every answer cached in memory (the disk cache is left alone)."""
    _MEMORY_CACHE.clear()


def cache_get(config: JudgeConfig, key: str) -> Any | None:
    """The cached value for `key` (memory first, then `cache_dir`), or None."""
    if not config.cache:
        return None
    if key in _MEMORY_CACHE:
        _MEMORY_CACHE.move_to_end(key)
        return _MEMORY_CACHE[key]
    if config.cache_dir is None:
        return None
    path = config.cache_dir / f"{key}.json"
    if not path.exists():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))["value"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("ignoring unreadable judge cache file %s: %s", path, exc)
        return None
    _remember(key, value)
    return value


def cache_put(config: JudgeConfig, key: str, value: Any) -> None:
    """Store `value` (JSON-ready) under `key`, in memory and, with `cache_dir`, atomically on disk."""
    if not config.cache:
        return
    _remember(key, value)
    if config.cache_dir is None:
        return
    body = json.dumps({"model": config.model, "value": value}, ensure_ascii=False, indent=1)
    atomic_write_bytes(config.cache_dir / f"{key}.json", body.encode("utf-8"))


def _remember(key: str, value: Any) -> None:
    _MEMORY_CACHE[key] = value
    _MEMORY_CACHE.move_to_end(key)
    while len(_MEMORY_CACHE) > MEMORY_CACHE_SIZE:
        _MEMORY_CACHE.popitem(last=False)


__all__ = [
    "JudgeAnswer",
    "JudgeConfig",
    "JudgeError",
    "JudgeResponseError",
    "answer_cache_key",
    "as_judge_config",
    "ask_judge",
    "clear_memory_cache",
    "complete",
    "is_local_judge",
]
