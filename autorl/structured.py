"""Structured output from any endpoint: a JSON object that matches a schema, or a clear error.

`ask_structured` sends the schema as `response_format` json_schema (strict), so a server with
constrained decoding (our own included) can only answer valid JSON. A provider that rejects
json_schema with a 400 is asked again in JSON mode (`json_object`), and one that rejects that too
without any `response_format`; each endpoint's working mode is remembered for the process. The
prompt always states the shape, so an unconstrained answer can still be right.

An answer is parsed tolerantly (the object alone, in a fence, or with prose around it), checked
against the schema with `jsonschema`, then by the caller's `validate`; an invalid answer is asked
again with the reason it was invalid. Calls go through `autorl.judge`'s transport (the `openai`
client for `base_url` endpoints, LiteLLM otherwise) and its retry rules for transport errors.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar

from autorl.judge import JudgeAnswer, JudgeConfig, as_judge_config
from autorl.retries import Attempts, Rejected, ask_with_retries, cut_off_note, is_transport_error, status_code

logger = logging.getLogger(__name__)

Endpoint = JudgeConfig | str
"""A model to ask: a LiteLLM model string, or a `JudgeConfig` (e.g. `base_url` + model name)."""

Mode = Literal["json_schema", "json_object", "none"]
_LADDER: tuple[Mode, ...] = ("json_schema", "json_object", "none")
_MODES: dict[tuple[str, str | None], Mode] = {}
"""The response_format mode each endpoint (model, URL) accepted in this process."""

T = TypeVar("T")


class StructuredOutputError(RuntimeError):
    """No valid structured answer after every attempt; `attempts` holds each raw answer or error."""

    def __init__(self, message: str, attempts: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.attempts: list[str] = list(attempts)


class InvalidAnswerError(ValueError):
    """An answer that does not match the schema or the caller's check (the message says why)."""


