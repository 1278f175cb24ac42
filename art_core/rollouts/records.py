"""The data that flows through the loop: token records, histories and trajectories.

A `Trajectory` is what one rollout produced: the chat messages (with tool calls and tool
results), the exact token records our server returned for every sampled turn, a reward and
free-form metrics. Trajectories cross process boundaries (the remote backend, the jsonl
logs), so they are pydantic models.

ART compatibility: `Trajectory(messages_and_choices=[*messages, choice], reward=r)` works,
where `choice` is an `openai` or LiteLLM `Choice` returned by our server; its token record is
taken from the extra fields our server adds to every choice (LiteLLM moves most of them into
`provider_specific_fields`; both places are read).
"""

from __future__ import annotations

import math
import time
import traceback as traceback_module
from collections.abc import Iterable, MutableSequence
from typing import Annotated, Any, overload

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic.json_schema import SkipJsonSchema

from art_core.rollouts.messages import Message, MessageList, Tool, as_message_list

MessagesField = Annotated[list[Message], AfterValidator(as_message_list)]
"""A list of message dicts, stored as a `MessageList`: `x.messages` is the list, `x.messages()` ART's call."""


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
    seconds: float | None = None
    """Wall-clock seconds the server took, from the request's arrival to its answer; recorded for
    captured rollouts (None where the turn came from a client's response)."""

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

    messages: MessagesField = Field(default_factory=MessageList)
    tools: list[Tool] | None = None
    turns: list[Turn] = Field(default_factory=list)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, as_message_list(value) if name == "messages" else value)


TOKEN_FIELDS = ("prompt_token_ids", "token_ids", "token_logprobs")
"""The token fields our server adds to every choice (with `served_model`)."""


def _token_fields(choice: Any, data: dict[str, Any]) -> dict[str, Any]:
    """The choice's token fields wherever the client put them: at its top level (openai keeps
    unknown fields there) or in `provider_specific_fields` (where LiteLLM moves most of them)."""
    top = data if isinstance(choice, dict) else {**data, **(choice.model_extra or {})}
    found: dict[str, Any] = {}
    for source in (top.get("provider_specific_fields") or {}, top):
        for key in (*TOKEN_FIELDS, "served_model"):
            if isinstance(source, dict) and source.get(key) is not None:
                found[key] = source[key]
    return found


def turn_from_choice(choice: Any) -> tuple[Message, Turn | None]:
    """Split an `openai` or LiteLLM Choice (or its dict) from our server into a message and a token record.

    Returns the assistant message as a dict (tool calls kept) and the `Turn` when the choice
    carries our server's token fields (at its top level or in LiteLLM's
    `provider_specific_fields`), None when it carries none of them (a choice from some other
    server). A choice with only some of them is a ValueError naming the missing ones.
    """
    data: dict[str, Any] = choice if isinstance(choice, dict) else choice.model_dump()
    message = {k: v for k, v in (data.get("message") or {}).items() if v is not None}
    message.setdefault("role", "assistant")
    message.setdefault("content", None)
    for key in ("refusal", "audio", "annotations", "function_call", "provider_specific_fields"):
        message.pop(key, None)
    if not message.get("tool_calls"):
        message.pop("tool_calls", None)
    fields = _token_fields(choice, data)
    missing = [key for key in TOKEN_FIELDS if key not in fields]
    if len(missing) == len(TOKEN_FIELDS):
        return message, None
    if missing:
        present = [key for key in TOKEN_FIELDS if key in fields]
        raise ValueError(
            f"choice has {', '.join(present)} but no {', '.join(missing)} (looked at its top level and "
            "its provider_specific_fields); the server must return all of "
            f"{', '.join(TOKEN_FIELDS)} to train on it"
        )
    turn = Turn(
        prompt_ids=list(fields["prompt_token_ids"]),
        completion_ids=list(fields["token_ids"]),
        logprobs=list(fields["token_logprobs"]),
        model=str(fields.get("served_model") or ""),
        finish_reason=str(data.get("finish_reason") or "stop"),
    )
    return message, turn


def untrained_choice_note(item: Any, turn: Turn | None, index: int) -> str | None:
    """Why the choice added as message `index` has no token record (None for messages and records)."""
    if turn is not None or (isinstance(item, dict) and "role" in item):
        return None
    if isinstance(item, BaseModel) and hasattr(item, "role") and not hasattr(item, "message"):
        return None
    return (
        f"the choice added as message {index} carries none of {', '.join(TOKEN_FIELDS)} (neither at its "
        "top level nor in provider_specific_fields), so it was not served by our server"
    )


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

    messages: MessagesField = Field(default_factory=MessageList)
    """The conversation in OpenAI format, including assistant tool calls and tool results.

    A list (preferred: `trajectory.messages`); calling it, `trajectory.messages()`, is ART's
    method and returns a copy."""
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
    """Wall-clock time (`time.time()`) the rollout started; by default when this object was made. A
    step's `time/rollout_s` counts from its earliest trajectory's, so a rollout that makes its
    Trajectory after its model calls should pass the time it started."""
    untrained_choices: SkipJsonSchema[list[str]] = Field(default_factory=list, exclude=True, repr=False)
    """Why each choice added without a token record has none (shown by NoTrainableTokensError);
    not serialised."""

    def __init__(self, messages_and_choices: Iterable[Any] | None = None, **data: Any) -> None:
        """Accepts ART's `messages_and_choices` (messages mixed with choices) beside the fields."""
        if messages_and_choices is not None:
            data["messages_and_choices"] = messages_and_choices
        super().__init__(**data)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, as_message_list(value) if name == "messages" else value)

    @model_validator(mode="before")
    @classmethod
    def _from_messages_and_choices(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "messages_and_choices" not in data:
            return data
        data = dict(data)
        items = data.pop("messages_and_choices")
        messages: list[Message] = list(data.get("messages", []))
        turns: list[Turn] = list(data.get("turns", []))
        notes: list[str] = list(data.get("untrained_choices", []))
        for item in items:
            message, turn = message_or_choice(item)
            note = untrained_choice_note(item, turn, len(messages))
            if note is not None:
                notes.append(note)
            messages.append(message)
            if turn is not None:
                turns.append(turn)
        data["messages"], data["turns"], data["untrained_choices"] = messages, turns, notes
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
        note = untrained_choice_note(choice, turn, len(self.messages))
        if note is not None:
            self.untrained_choices.append(note)
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
    code: str | None = None
    """The error's code where it has one (an OpenAI API error's `code`, e.g. "context_length_exceeded";
    a LiteLLM `ContextWindowExceededError` counts as that too)."""

    @classmethod
    def from_exception(cls, exc: BaseException) -> ExceptionInfo:
        return cls(
            type=type(exc).__name__,
            message=str(exc),
            traceback="".join(traceback_module.format_exception(exc)),
            code=_error_code(exc),
        )


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
"""The code of a request whose prompt did not fit the model's context (OpenAI's, and our server's)."""


def _error_code(exc: BaseException) -> str | None:
    code = getattr(exc, "code", None)
    if isinstance(code, str) and code:
        return code
    if type(exc).__name__ in ("ContextWindowExceededError", "ContextLengthError"):
        return CONTEXT_LENGTH_EXCEEDED
    return None


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
        note = untrained_choice_note(value, turn, min(index, len(self)))
        if note is not None:
            self._trajectory.untrained_choices.append(note)
        self._trajectory.messages.insert(index, message)
        if turn is not None:
            self._trajectory.turns.append(turn)

    def __eq__(self, other: object) -> bool:
        return list(self) == other

    def __repr__(self) -> str:
        return repr(self._trajectory.messages)
