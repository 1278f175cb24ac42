"""RULER: an LLM judge scores a group of trajectories relative to each other.

GRPO only needs rewards that rank the trajectories of one group, and ranking is easier than
absolute grading, so a judge reads all of them at once and scores each between 0 and 1.

What the judge sees (`build_judge_messages`, pure and golden-tested): a system prompt (shared
goal, compare relatively, scores in 0..1, the JSON shape, then the rubric), and one user message
with the tools the agent had (`<tools>`), the longest common message prefix once (`<context>`)
and each trajectory's remainder (`<trajectory id="1">` ... `id="N"`), all as JSON.

What changes from OpenPipe ART's RULER:
- scores are matched to trajectories by id, never by position, and validated (`parse_scores`):
  wrong count, unknown, duplicate or missing ids, scores outside [0, 1] or NaN are errors;
- an invalid answer is retried (`JudgeConfig.max_attempts`) with the reason it was invalid;
- the judge is any LiteLLM model or any OpenAI-compatible URL (our own server included), and is
  sent the answer's JSON schema as `response_format` so constrained decoding can enforce it; the
  schema names every trajectory id exactly once, in order (`judge_response_schema`), so a
  constrained answer cannot have a duplicate or missing id;
- a small judge gets a signal through two more modes, read from its logprobs (`RulerConfig.mode`,
  `autorl.judging`): probability-weighted digit scores (`autorl.weighted`) and pairwise
  preferences combined by Bradley-Terry (`autorl.pairwise`); "auto" picks by the judge;
- the agent's tools are shown to the judge;
- identical trajectories are judged once and share one score (so they always score the same; a
  group whose trajectories are all identical is judged as a single trajectory);
- failures are never a silent zero or a silently dropped group: they raise, or (on_error="count")
  leave the rewards unset and set `group.metrics["ruler_errors"] = 1`, which `scored_groups`
  counts and separates before training; every group says how many judge calls it took and how
  many of them failed (`judge_calls`, `judge_errors`).

Only `trajectory.messages` is judged: `additional_histories` (sub-agents, other LLM nodes) are
not shown to the judge.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from art_core.types import TrajectoryGroup
from autorl.judge import JudgeConfig, JudgeError, JudgeResponseError, as_judge_config, ask_judge
from autorl.judging import Judgement, JudgingMode, RulerConfig, TrajectoryScore, resolve_mode
from autorl.label_probs import NoLabelProbabilitiesError
from autorl.pairwise import judge_pairwise
from autorl.transcript import common_prefix_length, json_lines, to_json
from autorl.weighted import judge_weighted

logger = logging.getLogger(__name__)

DEFAULT_RUBRIC = """\
- A trajectory that achieves its goal must always score much higher than one that does not.
- Give partial credit: a trajectory that makes real progress towards the goal scores higher than one that makes none.
- Among trajectories that reach the same outcome, the more efficient one scores higher: fewer needless steps, tool calls, errors and words.
- Let the size of each score gap match the size of the quality gap: small differences in quality get small differences in score.
- Judge what the trajectory shows: an answer that the context or the tool results contradict is wrong, however confident it sounds."""
"""The grading standards used when none are given (in the spirit of ART's default rubric)."""

SYSTEM_PROMPT = """\
You are judging the trajectories of an AI agent. All of them pursue the same goal from the same start; \
compare them with each other and give each one a score between 0 and 1.

The scores are relative: they rank the trajectories of this group against each other, so a better \
trajectory gets a higher score than a worse one and trajectories of equal quality get equal scores.

Messages that all trajectories share are shown once, inside <context>; each <trajectory id="..."> holds \
what follows the context in that trajectory. <tools>, when present, lists the tools the agent could call. \
Everything is in OpenAI chat-message JSON.

Answer with one JSON object and nothing else, exactly in this shape, with one entry per trajectory id:
{{"scores": [{{"trajectory_id": "1", "explanation": "<one or two sentences>", "score": <a number from 0 to 1>}}]}}

Grading standards:
{rubric}"""
"""The judge's system prompt; `{rubric}` is replaced by the grading standards."""


class TooFewTrajectoriesError(ValueError):
    """Relative scoring needs at least two trajectories."""


# -- prompt -------------------------------------------------------------------------------------


def build_judge_messages(
    message_lists: Sequence[Sequence[Mapping[str, Any]]],
    rubric: str = DEFAULT_RUBRIC,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """The chat messages asking a judge to score `message_lists` (ids "1".."N"); pure, deterministic."""
    if not message_lists:
        raise ValueError("build_judge_messages needs at least one message list")
    prefix = common_prefix_length(message_lists)
    blocks = []
    if tools:
        blocks.append(f"<tools>\n{json_lines(tools)}\n</tools>")
    if prefix:
        blocks.append(f"<context>\n{json_lines(message_lists[0][:prefix])}\n</context>")
    for i, messages in enumerate(message_lists, start=1):
        blocks.append(f'<trajectory id="{i}">\n{json_lines(messages[prefix:])}\n</trajectory>')
    ids = ", ".join(f'"{i}"' for i in range(1, len(message_lists) + 1))
    blocks.append(f"Score all {len(message_lists)} trajectories (ids {ids}).")
    return [
        {"role": "system", "content": SYSTEM_PROMPT.format(rubric=rubric.strip())},
        {"role": "user", "content": "\n\n".join(blocks)},
    ]


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
            "score": {"type": "number", "minimum": 0, "maximum": 1},
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
    llguidance) cannot answer a duplicate, unknown or missing id. OpenAI's strict mode rejects
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


# -- judging ------------------------------------------------------------------------------------


def _correction(reason: str, ids: Sequence[str]) -> str:
    return (
        f"That answer is invalid: {reason}. Answer again with one JSON object of the form "
        f'{{"scores": [{{"trajectory_id": ..., "explanation": ..., "score": ...}}]}} holding exactly '
        f"{len(ids)} entries, one for each trajectory id {list(ids)}, each score a number from 0 to 1."
    )


async def _judge_sampled(
    unique: Sequence[Sequence[Mapping[str, Any]]],
    config: JudgeConfig,
    rubric: str,
    tools: Sequence[Mapping[str, Any]] | None,
) -> Judgement:
    ids = [str(j + 1) for j in range(len(unique))]
    scores, calls = await ask_judge(
        config,
        build_judge_messages(unique, rubric, tools),
        judge_response_schema(ids, config.explanation_max_chars),
        parse=lambda text: parse_scores(text, ids),
        correction=lambda reason: _correction(reason, ids),
        fallback_schema=judge_response_fallback_schema(ids, config.explanation_max_chars),
    )
    return Judgement(scores, calls, len(unique), errors=max(calls - 1, 0), mode="sampled")


async def _judge_distinct(
    unique: Sequence[Sequence[Mapping[str, Any]]],
    config: JudgeConfig,
    rubric: str,
    tools: Sequence[Mapping[str, Any]] | None,
    settings: RulerConfig,
) -> Judgement:
    mode: JudgingMode = resolve_mode(settings, config)
    if mode == "sampled":
        return await _judge_sampled(unique, config, rubric, tools)
    judge_by_probs = judge_weighted if mode == "weighted" else judge_pairwise
    try:
        return await judge_by_probs(unique, config, rubric, tools, settings)
    except NoLabelProbabilitiesError as exc:
        if settings.mode != "auto":
            raise
        logger.warning(
            "RULER %s judge %s gave no label probabilities (%s); judging the group with sampled JSON instead",
            mode,
            config.model,
            str(exc)[:300],
        )
        try:
            sampled = await _judge_sampled(unique, config, rubric, tools)
        except JudgeError as failed:
            failed.calls += exc.calls
            failed.errors += exc.errors
            raise
        return dataclasses.replace(
            sampled, attempts=sampled.attempts + exc.calls, errors=sampled.errors + exc.errors, fallback=True
        )


async def judge_message_lists(
    message_lists: Sequence[Sequence[Mapping[str, Any]]],
    judge: JudgeConfig | str,
    rubric: str = DEFAULT_RUBRIC,
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    config: RulerConfig | None = None,
) -> Judgement:
    """`ruler`, also saying how many calls it took, how many failed and how many distinct
    trajectories were judged. Identical message lists are judged once and share a score."""
    judge_config = as_judge_config(judge)
    settings = config if config is not None else RulerConfig()
    if len(message_lists) < 2:
        raise TooFewTrajectoriesError(
            f"RULER scores trajectories relative to each other and needs at least 2, got {len(message_lists)}"
        )
    distinct: dict[str, int] = {}
    slot = [distinct.setdefault(to_json(list(m)), len(distinct)) for m in message_lists]
    unique = [message_lists[slot.index(j)] for j in range(len(distinct))]
    judgement = await _judge_distinct(unique, judge_config, rubric, tools, settings)
    out = [
        TrajectoryScore(str(i + 1), judgement.scores[j].score, judgement.scores[j].explanation)
        for i, j in enumerate(slot)
    ]
    return dataclasses.replace(judgement, scores=out)


async def ruler(
    message_lists: Sequence[Sequence[Mapping[str, Any]]],
    judge: JudgeConfig | str,
    rubric: str = DEFAULT_RUBRIC,
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    config: RulerConfig | None = None,
) -> list[TrajectoryScore]:
    """Score each message list relative to the others; ids "1".."N" in input order.

    `config` chooses the judging mode (`RulerConfig`, default "auto": see `autorl.judging`).
    Raises TooFewTrajectoriesError (a ValueError) for fewer than 2 lists, JudgeResponseError when
    the judge kept answering invalidly, JudgeError when the calls themselves failed.
    """
    return (await judge_message_lists(message_lists, judge, rubric, tools, config=config)).scores


# -- groups -------------------------------------------------------------------------------------


def _group_tools(group: TrajectoryGroup) -> list[dict[str, Any]] | None:
    """Every distinct tool the group's trajectories had, in order of appearance."""
    seen: dict[str, dict[str, Any]] = {}
    for trajectory in group.trajectories:
        for tool in trajectory.tools or ():
            seen.setdefault(to_json(tool), tool)
    return list(seen.values()) or None


def _copy_group(group: TrajectoryGroup) -> TrajectoryGroup:
    """A copy whose trajectories, metrics and logs can change without touching `group`."""
    trajectories = [t.model_copy(deep=True) for t in group.trajectories]
    new = group.model_copy(
        update={
            "trajectories": trajectories,
            "exceptions": list(group.exceptions),
            "metadata": dict(group.metadata),
            "metrics": dict(group.metrics),
            "logs": list(group.logs),
        }
    )
    for trajectory in new.trajectories:
        if trajectory.reward is not None:
            trajectory.metrics["independent_reward"] = trajectory.reward
        trajectory.reward = None
    return new


async def ruler_score_group(
    group: TrajectoryGroup,
    judge: JudgeConfig | str,
    rubric: str = DEFAULT_RUBRIC,
    *,
    on_error: Literal["raise", "count"] = "raise",
    config: RulerConfig | None = None,
) -> TrajectoryGroup:
    """A copy of `group` whose rewards are RULER scores; usable as `after_each` in gathering.

    `config` chooses the judging mode (`RulerConfig`; default "auto", see `autorl.judging`).
    Each trajectory keeps its previous reward (if any) in `metrics["independent_reward"]` and gets
    `metrics["ruler_score"]` and `reward` set to its score, and the judge's explanation appended to
    its `logs`. The group's metrics say how it went, on success and failure alike:
    `ruler_errors` (1 if the group could not be scored, else 0), `judge_calls` (calls made, 0 from
    the cache; `ruler_attempts` is the same number, kept for compatibility), `judge_errors` (calls
    that gave no usable answer: transport errors and invalid answers, retried or not) and
    `judge_fallbacks` (1 when "auto" fell back to sampled JSON).

    Failure (a judge error, or fewer than 2 trajectories): on_error="raise" raises it; "count"
    returns the copy with every reward unset (None, never a made-up 0), `ruler_errors` = 1 and the
    error in `group.logs`, logged at WARNING. Training refuses unset rewards, so pass the groups
    through `scored_groups` first and log its count.
    """
    if on_error not in ("raise", "count"):
        raise ValueError(f"on_error must be 'raise' or 'count', got {on_error!r}")
    if group.pending:
        raise ValueError("the group has unfinished rollouts: await it (or gather it) before scoring it")
    scored = _copy_group(group)
    try:
        judgement = await judge_message_lists(
            [t.messages for t in scored.trajectories], judge, rubric, _group_tools(scored), config=config
        )
    except (JudgeError, TooFewTrajectoriesError) as exc:
        calls = exc.calls if isinstance(exc, JudgeError) else 0
        errors = exc.errors if isinstance(exc, JudgeError) else 0
        scored.metrics.update(ruler_errors=1, ruler_attempts=calls, judge_calls=calls, judge_errors=errors)
        if on_error == "raise":
            raise
        message = f"RULER failed for a group of {len(scored.trajectories)} trajectories: {exc}"
        logger.warning("%s", message)
        scored.logs.append(message)
        return scored
    for trajectory, score in zip(scored.trajectories, judgement.scores, strict=True):
        trajectory.metrics["ruler_score"] = score.score
        trajectory.reward = score.score
        trajectory.logs.append(f"RULER score {score.score:.3f}: {score.explanation}")
    scored.metrics.update(
        ruler_errors=0,
        ruler_attempts=judgement.attempts,
        judge_calls=judgement.attempts,
        judge_errors=judgement.errors,
        judge_fallbacks=int(judgement.fallback),
    )
    scored.logs.append(f"RULER judged {judgement.judged} distinct trajectories in mode {judgement.mode!r}")
    return scored


def scored_groups(groups: Iterable[TrajectoryGroup]) -> tuple[list[TrajectoryGroup], int]:
    """The groups RULER scored, and how many it failed on (`metrics["ruler_errors"]`), to log as a metric."""
    ok, failed = [], 0
    for group in groups:
        if group.metrics.get("ruler_errors"):
            failed += 1
        else:
            ok.append(group)
    return ok, failed


__all__ = [
    "DEFAULT_RUBRIC",
    "JudgeConfig",
    "JudgeError",
    "JudgeResponseError",
    "Judgement",
    "JudgingMode",
    "RulerConfig",
    "common_prefix_length",
    "judge_response_fallback_schema",
    "json_lines",
    "to_json",
    "TooFewTrajectoriesError",
    "TrajectoryScore",
    "build_judge_messages",
    "judge_message_lists",
    "judge_response_schema",
    "parse_scores",
    "ruler",
    "ruler_score_group",
    "scored_groups",
]
