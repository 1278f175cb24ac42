"""Training processes beyond the service's own: rank 0 is the `ModelService`, ranks 1..N-1 follow it.

`TrainGroup.spawn(n)` (what `art serve --train-procs N` and `LocalBackend(train_procs=N)` use)
starts N-1 `python -m art_core.host.train_worker` processes on this machine with torchrun's
environment variables and joins them in one process group. `TrainGroup.from_env()` joins a group
that torchrun started instead (`torchrun ... -m art_core.host.train_worker serve ...`, several
nodes): global rank 0 serves, the other ranks follow.

Each registered model gets a `GroupTrainer` on rank 0 and a `Trainer` on every other rank; rank 0
broadcasts what to do before it does it (register, train a batch, load a checkpoint, stop), as
JSON over the process group (art_core.training.distributed), and every rank then runs the same
collective steps. Rank 0 writes the checkpoints (ModelStorage's atomic folders); a resume sends
the checkpoint's files to the other ranks, so nodes need no shared filesystem.

`fsdp` (`art serve --fsdp`, `LocalBackend(fsdp=True)`): every rank shards its copy's frozen base
Linear layers with FSDP2 (`shard_base_linears`) before building its trainer, and trains in
lockstep; the LoRA stays replicated, so checkpoints are the same files as without it. The sharded
model can then run forward passes only with every rank taking part, so nothing serves from it:
`ModelService` serves from a copy of its own (`host.service`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from peft import PeftModel

from art_core.training.batch import PreparedBatch, TrainingExample
from art_core.training.config import LoRAConfig, LossConfig, TrainConfig
from art_core.training.distributed import (
    World,
    broadcast_files,
    broadcast_json,
    close_world,
    init_world,
    shard_base_linears,
)
from art_core.training.sequences import TokenSequence
from art_core.training.trainer import Trainer

logger = logging.getLogger(__name__)

WORKER_MODULE = "art_core.host.train_worker"


STOP_TIMEOUT_S = 60.0
"""How long `TrainGroup.close` waits for each rank it started to exit after the stop message."""


class TrainWorkerError(RuntimeError):
    """A training rank exited; the group cannot train until the service restarts."""


class FSDPSetupError(ValueError):
    """FSDP was asked for where the base cannot be sharded (one training process, or an engine that
    would serve from the trainer's sharded model); the message says what to pass instead."""


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def rank_env(base: Mapping[str, str], *, rank: int, world_size: int, port: int) -> dict[str, str]:
    """torchrun's variables for local rank `rank` of a one-node group on 127.0.0.1:`port`."""
    return {
        **base,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def examples_to_json(examples: list[TrainingExample]) -> list[dict[str, Any]]:
    return [
        {
            "token_ids": list(e.sequence.token_ids),
            "mask": list(e.sequence.mask),
            "logprobs": list(e.sequence.logprobs),
            "advantage": e.advantage,
            "group_index": e.group_index,
            "trajectory_index": e.trajectory_index,
        }
        for e in examples
    ]


def examples_from_json(rows: list[dict[str, Any]]) -> list[TrainingExample]:
    return [
        TrainingExample(
            TokenSequence(tuple(r["token_ids"]), tuple(r["mask"]), tuple(float(x) for x in r["logprobs"])),
            float(r["advantage"]),
            int(r["group_index"]),
            int(r["trajectory_index"]),
        )
        for r in rows
    ]


def config_to_json(config: TrainConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def config_from_json(data: dict[str, Any]) -> TrainConfig:
    fields = dict(data)
    fields["loss"] = LossConfig(**fields["loss"])
    fields["adam_betas"] = tuple(fields["adam_betas"])
    return TrainConfig(**fields)


def lora_from_json(data: dict[str, Any]) -> LoRAConfig:
    return LoRAConfig(**{**data, "target_modules": tuple(data["target_modules"])})


class TrainGroup:
    """Rank 0's handle on the other training ranks (see the module docstring)."""

    def __init__(
        self, world: World, workers: list[subprocess.Popen[bytes]] | None = None, *, fsdp: bool = False
    ) -> None:
        """`fsdp`: every rank shards its model's frozen base Linear layers (see the module docstring)."""
        if not world.is_main:
            raise ValueError(f"a TrainGroup runs on rank 0; this is rank {world.rank}")
        self.world = world
        self.workers = workers or []
        self.fsdp = fsdp
        self._closed = False

    @classmethod
    def spawn(
        cls, procs: int, *, device: str = "cpu", timeout_s: float = 600.0, fsdp: bool = False
    ) -> TrainGroup:
        """Start `procs - 1` worker ranks on this machine and join them (device "cpu": gloo;
        "cuda": rank i on cuda:i, NCCL)."""
        if procs < 2:
            raise ValueError(f"a TrainGroup needs 2 or more training processes, got {procs}")
        cuda = device.startswith("cuda")
        port = _free_port()
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
        env["ART_TRAIN_DEVICE"] = "cuda" if cuda else "cpu"
        workers = [
            subprocess.Popen(
                [sys.executable, "-m", WORKER_MODULE],
                env=rank_env(env, rank=rank, world_size=procs, port=port),
            )
            for rank in range(1, procs)
        ]
        world = World(rank=0, world_size=procs, local_rank=0, device="cuda:0" if cuda else "cpu")
        try:
            init_world(world, timeout_s=timeout_s, init_method=f"tcp://127.0.0.1:{port}")
        except BaseException:
            for worker in workers:
                worker.kill()
            raise
        sharding = ", the base sharded by FSDP2" if fsdp else ""
        logger.info("training on %d processes (%s)%s", procs, world.backend, sharding)
        return cls(world, workers, fsdp=fsdp)

    @classmethod
    def from_env(cls, world: World, timeout_s: float = 1800.0, *, fsdp: bool = False) -> TrainGroup:
        """Rank 0 of a group that torchrun started (the other ranks run `train_worker.follow`)."""
        init_world(world, timeout_s=timeout_s)
        return cls(world, fsdp=fsdp)

    def send(self, message: dict[str, Any]) -> None:
        dead = [w.pid for w in self.workers if w.poll() is not None]
        if dead:
            raise TrainWorkerError(
                f"training worker process(es) {dead} exited; restart the service (see their stderr)"
            )
        broadcast_json(message, self.world)

    def trainer(
        self,
        name: str,
        peft_model: PeftModel,
        *,
        base_model: str,
        lora: LoRAConfig,
        pad_id: int,
        adapter_name: str,
        trust_remote_code: bool = False,
    ) -> GroupTrainer:
        """Rank 0's trainer of model `name`; every other rank builds the same model and trainer
        (with `fsdp`, each shards its model's base first: `peft_model` here too)."""
        self.send(
            {
                "op": "register",
                "name": name,
                "base_model": base_model,
                "lora": dataclasses.asdict(lora),
                "pad_id": pad_id,
                "adapter_name": adapter_name,
                "trust_remote_code": trust_remote_code,
                "fsdp": self.fsdp,
            }
        )
        if self.fsdp:
            shard_for_training(peft_model, self.world)
        return GroupTrainer(
            self, name, peft_model, pad_id=pad_id, adapter_name=adapter_name, lockstep=self.fsdp
        )

    def close(self) -> None:
        """Tell the other ranks to stop and wait for them (each gets STOP_TIMEOUT_S, then SIGKILL).

        Raises TrainWorkerError, once all are gone, if a rank this group started had exited with
        an error or had to be killed; a stopped rank exits with status 0."""
        if self._closed:
            return
        self._closed = True
        failed: list[str] = []
        stop_error: Exception | None = None
        try:
            if all(w.poll() is None for w in self.workers):
                broadcast_json({"op": "stop"}, self.world)
        except Exception as exc:  # a rank died meanwhile (its status is reported below), or the group broke
            stop_error = exc
        finally:
            for rank, worker in enumerate(self.workers, start=1):
                try:
                    status = worker.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    worker.kill()
                    worker.wait()
                    failed.append(
                        f"rank {rank} (pid {worker.pid}) did not stop within {STOP_TIMEOUT_S:g} s: killed"
                    )
                else:
                    if status != 0:
                        failed.append(f"rank {rank} (pid {worker.pid}) exited with status {status}")
            close_world()
        if failed:
            raise TrainWorkerError(f"training worker {'; '.join(failed)} (see its stderr)") from stop_error
        if stop_error is not None:
            raise stop_error


def shard_for_training(model: PeftModel, world: World) -> None:
    """`shard_base_linears` on one rank of an `fsdp` group: the same on every rank, since they all
    load the same base; a model with nothing to shard fails on every rank alike."""
    sharded = shard_base_linears(model, world)
    if not sharded:
        raise FSDPSetupError(
            f"{type(model.get_base_model()).__name__} has no frozen nn.Linear in decoder layers to shard; "
            "train it without --fsdp"
        )
    logger.info(
        "rank %d: %d base Linear layers sharded over %d ranks (FSDP2)", world.rank, sharded, world.world_size
    )


class GroupTrainer(Trainer):
    """A `Trainer` on rank 0 that has the other ranks do the same step."""

    def __init__(
        self,
        group: TrainGroup,
        name: str,
        model: PeftModel,
        *,
        pad_id: int,
        adapter_name: str,
        lockstep: bool = False,
    ) -> None:
        self.group, self.name = group, name
        super().__init__(
            model,
            pad_id=pad_id,
            adapter_name=adapter_name,
            config=TrainConfig(),
            world=group.world,
            lockstep=lockstep,
        )

    def train_step(self, batch: PreparedBatch, config: TrainConfig | None = None) -> dict[str, float]:
        self.group.send(
            {
                "op": "train",
                "name": self.name,
                "examples": examples_to_json(batch.examples),
                "scored_tokens": batch.scored_tokens,
                "config": config_to_json(config or self.config),
            }
        )
        return super().train_step(batch, config)

    def load_state(self, directory: Path) -> None:
        self.group.send({"op": "load", "name": self.name})
        super().load_state(directory)
        broadcast_files(Path(directory), self.group.world, Path(directory))
