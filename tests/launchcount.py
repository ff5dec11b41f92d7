"""Where the suite's time goes: the processes each test file starts.

Every launch of hpctrain or of a test script pays its interpreters' start-up (importing torch, the
`torch._dynamo` import of torch.optim's first step, MPI init) before it does anything, so the number of
interpreters a file starts is the first thing to look at when the suite is slow. With
`HPCTRAIN_TEST_LAUNCHES=FILE`, tests/conftest.py appends one line per process a test starts to FILE (each
pytest-xdist worker too: the test, the interpreters it starts and its first 8 arguments, to tell `mpirun` ranks
from `hpctrain` alone), and the run ends with a table of them per test file (`table`).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Sequence


def ranks_of(argv: Sequence[str]) -> int:
    """How many Python interpreters `argv` starts: N for `mpirun -n N ...`, N + 1 for `hpctrain launch -n N`
    or `hpctrain bench ... -n N` (the launcher is one more), 1 for any other Python, 0 for anything else
    (sbatch, scancel, a shell tool)."""
    argv = [str(a) for a in argv]
    if not argv:
        return 0
    n = _option(argv, ("-n", "-np", "--n"))
    if Path(argv[0]).name == "mpirun":
        return n or 1
    if "python" not in Path(argv[0]).name:
        return 0
    if argv[1:3] == ["-m", "hpctrain"] and argv[3:4] in (["launch"], ["bench"]) and n:
        return n + 1
    return 1


def _option(argv: list[str], names: tuple[str, ...]) -> int:
    for i, arg in enumerate(argv[:-1]):
        if arg in names and argv[i + 1].isdigit():
            return int(argv[i + 1])
    for arg in argv:
        for name in names:
            if arg.startswith(name + "=") and arg[len(name) + 1:].isdigit():
                return int(arg[len(name) + 1:])
    return 0


def record(path: str, argv: Sequence[str]) -> None:
    """Append one line for a process the current test starts (one short O_APPEND write: workers share FILE)."""
    interpreters = ranks_of(argv)
    if not interpreters:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
    line = json.dumps({"test": test, "interpreters": interpreters, "argv": [str(a) for a in argv][:8]}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def table(lines: Sequence[str]) -> list[str]:
    """Per test file: the tests that started a process, the launches and the interpreters they started, the
    file that started most first."""
    files: dict[str, dict] = defaultdict(lambda: {"tests": set(), "launches": 0, "interpreters": 0})
    for line in lines:
        if not line.strip():
            continue
        rec = json.loads(line)
        row = files[rec["test"].split("::", 1)[0]]
        row["tests"].add(rec["test"])
        row["launches"] += 1
        row["interpreters"] += rec["interpreters"]
    out = [f"{'interpreters':>12} {'launches':>8} {'tests':>5}  file"]
    for name, row in sorted(files.items(), key=lambda kv: (-kv[1]["interpreters"], kv[0])):
        out.append(f"{row['interpreters']:>12} {row['launches']:>8} {len(row['tests']):>5}  {name}")
    total = [sum(r[k] for r in files.values()) for k in ("interpreters", "launches")]
    out.append(f"{total[0]:>12} {total[1]:>8} {sum(len(r['tests']) for r in files.values()):>5}  in all")
    return out
