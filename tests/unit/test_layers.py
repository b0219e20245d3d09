"""The layers of ``services/kiln`` (README, Architecture): which package may import which, read
from the source's import statements, and the engine runtime and the domain model importable in a
process without gRPC, NATS or SQLAlchemy."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "services" / "kiln"

FORBIDDEN: dict[str, tuple[str, ...]] = {
    "domain": ("kiln.",),  # but kiln.events and kiln.v1 (below)
    "ops": ("kiln.workloads", "kiln.runtime", "kiln.engine_pool", "kiln.agent_runner"),
    "runtime": (
        "kiln.engine_pool",
        "kiln.baselines",
        "kiln.agent_runner",
        "kiln.ledger",
        "kiln.board",
        "kiln.cost_model",
        "kiln.common",
        "kiln.export",
        "kiln.cli",
    ),
    "baselines": ("kiln.engine_pool", "kiln.agent_runner", "kiln.ledger"),
    "workloads": ("kiln.runtime", "kiln.engine_pool", "kiln.agent_runner", "kiln.ledger"),
    "export": ("kiln.engine_pool", "kiln.cli", "kiln.agent_runner"),
    "cli": ("kiln.agent_runner",),
    "engine_pool": ("kiln.agent_runner", "kiln.baselines"),
    # The dashboard is a client: it reads the services over gRPC and NATS, never their code.
    "dashboard": ("kiln.agent_runner", "kiln.engine_pool", "kiln.cost_model", "kiln.cli"),
}
"""Package -> module prefixes none of its files may import."""
ALLOWED: dict[str, tuple[str, ...]] = {
    # kiln.v1: the candidate's proto conversion (imported lazily, protobuf only)
    "domain": ("kiln.domain", "kiln.events", "kiln.v1"),
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_crosses_a_layer_upwards(package: str) -> None:
    crossings = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in sorted(_imports(path)):
            allowed = ALLOWED.get(package, ())
            if name.startswith(FORBIDDEN[package]) and not name.startswith(allowed):
                crossings.append(f"{path.relative_to(ROOT)} imports {name}")
    assert crossings == []


def test_runtime_and_domain_import_without_grpc_nats_or_sqlalchemy() -> None:
    script = textwrap.dedent(
        """
        import importlib, importlib.abc, pkgutil, sys

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in ("grpc", "nats", "sqlalchemy", "psycopg"):
                    raise ImportError("blocked " + name)

        sys.meta_path.insert(0, Block())
        import kiln.domain, kiln.runtime
        for package in (kiln.domain, kiln.runtime):
            for info in pkgutil.iter_modules(package.__path__):
                importlib.import_module(package.__name__ + "." + info.name)
        print(sorted(m for m in sys.modules if m.startswith("kiln.")))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert "kiln.runtime.engine" in loaded and "kiln.domain.compilation" in loaded
    assert not [m for m in loaded if m.startswith(("kiln.engine_pool", "kiln.common"))]


def _module_name(path: Path) -> str:
    parts = ("kiln", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _file_imports(path: Path, files: set[str]) -> set[str]:
    """The kiln modules (files) ``path`` imports: ``from P import m`` names the submodule P.m
    when it is a file, else P; a name that is no file stands for its nearest enclosing one."""
    found: set[str] = set()

    def nearest(name: str) -> str:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(nearest(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in files else nearest(node.module))
    return {name for name in found if name.startswith("kiln")}


def test_no_import_cycle_between_modules() -> None:
    """Every import statement (lazy and TYPE_CHECKING ones too) draws an arrow between files;
    none may close a circle. The package ``kiln`` itself (its lazy public API) is left out."""
    paths = {
        _module_name(p): p
        for p in ROOT.rglob("*.py")
        if "_pb2" not in p.name and p != ROOT / "__init__.py"
    }
    graph = {name: _file_imports(path, set(paths)) - {name} for name, path in paths.items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == [], cycles
