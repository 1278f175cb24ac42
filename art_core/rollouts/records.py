"""The data that flows through the loop: token records, histories and trajectories.

A `Trajectory` is what one rollout produced: the chat messages (with tool calls and tool
results), the exact token records our server returned for every sampled turn, a reward and
free-form metrics. Trajectories cross process boundaries (the remote backend, the jsonl
logs), so they are pydantic models.

ART compatibility: `Trajectory(messages_and_choices=[*messages, choice], reward=r)` works,
where `choice` is an `openai` `Choice` returned by our server; its token record is taken
from the extra fields our server adds to every choice.
"""

from __future__ import annotations

import math
import time
import traceback as traceback_module
from collections.abc import Iterable, MutableSequence
from typing import Any, overload

from pydantic import BaseModel, ConfigDict, Field, model_validator

Message = dict[str, Any]
"""An OpenAI chat message as a plain dict (`role`, `content`, optional `tool_calls`, ...)."""

Tool = dict[str, Any]
"""An OpenAI tool definition (`{"type": "function", "function": {...}}`)."""


class Turn(BaseModel):
    """The exact tokens of one sampled completion, as recorded by our server."""

    model_config = ConfigDict(frozen=True)

    prompt_ids: list[int]
    """Token ids of the rendered prompt the engine conditioned on."""
    completion_ids: list[int]
    """Token ids the engine sampled (including a final end-of-turn token when it stopped)."""
    logprobs: list[float]
    """Log-probability of each sampled id under the serving policy (temperature 1)."""
    model: str = ""
    """The served model name that produced it, e.g. `agent-001@3`."""
    finish_reason: str = "stop"
    """`stop`, `length` or `tool_calls`."""

    @model_validator(mode="after")
    def _aligned(self) -> Turn:
        if len(self.completion_ids) != len(self.logprobs):
            raise ValueError(
                f"Turn has {len(self.completion_ids)} completion ids but {len(self.logprobs)} logprobs; "
                "they must be aligned one to one"
            )
        return self


class History(BaseModel):
    """A conversation that does not continue the main one (another LLM node, a sub-agent)."""

    messages: list[Message] = Field(default_factory=list)
    tools: list[Tool] | None = None
    turns: list[Turn] = Field(default_factory=list)


def turn_from_choice(choice: Any) -> tuple[Message, Turn | None]:
    """Split an `openai` Choice (or its dict) from our server into a message and a token record.

    Returns the assistant message as a dict (tool calls kept) and the `Turn` when the choice
    carries our server's token fields, else None (a choice from some other server).
    """
    data: dict[str, Any] = choice if isinstance(choice, dict) else choice.model_dump()
    message = {k: v for k, v in (data.get("message") or {}).items() if v is not None}
    message.setdefault("role", "assistant")
    message.setdefault("content", None)
    for key in ("refusal", "audio", "annotations", "function_call"):
        message.pop(key, None)
    if not message.get("tool_calls"):
        message.pop("tool_calls", None)
    extra = data if isinstance(choice, dict) else {**data, **(choice.model_extra or {})}
    if "token_ids" not in extra or "prompt_token_ids" not in extra:
        return message, None
    if extra.get("token_logprobs") is None:
        raise ValueError(
            "choice has `token_ids` but no `token_logprobs`; the server must return both to train on it"
        )
    turn = Turn(
        prompt_ids=list(extra["prompt_token_ids"]),
        completion_ids=list(extra["token_ids"]),
        logprobs=list(extra["token_logprobs"]),
        model=str(extra.get("served_model") or ""),
        finish_reason=str(data.get("finish_reason") or "stop"),
    )
    return message, turn


def message_or_choice(item: Any) -> tuple[Message, Turn | None]:
    """A chat message (a dict, or a pydantic message object with a `role`) or a choice, as a
    message dict and the choice's token record (None for messages)."""
    if isinstance(item, dict) and "role" in item:
        return item, None
    if isinstance(item, BaseModel) and hasattr(item, "role") and not hasattr(item, "message"):
        return item.model_dump(exclude_none=True), None
    return turn_from_choice(item)


