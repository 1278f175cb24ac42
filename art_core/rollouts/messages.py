"""Message-list types under ART's names, and the list that `Trajectory.messages` holds.

`Messages` and `Tools` are ART's aliases for a conversation and a tool list (plain OpenAI dicts).
`MessageList` is a `list` of message dicts that can also be called: `trajectory.messages` is our
attribute (preferred), `trajectory.messages()` is ART's method, and both give the same messages.
"""

from __future__ import annotations

import copy
from typing import Any

Message = dict[str, Any]
"""An OpenAI chat message as a plain dict (`role`, `content`, optional `tool_calls`, ...)."""

Tool = dict[str, Any]
"""An OpenAI tool definition (`{"type": "function", "function": {...}}`)."""

Messages = list[Message]
"""ART's `art.Messages`: a conversation as a list of OpenAI message dicts."""

Tools = list[Tool]
"""ART's `art.Tools`: the tools offered to the model, as OpenAI tool definitions."""


class MessageList(list[Message]):
    """The messages of a trajectory: a plain list that can also be called, as ART's `messages()`.

    Calling it returns a new list of copies, so a caller may edit what it got (e.g. append the
    next user turn before calling a judge) without touching the trajectory. Choices appended
    through `messages_and_choices` are already stored as assistant dicts with their `tool_calls`,
    which is what ART's `messages()` builds from them.
    """

    def __call__(self) -> Messages:
        return [copy.copy(message) for message in self]

    def __copy__(self) -> MessageList:
        return MessageList(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> MessageList:
        return MessageList(copy.deepcopy(list(self), memo))

    def __reduce__(self) -> tuple[Any, ...]:
        return (MessageList, (list(self),))


def as_message_list(value: Any) -> Any:
    """`value` as a `MessageList` when it is a list (pydantic validator and `__setattr__` hook)."""
    if isinstance(value, list) and not isinstance(value, MessageList):
        return MessageList(value)
    return value
