"""`art serve` that SIGKILLs itself once at a chosen point of a train step, for the restart test.

`ART_TEST_DIE=<point>:<marker file>`: `train` dies inside the trainer's step (before the step
commits), `commit` right after `ModelStorage.commit_step` (committed, nothing answered yet), `chat`
when chat completion request number `ART_TEST_DIE_AFTER` + 1 arrives (rollouts in flight). The
marker file makes it happen once across restarts. The rest of argv goes to `art`'s CLI.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any


def _die_once(marker: Path) -> None:
    if not marker.exists():
        marker.write_text("died\n")
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    point, _, marker = os.environ.get("ART_TEST_DIE", "").partition(":")
    if point == "train":
        from art_core.training.trainer import Trainer

        original_step = Trainer.train_step

        def train_step(self: Trainer, *args: Any, **kwargs: Any) -> Any:
            _die_once(Path(marker))
            return original_step(self, *args, **kwargs)

        Trainer.train_step = train_step  # type: ignore[method-assign]
    elif point == "chat":
        from art_core.server import chat_completion as module

        original_prepare = module.prepare_chat
        after, seen = int(os.environ.get("ART_TEST_DIE_AFTER", "0")), [0]

        def prepare_chat(*args: Any, **kwargs: Any) -> Any:
            seen[0] += 1
            if seen[0] > after:
                _die_once(Path(marker))
            return original_prepare(*args, **kwargs)

        module.prepare_chat = prepare_chat  # type: ignore[assignment]
    elif point == "commit":
        from art_core.storage import ModelStorage

        original_commit = ModelStorage.commit_step

        def commit_step(self: ModelStorage, *args: Any, **kwargs: Any) -> Any:
            path = original_commit(self, *args, **kwargs)
            _die_once(Path(marker))
            return path

        ModelStorage.commit_step = commit_step  # type: ignore[method-assign]
    from art_core.app.cli import main as cli

    sys.argv = ["art", *sys.argv[1:]]
    cli()


if __name__ == "__main__":
    main()
