"""A small training script that `bench/crash_resume.py` (and tests/host/test_crash_resume.py) kill.

`python bench/crash_train.py --root DIR --steps N [--model tiny-random]` registers a LoRA model
under DIR (resuming from its latest checkpoint), then trains until the model is at step N: each
step gathers two groups of three real rollouts through our server and the `openai` client, then
`model.train`. It prints one JSON line per event on stdout, flushed:

- `{"resumed": s, "history_steps": [...], "trajectory_steps": [...], "temporary": [...]}` right
  after `register` (the model's view of its own run: `model.history()`'s train steps, the train
  trajectory files, the names of temporary files left anywhere under the model's folder);
- `{"phase": p, "step": s}` at each progress callback of `model.train` (`prepare`, `train`,
  `done`, then `checkpoint` once step s is on disk: the commit runs in the background, during the
  next step's rollouts) and `{"phase": "rollout", "step": s}` when a step's rollouts start;
- `{"finished": s}` when the model reached step N and the backend closed (all of it on disk).

`ART_CRASH_AT=<window>:<step>` makes the script SIGKILL itself in one window of step `step`, to hit
each window deliberately (the bench also kills it from outside at random moments):

| window        | where the kill lands                                                              |
|---------------|-----------------------------------------------------------------------------------|
| `rollout`     | inside a rollout, after its chat completion                                       |
| `train`       | inside the train step, after the backward pass, before the optimizer step         |
| `save`        | mid checkpoint write: the state is in the temporary folder, not yet renamed       |
| `trajectories`| mid trajectory write: half the file written to its temporary name                 |
| `checkpoint`  | right after the checkpoint is committed (the `checkpoint` progress phase, issue 18)|
| `history`     | mid history append: half the line written to history.jsonl (a torn append; our own |
|               | append writes the line in one `write`, so this emulates a worse file system)      |
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

PROJECT, NAME = "crash", "agent"


def emit(event: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def crash_plan() -> tuple[str, int] | None:
    text = os.environ.get("ART_CRASH_AT", "")
    if not text:
        return None
    window, _, step = text.partition(":")
    return window, int(step)


def install_faults(plan: tuple[str, int] | None, current_step: list[int]) -> None:
    """Wrap the library's write and train calls so the kill lands inside `plan`'s window."""
    if plan is None:
        return
    window, at = plan

    def armed() -> bool:
        return current_step[0] == at

    # The commit runs in the background (TorchServing.overlap_checkpoint) while the next step's
    # rollouts run, so the write windows tell their step from what is written, not `current_step`.
    def writing(name: str) -> bool:
        return name.startswith((f".tmp-{at:04d}-", f"{at:04d}."))

    import art_core.storage as storage
    from art_core.training.trainer import Trainer

    if window == "train":
        original_optim = Trainer.optim_step

        def optim_step(self: Trainer, learning_rate: float) -> dict[str, float]:
            if armed():
                die()
            return original_optim(self, learning_rate)

        Trainer.optim_step = optim_step  # type: ignore[method-assign]
    elif window == "save":
        original_save = Trainer.save_state

        def save_state(self: Trainer, directory: Path) -> None:
            original_save(self, directory)
            if writing(Path(directory).name):
                die()

        Trainer.save_state = save_state  # type: ignore[method-assign]
    elif window == "trajectories":
        original_write = storage.atomic_write_bytes

        def atomic_write_bytes(path: Path, data: bytes) -> None:
            if writing(Path(path).name) and Path(path).parent.name == "train":
                temp = Path(path).parent / f".tmp-{Path(path).name}.crash"
                temp.parent.mkdir(parents=True, exist_ok=True)  # as the real write does
                temp.write_bytes(data[: len(data) // 2])
                die()
            original_write(path, data)

        storage.atomic_write_bytes = atomic_write_bytes  # type: ignore[assignment]
    elif window == "history":
        original_append = storage.ModelStorage.append_history

        def append_history(self: storage.ModelStorage, record: dict[str, Any]) -> None:
            if record.get("step") == at and "trained" in record:
                line = json.dumps(record).encode()
                with open(self.history_path, "ab") as handle:
                    handle.write(line[: len(line) // 2])
                    handle.flush()
                    os.fsync(handle.fileno())
                die()
            original_append(self, record)

        storage.ModelStorage.append_history = append_history  # type: ignore[method-assign]


def disk_view(root: Path, model: Any, history: list[dict[str, Any]]) -> dict[str, Any]:
    folder = root / PROJECT / "models" / NAME
    trajectories = folder / "trajectories" / "train"
    return {
        "history_steps": [int(r["step"]) for r in history if "trained" in r],
        "trajectory_steps": sorted(int(p.stem) for p in trajectories.glob("*.jsonl") if p.stem.isdigit())
        if trajectories.is_dir()
        else [],
        "temporary": sorted(str(p.relative_to(folder)) for p in folder.rglob(".tmp-*")),
    }


async def run(args: argparse.Namespace) -> None:
    from art_core import TrainableModel, TrainConfig, Trajectory, TrajectoryGroup, gather_trajectory_groups
    from art_core.backends import LocalBackend

    plan = crash_plan()
    current = [0]
    install_faults(plan, current)
    async with LocalBackend(args.root) as backend:
        model = TrainableModel(project=PROJECT, name=NAME, base_model=args.model)
        await model.register(backend)
        step = await model.get_step()
        emit({"resumed": step, **disk_view(Path(args.root), model, await model.history())})
        client = model.openai_client()

        async def rollout(group: int, index: int) -> Trajectory:
            messages = [{"role": "user", "content": f"step {current[0]} task {group}: say a word"}]
            completion = await client.chat.completions.create(
                model=model.get_inference_name(), messages=messages, max_tokens=4, temperature=1.0
            )
            if plan == ("rollout", current[0]) and index == 1:
                die()
            return Trajectory(messages_and_choices=[*messages, completion.choices[0]], reward=index / 2)

        def progress(phase: str, metrics: dict[str, float]) -> None:
            step = int(metrics["step"]) if phase in ("checkpoint", "done") else current[0]
            emit({"phase": phase, "step": step})  # `checkpoint` may come during the next step's rollouts
            if phase == "checkpoint" and plan == ("checkpoint", step):
                die()

        while step < args.steps:
            current[0] = step + 1
            emit({"phase": "rollout", "step": current[0]})
            groups = await gather_trajectory_groups(
                [TrajectoryGroup(rollout(g, i) for i in range(3)) for g in range(2)], pbar=False
            )
            result = await model.train(groups, config=TrainConfig(learning_rate=1e-3), on_progress=progress)
            step = result.step
    emit({"finished": step})  # after close(): the last step's background commit is on disk


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", required=True, help="the backend's folder (kept between runs)")
    parser.add_argument("--steps", type=int, default=4, help="train until the model is at this step")
    parser.add_argument("--model", default="tiny-random", help="base model id (default: tiny-random)")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
