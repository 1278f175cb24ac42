"""The run's report: autorl's `reward.png` and `report.md`, with MCP's figures as notes, and `summary.json`.

The PNG, the per-step table, the head-to-head headline and the validation answers are autorl's
(`autorl.report.write_report`); this module only says what MCP adds: the success rate where
checkable, completion, turns, and calls and error rate per tool, before and after.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from art_core.atomic import atomic_write_bytes
from autorl.report import write_report as write_shared_report


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _failed(evaluation: Mapping[str, Any]) -> str:
    if not evaluation:
        return "n/a"
    return f"{evaluation.get('exceptions', 0)} raised, {evaluation.get('server_failures', 0)} server failures"


def mcp_notes(summary: Mapping[str, Any], details: Mapping[str, Any], *, judged: bool = True) -> list[str]:
    """The report's MCP lines: validation before/after, per-tool calls and error rates; pure.
    `judged`: whether RULER scored the groups (False: `--judge none`, the checks alone)."""
    before, after = details.get("before") or {}, details.get("after") or {}
    notes = [
        f"server: `{summary['server']}`; server restarts {summary['server_restarts']}, "
        f"tool errors {summary['tool_errors']}",
        f"validation success rate (checkable scenarios): before {_fmt(summary['val_success_before'])}, "
        f"after {_fmt(summary['val_success_after'])}",
        f"validation rollouts: before {_fmt(before.get('rollouts'))} ({_failed(before)}), "
        f"after {_fmt(after.get('rollouts'))} ({_failed(after)}); rollouts that raised are left out of "
        "the rates, and a server failure counts as a failed task",
        f"validation rollouts ending with complete_task: before {_fmt(before.get('completed_rate'))}, "
        f"after {_fmt(after.get('completed_rate'))}; mean turns: before {_fmt(before.get('mean_turns'))}, "
        f"after {_fmt(after.get('mean_turns'))}",
        "the reward is the shaped check and RULER combined (mcp_rl.rewards), not RULER alone"
        if judged
        else "the reward is the shaped check alone (mcp_rl.rewards; no judge: `--judge none`)",
    ]
    tools = sorted({*(before.get("tools") or {}), *(after.get("tools") or {})})
    for tool in tools:
        b, a = (before.get("tools") or {}).get(tool, {}), (after.get("tools") or {}).get(tool, {})
        notes.append(
            f"tool `{tool}`: calls {_fmt(b.get('calls'))} -> {_fmt(a.get('calls'))}, error rate "
            f"{_fmt(b.get('error_rate'))} -> {_fmt(a.get('error_rate'))} (before -> after)"
        )
    return notes


def _atomic_write(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def write_report(
    out: Path,
    summary: Mapping[str, Any],
    details: Mapping[str, Any],
    history: Sequence[Mapping[str, Any]],
    *,
    examples: Sequence[Mapping[str, str]] = (),
    judged: bool = True,
) -> Path:
    """Write `summary.json`, `reward.png` (when a step has a reward) and `report.md`; returns the
    report. `judged`: whether RULER scored the groups (False: `--judge none`)."""
    _atomic_write(out / "summary.json", json.dumps({**summary, "details": details}, indent=2) + "\n")
    duel = details.get("head_to_head") or {}
    shared = {
        **summary,
        "task": f"MCP server {summary['server']}",
        "inputs_train": summary["scenarios_train"],
        "inputs_val": summary["scenarios_val"],
        "win_rate_ci": (duel.get("ci_low", 0.0), duel.get("ci_high", 1.0)),
        "judged": judged,
        "judge_errors": sum(int(h.get("judge_errors") or 0) for h in history)
        + int(duel.get("judge_errors", 0)),
    }
    report, _ = write_shared_report(
        out,
        shared,
        history,
        notes=mcp_notes(summary, details, judged=judged),
        examples=examples,
        reward_label="mean reward (check and RULER)" if judged else "mean reward (check)",
        reward_note="the shaped check is absolute, RULER relative within each group"
        if judged
        else "the shaped check: absolute, comparable across steps",
    )
    return report


__all__ = ["mcp_notes", "write_report"]
