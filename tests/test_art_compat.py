"""ART compatibility: `import art_core as art` runs scripts written for OpenPipe ART 0.4 and 0.5.

The two loops below are written the way ART's documentation writes a training script (our own
words, ART's API), each against the real server through the real `openai` (and `litellm`)
client, on the tiny random model, 2 steps each. The rest are focused tests of the names added
for ART: `retry`, `Model`, generic configs, `DatasetBatch` unpacking, `Trajectory.messages()`,
ART's training keyword arguments, the yielded-trajectory capture and `trajectory_group_batches`.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time

import litellm
import openai
import pytest
from pydantic import BaseModel, ValidationError

import art_core as art
from art_core.backends import LocalBackend
from art_core.training.art_args import UnsupportedArtArgumentError, apply_art_args
from art_core.types import GatherError
from art_core.utils import iterate_dataset

# The public names of ART's `art/__init__.py` (`__all__`), 0.4.11 and 0.5.18 together.
ART_ALL = [
    "dev",
    "auto_trajectory",
    "capture_auto_trajectory",
    "gather_trajectories",
    "gather_trajectory_groups",
    "trajectory_group_batches",
    "Backend",
    "LocalBackend",
    "LocalTrainResult",
    "ServerlessBackend",
    "ServerlessTrainResult",
    "Messages",
    "MessagesAndChoices",
    "Tools",
    "Model",
    "TrainableModel",
    "retry",
    "TrainSFTConfig",
    "TrainConfig",
    "TrainResult",
    "Trajectory",
    "TrajectoryGroup",
    "capture_yielded_trajectory",
    "yield_trajectory",
]
OUT_OF_SCOPE = {"ServerlessBackend", "ServerlessTrainResult"}  # W&B serverless training
NOT_IMPLEMENTED = {"auto_trajectory", "capture_auto_trajectory"}  # see art_core/rollouts/unsupported.py
SCENARIOS = ["def main():", "import os", "class A:", "print(", "for i in", "x = ["]


def reward_of(text: str | None) -> float:
    """A reward the tiny random model's text varies on: the share of distinct characters."""
    text = text or ""
    return len(set(text)) / max(len(text), 1)


# ---- ART 0.4 style: model.train(groups, config=TrainConfig(...)) ------------------------------


class PolicyConfig(BaseModel):
    max_tokens: int = 6
    turns: int = 2


@art.retry(max_attempts=2, delay=0.0, exceptions=(openai.APIConnectionError,))
async def rollout_04(
    model: art.TrainableModel[PolicyConfig], opponent: art.Model, scenario: str
) -> art.Trajectory:
    client = model.openai_client()
    messages: art.Messages = [{"role": "user", "content": scenario}]
    trajectory = art.Trajectory(messages_and_choices=messages, reward=0.0)
    for _ in range(model.config.turns if model.config else 1):
        completion = await client.chat.completions.create(
            model=model.name, messages=trajectory.messages(), max_tokens=model.config.max_tokens
        )
        trajectory.messages_and_choices.append(completion.choices[0])
        # The opponent (a model we do not train) answers as the user.
        reply = await opponent.openai_client().chat.completions.create(
            model=opponent.get_inference_name(), messages=trajectory.messages(), max_tokens=4
        )
        trajectory.messages_and_choices.append({"role": "user", "content": reply.choices[0].message.content})
    trajectory.reward = sum(
        reward_of(m["content"]) for m in trajectory.messages() if m["role"] == "assistant"
    )
    trajectory.metrics["turns"] = model.config.turns if model.config else 1
    return trajectory


