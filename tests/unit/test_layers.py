"""The layering STYLE.md promises, checked on the source: who may import what."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "hpctrain"
OWNERS = {"mpi4py": {"comm.py"}, "submitit": {"slurm.py"}, "hpccm": {"containers.py"}}


def imports(path: Path) -> set[str]:
    """Top-level names of every module imported anywhere in the file (lazy imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
            elif node.level >= 1:
                names.add("." + (node.module or "").split(".")[0])
    return names


FILES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("library", sorted(OWNERS))
def test_only_the_owner_imports(library: str) -> None:
    users = {p.name for p in FILES if library in imports(p)}
    assert users == OWNERS[library], f"{library} imported outside {OWNERS[library]}: {users - OWNERS[library]}"


def test_nothing_below_the_cli_imports_it() -> None:
    offenders = [p.name for p in FILES if p.parent == PACKAGE and p.name != "__main__.py" and ".cli" in imports(p)]
    assert offenders == []


def test_lower_layers_do_not_import_upper_ones() -> None:
    lower = {"comm.py", "data.py", "checkpoint.py", "config.py", "errors.py", "env.py", "durable.py", "threads.py",
             "stop.py", "watchdog.py"}
    upper = {".trainer", ".sharding", ".slurm", ".containers", ".cli", ".api", ".bench", ".report"}
    for p in FILES:
        if p.name in lower:
            assert not imports(p) & upper, (p.name, imports(p) & upper)
