"""Import direction between the layers (docs/architecture.md "Layers"), checked on the source with `ast`.

R1 imports point down the floors, and siblings on one floor never import each other; R2 the server
reaches engines only through the engine-neutral modules, never `engine.torch` / `engine.vllm`; R3
only `backends.local`, `host` and `app` import `host` (its `records`, the wire records, anyone above); R5 `art_core` imports none of integrations,
autorl, mcp_rl (and those three only downwards); R6 code outside `art_core` imports it only through
`art_core` or one of its packages (`art_core.X`), never a module inside one. Cycles between modules
fail too. Every import counts: module level, function-local and `TYPE_CHECKING`.
R4 (no torch or transformers at import) is checked by importing in a subprocess.

`ALLOWED` holds the known violations, each with its reason; it should only shrink.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Higher imports lower. The ground floor (models, rollouts, storage) is ordered: storage persists
# the rollout records, so it sits just above them.
FLOORS = {
    "art_core": 9,  # the user API facade (art_core/__init__.py)
    "app": 8,
    "backends": 7,
    "model": 6,
    "host": 5,
    "server": 4,
    "engine": 3,
    "training": 3,
    "capture": 3,
    "storage": 2,
    "models": 1,
    "rollouts": 1,
    "_lazy": 0,
    "atomic": 0,  # atomic writes, standard library only (storage, models.loading, app.plotting)
}
# The ART-compatible facades belong to the rollouts layer (`dev` holds only TypedDicts).
PACKAGE_OF = {"types": "rollouts", "utils": "rollouts", "dev": "rollouts"}
SERVER_MAY_IMPORT = {
    f"art_core.engine{suffix}"
    for suffix in (
        "",
        ".protocol",
        ".config",
        ".errors",
        ".sampling",
        ".grammar",
        ".finish_reason",
        ".detokenizer",
        ".deltas",
    )
}
HOST_IMPORTERS = ("art_core.backends.local", "art_core.host", "art_core.app")
HOST_RECORDS = "art_core.host.records"  # the wire records (ModelSpec, TrainResult, ...): any floor above
HOST_IMPORTER_PACKAGES = {"art_core.backends"}  # backends/__init__ re-exports ServingConfig
OUTSIDE = ("integrations", "autorl", "mcp_rl")
OUTSIDE_MAY_IMPORT = {"integrations": set(), "autorl": {"integrations"}, "mcp_rl": {"autorl", "integrations"}}

# (importer, imported) -> why it is still there. Empty this list; don't add to it.
ALLOWED: dict[tuple[str, str], str] = {}
ALLOWED_CYCLES: dict[frozenset[str], str] = {}


@dataclass(frozen=True)
class Violation:
    importer: str
    imported: str
    rule: str


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, str]:
    """Every module of art_core, the three upper packages and examples/, by dotted name."""
    found = {}
    for top in ("art_core", *OUTSIDE, "examples"):
        for path in sorted((ROOT / top).rglob("*.py")):
            found[module_name(path)] = path.read_text()
    return found


def imports(name: str, source: str, known: set[str]) -> set[str]:
    """The modules `name` imports (absolute names; `from p import m` counts as `p.m` when m is a module)."""
    found = set()
    is_package = name in {k.rpartition(".")[0] for k in known} or name.count(".") == 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if child in known else base)
    return found


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return parts[0]
    return PACKAGE_OF.get(parts[1], parts[1])


def check_edge(importer: str, imported: str) -> list[str]:
    """The rules `importer -> imported` breaks (both dotted names)."""
    top_in, top_out = importer.split(".")[0], imported.split(".")[0]
    broken = []
    if top_in == "art_core" and top_out in OUTSIDE:
        broken.append("R5")
    if top_in in OUTSIDE and top_out in OUTSIDE and top_out != top_in:
        if top_out not in OUTSIDE_MAY_IMPORT[top_in]:
            broken.append("R5")
    if top_in != "art_core" and top_out == "art_core" and imported.count(".") > 1:
        broken.append("R6")
    if top_in != "art_core" or top_out != "art_core":
        return broken
    source, target = layer(importer), layer(imported)
    if source != target and FLOORS[source] <= FLOORS[target]:
        broken.append("R1")
    if source == "server" and target == "engine" and imported not in SERVER_MAY_IMPORT:
        broken.append("R2")
    if (
        target == "host"
        and imported != HOST_RECORDS
        and not (importer.startswith(HOST_IMPORTERS) or importer in HOST_IMPORTER_PACKAGES)
    ):
        broken.append("R3")
    return broken


def graph(modules: dict[str, str]) -> dict[str, set[str]]:
    known = set(modules)
    return {name: imports(name, source, known) for name, source in modules.items()}


def violations(modules: dict[str, str]) -> set[Violation]:
    found = set()
    for importer, targets in graph(modules).items():
        for imported in targets:
            for rule in check_edge(importer, imported):
                found.add(Violation(importer, imported, rule))
    return found


def cycles(modules: dict[str, str]) -> list[frozenset[str]]:
    """The strongly connected groups of two or more modules (Tarjan), among the given modules."""
    edges = {k: {t for t in v if t in modules} for k, v in graph(modules).items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in edges[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(frozenset(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_imports_point_down_except_the_allowlisted_ones() -> None:
    found = {(v.importer, v.imported): v.rule for v in violations(sources())}
    new = {edge: rule for edge, rule in found.items() if edge not in ALLOWED}
    assert not new, f"wrong-way imports (see this file's docstring for the rules): {new}"
    stale = set(ALLOWED) - set(found)
    assert not stale, f"fixed, so remove them from ALLOWED: {stale}"


def test_no_import_cycles_except_the_allowlisted_ones() -> None:
    found = set(cycles(sources()))
    assert found - set(ALLOWED_CYCLES) == set(), "new import cycles"
    assert set(ALLOWED_CYCLES) - found == set(), "fixed, so remove them from ALLOWED_CYCLES"


@pytest.mark.parametrize(
    ("modules", "rule"),
    [
        ({"art_core.engine.sampling": "from art_core.training.loss import LossConfig"}, "R1"),
        ({"art_core.training.loss": "import art_core.capture"}, "R1"),
        ({"art_core.rollouts.records": "def f():\n    from art_core.storage import ModelStorage"}, "R1"),
        ({"art_core.server.app": "from art_core.engine.torch.engine import TorchEngine"}, "R2"),
        ({"art_core.server.app": "from art_core.engine.vllm import engine"}, "R2"),
        ({"art_core.model": "from art_core.host.service import ModelService"}, "R3"),
        ({"art_core.rollouts.groups": "import autorl.ruler"}, "R5"),
        ({"integrations.scope": "from autorl import ruler"}, "R5"),
        ({"autorl.ruler": "from art_core.rollouts.records import Trajectory"}, "R6"),
    ],
)
def test_a_wrong_way_import_is_caught(modules: dict[str, str], rule: str) -> None:
    assert rule in {v.rule for v in violations(modules)}


def test_downward_and_facade_imports_pass() -> None:
    modules = {
        "art_core.server.app": "from art_core.engine.protocol import Engine\nfrom art_core.capture import X",
        "art_core.host.service": "from art_core.engine.torch.engine import TorchEngine",
        "art_core.backends.local": "from art_core.host import ModelService",
        "art_core.engine.torch.engine": "from art_core.engine.config import EngineConfig",
        "autorl.ruler": "from art_core.types import TrajectoryGroup\nfrom integrations import scope",
        "mcp_rl.loop": "import autorl\nfrom art_core.backends import LocalBackend",
    }
    assert violations(modules) == set()


def test_a_cycle_is_caught() -> None:
    modules = {"art_core.a": "import art_core.b", "art_core.b": "def f():\n    import art_core.a"}
    assert cycles(modules) == [frozenset({"art_core.a", "art_core.b"})]


# R4: these stay light, so a RemoteBackend client needs neither torch nor transformers.
LIGHT = [
    "art_core",
    "art_core.rollouts",
    "art_core.types",
    "art_core.capture",
    "art_core.model",
    "art_core.host.records",
    "art_core.backends.remote",
]
# ... except, today, these (each with the import chain that pulls torch in). Strict: a fix fails here.
TORCH_AT_IMPORT_TODAY: dict[str, str] = {}


@pytest.mark.parametrize(
    "module",
    [
        pytest.param(m, marks=pytest.mark.xfail(strict=True, reason=TORCH_AT_IMPORT_TODAY[m]))
        if m in TORCH_AT_IMPORT_TODAY
        else m
        for m in LIGHT
    ],
)
def test_light_modules_import_without_torch(module: str) -> None:
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"importing {module} loads {result.stdout.strip()}"
