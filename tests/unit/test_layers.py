"""The layering the README's module map promises, checked on the source: who may import whom, by package.

    base  <-  trace  <-  compute, comm  <-  data  <-  checkpoint  <-  control  <-  api, tools, bench  <-  cli
    compute, comm  <-  parallel  <-  checkpoint, control (model parallelism: groups, the split GPT, the pipeline)
    base, trace, comm  <-  horovod (Horovod's API, imported by user scripts only)

(trace, the flight recorder and the timeline, sits under comm, which feeds it.)

Every import counts, the lazy ones inside functions included. Also: no import cycle between modules, no
private name imported from another module, mpi4py only in comm, submitit only in the Slurm code, hpccm only
in the container code, and the sizes a reader can hold (modules <= 500 lines, functions <= 80).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "hpctrain"
FILES = sorted(PACKAGE.rglob("*.py"))

# package -> the hpctrain packages its modules may import (itself included)
MAY_IMPORT = {
    "base": {"base"},
    "trace": {"base", "trace"},  # the flight recorder and the timeline: fed by comm, so below it
    "compute": {"base", "compute"},
    "comm": {"base", "trace", "comm"},
    "data": {"base", "trace", "comm", "data"},  # the shard writer runs on every rank of `launch -n N -- shard` and gathers over comm
    # model parallelism: process groups and point-to-point over comm, the split GPT over compute's; control runs it
    "parallel": {"base", "trace", "compute", "comm", "parallel"},
    # what a checkpoint holds and how it is written, found and read back: under the trainer, which asks it
    "checkpoint": {"base", "trace", "compute", "comm", "data", "parallel", "checkpoint"},
    "control": {"base", "trace", "compute", "comm", "data", "parallel", "checkpoint", "control"},
    "api": {"base", "trace", "compute", "comm", "data", "parallel", "checkpoint", "control", "api"},
    "horovod": {"base", "trace", "comm", "horovod"},  # Horovod's PyTorch API over the comm layer (import hpctrain.horovod)
    "tools": {"base", "trace", "compute", "comm", "data", "parallel", "checkpoint", "control", "tools"},
    # the measurements behind the performance page: they time the trainer's own step, so they sit above control
    "bench": {"base", "trace", "compute", "comm", "data", "parallel", "checkpoint", "control", "bench"},
    "cli": {"base", "trace", "compute", "comm", "data", "parallel", "checkpoint", "control", "api", "tools", "bench",
            "cli"},
    # the library API and the host memory tuning (base.hostmem) lazily, on first use: the import changes nothing
    "__init__": {"base", "api"},
    "__main__": {"base", "cli"},
}
OWNERS = {"mpi4py": "hpctrain.comm", "submitit": "hpctrain.tools.slurm", "hpccm": "hpctrain.tools.containers"}
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 500, 80
# modules still being split up while this restructuring lands (empty when it is done)
NOT_YET: set[str] = set()


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def imported(path: Path) -> list[tuple[str, list[str]]]:
    """(absolute module, names taken from it) for every import in the file, lazy ones included."""
    here = module_name(path).split(".")
    package = here if is_package(path) else here[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.append((module, [alias.name for alias in node.names]))
    return out


MODULES = {module_name(p): p for p in FILES}


def resolve(module: str, names: list[str]) -> list[str]:
    """The hpctrain modules an import reaches: `from pkg import mod` reaches pkg.mod."""
    if not module.startswith("hpctrain"):
        return []
    reached = [module] if module in MODULES else []
    reached += [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]
    return reached or [module]


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    return parts[1]


def test_every_module_is_in_a_layer() -> None:
    assert {layer(m) for m in MODULES} <= set(MAY_IMPORT), {layer(m) for m in MODULES} - set(MAY_IMPORT)


@pytest.mark.parametrize("library", sorted(OWNERS))
def test_only_the_owner_imports(library: str) -> None:
    users = {module_name(p) for p in FILES if any(m.split(".")[0] == library for m, _ in imported(p))}
    assert users and all(u.startswith(OWNERS[library]) for u in users), (library, users)


@pytest.mark.parametrize("path", FILES, ids=lambda p: module_name(p))
def test_imports_flow_down_the_layers(path: Path) -> None:
    here = layer(module_name(path))
    wrong = {m for module, names in imported(path) for m in resolve(module, names)
             if m.startswith("hpctrain.") and layer(m) not in MAY_IMPORT[here]}
    assert not wrong, f"{module_name(path)} ({here}) may not import {sorted(wrong)}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: module_name(p))
def test_no_private_name_crosses_a_module(path: Path) -> None:
    if module_name(path) in NOT_YET:
        pytest.skip("being split up")
    private = [f"{module}.{name}" for module, names in imported(path) if module.startswith("hpctrain")
               for name in names if name.startswith("_") and not name.startswith("__")]
    assert not private, f"{module_name(path)} imports private names {private}"


def test_no_import_cycles() -> None:
    graph = {m: {t for module, names in imported(p) for t in resolve(module, names) if t in MODULES and t != m}
             for m, p in MODULES.items()}
    # a package's __init__ is imported with any of its modules: not an edge of its own design
    graph = {m: {t for t in ts if not (is_package(MODULES[t]) and m.startswith(t + "."))} for m, ts in graph.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t] if t in stack else [m, t])
            elif t not in state:
                visit(t, stack + [t])
        state[m] = 2

    graph = {m: ts - NOT_YET for m, ts in graph.items() if m not in NOT_YET}
    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


@pytest.mark.parametrize("path", FILES, ids=lambda p: module_name(p))
def test_sizes_a_reader_can_hold(path: Path) -> None:
    if module_name(path) in NOT_YET:
        pytest.skip("being split up")
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_MODULE_LINES, f"{module_name(path)}: {len(text.splitlines())} lines"
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)" for node in ast.walk(ast.parse(text))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"{module_name(path)}: {long}"


# a feature's code in its package, not modules of another named by a prefix (ckpt_a.py, ckpt_b.py); the package's
# name says what lives there. (hpctrain.control.checkpoint: the old documented name, a warning shim.)
HOMES = {"ckpt": "hpctrain.checkpoint", "checkpoint": "hpctrain.checkpoint", "bench": "hpctrain.bench"}
HOME_EXCEPTIONS = {"hpctrain.control.checkpoint", "hpctrain.cli.bench"}  # cli: one file per command group


def test_each_feature_has_one_package() -> None:
    strays = [name for name in MODULES if name not in HOME_EXCEPTIONS for prefix, home in HOMES.items()
              if name.split(".")[-1].startswith(prefix) and not (name + ".").startswith(home + ".")]
    assert not strays, f"modules outside their feature's package: {strays} (homes: {HOMES})"


# Who may hold a whole TrainConfig: the trainer (it hands each component its section), the commands, the tools
# around the layers, and the library API; everything else receives a section (base/sections.py) or plain values.
WHOLE_CONFIG_ALLOWED = ("hpctrain.control.trainer", "hpctrain.cli.", "hpctrain.tools.", "hpctrain.api",
                        "hpctrain.base.config")


def test_each_component_receives_its_section_not_the_whole_config() -> None:
    takers = []
    for path in FILES:
        name = module_name(path)
        if name.startswith(WHOLE_CONFIG_ALLOWED):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
                if any(a.annotation is not None and "TrainConfig" in ast.unparse(a.annotation) for a in args):
                    takers.append(f"{name}.{node.name}")
    assert not takers, f"these take a whole TrainConfig; give them its section instead: {takers}"


def test_train_config_is_its_sections_and_no_section_field_is_declared_twice() -> None:
    """Each training option is declared once, in its section (with its default, help and check): TrainConfig
    holds the sections themselves, no other config class re-declares a section's field (ShardConfig is another
    command's: its `seed` is the split's), and every field has one flat name (its flag and TOML key)."""
    import typing
    from dataclasses import fields

    from hpctrain.base.config import TrainConfig
    from hpctrain.base.sections import TRAIN_FLAT, TRAIN_SECTION_CLASSES

    hints = typing.get_type_hints(TrainConfig)
    assert {name: hints[name] for name in TRAIN_SECTION_CLASSES} == TRAIN_SECTION_CLASSES
    assert [f.name for f in fields(TrainConfig)] == [*TRAIN_SECTION_CLASSES, "extra"]
    declared: dict[str, list[str]] = {}
    for path in (PACKAGE / "base" / "config.py", PACKAGE / "base" / "sections.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        declared.setdefault(item.target.id, []).append(f"{path.stem}.{node.name}")
    section_fields = [(section, f.name) for section, cls in TRAIN_SECTION_CLASSES.items() for f in fields(cls)]
    twice = {f"{section}.{name}": declared[name] for section, name in section_fields
             if len([c for c in declared[name] if c != "config.ShardConfig"]) > 1}
    assert not twice, f"section fields declared again beside their section (declare each once, in its section): {twice}"
    assert sorted(TRAIN_FLAT.values()) == sorted(section_fields), "a flat name given to two fields"