async def test_an_art_04_script_trains_two_steps(tmp_path):
    base = art.TrainableModel[PolicyConfig](
        name="agent-04", project="compat", base_model="tiny-random", config=PolicyConfig(max_tokens=4)
    )
    model = base.model_copy(deep=True)  # ART scripts derive runs from a base model like this
    model.name = "agent-04b"
    model.config.max_tokens = 6
    assert base.config.max_tokens == 4 and base.name == "agent-04"
    backend = LocalBackend(tmp_path)
    await model.register(backend)
    try:
        opponent = art.Model(
            name="opponent",
            project="compat",
            inference_base_url=model.inference_base_url,
            inference_api_key=model.inference_api_key,
            inference_model_name=model.get_inference_name(0),  # the untrained step-0 policy
        )
        for batch, epoch, global_step, epoch_step in iterate_dataset(
            SCENARIOS[:4],
            groups_per_step=2,
            num_epochs=1,
            initial_step=await model.get_step(),
            use_tqdm=False,
        ):
            assert epoch == 0 and global_step == epoch_step
            groups = await art.gather_trajectory_groups(
                (art.TrajectoryGroup(rollout_04(model, opponent, s) for _ in range(4)) for s in batch),
                pbar_desc="gather",
            )
            await model.log(groups[:1], split="val")
            await model.train(groups, config=art.TrainConfig(learning_rate=1e-4, beta=0.0))
        assert await model.get_step() == 2
        history = await model.history()
        trained = [h for h in history if "trained" in h]
        assert [h["trained"] for h in trained] == [1, 1], history
        assert [h["step"] for h in history if "val/reward" in h] == [0, 1]
        stored = json.loads((tmp_path / "compat/models/agent-04b/model.json").read_text())
        assert stored["config"] == {"max_tokens": 6, "turns": 2}
        # A copy of a registered model is a new, unregistered model.
        with pytest.raises(RuntimeError, match="not registered"):
            model.model_copy().openai_client()
    finally:
        await backend.close()


# ---- ART 0.5 style: await backend.train(model, groups, learning_rate=...) ----------------------


async def test_an_art_05_script_trains_two_steps(tmp_path):
    model = art.TrainableModel(name="agent-05", project="compat", base_model="tiny-random")
    backend = art.LocalBackend(path=str(tmp_path))
    await model.register(backend)
    try:
        judge = art.Model(
            name="judge",
            project="compat",
            inference_base_url=model.inference_base_url,
            inference_api_key=model.inference_api_key,
            inference_model_name=f"openai/{model.name}@0",  # a LiteLLM name, as ART's judges use
        )

        async def rollout(scenario: str, step: int) -> art.Trajectory:
            messages: art.Messages = [{"role": "user", "content": scenario}]
            completion = await model.openai_client().chat.completions.create(
                model=model.get_inference_name(step), messages=messages, max_tokens=6
            )
            choice = completion.choices[0]
            verdict = await litellm.acompletion(
                messages=[*messages, {"role": "user", "content": choice.message.content or ""}],
                max_tokens=4,
                **judge.litellm_completion_params(),
            )
            reward = reward_of(choice.message.content) + 0.1 * reward_of(verdict.choices[0].message.content)
            return art.Trajectory(messages_and_choices=[*messages, choice], reward=reward)

        results = []
        for step in range(await model.get_step(), 2):
            groups = await art.gather_trajectory_groups(
                [
                    art.TrajectoryGroup(rollout(s, step) for _ in range(4))
                    for s in SCENARIOS[2 * step : 2 * step + 2]
                ],
                pbar_desc="gather",
                max_exceptions=0,
            )
            result = await backend.train(
                model, groups, learning_rate=1e-4, loss_fn="cispo", epsilon_high=4.0, scale_rewards=True
            )
            await model.log(metrics=result.metrics, step=result.step)
            results.append(result)
        assert [r.step for r in results] == [1, 2]
        assert all(isinstance(r, art.LocalTrainResult) and r.trained for r in results)
        assert results[-1].checkpoint_path and results[-1].checkpoint_path.endswith("0002")
        assert "loss/policy_loss" in results[-1].metrics
        assert model.get_inference_name(2) == "agent-05@2"
        assert model.litellm_completion_params(2)["model"] == "openai/agent-05@2"
        history = await model.history()
        assert [h["step"] for h in history] == [1, 2]  # the logged train metrics are not repeated
        with pytest.raises(TypeError, match="'learning_rat'"):
            await backend.train(model, groups, learning_rat=1e-4)
        with pytest.raises(UnsupportedArtArgumentError, match="kl_penalty_coef"):
            await backend.train(model, groups, kl_penalty_coef=0.1)
        assert await model.get_step() == 2  # refused calls train nothing
    finally:
        await backend.close()


