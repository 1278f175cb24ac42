"""Atomic writes, once for the whole package: a file or a folder appears whole or not at all.

Holds `atomic_write_bytes` (temporary file beside the target, fsync, rename, fsync the folder),
`atomic_dir` (fill a temporary folder beside the target, fsync the tree, rename it into place,
optionally moving an existing target aside first) and the fsync helpers `fsync_dir`/`fsync_tree`.
Standard library only, on the ground floor, so that `storage` (checkpoints, JSON, history),
`models.loading` (the converted-model cache) and `app.plotting` (reward plots) share one
implementation, folder fsync included (DESIGN.md: every write is atomic). Left out: what is written
and where (`storage` lays out a model's folder).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Persist a folder's entries (a rename into it); a no-op where folders cannot be opened (Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then every folder (so their entries are on disk too)."""
    for folder, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(folder, name), "rb") as handle:
                os.fsync(handle.fileno())
        fsync_dir(Path(folder))


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically: temporary file in the same folder, fsync, rename, fsync folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=f".tmp-{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@contextmanager
def atomic_dir(target: Path, *, temp_prefix: str, replace: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder beside `target` (named `temp_prefix` + random); when the block
    ends without an exception, fsync it and rename it to `target`, then fsync the parent folder.

    `target` must not exist unless `replace` is True: then the old folder is first renamed aside
    (`<temp_prefix>old-...`) and removed after the swap, so a crash leaves the old or the new
    folder, never a mix. If the block raises, the temporary folder is removed and nothing changes.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() and not replace:
        raise FileExistsError(f"{target} already exists")
    temp = Path(tempfile.mkdtemp(prefix=temp_prefix, dir=target.parent))
    temp.chmod(0o755)  # mkdtemp makes it private; these folders are read by others (caches, servers)
    aside = target.parent / f"{temp_prefix}old-{uuid.uuid4().hex[:8]}"
    try:
        yield temp
        fsync_tree(temp)
        if target.exists():
            os.rename(target, aside)
        os.rename(temp, target)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    fsync_dir(target.parent)
    shutil.rmtree(aside, ignore_errors=True)


__all__ = ["atomic_dir", "atomic_write_bytes", "fsync_dir", "fsync_tree"]
