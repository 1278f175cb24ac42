"""Data-parallel training of the LoRA over `torch.distributed` (torchrun, gloo on CPU, NCCL on GPU).

Every rank holds the whole `PreparedBatch` of a step (rank 0 sends it to the others, or each
builds it from the same data), and so the batch's normalisers (`BatchTotals`: sequences, trained
tokens, longest completion) are the global ones on every rank. Each rank runs `forward_backward`
on its share of the step's micro-batches (`assign_shares`, balanced by tokens); a micro-batch's
loss is already divided by the global totals, so the SUM of the ranks' gradients
(`all_reduce_gradients`) is the gradient of the whole batch, as one process would compute it, up
to the order of float additions. The gradient-norm clip and the AdamW step then run on identical
gradients on every rank, so the LoRA stays identical everywhere without any further sync.

Where ranks hold different examples, `global_totals` all-reduces the counts
(sums, and a max for the longest completion) before any loss is computed.

This is what DDP does (bucketed all-reduce of the gradients of the trainable parameters), done
explicitly because the trainer calls the body's modules directly (its packed forward), which a
DDP wrapper's forward hooks would not see. `shard_base_linears` adds FSDP2 (`fully_shard`) for a
base model that does not fit one device: each frozen base `nn.Linear` of the decoder is sharded
across the ranks and gathered for its forward; the LoRA weights stay replicated and are
all-reduced as above, so checkpoints stay plain tensors.

Messages between ranks (`broadcast_json`, `all_gather_json`) are JSON in uint8 tensors, never
pickle.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from art_core.training.batch import BatchTotals

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""The environment torchrun (and `art serve --train-procs`) sets for every rank."""


@dataclass(frozen=True)
class World:
    """This process's place among the training ranks."""

    rank: int
    """Global rank; 0 writes checkpoints and drives the others."""
    world_size: int
    """Number of training processes."""
    local_rank: int = 0
    """Rank on this node: the CUDA device index on GPUs."""
    device: str = "cpu"
    """Where this rank's model lives ("cpu" or "cuda:<local_rank>")."""

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank {self.rank} of {self.world_size}")
        if self.local_rank < 0:
            raise ValueError(f"local_rank must be >= 0, got {self.local_rank}")

    @property
    def backend(self) -> str:
        """NCCL for CUDA devices, gloo otherwise."""
        return "nccl" if self.device.startswith("cuda") else "gloo"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def world_from_env(env: Mapping[str, str], *, cuda: bool) -> World | None:
    """The `World` torchrun describes in `env`; None when not launched as one of several ranks.

    `cuda`: put each rank on `cuda:<LOCAL_RANK>` (else CPU)."""
    if "WORLD_SIZE" not in env or int(env["WORLD_SIZE"]) <= 1:
        return None
    missing = [name for name in TORCHRUN_VARIABLES if name not in env]
    if missing:
        raise RuntimeError(
            f"WORLD_SIZE is set but {', '.join(missing)} is not: launch with torchrun, which sets all of "
            f"{', '.join(TORCHRUN_VARIABLES)}"
        )
    local_rank = int(env["LOCAL_RANK"])
    return World(
        rank=int(env["RANK"]),
        world_size=int(env["WORLD_SIZE"]),
        local_rank=local_rank,
        device=f"cuda:{local_rank}" if cuda else "cpu",
    )


