"""Writing a LoRA-merged weight straight into its oneDNN-packed copy, where the layout is known.

`decode_step` multiplies by oneDNN-packed weights (`torch.ops.mkldnn._reorder_linear_weight`),
and in float32 the serving copy's LoRA update is merged into them (`decode_step.merges_into_pack`).
After every train step each merged pack is rewritten. Through oneDNN that is three passes over the
425 MB of SmolLM2-135M's projections: `W + U D` into a plain matrix, the reorder into a new packed
tensor, and a copy of that into the old pack's buffer (kept so a re-merge leaves the heap as it
was). On an AVX2 CPU (2 threads) those take ~40, ~120 and ~80 ms.

On an AVX2 CPU (measured on an AMD EPYC, family 23) oneDNN's float32 layout is a plain blocking
of the output rows: the packed buffer of an [O, I] weight is [O / b, I, b], block j holding rows
j*b .. j*b+b-1 transposed (b = 64 for SmolLM2's shapes, 16 for some narrow ones).
Where that holds, `write_merged` writes `W + U D` into the existing buffer in two passes: each
block's `W_j^T`, then `D^T U_j^T` added by one batched matmul (~95 ms in all for SmolLM2-135M).

The layout is never assumed: `blocked_rows` packs two probe matrices of the weight's exact shape
(each element's row index, and its column index) and accepts a block size only if the packed
buffer is exactly that blocking of both. Anything else (another ISA's layout, padding, bf16)
answers None, and the caller packs through oneDNN as before.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch


@functools.cache
def blocked_rows(rows: int, cols: int, dtype: torch.dtype, rows_hint: int) -> int | None:
    """The block size b if oneDNN packs a float32 [rows, cols] weight (for `rows_hint` rows) as
    [rows / b, cols, b] on this CPU, else None. Probed once per shape and process, one probe
    matrix at a time (at most twice the weight's size held meanwhile)."""
    if dtype != torch.float32 or max(rows, cols) >= 2**24:  # the probes' indices must be exact
        return None
    block: int | None = None
    for probe_columns in (True, False):  # the columns' probe first: it shows the block size
        if probe_columns:
            index = torch.arange(cols, dtype=dtype).expand(rows, cols).contiguous()
        else:
            index = torch.arange(rows, dtype=dtype).unsqueeze(1).expand(rows, cols).contiguous()
        with torch.inference_mode():
            packed = torch.ops.mkldnn._reorder_linear_weight(index, rows_hint)
            raw = raw_buffer(packed)
            if raw is None or raw.numel() != rows * cols:
                return None
            if block is None:  # row 0 of column 0 first; column 1 starts after one block of rows
                later = torch.nonzero(raw[: rows + 1] != 0)
                block = rows if later.numel() == 0 else int(later[0])
                if block == 0 or rows % block != 0:
                    return None
            same = torch.equal(
                raw.view(rows // block, cols, block), index.view(rows // block, block, cols).transpose(1, 2)
            )
            del raw  # the view of the probe's buffer goes before the probe
        if not same:
            return None
    return block


def raw_buffer(packed: torch.Tensor) -> torch.Tensor | None:
    """A flat float32 CPU tensor over `packed`'s own memory (an mkldnn tensor), None where torch
    does not expose it. It does not keep `packed` alive: use it only while `packed` is held."""
    ops = torch.ops.mkldnn
    if not (packed.is_mkldnn and packed.dtype == torch.float32):
        return None
    if not (hasattr(ops, "data_ptr") and hasattr(ops, "_nbytes")):
        return None
    address, nbytes = int(ops.data_ptr(packed)), int(ops._nbytes(packed))
    if address == 0 or nbytes % 4:
        return None
    array = np.ctypeslib.as_array((ctypes.c_float * (nbytes // 4)).from_address(address))
    return torch.from_numpy(array)


def write_merged(
    packed: torch.Tensor,
    weights: tuple[torch.Tensor, ...],
    up_t: torch.Tensor | None,
    down_t: torch.Tensor | None,
    rows_hint: int,
) -> bool:
    """Write `cat(weights) + up_t.T @ down_t.T` (`up_t` None: the weights alone) into `packed`, the
    oneDNN-packed copy of a float32 weight of that shape, in place; False (nothing written) where
    its layout is not a known blocking (`blocked_rows`) or a member's rows do not start a block.
    `up_t` is [rank, rows], `down_t` [cols, rank] (`decode_step.LowRank`'s)."""
    rows, cols = sum(w.shape[0] for w in weights), weights[0].shape[1]
    if tuple(packed.shape) != (rows, cols) or any(w.dtype != torch.float32 for w in weights):
        return False
    block = blocked_rows(rows, cols, torch.float32, rows_hint)
    if block is None or any(w.shape[0] % block for w in weights):
        return False
    raw = raw_buffer(packed)
    if raw is None or raw.numel() != rows * cols:
        return False
    target = raw.view(rows // block, cols, block)
    start = 0
    for weight in weights:
        end = start + weight.shape[0]
        member = target[start // block : end // block]
        member.copy_(weight.detach().view(-1, block, cols).transpose(1, 2))
        if up_t is not None and down_t is not None:
            ups = up_t[:, start:end].unflatten(1, (-1, block)).transpose(0, 1)  # [blocks, rank, b]
            member.baddbmm_(down_t.expand(member.shape[0], *down_t.shape), ups)
        start = end
    return True
