"""Capture of LLM calls into rollouts: the active rollout id, the server's recorder, the trajectory.

One mechanism, several doors. A rollout scope (`integrations.scope`) sets the *active rollout*
(a contextvar). Every request that reaches our server under a rollout id - given by the
`X-Rollout-Id` header, or by the rollout-scoped base URL `<server>/rollouts/<id>/v1`, which wins
over a header - is recorded server-side with the exact prompt ids, sampled ids and logprobs of
every choice. When the scope exits it fetches (and so frees) the records over HTTP and turns them
into a `Trajectory` with `trajectory_from_records`, a pure function.

This package holds the parts `art_core` needs without importing `integrations`:
- `context`: the active rollout (one contextvar; the scope object hangs off it) and the one request
  hook every door installs, which tags only requests to the rollout's own server;
- `CallRecord` / `RolloutRecords` (pydantic: they cross HTTP) and `RolloutRecorder`, the bounded
  in-memory store behind the server's `/rollouts/...` routes;
- `trajectory_from_records`: the main history is the longest conversation (ties: the latest call);
  its turns are those of the calls whose conversation (request messages + the reply) is a prefix of
  it, in order; the other calls form `additional_histories`, grouped the same way. With `n > 1`
  every choice is recorded; the choice the caller continued with (the one equal to the next
  message) is used, and choice 0 for the final call of a history.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field

from art_core.capture.context import (
    ROLLOUT_ID_HEADER,
    ActiveRollout,
    InvalidRolloutIdError,
    active_rollout,
    add_rollout_header,
    add_rollout_header_async,
    install_hook,
    request_hook,
    reset_active_rollout,
    rollout_base_url,
    rollout_headers,
    server_root,
    set_active_rollout,
    tag_request,
    validate_rollout_id,
)
from art_core.capture.tool_log import TOOL_LOG_PREFIX, tool_calls_from_logs
from art_core.rollouts.records import History, Message, Tool, Trajectory, Turn, turn_from_choice

logger = logging.getLogger(__name__)

# -- records (cross HTTP) -----------------------------------------------------------------------


class RecordedChoice(BaseModel):
    """One choice of a recorded call: the assistant message returned and its exact tokens."""

    message: Message
    turn: Turn


class CallRecord(BaseModel):
    """One chat completion our server answered under a rollout id."""

    seq: int
    """Arrival order on the server (increasing across all rollouts)."""
    model: str
    """The model name the request asked for."""
    messages: list[Message]
    """The request messages as sent (fields the client left out stay out)."""
    tools: list[Tool] | None = None
    """The tools offered in the request."""
    choices: list[RecordedChoice]
    """Every returned choice, in index order."""
    created: float = Field(default_factory=time.time)
    """When the response was sent (Unix seconds)."""


class RolloutRecords(BaseModel):
    """The body of `GET /rollouts/{id}/records` and `DELETE /rollouts/{id}`."""

    rollout_id: str
    records: list[CallRecord] = Field(default_factory=list)


def call_record(
    seq: int, model: str, messages: list[Message], tools: list[Tool] | None, response: dict[str, Any]
) -> CallRecord:
    """A CallRecord from a request and the ChatCompletion body our server answered it with."""
    choices = []
    for choice in response["choices"]:
        message, turn = turn_from_choice(choice)
        if turn is None:
            raise ValueError("a choice from our server must carry its token fields")
        choices.append(RecordedChoice(message=message, turn=turn))
    return CallRecord(seq=seq, model=model, messages=messages, tools=tools, choices=choices)


# -- the recorder (server side) -----------------------------------------------------------------


@dataclass(frozen=True)
class RecorderConfig:
    """Bounds on what the server keeps for rollouts whose records were not fetched yet."""

    max_rollouts: int = 4096
    """Rollouts held at once; beyond it the least recently used one is dropped (with a warning)."""
    max_records_per_rollout: int = 1024
    """Calls kept per rollout; later ones are dropped (with a warning) until the records are fetched."""
    ttl_s: float = 3600.0
    """A rollout untouched this long is considered abandoned and dropped (with a warning)."""

    def __post_init__(self) -> None:
        if self.max_rollouts < 1 or self.max_records_per_rollout < 1:
            raise ValueError("max_rollouts and max_records_per_rollout must be >= 1")
        if not self.ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 seconds, got {self.ttl_s}")


@dataclass
class _Entry:
    records: list[CallRecord]
    touched: float
    dropped: int = 0


class RolloutRecorder:
    """Records of chat completions per rollout id, until a client fetches them. Thread-safe.

    Memory stays bounded: `pop` frees a rollout's records, abandoned rollouts expire after
    `ttl_s`, and the number of rollouts and of records per rollout are capped.
    """

    def __init__(self, config: RecorderConfig | None = None) -> None:
        self.config = config or RecorderConfig()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._seq = itertools.count()

    def next_seq(self) -> int:
        """An arrival number: take it when a request arrives, so records sort in request order."""
        return next(self._seq)

    def record(self, rollout_id: str, record: CallRecord) -> None:
        validate_rollout_id(rollout_id)
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            entry = self._entries.get(rollout_id)
            if entry is None:
                entry = self._entries[rollout_id] = _Entry([], now)
                self._evict_over_capacity()
            entry.touched = now
            self._entries.move_to_end(rollout_id)
            if len(entry.records) >= self.config.max_records_per_rollout:
                entry.dropped += 1
                if entry.dropped == 1:
                    logger.warning(
                        "rollout %s has %d unfetched records (max_records_per_rollout); dropping later ones",
                        rollout_id,
                        len(entry.records),
                    )
                return
            entry.records.append(record)

    def peek(self, rollout_id: str) -> list[CallRecord]:
        """The rollout's records in request order, kept."""
        with self._lock:
            entry = self._entries.get(rollout_id)
            return sorted(entry.records, key=lambda r: r.seq) if entry else []

    def pop(self, rollout_id: str) -> list[CallRecord]:
        """The rollout's records in request order, forgotten here (an unknown id gives [])."""
        with self._lock:
            entry = self._entries.pop(rollout_id, None)
        return sorted(entry.records, key=lambda r: r.seq) if entry else []

    def stats(self) -> dict[str, int]:
        """`rollouts` held and `records` held in total."""
        with self._lock:
            return {
                "rollouts": len(self._entries),
                "records": sum(len(e.records) for e in self._entries.values()),
            }

    def _expire(self, now: float) -> None:
        while self._entries:
            rollout_id, entry = next(iter(self._entries.items()))
            if now - entry.touched < self.config.ttl_s:
                return
            del self._entries[rollout_id]
            logger.warning(
                "dropped %d records of rollout %s, unfetched for %.0f s (abandoned?)",
                len(entry.records),
                rollout_id,
                now - entry.touched,
            )

    def _evict_over_capacity(self) -> None:
        while len(self._entries) > self.config.max_rollouts:
            rollout_id, entry = self._entries.popitem(last=False)
            logger.warning(
                "dropped %d unfetched records of rollout %s: more than max_rollouts=%d rollouts are open",
                len(entry.records),
                rollout_id,
                self.config.max_rollouts,
            )


