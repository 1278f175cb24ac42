"""The model host behind every backend: base weights, LoRA, engine, trainer and storage.

`ModelService` owns the registered models of one process. The OpenAI-compatible server
asks it (as its `ModelRouter`) which engine and adapter serve a name; backends ask it to
register and train. Inference and training share one copy of the base weights: the
engine pauses while a step trains, then serves the new LoRA at once.

Served names: `name` is the latest weights; `name@step` is a checkpoint (the latest step is
the live adapter; older steps are loaded from disk on first use).

Engines (`serving`, a `ServingConfig`: see `host.serving`). `TorchServing` (the default): TorchEngine
generates from the very peft model being trained; with `replicas=N` N TorchEngines serve behind a
`ReplicatedEngine` (`host.torch_replicas`), each in a child process of its own (the default) or in
this process (that one and N-1 on copies of the weights), each step's LoRA copied into every replica
while all are paused; one that dies is rebuilt. `VLLMServing`: VLLMEngine serves from its own copy of
the base weights (its own process; the trainer's model moves to the GPU when there is one). After each train step the
checkpoint is hot-loaded into it before requests resume (`VLLMAdapterRouter`): `name` is the
newest step, `name@step` exactly that step's checkpoint. The pause around the train step puts
vLLM to sleep where sleep mode is on (GPU), so training has the GPU memory.

A `train_group` with `fsdp` shards the trainer's base over its ranks (`host.train_group`): that
model runs forward passes only with every rank taking part, so no engine may run on it. TorchServing
then serves from replica processes, one even with `replicas=1` (each loads the base weights itself
and follows the trainer's LoRA, which stays whole); thread replicas are refused (replica 0 would
be the trainer's model). VLLMEngine serves from its own copy anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from peft import PeftModel

from art_core.engine.errors import UnknownAdapterError
from art_core.engine.openmp import releasing_thread_pool
from art_core.engine.protocol import Engine
from art_core.engine.torch.engine import TorchEngine
from art_core.engine.vllm.config import VLLMEngineConfig, require_vllm
from art_core.engine.vllm.router import VLLMAdapterRouter
from art_core.host.commits import BackgroundCommit
from art_core.host.records import ModelSpec, ProgressCallback, TrainResult
from art_core.host.serving import ServingConfig, TorchServing, VLLMServing
from art_core.host.sinks import ObserveConfig, SinkRunner, StepRecord, build_sinks
from art_core.host.step_record import PhaseTimer, rollout_seconds, train_record
from art_core.host.torch_replicas import LoraCopies, ProcessLora, process_replicas, torch_replicas
from art_core.host.train_group import FSDPSetupError, TrainGroup, TrainWorkerError
from art_core.models.loading import LoadedModel, load_model
from art_core.rollouts.groups import TrajectoryGroup
from art_core.server.router import ServedModel, UnknownModelError
from art_core.storage import (
    InvalidServedNameError,
    ModelStorage,
    parse_served_name,
    served_name,
    validate_name,
)
from art_core.training.batch import PreparedBatch, prepare_batch
from art_core.training.config import TrainConfig
from art_core.training.lora import attach_lora
from art_core.training.trainer import Trainer

logger = logging.getLogger(__name__)

LIVE_ADAPTER = "live"
"""The peft adapter name of the weights being trained (served as `name`)."""


@dataclass
class HostedModel:
    """One registered model and everything that serves and trains it."""

    spec: ModelSpec
    loaded: LoadedModel
    engine: Engine
    trainer: Trainer
    storage: ModelStorage
    step: int
    train_lock: threading.Lock = field(default_factory=threading.Lock)
    step_adapters: dict[int, str] = field(default_factory=dict)
    """TorchEngine: older steps loaded as adapters `step<k>`, by step."""
    adapters: VLLMAdapterRouter | None = None
    """VLLMEngine: the adapters serving `name` and `name@step` (None with TorchEngine)."""
    sinks: SinkRunner = field(default_factory=lambda: SinkRunner([]))
    """Where each step goes after history.jsonl (W&B, Langfuse; see `host.sinks`)."""
    copies: LoraCopies | ProcessLora | None = None
    """TorchServing(replicas=N > 1): the replicas' models (in-process copies, or the replica
    processes' shared LoRA), which each step's LoRA is published to (`publish()`)."""
    commits: BackgroundCommit = field(init=False)
    """The step commit in flight, if any (`TorchServing.overlap_checkpoint`; see `host.commits`)."""
    merge_seconds: float = 0.0
    """One TorchEngine: its `EngineStats.merge_seconds` after the last train call's re-merge, so
    that the next records its own re-merge and any in between (`time/remerge_s`)."""

    def __post_init__(self) -> None:
        self.commits = BackgroundCommit(self.spec.name)


class ModelService:
    """Registered models of this process; also the server's `ModelRouter`.

    `serving` chooses the engine and carries its options: `TorchServing(engine_config=EngineConfig(...))`
    (the default) or `VLLMServing(vllm=VLLMEngineConfig(...))`, which raises VLLMNotInstalledError at
    once where vLLM is missing; `observe` chooses the sinks each step goes to after
    history.jsonl (default: W&B and Langfuse where installed and configured).
    """

    def __init__(
        self,
        base_path: Path | str = ".art",
        serving: ServingConfig | None = None,
        *,
        train_group: TrainGroup | None = None,
        observe: ObserveConfig | None = None,
    ) -> None:
        """`train_group`: train every model on that group's processes (data-parallel; see
        art_core.host.train_group); None trains in this process alone."""
        self.base_path = Path(base_path)
        self.train_group = train_group
        self.serving = _variant(serving)
        self.observe = observe or ObserveConfig()
        self._sharded = train_group is not None and train_group.fsdp
        """The trainer's base is sharded (FSDP2): the engines serve copies of their own."""
        if self._sharded:
            _check_sharded_serving(self.serving)
        if isinstance(self.serving, VLLMServing):
            require_vllm()
        self._models: dict[str, HostedModel] = {}
        self._lock = threading.Lock()

    # ---- registration -------------------------------------------------------------------
    @releasing_thread_pool  # the loading thread's OpenMP workers would throttle the engine's
    def register(self, spec: ModelSpec) -> HostedModel:
        """Load (or reuse) the model named `spec.name`, resuming from its latest checkpoint."""
        validate_name(spec.project, "project")
        validate_name(spec.name, "model name")
        with self._lock:
            hosted = self._models.get(spec.name)
            if hosted is not None:
                if hosted.spec != spec:
                    raise ValueError(
                        f"model {spec.name!r} is already registered with a different spec "
                        f"({hosted.spec.model_dump()}); use another name or the same settings"
                    )
                hosted.commits.wait()  # its step is then the disk's
                return hosted
            hosted = self._load(spec)
            self._models[spec.name] = hosted
            return hosted

    def _load(self, spec: ModelSpec) -> HostedModel:
        started = time.perf_counter()
        serving = self.serving
        if isinstance(serving, VLLMServing) and serving.vllm.serves_lora:
            _check_lora_rank(spec, serving.vllm)
        loaded = load_model(spec.base_model, trust_remote_code=spec.trust_remote_code)
        if isinstance(serving, VLLMServing):
            loaded.model.to(serving.device())  # type: ignore[arg-type]  # transformers types `to` oddly
        peft_model = attach_lora(loaded.model, spec.lora, adapter_name=LIVE_ADAPTER)
        storage = ModelStorage.create(self.base_path, spec.project, spec.name)
        storage.recover()  # a crash's leftovers: a step's missing history line, temporary files, ...
        storage.write_json("model.json", spec.model_dump(mode="json"))
        trainer = self._trainer(spec, peft_model, loaded)
        step = storage.latest_step()
        if storage.steps():
            trainer.load_state(storage.checkpoint_dir(step))
            logger.info("resumed %s from step %d", spec.name, step)
        else:
            storage.write_checkpoint(0, trainer.save_state)
        if isinstance(serving, TorchServing):
            config = replace(
                serving.engine_config, max_context=_served_context(loaded, serving.engine_config.max_context)
            )
            if serving.replicas == 1 and not self._sharded:
                engine = TorchEngine(peft_model, loaded.tokenizer, config)
                hosted = HostedModel(spec, loaded, engine, trainer, storage, step)
                hosted.merge_seconds = engine.stats().merge_seconds  # the first merge is the engine's start
            else:  # a sharded trainer's model serves nothing: process replicas (checked in __init__)
                replicated, copies = (
                    process_replicas(
                        spec,
                        peft_model,
                        config,
                        serving.replicas,
                        serving.routing,
                        LIVE_ADAPTER,
                        serving.revive,
                    )
                    if serving.replica_processes or self._sharded
                    else torch_replicas(
                        spec,
                        peft_model,
                        loaded.tokenizer,
                        config,
                        serving.replicas,
                        serving.routing,
                        LIVE_ADAPTER,
                        serving.revive,
                    )
                )
                hosted = HostedModel(spec, loaded, replicated, trainer, storage, step, copies=copies)
        else:
            hosted = self._hosted_on_vllm(spec, loaded, trainer, storage, step, serving.vllm)
        hosted.sinks = self._sinks(spec, storage)
        logger.info("registered %s (%s) in %.1fs", spec.name, spec.base_model, time.perf_counter() - started)
        return hosted

    def _sinks(self, spec: ModelSpec, storage: ModelStorage) -> SinkRunner:
        try:
            sinks = build_sinks(self.observe, storage.root, spec.project, spec.name)
        except Exception as exc:  # observability never stops a run
            logger.warning(
                "no W&B/Langfuse logging for %s (%s: %s); history.jsonl has every metric",
                spec.name,
                type(exc).__name__,
                exc,
            )
            sinks = []
        return SinkRunner(sinks, queue_size=self.observe.queue_size)

    def record_logged(
        self, name: str, split: str, step: int, metrics: dict[str, Any], groups: Sequence[TrajectoryGroup]
    ) -> None:
        """Send a step `model.log` wrote to history.jsonl to the model's sinks."""
        hosted = self._models.get(name)
        if hosted is not None:  # a model logged but not registered here has no sinks
            hosted.sinks.submit(
                StepRecord(hosted.spec.project, name, step, split, dict(metrics), list(groups))
            )

    def _trainer(self, spec: ModelSpec, peft_model: PeftModel, loaded: LoadedModel) -> Trainer:
        if self.train_group is None:
            return Trainer(
                peft_model, pad_id=_pad_id(loaded), adapter_name=LIVE_ADAPTER, config=TrainConfig()
            )
        return self.train_group.trainer(
            spec.name,
            peft_model,
            base_model=spec.base_model,
            lora=spec.lora,
            pad_id=_pad_id(loaded),
            trust_remote_code=spec.trust_remote_code,
            adapter_name=LIVE_ADAPTER,
        )

    def _hosted_on_vllm(
        self,
        spec: ModelSpec,
        loaded: LoadedModel,
        trainer: Trainer,
        storage: ModelStorage,
        step: int,
        config: VLLMEngineConfig,
    ) -> HostedModel:
        """Start a VLLMEngine on the base weights and hot-load checkpoint `step` as `spec.name`."""
        from art_core.engine.vllm.engine import VLLMEngine

        config = replace(config, max_model_len=_served_context(loaded, config.max_model_len))
        engine = VLLMEngine(loaded.path, tokenizer=loaded.tokenizer, config=config)
        try:
            adapters = VLLMAdapterRouter(
                engine,
                spec.name,
                lambda s: storage.checkpoint_dir(s) if s in storage.steps() else None,
                merged=config.weight_sync == "merged",
            )
            adapters.publish(step, storage.checkpoint_dir(step))
        except BaseException:
            engine.close()
            raise
        return HostedModel(spec, loaded, engine, trainer, storage, step, adapters=adapters)

    def get(self, name: str) -> HostedModel:
        hosted = self._models.get(name)
        if hosted is None:
            raise self._unknown(name)
        return hosted

    def _unknown(self, name: str) -> UnknownModelError:
        return UnknownModelError(
            f"the model {name!r} does not exist; served models: {self.model_names()} "
            "(`name` is the latest weights, `name@step` a checkpoint)"
        )

    # ---- ModelRouter --------------------------------------------------------------------
    def resolve(self, name: str) -> ServedModel:
        try:
            base, step = parse_served_name(name)
        except InvalidServedNameError as exc:
            raise UnknownModelError(
                f"the model {name!r} does not exist: {exc}; served models: {self.model_names()}"
            ) from None
        hosted = self._models.get(base)
        if hosted is None:
            raise self._unknown(name)
        adapter = LIVE_ADAPTER
        if hosted.adapters is not None:
            try:
                adapter = hosted.adapters.resolve(name)
            except UnknownAdapterError as exc:
                raise self._unknown(name) from exc
        elif step is not None:
            adapter = self._adapter_for_step(hosted, name, step)
        return ServedModel(
            engine=hosted.engine,
            tokenizer=hosted.loaded.tokenizer,
            adapter=adapter,
            max_context=hosted.engine.max_context,
        )

    def _adapter_for_step(self, hosted: HostedModel, name: str, step: int) -> str:
        if step == hosted.step:
            return LIVE_ADAPTER
        if step not in hosted.storage.steps():
            raise self._unknown(name)
        adapter = hosted.step_adapters.get(step)
        if adapter is None:
            adapter = f"step{step}"
            hosted.engine.add_adapter(adapter, hosted.storage.checkpoint_dir(step))
            hosted.step_adapters[step] = adapter
        return adapter

    def model_names(self) -> list[str]:
        names: list[str] = []
        for hosted in self._models.values():
            names.append(hosted.spec.name)
            steps = hosted.storage.steps()
            if hosted.adapters is not None:  # vLLM merged serves its newest step only
                steps = hosted.adapters.served_steps(steps)
            names.extend(served_name(hosted.spec.name, s) for s in steps)
        return names

    # ---- training -----------------------------------------------------------------------
    async def train(
        self,
        name: str,
        groups: Sequence[TrajectoryGroup],
        config: TrainConfig,
        on_progress: ProgressCallback | None = None,
        request_key: str | None = None,
        *,
        background_commit: bool = True,
    ) -> TrainResult:
        """Train one step on `groups` in a worker thread; inference waits meanwhile.

        `request_key` makes the call idempotent: if the newest step was committed by a request with
        the same key (a client retrying after a lost connection or a server restart), its result is
        answered again and nothing trains.

        With TorchServing's `overlap_checkpoint` (the default) and `background_commit`, the step's
        commit is handed to the model's `BackgroundCommit` and the result returns as soon as the new
        LoRA serves: `hosted.step` is the new step from then on (it is what serves and trains next)
        and goes back to the step before if the commit fails, which the next `train` (or `close`)
        raises, after the rollback. False (the train route): return after the commit.
        """
        hosted = self.get(name)
        return await asyncio.to_thread(
            releasing_thread_pool(self._train_sync),
            hosted,
            list(groups),
            config,
            on_progress,
            request_key,
            background_commit,
        )

    def committed(self, name: str) -> HostedModel:
        """The model named `name` once no commit of it is in flight (`step`, `storage` are then the
        disk's); a failed commit is left for the next train or close to raise."""
        hosted = self.get(name)
        hosted.commits.wait()
        return hosted

    def _train_sync(
        self,
        hosted: HostedModel,
        groups: list[TrajectoryGroup],
        config: TrainConfig,
        on_progress: ProgressCallback | None,
        request_key: str | None = None,
        background_commit: bool = False,
    ) -> TrainResult:
        notify = on_progress or (lambda phase, metrics: None)
        with hosted.train_lock:
            waited = hosted.commits.settle()  # the previous step's commit: done, or its error raised
            if request_key is not None and hosted.storage.request_key(hosted.step) == request_key:
                return _replayed(hosted)
            started, step = time.perf_counter(), hosted.step + 1
            timer = PhaseTimer()  # the phases of this call; `before`: those since the previous call
            before = rollout_seconds(groups, time.time())
            remerge: dict[str, float] = {}  # this step's re-merge, inside `publish` (`resume`)
            prepared = prepare_batch(
                groups,
                scale_rewards=config.scale_rewards,
                max_context=hosted.engine.max_context,
                vocab_size=_vocab_size(hosted.loaded.model),
            )
            notify("prepare", prepared.metrics)
            hosted.engine.pause()

            def record(checkpoint_s: float) -> dict[str, Any]:
                seconds = {**before, **remerge, **timer.seconds, "checkpoint": checkpoint_s}
                return train_record(step, groups, prepared.metrics, metrics, seconds)

            rewritten = True  # until the trainer says it took no optimizer step
            try:
                with timer("train"):
                    metrics = hosted.trainer.train_step(prepared, config)
                rewritten = bool(metrics.get("trained", 0))
                if hosted.copies is not None:  # torch replicas: every one gets the step before any resumes
                    with timer("publish"):
                        hosted.copies.publish()
                if hosted.adapters is not None:  # vLLM: load the new step before waiting requests resume
                    with timer("checkpoint"):
                        self._commit(hosted, step, groups, record, request_key)
                    with timer("publish"):
                        hosted.adapters.publish(hosted.step, hosted.storage.checkpoint_dir(hosted.step))
            finally:
                with timer("publish"):  # torch: the live adapter is the trained one; serving resumes
                    if isinstance(hosted.engine, TorchEngine):  # a step that trained nothing: no re-merge
                        hosted.engine.resume(rewritten=rewritten)
                        remerge = _remerge_seconds(hosted)
                    else:
                        hosted.engine.resume()
            trained = rewritten  # the trainer took its optimizer step
            notify("train", metrics)
            warnings = _step_warnings(step, prepared, metrics)
            overlap = background_commit and hosted.adapters is None and _overlaps(self.serving)
            if hosted.adapters is None and not overlap:
                with timer("checkpoint"):
                    self._commit(hosted, step, groups, record, request_key)
            if not overlap:
                notify("checkpoint", {"step": float(hosted.step)})
            seconds = {**before, **remerge, **timer.seconds, "step": time.perf_counter() - started}
            if overlap:
                seconds["checkpoint_wait"] = waited
            final = train_record(step, groups, prepared.metrics, metrics, seconds)
            final.update(hosted.sinks.error_metrics())
            if overlap:
                hosted.step = step
                hosted.commits.submit(
                    step, lambda: self._commit_in_background(hosted, step, groups, final, request_key, notify)
                )
            else:
                self._record(hosted, final, groups)
            notify("done", {k: float(v) for k, v in final.items()})
            return TrainResult(
                step=step,
                trained=trained,
                metrics={k: float(v) for k, v in final.items()},
                warnings=warnings,
            )

    def _commit_in_background(
        self,
        hosted: HostedModel,
        step: int,
        groups: list[TrajectoryGroup],
        final: dict[str, Any],
        request_key: str | None,
        notify: ProgressCallback,
    ) -> None:
        """The commit of step `step` after `train` returned: `_commit` (rolled back on a failure), the
        `checkpoint` progress phase, then the history line `final` with `time/checkpoint_s` added."""
        started = time.perf_counter()
        self._commit(
            hosted, step, groups, lambda seconds: {**final, "time/checkpoint_s": seconds}, request_key
        )
        line = {**final, "time/checkpoint_s": time.perf_counter() - started}
        try:
            notify("checkpoint", {"step": float(step)})
        except Exception as exc:  # the caller's callback, after its call returned: never the commit's fault
            logger.warning(
                "the progress callback raised at step %d's checkpoint (%s: %s)", step, type(exc).__name__, exc
            )
        self._record(hosted, line, groups)

    @staticmethod
    def _record(hosted: HostedModel, line: dict[str, Any], groups: list[TrajectoryGroup]) -> None:
        """A committed step's history line: history.jsonl, then the sinks."""
        hosted.storage.append_history(line)
        hosted.sinks.submit(
            StepRecord(hosted.spec.project, hosted.spec.name, int(line["step"]), "train", line, groups)
        )

    @staticmethod
    def _commit(
        hosted: HostedModel,
        step: int,
        groups: list[TrajectoryGroup],
        record: Callable[[float], dict[str, Any]],
        request_key: str | None,
    ) -> None:
        """Commit step `step` (`ModelStorage.commit_step`: trajectories, then the checkpoint holding
        the history line `record(checkpoint_s)`); `hosted.step` is `step` after it. It advances on
        every step, trained or not, so that `get_step()` is also the data position a resumed run
        continues from. On a failure the trainer goes back to checkpoint `step - 1`, and so does
        `hosted.step` (a background commit set it to `step` beforehand)."""
        started, previous = time.perf_counter(), step - 1
        try:
            hosted.storage.commit_step(
                step,
                groups,
                hosted.trainer.save_state,
                lambda: record(time.perf_counter() - started),
                request_key,
            )
        except Exception as exc:
            # The trainer holds the uncommitted step's weights: back to the newest checkpoint, so that
            # what is served and trained next is what the disk says (a retry trains the step again).
            hosted.step = previous
            name, why = hosted.spec.name, f"{type(exc).__name__}: {exc}"
            try:
                # torch serves the trainer's own weights: no batch may see half of the rollback, and
                # the other replicas follow it (vLLM serves its own copy and is not touched)
                serves_trainer = hosted.adapters is None
                with _paused(hosted.engine) if serves_trainer else contextlib.nullcontext():
                    hosted.trainer.load_state(hosted.storage.checkpoint_dir(previous))
                    if hosted.copies is not None:
                        hosted.copies.publish()
            except Exception as rollback:  # logged; the commit's error is the one that propagates
                logger.error(
                    "step %d of %s was not committed (%s), and rolling back to checkpoint %d failed "
                    "(%s: %s): register the model again before training on",
                    step, name, why, previous, type(rollback).__name__, rollback,
                )  # fmt: skip
                rolled_back = False
            else:
                rolled_back = True
            if not rolled_back:
                raise
            logger.error(
                "step %d of %s was not committed (%s); rolled back to checkpoint %d",
                step,
                name,
                why,
                previous,
            )
            raise
        hosted.step = step

    def delete_checkpoints(self, name: str, keep: Iterable[int]) -> list[int]:
        hosted = self.committed(name)
        keep_set = set(keep) | {hosted.step}
        if hosted.adapters is not None:
            for step in hosted.adapters.loaded_steps():
                if step not in keep_set:
                    hosted.adapters.forget(step)
        for step in [s for s in hosted.step_adapters if s not in keep_set]:
            hosted.engine.remove_adapter(hosted.step_adapters.pop(step))
        return hosted.storage.delete_checkpoints(keep_set)

    def close(self) -> None:
        """Finish every commit in flight, close sinks and engines, stop the train group; then raise
        the first commit that failed, else the group's TrainWorkerError (a training rank had crashed)."""
        failed: list[Exception] = []
        for hosted in self._models.values():
            try:
                hosted.commits.settle()
            except Exception as exc:  # logged when it happened; raised once everything is closed
                failed.append(exc)
            hosted.sinks.close()
            hosted.engine.close()
        self._models.clear()
        if self.train_group is not None:
            try:
                self.train_group.close()
            except TrainWorkerError as exc:  # a rank had crashed: raised, or logged behind a failed commit
                if not failed:
                    raise
                logger.error("%s", exc)
        if failed:
            raise failed[0]


