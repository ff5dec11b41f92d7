"""Sweeps: a grid of `train` flags submitted as one Slurm job array.

`--sweep KEY=V1,V2,...` (repeatable) names a train flag and its values; the grid is the cartesian product of
the lists, keys in the order given. Element i of the array runs the command with `--KEY V` of its combination
appended (a flag given twice takes its last value, so the sweep's value overrides the command's own) and
`--run-dir RUN/KEY=V[_KEY=V...]` (RUN: the command's --run-dir, values as written).

At submission the elements are written into the job folder (`sweep-HASH.json`, named by its content so that
the batch script can name it before Slurm has given the job an id). The supervisor of each element reads its
argument list there by its array index (`SLURM_ARRAY_TASK_ID`, through `base.rankenv`): no value of the grid
ever passes through a shell.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import typing
from pathlib import Path
from typing import Any, Sequence

from ...base.config import TrainConfig
from ...base.sections import TRAIN_FLAT, train_options
from ...base.durable import write_text
from ...base.errors import ConfigError, SubmissionError

# Train fields that are no flag (extra, progress) or that the sweep sets itself (run_dir).
_NOT_SWEPT = ("run_dir", "extra", "progress")


def sweep_keys() -> list[str]:
    """The keys a sweep may vary: the flags of `hpctrain train` (written as flags, without the dashes)."""
    return [name.replace("_", "-") for name in TRAIN_FLAT if name not in _NOT_SWEPT]


def _field(key: str) -> str:
    name = key.removeprefix("--").replace("-", "_")
    if name in _NOT_SWEPT or name not in TRAIN_FLAT:
        raise ConfigError(f"--sweep key {key!r} is not a flag of `hpctrain train` that a sweep can vary; valid "
                          f"keys: {', '.join(sweep_keys())}")
    return name


def _hint(name: str) -> Any:
    """The type of train flag NAME's field, in its section."""
    cls, f = train_options()[name]
    return typing.get_type_hints(cls)[f.name]


def _is_bool(name: str) -> bool:
    hint = _hint(name)
    return hint is bool or set(typing.get_args(hint)) == {bool, type(None)}


def _value(name: str, text: str) -> Any:
    """TEXT as the train flag NAME's value, checked by TrainConfig's own rules (no I/O)."""
    hint = _hint(name)
    flag = "--" + name.replace("_", "-")
    try:
        if _is_bool(name):
            if text.lower() not in ("true", "false"):
                raise ValueError("true or false")
            value: Any = text.lower() == "true"
        elif hint is int:
            value = int(text)
        elif hint is float:
            value = float(text)
        else:
            value = text
    except ValueError:
        kind = {int: "a whole number", float: "a number"}.get(hint, "true or false")
        raise ConfigError(f"--sweep {flag}: {text!r} is not {kind}") from None
    try:
        TrainConfig.flat(**{"data": Path("."), "run_dir": Path("."), name: value})
    except ConfigError as exc:
        raise ConfigError(f"--sweep: {exc}") from None
    return value


def parse_sweep(items: Sequence[str]) -> list[tuple[str, list[str]]]:
    """[(KEY as written, [values as written])] of `--sweep KEY=V1,V2,...` items, each key a train flag and
    each value one that flag takes; raises ConfigError naming the bad item."""
    grid: list[tuple[str, list[str]]] = []
    seen: set[str] = set()
    for item in items:
        key, eq, text = str(item).partition("=")
        key = key.strip().removeprefix("--")
        if not eq or not key:
            raise ConfigError(f"--sweep {item!r} must be KEY=V1,V2,... with a train flag as KEY, e.g. --sweep lr=0.01,0.1")
        name = _field(key)
        if name in seen:
            raise ConfigError(f"--sweep {key} is given twice: put all its values in one list, e.g. {key}=V1,V2")
        seen.add(name)
        values = text.split(",")
        if not text or any(not v for v in values):
            raise ConfigError(f"--sweep {item!r} has an empty value: give one or more values, e.g. {key}=V1,V2")
        if len(set(values)) < len(values):
            raise ConfigError(f"--sweep {item!r} lists a value twice: each combination needs a run directory of its own")
        for value in values:
            if "/" in value or not value.isprintable():
                raise ConfigError(f"--sweep {key}: {value!r} cannot be part of a run directory's name (no '/', no "
                                  "control characters)")
            _value(name, value)
        grid.append((key, values))
    return grid