# -- records -> trajectory (pure) ---------------------------------------------------------------


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = [p.get("text", "") if isinstance(p, dict) and p.get("type") == "text" else p for p in content]
    return "".join(p if isinstance(p, str) else json.dumps(p, sort_keys=True) for p in parts)


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def message_key(message: Message) -> str:
    """A canonical form of a chat message for comparing conversations.

    Only what a chat template renders counts: role, text content, tool calls (id, name, parsed
    arguments), tool_call_id and name; so an assistant message echoed back by a client, with
    None fields dropped or extra fields added, equals the one our server returned.
    """
    calls = [
        {
            "id": call.get("id"),
            "name": (call.get("function") or {}).get("name"),
            "arguments": _arguments((call.get("function") or {}).get("arguments")),
        }
        for call in message.get("tool_calls") or ()
    ]
    key = {
        "role": message.get("role"),
        "content": _text(message.get("content")),
        "tool_calls": calls,
        "tool_call_id": message.get("tool_call_id"),
        "name": message.get("name"),
    }
    return json.dumps(key, sort_keys=True, default=str)


def _history(
    head: CallRecord, calls: Sequence[CallRecord], keys_of: dict[int, list[str]]
) -> tuple[History, list[CallRecord]]:
    """The history ending in `head`'s first choice, and the calls (among `calls`) that built it."""
    conversation = [*head.messages, head.choices[0].message]
    keys = [*keys_of[id(head)], message_key(head.choices[0].message)]
    turns: list[Turn] = []
    used: list[CallRecord] = []
    length = 0
    for call in calls:
        n = len(call.messages) + 1
        if call is head:
            turns.append(head.choices[0].turn)
            used.append(head)
            break
        if not length < n < len(keys) or keys_of[id(call)] != keys[: n - 1]:
            continue
        picked = next((c for c in call.choices if message_key(c.message) == keys[n - 1]), None)
        if picked is not None:
            turns.append(picked.turn)
            used.append(call)
            length = n
    return History(messages=conversation, tools=head.tools, turns=turns), used


def histories_from_records(records: Sequence[CallRecord]) -> list[History]:
    """Split a rollout's calls into histories: the main one first, then the others in arrival order.

    The main history ends in the call with the most request messages (ties: the latest); see the
    module docstring. Each other history is built the same way from the calls left over.
    """
    remaining = sorted(records, key=lambda r: r.seq)
    keys_of = {id(r): [message_key(m) for m in r.messages] for r in remaining}
    found: list[tuple[int, History]] = []
    while remaining:
        head = max(remaining, key=lambda r: (len(r.messages), r.seq))
        history, used = _history(head, remaining, keys_of)
        found.append((used[0].seq, history))
        remaining = [r for r in remaining if all(r is not u for u in used)]
    main, *others = found
    return [main[1], *(history for _, history in sorted(others, key=lambda item: item[0]))]


def trajectory_from_records(records: Sequence[CallRecord], **fields: Any) -> Trajectory:
    """The Trajectory a rollout's records make; `fields` (reward, metadata, ...) are passed on.

    Raises ValueError when `records` is empty: an empty trajectory is never what the caller wants.
    """
    if not records:
        raise ValueError("no records: nothing was captured for this rollout")
    main, *others = histories_from_records(records)
    return Trajectory(
        messages=main.messages, tools=main.tools, turns=main.turns, additional_histories=others, **fields
    )


__all__ = [
    "ROLLOUT_ID_HEADER",
    "TOOL_LOG_PREFIX",
    "ActiveRollout",
    "CallRecord",
    "InvalidRolloutIdError",
    "RecordedChoice",
    "RecorderConfig",
    "RolloutRecorder",
    "RolloutRecords",
    "active_rollout",
    "add_rollout_header",
    "add_rollout_header_async",
    "call_record",
    "histories_from_records",
    "install_hook",
    "message_key",
    "request_hook",
    "reset_active_rollout",
    "rollout_base_url",
    "rollout_headers",
    "server_root",
    "set_active_rollout",
    "tag_request",
    "tool_calls_from_logs",
    "trajectory_from_records",
    "validate_rollout_id",
]
