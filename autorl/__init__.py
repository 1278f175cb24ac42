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
    "AutoRLConfig": "autorl.pipeline",
    "AutoRLResult": "autorl.pipeline",
    "RunMismatchError": "autorl.pipeline",
    "train": "autorl.pipeline",
    "make_inputs": "autorl.pipeline",
    "InputItem": "autorl.inputs",
    "InputSet": "autorl.inputs",
    "InputFileError": "autorl.inputs",
    "TooFewInputsError": "autorl.inputs",
    "generate_inputs": "autorl.inputs",
    "generate_items": "autorl.inputs",
    "load_inputs": "autorl.inputs",
    "save_inputs": "autorl.inputs",
    "HeadToHead": "autorl.head_to_head",
    "head_to_head": "autorl.head_to_head",
    "LoopConfig": "autorl.loop",
    "train_loop": "autorl.loop",
    "StructuredOutputError": "autorl.structured",
    "ask_structured": "autorl.structured",
}

__all__ = [
    "AutoRLConfig",
    "AutoRLResult",
    "HeadToHead",
    "InputFileError",
    "InputItem",
    "InputSet",
    "LoopConfig",
    "RunMismatchError",
    "StructuredOutputError",
    "TooFewInputsError",
    "ask_structured",
    "generate_inputs",
    "generate_items",
    "head_to_head",
    "load_inputs",
    "make_inputs",
    "save_inputs",
    "train",
    "train_loop",
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
    from autorl.head_to_head import HeadToHead, head_to_head
    from autorl.inputs import (
        InputFileError,
        InputItem,
        InputSet,
        TooFewInputsError,
        generate_inputs,
        generate_items,
        load_inputs,
        save_inputs,
    )
    from autorl.judge import JudgeConfig, JudgeError, JudgeResponseError
    from autorl.judging import RulerConfig
    from autorl.loop import LoopConfig, train_loop
    from autorl.pipeline import AutoRLConfig, AutoRLResult, RunMismatchError, make_inputs, train
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
    from autorl.structured import StructuredOutputError, ask_structured


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'autorl' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