def init_world(world: World, timeout_s: float = 1800.0, init_method: str | None = None) -> None:
    """Join the process group (`init_method` such as tcp://HOST:PORT, default env://:
    MASTER_ADDR/MASTER_PORT); no-op if already joined."""
    if dist.is_initialized():
        return
    if world.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(world.device))
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    dist.init_process_group(
        backend=world.backend,
        rank=world.rank,
        world_size=world.world_size,
        init_method=init_method,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def close_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def assign_shares(token_counts: Sequence[int], world_size: int) -> list[list[int]]:
    """Indices of the micro-batches each rank trains: the largest first, each to the least-loaded
    rank (ties to the lower rank); deterministic, so every rank computes the same assignment."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    loads = [0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for index in sorted(range(len(token_counts)), key=lambda i: (-token_counts[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shares[rank].append(index)
        loads[rank] += token_counts[index]
    return [sorted(share) for share in shares]


def _device_of(world: World) -> torch.device:
    return torch.device(world.device)


def all_reduce_gradients(params: Sequence[nn.Parameter], world: World) -> None:
    """Sum every parameter's `.grad` over the ranks, in one flat buffer (a missing grad counts as 0).

    A SUM, not a mean: each rank's losses are already divided by the whole batch's totals."""
    if world.world_size == 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for param, grad in zip(params, grads, strict=True):
        count = grad.numel()
        param.grad = flat[offset : offset + count].view_as(param).clone()
        offset += count


@torch.no_grad()
def broadcast_parameters(params: Sequence[Tensor], world: World) -> None:
    """Rank 0's values of `params` everywhere (start every rank from the same LoRA)."""
    if world.world_size == 1:
        return
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    dist.broadcast(flat, src=0)
    offset = 0
    for param in params:
        param.copy_(flat[offset : offset + param.numel()].view_as(param))
        offset += param.numel()


def global_totals(totals: BatchTotals, world: World) -> BatchTotals:
    """The whole batch's normalisers from each rank's own: sums of sequences and tokens, the max
    of the longest completion."""
    if world.world_size == 1:
        return totals
    sums = torch.tensor(
        [totals.num_sequences, totals.num_tokens], dtype=torch.float64, device=_device_of(world)
    )
    longest = torch.tensor([totals.max_completion_tokens], dtype=torch.float64, device=_device_of(world))
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    dist.all_reduce(longest, op=dist.ReduceOp.MAX)
    return BatchTotals(float(sums[0]), float(sums[1]), float(longest[0]))


def _encode(obj: Any, device: torch.device) -> Tensor:
    return _bytes_tensor(json.dumps(obj, allow_nan=True).encode(), device)


def _bytes_tensor(data: bytes, device: torch.device) -> Tensor:
    if not data:
        return torch.zeros(0, dtype=torch.uint8, device=device)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def broadcast_json(obj: Any, world: World) -> Any:
    """Rank 0's JSON-able `obj` on every rank (other ranks pass anything, e.g. None)."""
    if world.world_size == 1:
        return obj
    device = _device_of(world)
    payload = _encode(obj, device) if world.is_main else torch.zeros(0, dtype=torch.uint8, device=device)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    if not world.is_main:
        payload = torch.empty(int(size[0]), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=0)
    return json.loads(payload.cpu().numpy().tobytes().decode())


def all_gather_json(obj: Any, world: World) -> list[Any]:
    """Every rank's JSON-able `obj`, in rank order, on every rank."""
    if world.world_size == 1:
        return [obj]
    device = _device_of(world)
    payload = _encode(obj, device)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world.world_size)]
    dist.all_gather(sizes, size)
    longest = max(int(s[0]) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    gathered = [torch.zeros_like(padded) for _ in range(world.world_size)]
    dist.all_gather(gathered, padded)
    return [
        json.loads(g[: int(s[0])].cpu().numpy().tobytes().decode())
        for g, s in zip(gathered, sizes, strict=True)
    ]


def broadcast_files(directory: Path | None, world: World, into: Path) -> Path:
    """Rank 0's files of `directory` (flat, e.g. a checkpoint) written into `into` on the other
    ranks; returns the directory to read them from (`directory` itself on rank 0). No shared
    filesystem is needed: the bytes travel over the process group."""
    if world.is_main:
        if directory is None:
            raise ValueError("rank 0 must name the directory whose files it broadcasts")
        files = sorted(path for path in Path(directory).iterdir() if path.is_file())
        blobs = [path.read_bytes() for path in files]
        broadcast_json([[path.name, len(blob)] for path, blob in zip(files, blobs, strict=True)], world)
        payload = _bytes_tensor(b"".join(blobs), _device_of(world))
        if payload.numel():
            dist.broadcast(payload, src=0)
        return Path(directory)
    listing = broadcast_json(None, world)
    total = sum(size for _, size in listing)
    payload = torch.empty(total, dtype=torch.uint8, device=_device_of(world))
    if total:
        dist.broadcast(payload, src=0)
    data = payload.cpu().numpy().tobytes()
    into.mkdir(parents=True, exist_ok=True)
    offset = 0
    for name, size in listing:
        if Path(name).name != name or name in ("", ".", ".."):
            raise ValueError(f"rank 0 sent a file name that is not a plain name: {name!r}")
        (into / name).write_bytes(data[offset : offset + size])
        offset += size
    return into


def barrier(world: World) -> None:
    if world.world_size > 1:
        dist.barrier()


def shard_base_linears(model: nn.Module, world: World) -> int:
    """FSDP2: shard each frozen `nn.Linear` of the model's decoder layers across the ranks
    (`torch.distributed.fsdp.fully_shard`, gathered for its forward and again for its backward);
    returns how many were sharded. LoRA weights, norms, embeddings and the output head stay
    replicated (the head's weight is read directly by the chunked log-prob code)."""
    from torch.distributed.fsdp import fully_shard

    if world.world_size == 1:
        return 0
    mesh = dist.device_mesh.init_device_mesh(world.device.split(":")[0], (world.world_size,))
    targets = [
        module
        for name, module in model.named_modules()
        if type(module) is nn.Linear
        and ".layers." in f".{name}"
        and "lora_" not in name
        and not any(p.requires_grad for p in module.parameters())
    ]
    for module in targets:
        fully_shard(module, mesh=mesh, reshard_after_forward=True)
    return len(targets)