def _flag_args(key: str, value: str) -> list[str]:
    name = _field(key)
    flag = name.replace("_", "-")
    if _is_bool(name):
        return [f"--{flag}" if value.lower() == "true" else f"--no-{flag}"]
    return [f"--{flag}", value]


def command_run_dir(command: Sequence[str]) -> str | None:
    """The last --run-dir of COMMAND (the one `train` takes), or None."""
    found = None
    for i, arg in enumerate(command):
        if arg == "--run-dir" and i + 1 < len(command):
            found = command[i + 1]
        elif arg.startswith("--run-dir="):
            found = arg[len("--run-dir="):]
    return found


def sweep_elements(sweep: Sequence[str], command: Sequence[str]) -> list[dict[str, Any]]:
    """The array's elements for `--sweep` items and COMMAND (pure): each {"task", "params" {KEY: V},
    "run_dir", "args"} where args are what the element appends to COMMAND. [] without a sweep."""
    if not sweep:
        return []
    if not command or command[0] != "train":
        raise ConfigError(f"--sweep varies flags of `hpctrain train`: the command must be `train ...`, not "
                          f"{' '.join(command[:1]) or 'nothing'!r}")
    run = command_run_dir(command)
    if not run:
        raise ConfigError("--sweep needs --run-dir RUN in the train command: each combination trains in "
                          "RUN/KEY=V[_KEY=V...]")
    grid = parse_sweep(sweep)
    elements = []
    for task, values in enumerate(itertools.product(*(vals for _, vals in grid))):
        params = {key: value for (key, _), value in zip(grid, values)}
        run_dir = str(Path(run) / "_".join(f"{key}={value}" for key, value in params.items()))
        args = [arg for key, value in params.items() for arg in _flag_args(key, value)]
        elements.append({"task": task, "params": params, "run_dir": run_dir, "args": [*args, "--run-dir", run_dir]})
    return elements


def sweep_size(sweep: Sequence[str]) -> int:
    """How many combinations `--sweep` items make (0 without a sweep)."""
    if not sweep:
        return 0
    size = 1
    for _, values in parse_sweep(sweep):
        size *= len(values)
    return size


def sweep_file(folder: Path, elements: list[dict[str, Any]]) -> Path:
    """Where the elements are written: FOLDER/sweep-HASH.json, named by its content (pure)."""
    digest = hashlib.sha256(_text(elements).encode()).hexdigest()[:12]
    return Path(folder) / f"sweep-{digest}.json"


def _text(elements: list[dict[str, Any]]) -> str:
    return json.dumps({"elements": elements}, indent=1, sort_keys=True) + "\n"


def write_sweep_file(folder: Path, elements: list[dict[str, Any]]) -> Path:
    path = sweep_file(folder, elements)
    write_text(path, _text(elements))
    return path


def element_args(path: Path, task: int | None) -> list[str]:
    """The arguments array element TASK appends to the command, read from the sweep file PATH."""
    if task is None:
        raise SubmissionError(f"--sweep {path}: this job is not an element of a job array (no SLURM_ARRAY_TASK_ID)")
    try:
        elements = json.loads(Path(path).read_text())["elements"]
        args = next(e["args"] for e in elements if e["task"] == task)
    except (OSError, ValueError, KeyError, TypeError, StopIteration) as exc:
        raise SubmissionError(f"--sweep {path}: no arguments for array element {task} ({exc!r})") from None
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise SubmissionError(f"--sweep {path}: the arguments of array element {task} are not a list of strings")
    return args


def compare_sweep(run_dirs: Sequence[str], out_dir: Path) -> dict[str, Any]:
    """The comparison report of the sweep's finished runs, written into OUT_DIR (`hpctrain.tools.compare`)."""
    from ..compare import compare_runs

    return compare_runs([Path(r) for r in run_dirs], Path(out_dir))
