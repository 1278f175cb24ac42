"""Why a completion ended: `FinishReason`, a `StrEnum` whose values are OpenAI's strings.

Engines set `STOP`, `LENGTH` or `ABORT` on every `Completion`; the server adds `TOOL_CALLS` when it
parsed tool calls out of the text. Being a `str`, a member compares equal to its value ("stop") and
is written as that value in JSON, so the OpenAI wire format and `Turn.finish_reason` (a plain string
in the rollouts layer) are unchanged; what the enum adds is that a typo fails at import, not on a
client. Torch-free. The engine layers are described in docs/architecture.md.
"""

from __future__ import annotations

from enum import StrEnum


class FinishReason(StrEnum):
    """Why a completion ended."""

    STOP = "stop"
    """An eos or stop token id was sampled, or the text reached a stop string."""
    LENGTH = "length"
    """`max_tokens` or the context window ran out."""
    ABORT = "abort"
    """Its request was cancelled while decoding (a closed stream); nobody receives it."""
    TOOL_CALLS = "tool_calls"
    """The server parsed tool calls out of the text (set by the server, never by an engine)."""


__all__ = ["FinishReason"]
