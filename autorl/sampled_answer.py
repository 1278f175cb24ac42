"""The sampled-JSON judge's answer: its JSON schema (exact ids) and its validation.

Pure functions; `autorl.ruler` re-exports them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from autorl.judge import JudgeResponseError
from autorl.judging import TrajectoryScore


def _score_item(trajectory_id: dict[str, Any], explanation_max_chars: int | None) -> dict[str, Any]:
    explanation: dict[str, Any] = {
        "type": "string",
        "description": "One or two sentences on the trajectory's quality.",
    }
    if explanation_max_chars is not None:
        explanation["maxLength"] = explanation_max_chars
    return {
        "type": "object",
        "properties": {
            "trajectory_id": trajectory_id,
            "explanation": explanation,
            "score": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.01},
        },
        "required": ["trajectory_id", "explanation", "score"],
        "additionalProperties": False,
    }


def _scores_object(scores: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"scores": scores},
        "required": ["scores"],
        "additionalProperties": False,
    }


def judge_response_schema(ids: Sequence[str], explanation_max_chars: int | None = None) -> dict[str, Any]:
    """The JSON schema of a judge answer scoring exactly the trajectories `ids`, in ART's shape.

    Position k of `scores` must carry `trajectory_id` ids[k] (`prefixItems` with a `const` each,
    `items: false`, exactly len(ids) items), so a server with constrained decoding (ours,
    llguidance) cannot answer a duplicate, unknown or missing id. Scores have two decimals at
    most (`multipleOf` 0.01), so a small judge cannot run on writing digits until max_tokens. OpenAI's strict mode rejects
    `prefixItems`; such a judge is sent `judge_response_fallback_schema` instead.
    """
    positions = [_score_item({"type": "string", "const": i}, explanation_max_chars) for i in ids]
    scores = {
        "type": "array",
        "prefixItems": positions,
        "items": False,
        "minItems": len(ids),
        "maxItems": len(ids),
    }
    return _scores_object(scores)


def judge_response_fallback_schema(
    ids: Sequence[str], explanation_max_chars: int | None = None
) -> dict[str, Any]:
    """The same answer with each id from an `enum` (what OpenAI's strict mode takes): the count
    is exact, but duplicates are possible and `parse_scores` catches them."""
    item = _score_item({"type": "string", "enum": list(ids)}, explanation_max_chars)
    return _scores_object({"type": "array", "items": item, "minItems": len(ids), "maxItems": len(ids)})


# -- answer -------------------------------------------------------------------------------------


def _json_objects(text: str) -> list[Any]:
    """The whole text as JSON, else every top-level JSON object found in it (fences, prose around)."""
    try:
        return [json.loads(text)]
    except ValueError:
        pass
    decoder, found, pos = json.JSONDecoder(), [], text.find("{")
    while pos != -1:
        try:
            value, end = decoder.raw_decode(text, pos)
        except ValueError:
            pos = text.find("{", pos + 1)
            continue
        found.append(value)
        pos = text.find("{", end)
    return found


def _answer_object(text: str) -> dict[str, Any]:
    objects = [o for o in _json_objects(text) if isinstance(o, dict)]
    with_scores = [o for o in objects if "scores" in o]
    if len(with_scores) > 1:
        raise ValueError(f"the answer holds {len(with_scores)} JSON objects with 'scores'; expected one")
    if with_scores:
        return with_scores[0]
    if not objects:
        snippet = text.strip().replace("\n", " ")
        snippet = snippet[:120] + ("..." if len(snippet) > 120 else "")
        raise ValueError(f"invalid JSON: no JSON object found in the answer {snippet!r}")
    raise ValueError(f'missing "scores": the JSON object has keys {sorted(objects[0])}')


def _check_entry(k: int, entry: Any, ids: Sequence[str]) -> tuple[str | None, list[str]]:
    """The entry's valid id (or None) and what is wrong with it."""
    if not isinstance(entry, dict):
        return None, [f"scores[{k}] is a {type(entry).__name__}, not an object"]
    problems, tid = [], entry.get("trajectory_id")
    if isinstance(tid, int) and not isinstance(tid, bool):
        tid = str(tid)
    if not isinstance(tid, str):
        problems.append(f"scores[{k}] has no string trajectory_id")
        tid = None
    elif tid not in ids:
        problems.append(f"scores[{k}] has unknown trajectory_id {tid!r} (expected one of {list(ids)})")
        tid = None
    if not isinstance(entry.get("explanation"), str):
        problems.append(f"scores[{k}] is missing its explanation (a string)")
    score = entry.get("score")
    if isinstance(score, bool) or not isinstance(score, int | float):
        problems.append(f"scores[{k}] has a non-numeric score {score!r}")
    elif math.isnan(score):
        problems.append(f"scores[{k}] has score NaN")
    elif not 0.0 <= score <= 1.0:
        problems.append(f"scores[{k}] has score {score} outside [0, 1]")
    return tid, problems


def parse_scores(text: str, ids: Sequence[str]) -> list[TrajectoryScore]:
    """Validate a judge answer and return one score per id, in the order of `ids`; pure.

    Accepts the JSON object alone, in a ```json fence, or with prose around it. Raises
    JudgeResponseError naming every problem: invalid JSON, missing "scores", wrong count, unknown,
    duplicate or missing ids, missing explanation, non-numeric, NaN or out-of-range scores.
    """
    try:
        raw = _answer_object(text).get("scores")
    except ValueError as exc:
        raise JudgeResponseError(str(exc), [text]) from None
    if not isinstance(raw, list):
        raise JudgeResponseError(f'"scores" must be a list, got {type(raw).__name__}', [text])
    problems = []
    if len(raw) != len(ids):
        problems.append(f"expected {len(ids)} scores (one per trajectory id), got {len(raw)}")
    named: dict[str, int] = {}
    for k, entry in enumerate(raw):
        tid, entry_problems = _check_entry(k, entry, ids)
        problems += entry_problems
        if tid is not None and tid in named:
            problems.append(f"scores[{k}] has duplicate trajectory_id {tid!r} (also scores[{named[tid]}])")
        elif tid is not None:
            named[tid] = k
    missing = [i for i in ids if i not in named]
    if missing:
        problems.append(f"missing scores for trajectory ids {missing}")
    if problems:
        raise JudgeResponseError("; ".join(problems), [text])
    return [
        TrajectoryScore(
            trajectory_id=i, score=float(raw[named[i]]["score"]), explanation=raw[named[i]]["explanation"]
        )
        for i in ids
    ]


__all__ = ["judge_response_fallback_schema", "judge_response_schema", "parse_scores"]