def response_format(mode: Mode, schema: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    """The `response_format` of `mode` for `schema` (None for "none")."""
    if mode == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": name, "schema": dict(schema), "strict": True}}
    if mode == "json_object":
        return {"type": "json_object"}
    return None


def extract_json(text: str) -> Any:
    """The answer's JSON value: the whole text, else its first JSON object (fences, prose around)."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    decoder, pos = json.JSONDecoder(), text.find("{")
    while pos != -1:
        try:
            return decoder.raw_decode(text, pos)[0]
        except ValueError:
            pos = text.find("{", pos + 1)
    snippet = " ".join(text.split())[:120]
    raise InvalidAnswerError(f"no JSON object in the answer {snippet!r}")


def schema_problems(value: Any, schema: Mapping[str, Any], limit: int = 3) -> list[str]:
    """What is wrong with `value` against `schema` (at most `limit` problems; empty when valid)."""
    from jsonschema import Draft202012Validator

    errors = sorted(Draft202012Validator(dict(schema)).iter_errors(value), key=lambda e: list(e.path))
    problems = []
    for error in errors[:limit]:
        where = "/".join(str(p) for p in error.absolute_path) or "the answer"
        problems.append(f"{where}: {error.message[:200]}")
    return problems


def parse_answer(text: str, schema: Mapping[str, Any], validate: Callable[[Any], T] | None = None) -> Any:
    """Parse and check one answer; raises InvalidAnswerError with the reason; pure."""
    value = extract_json(text)
    problems = schema_problems(value, schema)
    if problems:
        raise InvalidAnswerError("; ".join(problems))
    if validate is None:
        return value
    try:
        return validate(value)
    except InvalidAnswerError:
        raise
    except (ValueError, TypeError, KeyError) as exc:
        raise InvalidAnswerError(str(exc)) from exc


def skeleton(schema: Mapping[str, Any]) -> Any:
    """An example value of `schema`'s shape (strings as "...", numbers as 0), for prompts; pure."""
    if "enum" in schema:
        return schema["enum"][0]
    if "const" in schema:
        return schema["const"]
    kind = schema.get("type")
    if kind == "object":
        return {k: skeleton(v) for k, v in schema.get("properties", {}).items()}
    if kind == "array":
        item = skeleton(schema.get("items", {}))
        return [item, "..."] if schema.get("maxItems", 2) > 1 else [item]
    if kind in ("integer", "number"):
        return schema.get("minimum", 0)
    if kind == "boolean":
        return True
    return "..."


def shape_hint(schema: Mapping[str, Any]) -> str:
    """The JSON shape of `schema` in one line, e.g. `{"items": [{"input": "..."}, "..."]}`; pure."""
    return json.dumps(skeleton(schema), ensure_ascii=False)


async def _send(
    config: JudgeConfig, messages: list[dict[str, Any]], fmt: dict[str, Any] | None
) -> JudgeAnswer:
    # The judge module's transport, with our own response_format (it only sends json_schema).
    from autorl import judge

    send = judge._send_openai if config.base_url else judge._send_litellm
    return await send(config, messages, judge._request_params(fmt, None))


async def _call(
    config: JudgeConfig, messages: list[dict[str, Any]], schema: Mapping[str, Any], name: str
) -> JudgeAnswer:
    """One answer, stepping down the response_format ladder when the endpoint answers 400 to a mode."""
    key = (config.model, config.endpoint)
    mode: Mode = _MODES.get(key, "json_schema" if config.structured_output else "none")
    while True:
        try:
            answer = await _send(config, messages, response_format(mode, schema, name))
        except Exception as exc:
            if mode == "none" or not is_transport_error(exc) or status_code(exc) != 400:
                raise
            lower = _LADDER[_LADDER.index(mode) + 1]
            logger.info(
                "%s at %s answered 400 to response_format %s (%s); using %s from now on",
                config.model,
                config.endpoint or "its provider",
                mode,
                str(exc).replace("\n", " ")[:200],
                lower,
            )
            mode = lower
            continue
        if config.structured_output:
            _MODES[key] = mode
        return answer


async def ask_structured(
    endpoint: Endpoint,
    messages: Sequence[Mapping[str, Any]],
    schema: Mapping[str, Any],
    *,
    validate: Callable[[Any], T] | None = None,
    max_attempts: int | None = None,
    name: str = "response",
) -> Any:
    """Ask `endpoint` until it answers JSON valid for `schema` (and `validate`), and return it.

    `validate(value)` may transform the value (its result is returned) and raises ValueError (or
    InvalidAnswerError) with a reason to ask again. `max_attempts` defaults to the endpoint's
    `JudgeConfig.max_attempts`. Raises StructuredOutputError naming every attempt's problem.
    """
    config = as_judge_config(endpoint)
    attempts_allowed = max_attempts if max_attempts is not None else config.max_attempts
    if attempts_allowed < 1:
        raise ValueError(f"max_attempts must be >= 1, got {attempts_allowed}")

    def accept(answer: JudgeAnswer, _: Attempts) -> Any:
        try:
            return parse_answer(answer.text, schema, validate)
        except InvalidAnswerError as exc:
            raise Rejected(cut_off_note(str(exc), answer, config)) from None

    def correction(reason: str) -> str:
        return (
            f"That answer is invalid: {reason}. Answer again with one JSON object of this shape, "
            f"and nothing else: {shape_hint(schema)}"
        )

    def fail(attempts: Attempts) -> StructuredOutputError:
        message = f"{config.model} gave no valid {name} in {attempts.calls} attempt(s): {attempts.summary()}"
        return StructuredOutputError(message, attempts.answers)

    value, _ = await ask_with_retries(
        config,
        [dict(m) for m in messages],
        lambda conversation: _call(config, conversation, schema, name),
        accept,
        correction=correction,
        fail=fail,
        max_attempts=attempts_allowed,
    )
    return value


def forget_modes() -> None:
    """Forget which response_format each endpoint accepted (tests)."""
    _MODES.clear()


__all__ = [
    "Endpoint",
    "InvalidAnswerError",
    "StructuredOutputError",
    "ask_structured",
    "extract_json",
    "forget_modes",
    "parse_answer",
    "schema_problems",
    "shape_hint",
    "skeleton",
]
