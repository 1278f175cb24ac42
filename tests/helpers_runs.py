"""A real two-step run of the tiny model, stored on disk, for the tests that read runs back.

Step 1: two groups of four rollouts through our server and the `openai` client, rewards set by
the rollout (i/3), one rollout raising (an exception the gather keeps). Step 2: the same rollouts
scored by the real RULER code (`ruler_score_group` as `after_each`) against a SCRIPTED judge
server (canned answers on 127.0.0.1, not a model) whose first answer is invalid, so the judge
errors are counted; step 2 trains with a KL term. Then `model.log(groups, split="val")`.

User messages and judge explanations hold HTML metacharacters, to check that reports escape them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from art_core import TrainableModel, TrainConfig, Trajectory, TrajectoryGroup, gather_trajectory_groups
from art_core.backends import LocalBackend
from art_core.server import serve_in_thread
from art_core.training.loss import LossConfig
from autorl.judge import JudgeConfig
from autorl.judging import RulerConfig
from autorl.ruler import ruler_score_group
from tests.helpers_judge import Reply, ScriptedJudge

PROJECT, MODEL = "obs", "agent-1"
LEARNING_RATE = 1e-2


def user_text(group: int, index: int) -> str:
    return f"<b>task {group}-{index}</b> & more"


def explanation(trajectory_id: str) -> str:
    return f"<i>judged</i> {trajectory_id} & fine"


@dataclass
class StoredRun:
    """What `build_run` did: where it stored the run, and the groups each step trained on."""

    root: Path
    groups: dict[int, list[TrajectoryGroup]] = field(default_factory=dict)
    val_groups: list[TrajectoryGroup] = field(default_factory=list)
    judge_requests: int = 0


async def _rollout(model: TrainableModel, group: int, index: int, fail: bool) -> Trajectory:
    if fail:
        raise ValueError("rollout failed on purpose")
    messages = [{"role": "user", "content": user_text(group, index)}]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=6
    )
    return Trajectory(
        messages_and_choices=[*messages, completion.choices[0]],
        reward=index / 3,
        metrics={"index": index},
    )


def _groups(model: TrainableModel, fail_one: bool) -> list[TrajectoryGroup]:
    return [
        TrajectoryGroup(_rollout(model, g, i, fail_one and (g, i) == (1, 3)) for i in range(4))
        for g in range(2)
    ]


def _scripted_judge() -> ScriptedJudge:
    """Scores trajectory k of n as k/n with an explanation; the very first answer is invalid."""
    judge = ScriptedJudge(model="scripted-observe")

    def respond(body: dict[str, Any]) -> Reply:
        if len(judge.requests) == 1:
            return Reply("this is not the JSON asked for")
        schema = body["response_format"]["json_schema"]["schema"]["properties"]["scores"]
        ids = [p["properties"]["trajectory_id"]["const"] for p in schema["prefixItems"]]
        scores = [
            {"trajectory_id": i, "explanation": explanation(i), "score": int(i) / len(ids)} for i in ids
        ]
        return Reply(json.dumps({"scores": scores}))

    judge.responder = respond
    return judge


async def build_run(root: Path) -> StoredRun:
    """Train the tiny model two steps under `root` and log a val step (see the module docstring)."""
    run = StoredRun(root)
    judge_server = _scripted_judge()
    handle = serve_in_thread(judge_server.app())
    judge = JudgeConfig(
        model=judge_server.model, base_url=handle.url + "/v1", api_key="x", retry_backoff_s=0.0
    )

    async def score(group: TrajectoryGroup) -> TrajectoryGroup:
        return await ruler_score_group(group, judge, config=RulerConfig(mode="sampled"))

    try:
        async with LocalBackend(root) as backend:
            model = TrainableModel(project=PROJECT, name=MODEL, base_model="tiny-random")
            await model.register(backend)
            first = await gather_trajectory_groups(
                _groups(model, fail_one=True), pbar=False, max_exceptions=1
            )
            await model.train(first, config=TrainConfig(learning_rate=LEARNING_RATE))
            second = await gather_trajectory_groups(
                _groups(model, fail_one=False), pbar=False, after_each=score
            )
            kl = TrainConfig(learning_rate=LEARNING_RATE, loss=LossConfig(kl_coef=0.1))
            await model.train(second, config=kl)
            run.val_groups = await gather_trajectory_groups(_groups(model, fail_one=False), pbar=False)
            await model.log(run.val_groups, split="val")
            run.groups = {1: list(first), 2: list(second)}
    finally:
        handle.stop()
    run.judge_requests = len(judge_server.requests)
    return run