# ---- the names --------------------------------------------------------------------------------


def test_import_art_core_as_art_gives_arts_public_names():
    missing = [name for name in ART_ALL if not hasattr(art, name)]
    assert missing == []
    assert set(ART_ALL) <= set(art.__all__)


def test_out_of_scope_names_raise_not_supported():
    for name in sorted(OUT_OF_SCOPE):
        with pytest.raises(art.NotSupportedError, match="serverless"):
            getattr(art, name)()
    with pytest.raises(art.NotSupportedError, match="integrations.rollout"):
        art.auto_trajectory()


async def test_experimental_s3_helpers_and_sft_raise_not_supported(tmp_path):
    backend = LocalBackend(tmp_path)
    model = art.TrainableModel(name="m", project="p", base_model="tiny-random")
    for method in ("_experimental_pull_from_s3", "_experimental_push_to_s3", "_experimental_fork_checkpoint"):
        with pytest.raises(art.NotSupportedError, match=method):
            await getattr(backend, method)(model, s3_bucket="b")
    with pytest.raises(art.NotSupportedError, match="train_sft"):
        await backend.train_sft(model, [], art.TrainSFTConfig())
    with pytest.raises(art.NotSupportedError, match="capture_auto_trajectory"):
        await art.capture_auto_trajectory(asyncio.sleep(0))


# ---- retry ------------------------------------------------------------------------------------


def test_retry_has_arts_signature():
    params = inspect.signature(art.retry).parameters
    assert {n: p.default for n, p in params.items()} == {
        "max_attempts": 3,
        "delay": 0.25,
        "backoff_factor": 2.0,
        "exceptions": (Exception,),
        "on_retry": None,
    }


def test_retry_sync_retries_then_returns_and_reports_each_failure():
    calls, seen = [], []

    @art.retry(max_attempts=3, delay=0.02, backoff_factor=2.0, on_retry=lambda e, n: seen.append((str(e), n)))
    def flaky(x: int) -> int:
        calls.append(x)
        if len(calls) < 3:
            raise ConnectionError(f"fail {len(calls)}")
        return x * 2

    started = time.perf_counter()
    assert flaky(21) == 42
    assert time.perf_counter() - started >= 0.02 + 0.04  # delay, then delay * backoff_factor
    assert calls == [21, 21, 21] and seen == [("fail 1", 1), ("fail 2", 2)]
    assert flaky.__name__ == "flaky"


async def test_retry_async_reraises_the_last_failure_and_skips_other_exceptions(caplog):
    errors = []

    @art.retry(max_attempts=2, delay=0.0, exceptions=(TimeoutError,))
    async def always_times_out() -> None:
        errors.append(TimeoutError(len(errors)))
        raise errors[-1]

    with caplog.at_level(logging.WARNING), pytest.raises(TimeoutError) as info:
        await always_times_out()
    assert info.value is errors[-1] and len(errors) == 2
    assert "Retry 1/2" in caplog.text and "always_times_out" in caplog.text

    attempts = []

    @art.retry(max_attempts=5, delay=0.0, exceptions=(TimeoutError,))
    async def wrong_kind() -> None:
        attempts.append(1)
        raise KeyError("not retried")

    with pytest.raises(KeyError):
        await wrong_kind()
    assert attempts == [1]


