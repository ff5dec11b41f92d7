"""Helpers of the Slurm tests: the local cluster (two slurmd, n1 and n2, on this host, from slurm/cluster.sh)
and the CLI as a user runs it.

Not a conftest.py: tests/conftest.py is imported as `conftest`, and a second one would shadow it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "slurm" / "cluster.sh"
CLI = Path(__file__).parent / "scripts" / "hpctrain_cli.py"


def _cluster(action: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CLUSTER), action], capture_output=True, text=True, timeout=timeout)


def cluster_session():
    """Start the local cluster unless it runs; yield; stop it again if this started it.

    Skips, saying why, only when the cluster cannot start (not root, no Debian packages, daemons failing).
    """
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root (it starts munged, slurmctld and slurmd): run as root, "
                    "or start it with `sudo make slurm-up` first")
    already = _cluster("status").returncode == 0
    if not already:
        up = _cluster("up")
        if up.returncode != 0:
            pytest.skip(f"the local Slurm cluster did not start (slurm/cluster.sh up exited {up.returncode}):\n"
                        f"{up.stdout}\n{up.stderr}")
    yield
    if not already:
        _cluster("down")


def cli(args: list[str], *, cwd: Path, timeout: float = 240, check: bool = True,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `hpctrain ARGS` as a user would (with the Slurm commands registered); jobs inherit `env`."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1",
               **(env or {}))
    proc = subprocess.run([sys.executable, str(CLI), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"hpctrain {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def submit_json(args: list[str], *, cwd: Path, **kw) -> dict:
    proc = cli(["submit", "--json", *args], cwd=cwd, **kw)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def wait_for(predicate, timeout: float, what: str, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
