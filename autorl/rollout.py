"""AutoRL's rollout: the model answers an input, optionally for several turns with a simulated user.

The trained model is called through its own `openai` client (so the server records the exact
tokens it sampled). With `user_turns > 0`, the generator plays the user: after each reply it
writes the user's next message (structured output `{"message": ...}`), for `user_turns` turns.
"""

from __future__ import annotations

import time
from typing import Any

from art_core import TrainableModel, Trajectory
from autorl.inputs import InputItem
from autorl.structured import Endpoint, ask_structured

USER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"message": {"type": "string", "minLength": 1, "maxLength": 400}},
    "required": ["message"],
    "additionalProperties": False,
}


def simulated_user_messages(task: str, conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The prompt of the simulated user: the task and the conversation so far, as a transcript; pure."""
    transcript = "\n\n".join(
        f"{m['role'].upper()}: {m.get('content') or ''}"
        for m in conversation
        if m["role"] in ("user", "assistant")
    )
    return [
        {
            "role": "system",
            "content": "You play the USER in a conversation with an AI assistant, to test it. "
            f"The assistant's task: {task.strip()}\nWrite the user's next message: a short, natural reply "
            "to the assistant's last message (a follow-up, a correction or a new detail), in the user's voice. "
            'Answer with JSON {"message": "..."} and nothing else.',
        },
        {
            "role": "user",
            "content": f"The conversation so far:\n\n{transcript}\n\nWrite the USER's next message.",
        },
    ]


async def simulated_user_reply(user: Endpoint, task: str, conversation: list[dict[str, Any]]) -> str:
    """The simulated user's next message (raises StructuredOutputError when it cannot write one)."""
    answer = await ask_structured(
        user, simulated_user_messages(task, conversation), USER_SCHEMA, name="user_message"
    )
    return str(answer["message"]).strip()


async def chat_rollout(
    model: TrainableModel,
    item: InputItem,
    *,
    system_prompt: str,
    task: str,
    max_tokens: int,
    temperature: float = 1.0,
    step: int | None = None,
    user_turns: int = 0,
    user: Endpoint | None = None,
) -> Trajectory:
    """One conversation: the input as first user turn, the model's reply, and `user_turns` more turns.

    `step` selects a checkpoint (`name@step`, e.g. 0 for the starting model); None is the latest.
    """
    if user_turns and user is None:
        raise ValueError("user_turns > 0 needs a `user` endpoint (the simulated user)")
    started = time.time()  # the trajectory's start: its step's `time/rollout_s` counts from the earliest
    client = model.openai_client()
    messages: list[Any] = [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": item.text},
    ]
    conversation: list[dict[str, Any]] = [dict(m) for m in messages]
    for turn in range(user_turns + 1):
        completion = await client.chat.completions.create(
            model=model.get_inference_name(step),
            messages=conversation,
            max_tokens=max_tokens,
            temperature=temperature,
        )
        choice = completion.choices[0]
        messages.append(choice)
        conversation.append({"role": "assistant", "content": choice.message.content or ""})
        if turn < user_turns:
            assert user is not None
            reply = await simulated_user_reply(user, task, conversation)
            messages.append({"role": "user", "content": reply})
            conversation.append({"role": "user", "content": reply})
    return Trajectory(
        messages_and_choices=messages,
        metadata={"input_id": item.id, "split": item.split, "model_step": -1 if step is None else step},
        start_time=started,
    )


__all__ = ["USER_SCHEMA", "chat_rollout", "simulated_user_messages", "simulated_user_reply"]