@pytest.mark.parametrize(
    "kwargs",
    [{"max_attempts": 0}, {"delay": -1.0}, {"backoff_factor": float("nan")}, {"exceptions": ValueError}],
)
def test_retry_rejects_bad_arguments_when_built(kwargs):
    with pytest.raises((ValueError, TypeError)):
        art.retry(**kwargs)


# ---- Model, generic config --------------------------------------------------------------------


def test_model_knows_its_endpoint_and_names():
    model = art.Model(
        name="gpt-4.1", project="p", inference_base_url="http://127.0.0.1:9/v1", inference_api_key="k"
    )
    assert not model.trainable and model.get_inference_name() == "gpt-4.1"
    assert model.get_inference_name(3) == "gpt-4.1@3"
    assert model.litellm_completion_params() == {
        "model": "gpt-4.1",
        "api_base": "http://127.0.0.1:9/v1",
        "api_key": "k",
        "temperature": 1.0,
    }
    client = model.openai_client()
    assert isinstance(client, openai.AsyncOpenAI) and client is model.openai_client()
    assert str(client.base_url).rstrip("/") == "http://127.0.0.1:9/v1"
    assert "k" not in repr(model).replace("kind", "")  # the key stays out of reprs
    with pytest.raises(ValueError, match="inference_base_url"):
        art.Model(name="bare", project="p").openai_client()


class RunConfig(BaseModel):
    max_turns: int = 3
    tags: list[str] = []


def test_generic_config_validates_copies_and_round_trips():
    model = art.TrainableModel[RunConfig](
        name="m", project="p", base_model="tiny-random", config={"max_turns": 5, "tags": ["a"]}
    )
    assert isinstance(model.config, RunConfig) and model.config.max_turns == 5
    deep = model.model_copy(deep=True)
    deep.config.tags.append("b")
    shallow = model.model_copy(update={"name": "m2"})
    assert model.config.tags == ["a"] and shallow.config is model.config and shallow.name == "m2"
    dumped = model.model_dump(mode="json")
    assert dumped["config"] == {"max_turns": 5, "tags": ["a"]} and dumped["trainable"] is True
    again = art.TrainableModel[RunConfig].model_validate_json(model.model_dump_json())
    assert again.config == model.config and again.base_model == "tiny-random"
    with pytest.raises(ValidationError, match="JSON"):
        art.TrainableModel(name="m", project="p", base_model="tiny-random", config=object())
    with pytest.raises(ValidationError, match="bogus"):
        art.TrainableModel(name="m", project="p", base_model="tiny-random", bogus=1)
    with pytest.raises(ValidationError, match="model name"):
        model.name = "../escape"


def test_internal_config_maps_lora_options_and_refuses_the_rest():
    model = art.TrainableModel(
        name="m",
        project="p",
        base_model="tiny-random",
        _internal_config={"peft_args": {"r": 4, "lora_alpha": 8}},
    )
    assert (model.lora_rank, model.lora_alpha) == (4, 8)
    with pytest.raises(ValueError, match="engine_args"):
        art.TrainableModel(
            name="m", project="p", base_model="tiny-random", _internal_config={"engine_args": {"x": 1}}
        )


# ---- iterate_dataset, messages() --------------------------------------------------------------


def test_dataset_batch_unpacks_as_arts_older_tuple(capfd):
    batches = list(iterate_dataset(list(range(5)), groups_per_step=2, num_epochs=2, use_tqdm=True))
    assert "iterate_dataset" in capfd.readouterr().err  # the tqdm bar
    for batch in batches:
        items, epoch, global_step, epoch_step = batch
        assert (items, epoch, global_step, epoch_step) == (
            batch.items,
            batch.epoch,
            batch.step,
            batch.epoch_step,
        )
    assert [b.step for b in batches] == list(range(6)) and [b.epoch for b in batches] == [0, 0, 0, 1, 1, 1]