@contextlib.contextmanager
def _paused(engine: Engine) -> Iterator[None]:
    """`engine` paused within the block."""
    engine.pause()
    try:
        yield
    finally:
        engine.resume()


def _replayed(hosted: HostedModel) -> TrainResult:
    """The result of the step a retried request already committed (its history line), trained again never."""
    record = hosted.storage.step_record(hosted.step) or {"step": hosted.step}
    logger.warning("step %d: a retried train request already committed it; not training again", hosted.step)
    return TrainResult(
        step=hosted.step,
        trained=bool(record.get("trained", 0)),
        metrics={k: float(v) for k, v in record.items() if isinstance(v, int | float)},
        warnings=[
            f"this request was already applied as step {hosted.step} (a retry after a lost connection "
            "or a server restart); it was not trained again"
        ],
    )


def _remerge_seconds(hosted: HostedModel) -> dict[str, float]:
    """`{"remerge": seconds}`: how long one TorchEngine's serving copy spent being merged again
    since the previous call (or since registration): the re-merge `resume()` runs, within this
    train call's `publish`, plus any the worker ran between calls (`weights_updated`). `{}` for
    an engine without a serving copy, for vLLM (its own copy) and for replicas (each merges on
    its own thread or process, at the same time, so their summed seconds are no wall time)."""
    if not isinstance(hosted.engine, TorchEngine):
        return {}
    total = hosted.engine.stats().merge_seconds
    seconds, hosted.merge_seconds = total - hosted.merge_seconds, total
    return {"remerge": seconds} if total > 0 else {}


