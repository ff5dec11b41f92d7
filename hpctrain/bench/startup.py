"""`hpctrain bench startup`: the time from `hpctrain launch -n N -- train` to its first step, and where it goes.

Most of a rank's start-up is in what no code of ours shortens: importing torch, the `torch._dynamo` import
that torch.optim's first step makes, and MPI init (mpi4py initializes MPI when `mpi4py.MPI` is imported). The
rest is ours: the launcher, mpirun starting the ranks, our own imports, reading the data, building the model,
the step itself. The real command runs twice on a small dataset: once as a user runs it in a terminal (its stderr a
pseudo-terminal), for the time to the first step (when rank 0 writes the step's line of metrics) and to the
first line of output; once under
Python's import timer (PYTHONPROFILEIMPORTTIME, which slows every import a little) on every process, for the
three parts. Ours is the first minus the three.
"""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

from ..base.errors import ConfigError, HpctrainError

# the parts that are not ours, by the module whose import holds each
PARTS = {"import_torch_s": "torch", "torch_dynamo_s": "torch._dynamo", "mpi_init_s": "mpi4py.MPI"}
_IMPORT_LINE = re.compile(r"^import time:\s+\d+ \|\s+(\d+) \|( *)(\S+)\s*$")


def measure_startup(n: int = 2, *, timeout: float = 600.0) -> dict:
    """Run `hpctrain launch -n n -- train` on the digits dataset to its second step, twice (see the module),
    and return the seconds to the first step and to the first line, the three parts and ours."""
    if n < 1:
        raise ConfigError(f"-n {n} must be at least 1 rank")
    with tempfile.TemporaryDirectory(prefix="hpctrain-startup-") as tmp:
        data = Path(tmp) / "data"
        shard = subprocess.run([sys.executable, "-m", "hpctrain", "shard", "digits", str(data), "--shards", str(n)],
                               capture_output=True, text=True, timeout=timeout)
        if shard.returncode:
            raise HpctrainError(f"could not shard the digits dataset for the measurement: {shard.stderr.strip()}")
        plain = _timed_run(data, Path(tmp) / "plain", n, {}, timeout)
        timed = _timed_run(data, Path(tmp) / "timed", n, {"PYTHONPROFILEIMPORTTIME": "1"}, timeout)
    parts = import_parts(timed["stderr"])
    first_step = plain["first_step_s"]
    return {"ranks": n, "first_step_s": first_step, "first_line_s": plain["first_line_s"], **parts,
            "ours_s": first_step - sum(parts.values())}


def _timed_run(data: Path, run: Path, n: int, env: dict[str, str], timeout: float) -> dict:
    argv = [sys.executable, "-m", "hpctrain", "launch", "-n", str(n), "--", "train", "--data", str(data),
            "--run-dir", str(run), "--max-steps", "2", "--log-every", "1"]
    metrics = run / "metrics.jsonl"
    start = time.monotonic()
    terminal = not env  # the run as a person sees it; the timed one's lines are read through a pipe
    primary, secondary = pty.openpty() if terminal else (-1, subprocess.PIPE)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=secondary, env={**os.environ, **env})
    if terminal:
        os.close(secondary)
    err = os.fdopen(primary, "rb", buffering=0) if terminal else proc.stderr
    first_line: list[float] = []
    stderr: list[str] = []
    readers = [threading.Thread(target=_read, args=(proc.stdout, start, first_line, []), daemon=True),
               threading.Thread(target=_read, args=(err, start, first_line, stderr), daemon=True)]
    for reader in readers:
        reader.start()
    first_step = None
    while proc.poll() is None and time.monotonic() - start < timeout:
        if first_step is None and metrics.exists() and metrics.stat().st_size:
            first_step = time.monotonic() - start
        time.sleep(0.005)
    if proc.poll() is None:
        proc.kill()
    for reader in readers:
        reader.join(timeout=10)
    if terminal:
        err.close()
    if proc.wait() != 0 or first_step is None:
        raise HpctrainError(f"`{' '.join(argv)}` exited {proc.returncode} before its first step:\n" + "".join(
            line + "\n" for line in stderr if not _IMPORT_LINE.match(line))[-2000:])
    return {"first_step_s": first_step, "first_line_s": min(first_line) if first_line else first_step,
            "stderr": stderr}


def _read(stream: IO[bytes], start: float, first_line: list[float], keep: list[str]) -> None:
    try:
        for raw in stream:
            line = raw.decode(errors="replace").rstrip("\r\n")
            if not first_line and not line.startswith("import time:"):
                first_line.append(time.monotonic() - start)
            keep.append(line)
    except OSError:  # the pseudo-terminal's end: every process that held it has exited
        pass


def import_parts(lines: list[str]) -> dict[str, float]:
    """The seconds each of PARTS took to import, the mean over the processes that imported it (the ranks), from
    the import timer's lines of all processes together (each process prints a module once, where it first
    imports it)."""
    seen: dict[str, list[float]] = {key: [] for key in PARTS}
    for line in lines:
        match = _IMPORT_LINE.match(line)
        if not match:
            continue
        name = match.group(3)
        for key, module in PARTS.items():
            if name == module:
                seen[key].append(int(match.group(1)) / 1e6)
    return {key: (sum(times) / len(times) if times else 0.0) for key, times in seen.items()}


def format_startup(result: dict) -> str:
    """The one line `hpctrain bench startup` prints."""
    return (f"start-up on {result['ranks']} ranks: {result['first_step_s']:.2f} s to the first step, of which "
            f"import torch {result['import_torch_s']:.2f}, torch._dynamo {result['torch_dynamo_s']:.2f}, "
            f"MPI init {result['mpi_init_s']:.2f}, ours {result['ours_s']:.2f} (the first line after "
            f"{result['first_line_s']:.2f} s)")