def test_messages_is_a_list_and_arts_method():
    trajectory = art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=1.0)
    assert trajectory.messages == [{"role": "user", "content": "hi"}]  # our attribute (preferred)
    copied = trajectory.messages()  # ART's method: a copy
    copied.append({"role": "assistant", "content": "x"})
    copied[0]["content"] = "changed"
    assert trajectory.messages == [{"role": "user", "content": "hi"}]
    trajectory.messages = [{"role": "system", "content": "s"}]  # reassigned: still callable
    assert trajectory.messages() == [{"role": "system", "content": "s"}]
    restored = art.Trajectory.model_validate_json(trajectory.model_dump_json())
    assert restored.messages() == trajectory.messages and type(restored.model_dump()["messages"]) is list
    assert art.History(messages=[{"role": "user", "content": "a"}]).messages()[0]["content"] == "a"


# ---- ART training arguments -------------------------------------------------------------------


def test_art_training_arguments_map_onto_our_configs():
    config = apply_art_args(
        art.TrainConfig(),
        {
            "learning_rate": 2e-5,
            "loss_fn": "ppo",
            "importance_sampling_level": "sequence",
            "epsilon": 0.1,
            "truncated_importance_sampling": None,
            "normalize_advantages": False,
            "logprob_calculation_chunk_size": 256,
            "advantage_balance": 0.0,  # unsupported, but ART's default: a no-op
        },
        where="test",
    )
    assert config.learning_rate == 2e-5 and not config.scale_rewards and config.logprob_chunk_size == 256
    assert (config.loss.name, config.loss.epsilon, config.loss.tis_cap) == ("gspo", 0.1, None)
    assert apply_art_args(art.TrainConfig(), {"ppo": False}, where="t").loss.name == "cispo"
    assert art.TrainConfig(beta=0.05).loss.kl_coef == 0.05  # ART 0.4's KL knob
    with pytest.raises(UnsupportedArtArgumentError, match=r"advantage_balance=0\.5"):
        apply_art_args(art.TrainConfig(), {"advantage_balance": 0.5}, where="t")
    with pytest.raises(UnsupportedArtArgumentError, match="average"):
        apply_art_args(art.TrainConfig(), {"importance_sampling_level": "average"}, where="t")
    with pytest.raises(TypeError, match="'lr'"):
        apply_art_args(art.TrainConfig(), {"lr": 1.0}, where="t")


# ---- yielded trajectories, batches ------------------------------------------------------------


async def test_capture_yielded_trajectory_returns_what_the_coroutine_yielded():
    async def agent(reward: float) -> str:
        await asyncio.sleep(0)
        art.yield_trajectory(art.Trajectory(reward=reward))
        return "answer"

    got = await asyncio.gather(*(art.capture_yielded_trajectory(agent(r)) for r in (0.1, 0.2, 0.3)))
    assert [t.reward for t in got] == [0.1, 0.2, 0.3]
    with pytest.raises(RuntimeError, match="outside capture_yielded_trajectory"):
        art.yield_trajectory(art.Trajectory(reward=1.0))

    async def silent() -> None:
        return None

    with pytest.raises(RuntimeError, match="without calling yield_trajectory"):
        await art.capture_yielded_trajectory(silent())


async def test_trajectory_group_batches_yields_full_batches_then_the_rest():
    async def rollout(i: int) -> art.Trajectory:
        await asyncio.sleep(0.001 * (i % 3))
        if i == 7:
            raise ValueError("boom")
        return art.Trajectory(reward=float(i))

    def groups():
        return [art.TrajectoryGroup(rollout(2 * g + j) for j in range(2)) for g in range(5)]

    sizes = [
        len(b) async for b in art.trajectory_group_batches(groups(), batch_size=2, max_batch_exceptions=1)
    ]
    assert sizes == [2, 2, 1]
    skipped = [b async for b in art.trajectory_group_batches(groups(), batch_size=2, skip_batches=2)]
    assert [len(b) for b in skipped] == [1]
    with pytest.raises(GatherError, match="max_batch_exceptions"):
        async for _ in art.trajectory_group_batches(groups(), batch_size=5):
            pass
