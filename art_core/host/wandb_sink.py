"""The W&B sink: one run per model, resumed across restarts, a table of sample trajectories per step.

The run id is made once and kept in the model's folder (`wandb_run.json`), so a restarted process
(or a second registration) logs into the same run (`wandb.init(id=..., resume="allow")`), never one
run per step. Each step logs its history line at `step` = our step, and a `wandb.Table`
(`samples/<split>`) of a few trajectories: the messages as text, the reward, and the logs (where
RULER writes the judge's explanation). wandb reads its own settings (`WANDB_MODE`, `WANDB_DIR`,
`WANDB_API_KEY`, `WANDB_ENTITY`); the W&B project is the model's project.
"""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path
from typing import Any

from art_core.atomic import atomic_write_bytes
from art_core.host.step_sink import StepRecord
from art_core.rollouts.records import Trajectory

logger = logging.getLogger(__name__)

RUN_FILE = "wandb_run.json"
"""In the model's folder: `{"id": ...}`, the W&B run every process of this model logs into."""
TABLE_COLUMNS: list[str | int] = ["step", "split", "group", "reward", "messages", "logs"]


def run_id(model_dir: Path) -> str:
    """The model's W&B run id, made (and stored atomically) on first use."""
    path = model_dir / RUN_FILE
    if path.exists():
        return str(json.loads(path.read_text(encoding="utf-8"))["id"])
    made = uuid.uuid4().hex[:16]
    atomic_write_bytes(path, json.dumps({"id": made}).encode())
    return made


def messages_text(trajectory: Trajectory) -> str:
    """`role: content` lines, tool calls as `-> name(arguments)`."""
    lines = []
    for message in trajectory.messages:
        content = message.get("content")
        lines.append(f"{message.get('role')}: {content if isinstance(content, str) else json.dumps(content)}")
        for call in message.get("tool_calls") or ():
            function = call.get("function") or {}
            lines.append(f"  -> {function.get('name')}({function.get('arguments')})")
    return "\n".join(lines)


def sample_rows(step: StepRecord, limit: int) -> list[list[Any]]:
    """Up to `limit` table rows: the best and the worst trajectories by reward, alternately."""
    scored = [(g, t) for g, group in enumerate(step.groups) for t in group.trajectories]
    ranked = sorted(
        scored, key=lambda item: -(item[1].reward if item[1].reward is not None else float("-inf"))
    )
    picked: list[tuple[int, Trajectory]] = []
    low, high = len(ranked) - 1, 0
    while high <= low and len(picked) < limit:
        picked.append(ranked[high])
        if high != low and len(picked) < limit:
            picked.append(ranked[low])
        high, low = high + 1, low - 1
    return [[step.step, step.split, g, t.reward, messages_text(t), "\n".join(t.logs)] for g, t in picked]


class WandbSink:
    """Logs every step of one model into its one W&B run (`wandb.init` on the first step)."""

    name = "wandb"

    def __init__(self, model_dir: Path, project: str, model: str, *, table_rows: int = 8) -> None:
        self.id = run_id(model_dir)
        self.project, self.model, self.table_rows = project, model, table_rows
        self._run: Any = None

    def _started(self) -> Any:
        if self._run is None:
            import wandb

            self._run = wandb.init(
                project=self.project,
                name=self.model,
                id=self.id,
                resume="allow",
                reinit="create_new",
                config={"model": self.model},
            )
        return self._run

    def record(self, step: StepRecord) -> None:
        import wandb

        run = self._started()
        data: dict[str, Any] = {k: v for k, v in step.metrics.items() if k != "step" and v is not None}
        rows = sample_rows(step, self.table_rows)
        if rows:
            data[f"samples/{step.split}"] = wandb.Table(columns=TABLE_COLUMNS, data=rows)
        run.log(data, step=step.step)

    def close(self) -> None:
        if self._run is not None:
            run, self._run = self._run, None
            run.finish()
