"""What the sides of `serve_throughput.py` share: the model, the adapter, the prompts, the output.

The model and LoRA settings every side uses, `chat_prompts` (the requests), `say` (the report's
output: stdout, or stderr under `--json`), `Target` (a server under test) and `start_worker` (a
side's worker process: `serve_throughput.py --worker NAME`). Left out: the sides themselves
(`serve_ours.py`, `serve_sequential.py`, `serve_vllm.py`) and process plumbing (`processes.py`).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from processes import thread_env
from topics import TOPICS

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "serve_throughput.py"
MODEL = "smollm2-135m"
MODEL_NAME = "bench-serve"  # our TrainableModel's name (what our server serves)
LORA_NAME = "bench-lora"  # the adapter's name on the vLLM server
LORA_R, LORA_ALPHA, LORA_B_STD, LORA_SEED = 16, 32, 0.04, 0
CHECK_TOKENS = 12
TEMPLATES = [
    "Write a short poem about {}.",
    "Describe {} in a few sentences.",
    "Tell a short story about {}.",
]

_out: list[IO[str]] = [sys.stdout]


def set_output(stream: IO[str]) -> None:
    """Where `say` writes (stderr under `--json`, so stdout holds only the JSON line)."""
    _out[0] = stream


def say(*parts: Any) -> None:
    print(*parts, file=_out[0], flush=True)


def chat_prompts(count: int) -> list[list[dict[str, str]]]:
    """`count` different one-message chats (32 topics, then other wordings)."""
    out = []
    for i in range(count):
        template = TEMPLATES[(i // len(TOPICS)) % len(TEMPLATES)]
        out.append([{"role": "user", "content": template.format(TOPICS[i % len(TOPICS)])}])
    return out


DTYPES = ("auto", "bfloat16", "float32")
"""`--dtype` choices; "auto" is resolved once, in the parent, by `resolved_dtype`."""


def resolved_dtype(name: str) -> str:
    """`--dtype` as every side runs it: "auto" is bfloat16 where this CPU's bf16 matmuls pay (native
    AMX-BF16 or AVX512-BF16, and measured faster than float32: `hardware.cpu_bf16_pays`), else
    float32; what our engine's `serve_dtype="auto"` picks for a LoRA model, so every side is
    measured at it."""
    if name != "auto":
        return name
    from art_core.models.hardware import cpu_bf16_pays

    return "bfloat16" if cpu_bf16_pays() else "float32"


def dtype_of(name: str) -> Any:
    import torch

    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]


@dataclass
class Target:
    """One server under test, up and serving."""

    key: str
    base_url: str
    api_key: str
    model: str
    pgid: int
    """Its process group, whose CPU time is taken around each round."""
    batches: Callable[[], dict[str, int]] | None = None
    """Ours only: reads the engine's batch and join counters (taken before and after each round)."""


def start_worker(name: str, args: argparse.Namespace, work: Path, extra: list[str]) -> subprocess.Popen[str]:
    argv = [sys.executable, str(SCRIPT), "--worker", name, "--work-dir", str(work)]
    argv += ["--threads", str(args.threads), "--dtype", args.dtype, "--requests", str(args.requests)]
    argv += ["--max-tokens", str(args.max_tokens), "--temperature", str(args.temperature), *extra]
    with open(work / f"{name}.log", "w") as log:
        return subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT,
            env=thread_env(args.threads), start_new_session=True,
        )  # fmt: skip
