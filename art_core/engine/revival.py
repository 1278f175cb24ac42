"""Bringing a dead inference replica back: `ReviveConfig`, the `ReplicaFactory` protocol, `revive`.

`ReplicatedEngine` (engine.replicas) marks a replica down when it dies; given a `ReplicaFactory` by
whoever built the replicas, it then runs `revive` on a thread of its own: wait, `factory.build`
a fresh engine, hand it to `rejoin`, and on a failure wait longer (doubling, capped) and try
again, up to `ReviveConfig.max_attempts` times. After the last failure the replica stays down and
that is logged as an error. Building is split from catching up so that the slow part (a new engine,
which may run while a train step has the replicas paused) never decides which step is served: the
router calls `factory.catch_up` with publishing held off and nothing paused, right before the
engine takes requests. Left out: the router's side of rejoining (`ReplicatedEngine._rejoin`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from art_core.engine.protocol import Engine

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReviveConfig:
    """How `ReplicatedEngine` rebuilds a dead replica (with a `ReplicaFactory`; without one it stays down)."""

    max_attempts: int = 5
    """Rebuilds tried after a replica dies before it is left down for good (0: never revive)."""
    backoff_s: float = 1.0
    """Wait before the first rebuild; it doubles after each failed one."""
    max_backoff_s: float = 30.0
    """The longest wait between two rebuilds."""

    def __post_init__(self) -> None:
        if self.max_attempts < 0:
            raise ValueError(f"max_attempts must be >= 0, got {self.max_attempts}")
        if self.backoff_s < 0:
            raise ValueError(f"backoff_s must be >= 0, got {self.backoff_s}")
        if self.max_backoff_s < self.backoff_s:
            raise ValueError(f"max_backoff_s ({self.max_backoff_s}) must be >= backoff_s ({self.backoff_s})")


def backoff_delays(config: ReviveConfig) -> list[float]:
    """The wait before each rebuild: `backoff_s`, doubling, at most `max_backoff_s`."""
    return [
        min(config.backoff_s * 2**attempt, config.max_backoff_s) for attempt in range(config.max_attempts)
    ]


class ReplicaFactory(Protocol):
    """Builds replacement engines for the replicas of one `ReplicatedEngine`."""

    def build(self, index: int) -> Engine:
        """A fresh engine for replica `index` (its predecessor is closed). It may run while a train
        step has the other replicas paused, so it must not change the trainer's model."""
        ...

    def catch_up(self, index: int, engine: Engine) -> None:
        """Bring `engine` to the step being served now (e.g. copy the trainer's live LoRA into it).
        The router calls it right before the engine takes requests, while nothing is paused and no
        publish runs; the named adapters (`add_adapter`) are loaded afterwards by the router."""
        ...


def revive(
    index: int,
    factory: ReplicaFactory,
    config: ReviveConfig,
    stop: threading.Event,
    rejoin: Callable[[Engine], None],
) -> bool:
    """Rebuild replica `index` until `rejoin` accepts an engine (True), the attempts run out or
    `stop` is set (False). An engine whose `rejoin` failed is closed."""
    for attempt, delay in enumerate(backoff_delays(config), start=1):
        if stop.wait(delay):
            return False
        try:
            engine = factory.build(index)
        except Exception as exc:
            logger.warning("rebuilding inference replica %d failed (attempt %d): %s", index, attempt, exc)
            continue
        if stop.is_set():
            close_quietly(engine)
            return False
        try:
            rejoin(engine)
        except Exception as exc:
            logger.warning("inference replica %d could not rejoin (attempt %d): %s", index, attempt, exc)
            close_quietly(engine)
            continue
        logger.info("inference replica %d is back (attempt %d)", index, attempt)
        return True
    if not stop.is_set():
        logger.error(
            "inference replica %d stays down: %d rebuild(s) failed (ReviveConfig.max_attempts)",
            index,
            config.max_attempts,
        )
    return False


def close_quietly(engine: Engine) -> None:
    """Close a replica's engine, logging (not raising) a failure: one replica failing to close must
    not keep the others open, and a rebuilt one that failed to join has nothing else left to do."""
    try:
        engine.close()
    except Exception:
        logger.exception("closing an inference replica failed")


__all__ = ["ReplicaFactory", "ReviveConfig", "backoff_delays", "close_quietly", "revive"]