def _step_warnings(step: int, prepared: PreparedBatch, metrics: dict[str, float]) -> list[str]:
    """What the result says about a step: the batch's warnings, a skipped optimizer step, and first
    why nothing trained (also logged)."""
    warnings = list(prepared.warnings)
    if metrics.get("optim_step_skipped"):
        warnings.append("the optimizer step was skipped: the gradient norm was not finite")
    if not metrics.get("trained", 0):
        warnings.insert(0, f"nothing trained: {untrained_reason(prepared.metrics, metrics)}")
        logger.info("step %d %s", step, warnings[0])
    return warnings


def _overlaps(serving: TorchServing | VLLMServing) -> bool:
    """Whether train steps commit in the background (`TorchServing.overlap_checkpoint`)."""
    return isinstance(serving, TorchServing) and serving.overlap_checkpoint


def untrained_reason(batch_metrics: dict[str, float], train_metrics: dict[str, float]) -> str:
    """One line on why a step trained nothing, from the batch's counters."""
    if train_metrics.get("optim_step_skipped"):
        return "the gradient norm was not finite, so the optimizer step was skipped"
    total = int(batch_metrics.get("groups_total", 0))
    parts = [
        f"{int(n)} of {total} groups {what}"
        for key, what in (
            ("groups_zero_variance", "had equal rewards (no signal to compare)"),
            ("groups_empty", "had no trajectories"),
            ("groups_unscored", "could not be scored (judge errors)"),
        )
        if (n := batch_metrics.get(key, 0))
    ]
    for key, what in (
        ("trajectories_skipped_no_tokens", "trajectories had no token records"),
        ("sequences_too_long", "sequences were longer than the context"),
    ):
        if n := batch_metrics.get(key, 0):
            parts.append(f"{int(n)} {what}")
    return "; ".join(parts) or "no example had a non-zero advantage"


