"""Merging a LoRA update straight into a oneDNN-packed weight (`packed_layout`): the same matrix as
oneDNN's own pack of the merged weight, read back and multiplied by oneDNN itself, or nothing
written where the layout is not one it knows."""

from __future__ import annotations

import pytest
import torch

from art_core.engine.torch.packed_layout import blocked_rows, write_merged
from tests.tolerances import assert_close

pytestmark = pytest.mark.isa  # the packed layout is the CPU's (see .ci/run)

HINT = 32

if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
    pytest.skip("this torch has no oneDNN packed linear", allow_module_level=True)


def _pack(matrix: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(matrix, HINT)


def _members(
    rows: tuple[int, ...], cols: int, rank: int, seed: int
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    weights = tuple(torch.randn(r, cols, generator=generator) for r in rows)
    up_t = torch.randn(rank, sum(rows), generator=generator) * 0.1
    down_t = torch.randn(cols, rank, generator=generator)
    return weights, up_t, down_t


@pytest.mark.parametrize(
    ("rows", "cols"),
    [((192,), 64), ((128, 64, 64), 96), ((256, 256), 64), ((64,), 128), ((960,), 576)],
    ids=["one", "qkv", "gate-up", "wide", "smollm2-qkv"],
)
def test_a_merged_weight_written_into_its_pack_is_what_onednn_packs_and_multiplies_by(
    rows: tuple[int, ...], cols: int
) -> None:
    """Where this CPU's float32 layout is a row blocking, the pack of an old matrix is overwritten
    in place with `W + U D` (members stacked), and oneDNN reads it back and multiplies by it as
    by its own pack of that matrix; elsewhere nothing is written."""
    rank = 8
    weights, up_t, down_t = _members(rows, cols, rank, seed=0)
    merged = torch.cat(weights) + up_t.t() @ down_t.t()
    old = torch.randn(sum(rows), cols, generator=torch.Generator().manual_seed(1))
    packed = _pack(old)
    block = blocked_rows(sum(rows), cols, torch.float32, HINT)
    fits = block is not None and all(r % block == 0 for r in rows)

    assert write_merged(packed, weights, up_t, down_t, HINT) == fits
    if not fits:
        torch.testing.assert_close(packed.to_dense(), old, rtol=0, atol=0)
        return
    assert_close(packed.to_dense(), merged, dtype=torch.float32, length=rank)
    x = torch.randn(32, cols, generator=torch.Generator().manual_seed(2))
    ours = torch.ops.mkldnn._linear_pointwise.default(x, packed, None, "none", [], "")
    theirs = torch.ops.mkldnn._linear_pointwise.default(x, _pack(merged), None, "none", [], "")
    assert_close(ours, theirs, dtype=torch.float32, length=cols + rank, depth=2)

    assert write_merged(packed, weights, None, None, HINT)  # the weights alone
    torch.testing.assert_close(packed.to_dense(), torch.cat(weights), rtol=0, atol=0)


def test_a_member_that_does_not_start_a_block_is_refused_and_nothing_is_written() -> None:
    """A fused group whose member boundary falls inside one of the layout's blocks."""
    shape = (256, 64)
    block = blocked_rows(*shape, torch.float32, HINT)
    if block is None or block < 2:
        pytest.skip("this CPU's float32 layout is no row blocking of this shape")
    rows = (block // 2, shape[0] - block // 2)
    weights, up_t, down_t = _members(rows, shape[1], 4, seed=3)
    old = torch.randn(*shape)
    packed = _pack(old)
    assert not write_merged(packed, weights, up_t, down_t, HINT)
    torch.testing.assert_close(packed.to_dense(), old, rtol=0, atol=0)


def test_other_dtypes_and_shapes_are_refused() -> None:
    """bf16 has no known layout here; a pack of another shape than the weights' is never written."""
    assert blocked_rows(192, 64, torch.bfloat16, HINT) is None
    weights, up_t, down_t = _members((192,), 64, 4, seed=4)
    packed = _pack(torch.zeros(128, 64))
    assert not write_merged(packed, weights, up_t, down_t, HINT)
    torch.testing.assert_close(packed.to_dense(), torch.zeros(128, 64), rtol=0, atol=0)
