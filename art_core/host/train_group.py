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
from art_core.training.distributed import World, broadcast_files, broadcast_json, close_world, init_world
from art_core.training.sequences import TokenSequence
from art_core.training.trainer import Trainer

logger = logging.getLogger(__name__)

WORKER_MODULE = "art_core.host.train_worker"


class TrainWorkerError(RuntimeError):
    """A training rank exited; the group cannot train until the service restarts."""


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

    def __init__(self, world: World, workers: list[subprocess.Popen[bytes]] | None = None) -> None:
        if not world.is_main:
            raise ValueError(f"a TrainGroup runs on rank 0; this is rank {world.rank}")
        self.world = world
        self.workers = workers or []
        self._closed = False

    @classmethod
    def spawn(cls, procs: int, *, device: str = "cpu", timeout_s: float = 600.0) -> TrainGroup:
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
        logger.info("training on %d processes (%s)", procs, world.backend)
        return cls(world, workers)

    @classmethod
    def from_env(cls, world: World, timeout_s: float = 1800.0) -> TrainGroup:
        """Rank 0 of a group that torchrun started (the other ranks run `train_worker.follow`)."""
        init_world(world, timeout_s=timeout_s)
        return cls(world)

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
        """Rank 0's trainer of model `name`; every other rank builds the same model and trainer."""
        self.send(
            {
                "op": "register",
                "name": name,
                "base_model": base_model,
                "lora": dataclasses.asdict(lora),
                "pad_id": pad_id,
                "adapter_name": adapter_name,
                "trust_remote_code": trust_remote_code,
            }
        )
        return GroupTrainer(self, name, peft_model, pad_id=pad_id, adapter_name=adapter_name)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if all(w.poll() is None for w in self.workers):
                broadcast_json({"op": "stop"}, self.world)
        finally:
            for worker in self.workers:
                try:
                    worker.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    worker.kill()
            close_world()


class GroupTrainer(Trainer):
    """A `Trainer` on rank 0 that has the other ranks do the same step."""

    def __init__(
        self, group: TrainGroup, name: str, model: PeftModel, *, pad_id: int, adapter_name: str
    ) -> None:
        self.group, self.name = group, name
        super().__init__(
            model, pad_id=pad_id, adapter_name=adapter_name, config=TrainConfig(), world=group.world
        )

    def train_step(self, batch: PreparedBatch, config: TrainConfig | None = None) -> dict[str, float]:
        self.group.send(
            {
                "op": "train",
                "name": self.name,
                "examples": examples_to_json(batch.examples),
                "config": config_to_json(config or self.config),
            }
        )
        return super().train_step(batch, config)

    def load_state(self, directory: Path) -> None:
        self.group.send({"op": "load", "name": self.name})
        super().load_state(directory)
        broadcast_files(Path(directory), self.group.world, Path(directory))