def _variant(serving: ServingConfig | None) -> TorchServing | VLLMServing:
    """`serving` as one of the two variants (None: `TorchServing()`); anything else is a TypeError."""
    if serving is None:
        return TorchServing()
    if isinstance(serving, TorchServing | VLLMServing):
        return serving
    raise TypeError(
        f"serving must be TorchServing(...) or VLLMServing(...), got {type(serving).__name__}: TorchEngine's "
        "EngineConfig goes in TorchServing(engine_config=...), vLLM's VLLMEngineConfig in VLLMServing(vllm=...)"
    )


def _check_sharded_serving(serving: TorchServing | VLLMServing) -> None:
    """FSDPSetupError where an engine would run on the trainer's sharded model: thread replicas."""
    if isinstance(serving, TorchServing) and serving.replicas > 1 and not serving.replica_processes:
        raise FSDPSetupError(
            "with --fsdp the trainer's model is sharded over the training processes and cannot serve, but "
            "--replica-threads serves replica 0 from it: use replica processes (--replica-processes, "
            "TorchServing(replica_processes=True), the default) or drop --fsdp"
        )


def _check_lora_rank(spec: ModelSpec, config: VLLMEngineConfig) -> None:
    """vLLM loads adapters up to `max_lora_rank`; checked before anything loads."""
    if spec.lora.r > config.max_lora_rank:
        raise ValueError(
            f"LoRA rank {spec.lora.r} is above the vLLM engine's max_lora_rank {config.max_lora_rank}: "
            "raise VLLMEngineConfig.max_lora_rank (art serve: --vllm-option max_lora_rank=N) or lower the rank"
        )


def _served_context(loaded: LoadedModel, cap: int | None) -> int:
    """The prompt + completion limit an engine is built with: the model's own (`LoadedModel.max_context`),
    lowered to the engine config's cap if one is set. The engine then owns it (`Engine.max_context`):
    the server checks prompts against it and the trainer drops longer sequences by it."""
    return loaded.max_context if cap is None else min(cap, loaded.max_context)


def _vocab_size(model: Any) -> int:
    """Rows of the input embedding: every token id the model takes is below it."""
    return int(model.get_input_embeddings().num_embeddings)


def _pad_id(loaded: LoadedModel) -> int:
    pad = loaded.tokenizer.pad_token_id
    if pad is None:
        pad = loaded.tokenizer.eos_token_id
    return int(pad)