class Trajectory(BaseModel):
    """One rollout: messages, exact token records, reward and metrics."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    messages: list[Message] = Field(default_factory=list)
    """The conversation in OpenAI format, including assistant tool calls and tool results."""
    tools: list[Tool] | None = None
    """The tools the agent was offered (shown to judges, rendered into prompts)."""
    turns: list[Turn] = Field(default_factory=list)
    """Token records of every sampled assistant turn, in order. These are what we train on."""
    additional_histories: list[History] = Field(default_factory=list)
    """Other conversations of the same rollout; they share this trajectory's advantage."""
    reward: float | None = None
    """The scalar reward. Must be set (and finite) before training."""
    metrics: dict[str, float | int | bool] = Field(default_factory=dict)
    metadata: dict[str, str | int | float | bool | None] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)
    start_time: float = Field(default_factory=time.time)

    def __init__(self, messages_and_choices: Iterable[Any] | None = None, **data: Any) -> None:
        """Accepts ART's `messages_and_choices` (messages mixed with choices) beside the fields."""
        if messages_and_choices is not None:
            data["messages_and_choices"] = messages_and_choices
        super().__init__(**data)

    @model_validator(mode="before")
    @classmethod
    def _from_messages_and_choices(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "messages_and_choices" not in data:
            return data
        data = dict(data)
        items = data.pop("messages_and_choices")
        messages: list[Message] = list(data.get("messages", []))
        turns: list[Turn] = list(data.get("turns", []))
        for item in items:
            message, turn = message_or_choice(item)
            messages.append(message)
            if turn is not None:
                turns.append(turn)
        data["messages"], data["turns"] = messages, turns
        return data

    @property
    def messages_and_choices(self) -> MessagesAndChoices:
        """ART's name for the conversation: a live view of `messages`.

        Appending a `Choice` to it (ART's `traj.messages_and_choices.append(choice)`) stores the
        message and records its token turn, exactly like `add_choice`.
        """
        return MessagesAndChoices(self)

    def add_choice(self, choice: Any) -> Message:
        """Append a message, or an assistant choice from our server (message and token record)."""
        message, turn = message_or_choice(choice)
        self.messages.append(message)
        if turn is not None:
            self.turns.append(turn)
        return message

    def log(self, message: str) -> None:
        self.logs.append(message)

    def finish(self) -> Trajectory:
        """Record the rollout's duration in `metrics["duration"]`."""
        self.metrics["duration"] = time.time() - self.start_time
        return self

    def checked_reward(self) -> float:
        """The reward, or a clear error if it is missing or not finite."""
        if self.reward is None:
            raise ValueError("trajectory has no reward: set `trajectory.reward` before training")
        if not math.isfinite(self.reward):
            raise ValueError(f"trajectory reward must be finite, got {self.reward!r}")
        return float(self.reward)


class ExceptionInfo(BaseModel):
    """A rollout's exception, kept with its traceback."""

    type: str
    message: str
    traceback: str

    @classmethod
    def from_exception(cls, exc: BaseException) -> ExceptionInfo:
        return cls(
            type=type(exc).__name__,
            message=str(exc),
            traceback="".join(traceback_module.format_exception(exc)),
        )


class MessagesAndChoices(MutableSequence[Any]):
    """A live view of `Trajectory.messages` that accepts ART's mix of messages and choices.

    Reading gives the message dicts. Adding a choice records its token turn as well; since turns
    are kept in order, a choice may only be added at the end.
    """

    def __init__(self, trajectory: Trajectory) -> None:
        self._trajectory = trajectory

    @overload
    def __getitem__(self, index: int) -> Message: ...
    @overload
    def __getitem__(self, index: slice) -> list[Message]: ...
    def __getitem__(self, index: int | slice) -> Message | list[Message]:
        return self._trajectory.messages[index]

    def __setitem__(self, index: Any, value: Any) -> None:
        if not isinstance(value, dict):
            raise TypeError("only message dicts can replace messages; append choices at the end instead")
        self._trajectory.messages[index] = value

    def __delitem__(self, index: int | slice) -> None:
        del self._trajectory.messages[index]

    def __len__(self) -> int:
        return len(self._trajectory.messages)

    def insert(self, index: int, value: Any) -> None:
        message, turn = message_or_choice(value)
        if turn is not None and index < len(self):
            raise ValueError(
                "a choice with a token record can only be appended at the end of the conversation"
            )
        self._trajectory.messages.insert(index, message)
        if turn is not None:
            self._trajectory.turns.append(turn)

    def __eq__(self, other: object) -> bool:
        return list(self) == other

    def __repr__(self) -> str:
        return repr(self._trajectory.messages)
