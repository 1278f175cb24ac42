"""`art_core.atomic`: the one implementation of atomic files and folders (storage, model cache, plots)."""

from __future__ import annotations

from pathlib import Path

import pytest

from art_core.atomic import atomic_dir, atomic_write_bytes


def test_a_folder_appears_whole_or_not_at_all(tmp_path: Path) -> None:
    target = tmp_path / "made"
    with atomic_dir(target, temp_prefix=".tmp-made-") as temp:
        (temp / "a.txt").write_text("a")
        assert not target.exists()  # nothing visible until the block ends
    assert (target / "a.txt").read_text() == "a"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["made"]
    with pytest.raises(FileExistsError, match="already exists"):
        with atomic_dir(target, temp_prefix=".tmp-made-"):
            pass
    with pytest.raises(RuntimeError, match="build failed"):
        with atomic_dir(target, temp_prefix=".tmp-made-", replace=True) as temp:
            (temp / "b.txt").write_text("b")
            raise RuntimeError("build failed")
    assert sorted(p.name for p in target.iterdir()) == ["a.txt"]  # the old folder is untouched
    with atomic_dir(target, temp_prefix=".tmp-made-", replace=True) as temp:
        (temp / "b.txt").write_text("b")
    assert sorted(p.name for p in target.iterdir()) == ["b.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["made"]  # no temporary or old folder left


def test_a_failed_file_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "f.bin"
    atomic_write_bytes(target, b"old")
    with pytest.raises(TypeError):
        atomic_write_bytes(target, "not bytes")  # type: ignore[arg-type]
    assert target.read_bytes() == b"old"
    assert [p.name for p in target.parent.iterdir()] == ["f.bin"]
