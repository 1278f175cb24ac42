"""Lazy exports for the torch-heavy packages: a name imports its module on first use, not at import.

A package lists its public names twice, once per reader: `if TYPE_CHECKING: from m import X as X`
for type checkers, and `__all__, __getattr__ = lazy_exports(__name__, {"m": ("X",)})` at run time.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def lazy_exports(
    package: str, modules: Mapping[str, Sequence[str]]
) -> tuple[list[str], Callable[[str], Any]]:
    """`__all__` and a module `__getattr__` for `package`, which export `modules[module]` from each module."""
    where = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return sorted(where), __getattr__
