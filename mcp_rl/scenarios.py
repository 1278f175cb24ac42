"""Scenarios: the tasks the agent attempts, with a difficulty and, where possible, a checkable answer.

A scenario file is JSONL, one scenario per line, meant to be read and edited by a person:

    {"id": "s001", "task": "How many figs are left?", "difficulty": 1, "expected": "4",
     "check": "number", "split": "val", "solvable": true}

`expected` (optional) is the answer, `check` how an answer is compared with it:
- `number`: some number in the answer equals `expected` (relative tolerance 1e-6);
- `contains`: `expected` appears in the answer (case and spacing ignored);
- `exact`: the answer equals `expected` (case and spacing ignored).
`solvable` is what the solvability filter found (null: not checked). `split` is `train` or `val`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from art_core.atomic import atomic_write_bytes

Check = Literal["number", "contains", "exact"]
CHECKS: tuple[Check, ...] = ("number", "contains", "exact")
Split = Literal["train", "val"]


class ScenarioFileError(ValueError):
    """A scenario file (or one of its lines) that cannot be used; the message names the line."""


@dataclass(frozen=True)
class Scenario:
    """One task for the agent."""

    id: str
    """Unique within its file."""
    task: str
    """What the user asks, in their words (never naming a tool)."""
    difficulty: int = 1
    """1 (one tool call) to 5 (a long multi-step analysis)."""
    expected: str | None = None
    """The answer, when the task has one that can be checked."""
    check: Check = "contains"
    """How an answer is compared with `expected`."""
    split: Split = "train"
    """`train` (trained on) or `val` (held out: scored before and after training)."""
    solvable: bool | None = None
    """True when an attempt with the real tools completed it, False when none did, None if unchecked."""

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.id):
            raise ValueError(f"scenario id {self.id!r} must be 1-64 letters, digits, '_', '.' or '-'")
        if not isinstance(self.task, str) or not self.task.strip():
            raise ValueError(f"scenario {self.id}: task must be a non-empty string")
        if (
            isinstance(self.difficulty, bool)
            or not isinstance(self.difficulty, int)
            or not 1 <= self.difficulty <= 5
        ):
            raise ValueError(
                f"scenario {self.id}: difficulty must be an integer from 1 to 5, got {self.difficulty!r}"
            )
        if self.expected is not None and (not isinstance(self.expected, str) or not self.expected.strip()):
            raise ValueError(f"scenario {self.id}: expected must be a non-empty string or null")
        if self.check not in CHECKS:
            raise ValueError(f"scenario {self.id}: check must be one of {CHECKS}, got {self.check!r}")
        if self.check == "number" and self.expected is not None and _number(self.expected) is None:
            raise ValueError(
                f"scenario {self.id}: check 'number' needs a numeric expected answer, got {self.expected!r}"
            )
        if self.split not in ("train", "val"):
            raise ValueError(f"scenario {self.id}: split must be 'train' or 'val', got {self.split!r}")

    @property
    def checkable(self) -> bool:
        return self.expected is not None


_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?|[-+]?\.\d+")


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


def numbers_in(text: str) -> list[float]:
    """Every number written in `text` ("1,200" is 1200); pure."""
    return [v for v in (_number(m) for m in _NUMBER.findall(text)) if v is not None]


def _normal(text: str) -> str:
    return " ".join(text.casefold().split())


def check_answer(scenario: Scenario, answer: str | None) -> bool | None:
    """Whether `answer` matches the scenario's expected answer; None when it has none."""
    if scenario.expected is None:
        return None
    if not answer:
        return False
    if scenario.check == "number":
        want = _number(scenario.expected)
        assert want is not None  # validated in __post_init__
        return any(math.isclose(v, want, rel_tol=1e-6, abs_tol=1e-9) for v in numbers_in(answer))
    if scenario.check == "exact":
        return _normal(answer).strip(" .") == _normal(scenario.expected).strip(" .")
    return _normal(scenario.expected) in _normal(answer)


def scenario_from_dict(data: Any, where: str) -> Scenario:
    """A Scenario from one parsed line; ScenarioFileError naming `where` otherwise."""
    if not isinstance(data, dict):
        raise ScenarioFileError(f"{where}: expected a JSON object, got {type(data).__name__}")
    known = set(Scenario.__dataclass_fields__)
    unknown = set(data) - known
    if unknown:
        raise ScenarioFileError(f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
    try:
        return Scenario(**data)
    except (TypeError, ValueError) as exc:
        raise ScenarioFileError(f"{where}: {exc}") from exc


def load_scenarios(path: Path) -> list[Scenario]:
    """The scenarios of a JSONL file (blank lines and lines starting with # are skipped)."""
    if not path.is_file():
        raise ScenarioFileError(f"scenario file {path} does not exist")
    scenarios: list[Scenario] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            data = json.loads(line)
        except ValueError as exc:
            raise ScenarioFileError(f"{path}:{number}: not valid JSON ({exc})") from exc
        scenarios.append(scenario_from_dict(data, f"{path}:{number}"))
    ids = [s.id for s in scenarios]
    duplicated = sorted({i for i in ids if ids.count(i) > 1})
    if duplicated:
        raise ScenarioFileError(f"{path}: duplicate scenario ids {duplicated}")
    if not scenarios:
        raise ScenarioFileError(f"{path} holds no scenarios")
    return scenarios


def save_scenarios(path: Path, scenarios: Iterable[Scenario]) -> Path:
    """Write scenarios as JSONL (atomically: a temporary file, fsync, rename)."""
    text = "".join(json.dumps(asdict(s), ensure_ascii=False) + "\n" for s in scenarios)
    atomic_write_bytes(path, text.encode("utf-8"))
    return path


def split_of(scenarios: Iterable[Scenario], split: Split) -> list[Scenario]:
    return [s for s in scenarios if s.split == split]


__all__ = [
    "CHECKS",
    "Check",
    "Scenario",
    "ScenarioFileError",
    "check_answer",
    "load_scenarios",
    "numbers_in",
    "save_scenarios",
    "scenario_from_dict",
    "split_of",
]
