"""Process plumbing for the benchmarks: thread environments, ports, CPU pinning, CPU time, memory,
logs, process groups, and the marked-line protocol between a benchmark and its worker processes.

`thread_env` and `bind_cpus` set a child's threads; `free_port` (a port on 127.0.0.1) and
`stop_group` (end a server and its children: SIGINT, SIGTERM, then SIGKILL, so no process outlives a
run on a shared machine) are `art_core.app.processes`'s, re-exported here; `group_cpu_s` reads a
process group's CPU seconds from /proc (None elsewhere); `log_tail` and `failure` quote a child's log when it fails; `emit` and `read_marked` carry
one JSON answer per marked stdout line. Left out: what any side runs (`serve_ours.py`,
`serve_sequential.py`, `serve_vllm.py`). Standard library and `art_core.app` only. The figures these benchmarks print
are collected in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
from pathlib import Path
from typing import Any

from art_core.app import free_port, stop_group  # one home for ports and process groups

MARK = "@@serve_throughput "
"""Starts a worker's stdout line that carries an answer (a JSON object with its `kind`)."""

logger = logging.getLogger("serve_throughput")


def thread_env(threads: int) -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }


def emit(kind: str, payload: dict[str, Any]) -> None:
    """A worker's answer to the benchmark: one marked JSON line on stdout."""
    print(MARK + json.dumps({"kind": kind, **payload}), flush=True)


def read_marked(proc: subprocess.Popen[str], kind: str) -> dict[str, Any]:
    """The worker's next marked line of `kind` (other stdout lines are passed to the log)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(MARK):
            message = json.loads(line[len(MARK) :])
            if message.pop("kind") == kind:
                return message
        else:
            logger.info("worker: %s", line.rstrip())
    raise RuntimeError(f"the worker exited (code {proc.wait()}) before it answered {kind!r}")


def group_cpu_s(pgid: int) -> float | None:
    """CPU seconds (user + system) of the live processes in process group `pgid`; None without /proc."""
    ticks, total = os.sysconf("SC_CLK_TCK"), 0
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return None
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as handle:
                stat = handle.read()
        except OSError:
            continue  # it exited meanwhile
        fields = stat[stat.rfind(")") + 2 :].split()  # fields from the 3rd on: state, ppid, pgrp, ...
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / ticks


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def failure(what: str, log_path: Path) -> str:
    """`what`, the last exception named in the log (vLLM's root cause, not its generic wrapper), the log's end."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    causes = [
        match.group(0).strip()
        for line in lines
        if (match := re.search(r"\b\w*(Error|Exception): .*", line))
        and "Engine core initialization failed" not in line
    ]
    cause = f" ({causes[-1][:300]})" if causes else ""
    return f"{what}{cause}; its log ({log_path}) ends:\n{log_tail(log_path)}"


def mem_available_gib() -> float | None:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def bind_cpus(threads: int) -> str:
    cpus = (
        sorted(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else list(range(os.cpu_count() or 1))
    )
    return ",".join(str(c) for c in cpus[:threads])


__all__ = [
    "MARK",
    "bind_cpus",
    "emit",
    "failure",
    "free_port",
    "group_cpu_s",
    "log_tail",
    "mem_available_gib",
    "read_marked",
    "stop_group",
    "thread_env",
]
