"""autorl: from a task description to a trained agent; home of RULER, the relative LLM judge.

Importing this package is cheap and has no side effects; modules load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "DEFAULT_RUBRIC": "autorl.ruler",
    "TrajectoryScore": "autorl.ruler",
    "build_judge_messages": "autorl.ruler",
    "judge_response_schema": "autorl.ruler",
    "parse_scores": "autorl.ruler",
    "ruler": "autorl.ruler",
    "ruler_score_group": "autorl.ruler",
    "scored_groups": "autorl.ruler",
    "RulerConfig": "autorl.judging",
    "JudgeConfig": "autorl.judge",
    "JudgeError": "autorl.judge",
    "JudgeResponseError": "autorl.judge",
}

__all__ = [
    "DEFAULT_RUBRIC",
    "JudgeConfig",
    "JudgeError",
    "JudgeResponseError",
    "RulerConfig",
    "TrajectoryScore",
    "build_judge_messages",
    "judge_response_schema",
    "parse_scores",
    "ruler",
    "ruler_score_group",
    "scored_groups",
]

if TYPE_CHECKING:
    from autorl.judge import JudgeConfig, JudgeError, JudgeResponseError
    from autorl.judging import RulerConfig
    from autorl.ruler import (
        DEFAULT_RUBRIC,
        TrajectoryScore,
        build_judge_messages,
        judge_response_schema,
        parse_scores,
        ruler,
        ruler_score_group,
        scored_groups,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'autorl' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
