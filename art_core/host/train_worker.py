"""A training rank other than 0: builds the models rank 0 registers and trains what it broadcasts.

Started by `TrainGroup.spawn` (`art serve --train-procs N`, `LocalBackend(train_procs=N)`) with
torchrun's environment. `train_group_for` picks the group a service trains on:

- `train_procs` N >= 2 on one machine: the service is rank 0 and spawns ranks 1..N-1; on CUDA,
  rank i uses cuda:i (NCCL), on CPU gloo.
- under torchrun (WORLD_SIZE > 1 in the environment, e.g. two nodes:
  `torchrun --nnodes 2 --nproc-per-node 8 --node-rank R --rdzv-endpoint HOST:29500
  -m art_core.app.cli serve ...`): global rank 0 serves, every other rank follows rank 0's steps
  (`follow`) and exits when the server stops.

With `fsdp` (`--fsdp`) each rank shards its copy of the base (`shard_for_training`) before it
builds the model's trainer; rank 0 says so in each model's register message.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import tempfile
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from art_core.host.train_group import (
    FSDPSetupError,
    TrainGroup,
    config_from_json,
    examples_from_json,
    lora_from_json,
    shard_for_training,
)
from art_core.models.loading import load_model
from art_core.training.batch import PreparedBatch
from art_core.training.config import TrainConfig
from art_core.training.distributed import (
    World,
    broadcast_files,
    broadcast_json,
    close_world,
    init_world,
    world_from_env,
)
from art_core.training.lora import attach_lora
from art_core.training.trainer import Trainer

logger = logging.getLogger(__name__)


def follow(world: World) -> None:
    """Run rank 0's messages until it says stop (the process group must be joined).

    SIGINT and SIGTERM are ignored meanwhile: a Ctrl-C in the terminal, `kill` of the process
    group or a supervisor's stop reaches every rank at once, and a follower that died of it would
    break the group under rank 0's orderly shutdown. Rank 0 handles them (`art serve` shuts down
    and sends stop); if rank 0 dies instead, the next collective fails here, loudly."""
    trainers: dict[str, Trainer] = {}
    with _signals_ignored(), tempfile.TemporaryDirectory(prefix=f"art-rank{world.rank}-") as scratch:
        while True:
            message: dict[str, Any] = broadcast_json(None, world)
            op = message["op"]
            if op == "stop":
                return
            if op == "register":
                trainers[message["name"]] = _build_trainer(message, world)
            elif op == "train":
                examples = examples_from_json(message["examples"])
                trainers[message["name"]].train_step(
                    PreparedBatch(examples, {}, scored_tokens=message["scored_tokens"]),
                    config_from_json(message["config"]),
                )
            elif op == "load":
                into = Path(scratch) / message["name"]
                trainers[message["name"]].load_state(broadcast_files(None, world, into))
            else:
                raise RuntimeError(f"rank {world.rank}: unknown message {op!r} from rank 0")


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    """SIGINT and SIGTERM ignored within the block (in the main thread; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _build_trainer(message: dict[str, Any], world: World) -> Trainer:
    loaded = load_model(message["base_model"], trust_remote_code=bool(message["trust_remote_code"]))
    loaded.model.to(world.device)  # type: ignore[arg-type]  # transformers types `to` oddly
    model = attach_lora(loaded.model, lora_from_json(message["lora"]), adapter_name=message["adapter_name"])
    fsdp = bool(message["fsdp"])
    if fsdp:
        shard_for_training(model, world)
    return Trainer(
        model,
        pad_id=message["pad_id"],
        adapter_name=message["adapter_name"],
        config=TrainConfig(),
        world=world,
        lockstep=fsdp,
    )


class FollowerExit(Exception):
    """This process was a follower rank and has finished; the CLI exits 0 without serving."""


def train_group_for(
    train_procs: int | None, *, cuda: bool, fsdp: bool = False, env: Mapping[str, str] | None = None
) -> TrainGroup | None:
    """The TrainGroup for `art serve` (None: train in-process). A follower rank under torchrun
    runs its loop here and raises FollowerExit when rank 0 stops. `fsdp`: shard the base over the
    group's ranks (FSDPSetupError without a group of 2 or more)."""
    env = os.environ if env is None else env
    world = world_from_env(env, cuda=cuda)
    if world is not None:
        if train_procs is not None:
            raise ValueError(
                "--train-procs starts its own processes; under torchrun the group is torchrun's: drop one"
            )
        if world.is_main:
            return TrainGroup.from_env(world, fsdp=fsdp)
        init_world(world)
        try:
            follow(world)
        finally:
            close_world()
        raise FollowerExit
    if fsdp and (train_procs is None or train_procs < 2):
        procs = 1 if train_procs is None else train_procs
        raise FSDPSetupError(
            f"--fsdp shards the base model over several training processes, but --train-procs is {procs} "
            "and this process is not one of several torchrun ranks: pass --train-procs N with N >= 2 "
            "(LocalBackend(train_procs=N, fsdp=True)), run under torchrun with 2 or more processes, "
            "or drop --fsdp"
        )
    if train_procs is None or train_procs == 1:
        return None
    if train_procs < 1:
        raise ValueError(f"--train-procs must be >= 1, got {train_procs}")
    if cuda:
        import torch

        if torch.cuda.device_count() < train_procs:
            raise ValueError(
                f"--train-procs {train_procs} needs {train_procs} CUDA devices; this machine has "
                f"{torch.cuda.device_count()}"
            )
    return TrainGroup.spawn(train_procs, device="cuda" if cuda else "cpu", fsdp=fsdp)


def main() -> None:
    """A follower rank started by `TrainGroup.spawn` (or torchrun: see art_core.app.train_procs)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cuda = os.environ.get("ART_TRAIN_DEVICE", "cpu") == "cuda"
    world = world_from_env(os.environ, cuda=cuda)
    if world is None or world.is_main:
        raise SystemExit(
            "train_worker is a training rank other than 0: `art serve --train-procs N` starts it "
            "(or torchrun, through `python -m art_core.app.cli serve`)"
        )
    init_world(world)
    try:
        follow(world)
    finally:
        close_world()


if __name__ == "__main__":
    main()
