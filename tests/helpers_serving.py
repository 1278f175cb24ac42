"""The tiny model served by a LocalBackend of its own, one per test module (the capture tests)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from art_core.backends import LocalBackend
from art_core.model import TrainableModel

Served = tuple[LocalBackend, TrainableModel]


def served_fixture(directory: str, *, project: str, name: str) -> Any:
    """A module-scoped `served` fixture: (backend, model), the tiny model registered as `project/name`.

    The backend stores under a fresh temporary `directory` and is closed after the module's tests.
    In a test module: `served = served_fixture("capture", project="capture", name="agent")`.
    """

    @pytest_asyncio.fixture(scope="module", loop_scope="module", name="served")
    async def served(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Served]:
        backend = LocalBackend(tmp_path_factory.mktemp(directory))
        model = TrainableModel(project=project, name=name, base_model="tiny-random")
        await model.register(backend)
        yield backend, model
        await backend.close()

    return served
