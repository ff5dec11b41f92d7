"""Shared test helpers: run hpctrain under a real `mpirun`, and small real datasets on tmp_path."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

import launchcount

ROOT = Path(__file__).resolve().parents[1]
# The two pytest workers' jobs share the cores: more ranks than cores, which no mpirun of theirs can see. A rank
# waiting in MPI (a blocking collective spins) yields its core to whatever else can run, as Open MPI does by
# itself on a node it knows is oversubscribed; every process the tests start inherits this.
os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
PYTHON = sys.executable
CHECKS = ROOT / "tests" / "mpi" / "scripts" / "checks.py"
SITE = ROOT / "tests" / "startup"  # its sitecustomize: whole lines, and warm ranks (warmranks.py)
sys.path.insert(0, str(SITE))
import warmranks  # noqa: E402


def mpi_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(SITE), env.get("PYTHONPATH")])))
    env.update(extra)
    return env


def mpirun(n: int, args: list[str], *, timeout: float = 300, check: bool = True, python_module: bool = True,
           cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `python -m hpctrain ARGS` (or a python script when python_module is False) on n real MPI ranks."""
    cmd = ["mpirun", "-n", str(n), "--oversubscribe", "--bind-to", "none", PYTHON]
    cmd += ["-m", "hpctrain", *args] if python_module else list(args)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or mpi_env(), cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def hpctrain(args: list[str], *, timeout: float = 300, check: bool = True, env: dict[str, str] | None = None,
             cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run the CLI as a user would, in a fresh process with no launcher."""
    proc = subprocess.run([PYTHON, "-m", "hpctrain", *args], capture_output=True, text=True, timeout=timeout,
                          env=env or mpi_env(), cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"hpctrain {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def mpi_checks(n: int, scripts: list[list[str]], *, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run several check scripts (each a list: the script's path and its arguments) on n real MPI ranks in one
    launch (tests/mpi/scripts/checks.py): the ranks start once for all of them. Not checked: each test asserts
    its own script's marker and the launch's exit code, so the failing script's test shows its traceback. A
    launch past `timeout` (the sum of its scripts' own) comes back failed, so that no test launches it again."""
    args = [str(CHECKS)]
    for script in scripts:
        args += [*map(str, script), "---"]
    try:
        return mpirun(n, args, python_module=False, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        out, err = (text.decode() if isinstance(text, bytes) else text or "" for text in (exc.stdout, exc.stderr))
        return subprocess.CompletedProcess(exc.cmd, -9, out, f"{err}\nkilled after {timeout} s")


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="session")
def digits2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits dataset in 2 shards (read-only for tests)."""
    out = tmp_path_factory.mktemp("digits") / "data"
    hpctrain(["shard", "digits", str(out), "--shards", "2"])
    return out


@pytest.fixture(scope="session", autouse=True)
def warm_ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """This worker's warm-rank server (tests/startup/warmranks.py): the MPI ranks its tests start fork from a
    process that imported torch once. `HPCTRAIN_WARM_RANKS=0` runs every rank cold."""
    if os.environ.get(warmranks.SOCKET_VAR) == "0":
        os.environ.pop(warmranks.SOCKET_VAR)
        yield
        return
    folder = tmp_path_factory.mktemp("warm")
    path = str(folder / "s")
    log = open(folder / "server.log", "w")
    server = subprocess.Popen([PYTHON, str(SITE / "warmranks.py"), path], env=mpi_env(), stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        ready = bool(select.select([server.stdout], [], [], 300)[0]) and server.stdout.readline().strip() == "ready"
        if ready:
            os.environ[warmranks.SOCKET_VAR] = path
        yield
    finally:
        os.environ.pop(warmranks.SOCKET_VAR, None)
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=30)
        log.close()


@pytest.fixture(autouse=True)
def _cold_ranks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test marked `cold` starts its ranks as fresh processes (see tests/startup/warmranks.py for when)."""
    if request.node.get_closest_marker("cold"):
        monkeypatch.delenv(warmranks.SOCKET_VAR, raising=False)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every unit test is in the quick tier (`-m quick`, `make check`) by its folder."""
    for item in items:
        if item.nodeid.startswith("tests/unit/"):
            item.add_marker(pytest.mark.quick)


def pytest_configure(config: pytest.Config) -> None:
    """`HPCTRAIN_TEST_LAUNCHES=FILE`: count the processes each test starts (tests/launchcount.py)."""
    path = os.environ.get("HPCTRAIN_TEST_LAUNCHES")
    if not path or getattr(subprocess.Popen, "_counted", False):
        return
    if not hasattr(config, "workerinput") and os.path.exists(path):
        os.unlink(path)  # a fresh count per run; the workers start after the controller's configure
    start = subprocess.Popen.__init__

    def counted(self: subprocess.Popen, args: object, *rest: object, **kw: object) -> None:
        if isinstance(args, (list, tuple)):
            launchcount.record(path, args)
        start(self, args, *rest, **kw)

    subprocess.Popen.__init__ = counted  # type: ignore[method-assign]
    subprocess.Popen._counted = True  # type: ignore[attr-defined]


def pytest_terminal_summary(terminalreporter: object, config: pytest.Config) -> None:
    path = os.environ.get("HPCTRAIN_TEST_LAUNCHES")
    if path and not hasattr(config, "workerinput") and os.path.exists(path):
        terminalreporter.write_sep("=", "processes started per test file (HPCTRAIN_TEST_LAUNCHES)")
        for line in launchcount.table(Path(path).read_text().splitlines()):
            terminalreporter.write_line(line)


# The scopes that keep a worker longest: seconds of one worker in a two-worker `make test` (`--durations=0`,
# summed per scope; 2026-12-07). They are handed out first, longest first, so that the many short files fill
# the end of the run on both workers instead of a long one ending it alone. Refresh it when a file grows.
SLOWEST_SCOPES = {"tests/slurm": 240, "tests/mpi/test_hangs_mpi.py": 115, "tests/chaos/test_chaos.py": 85,
                  "tests/mpi/test_checkpoint_mpi.py": 65, "tests/mpi/test_zero_mpi.py": 60,
                  "tests/mpi/test_stop_signals_mpi.py": 55, "tests/mpi/test_promise_matrix_mpi.py": 50,
                  "tests/mpi/test_examples_mpi.py": 45, "tests/mpi/test_startup_measure_mpi.py": 45,
                  "tests/mpi/test_warm_ranks_mpi.py": 40, "tests/mpi/test_docs_commands.py": 40}


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """`--dist loadfile` (`make test TEST_WORKERS=2`) keeps each file's tests on one worker, so its module
    fixtures are built once; here the Slurm files count as one file: one worker owns the local cluster. The
    slowest scopes go first (SLOWEST_SCOPES), then the others, those with the most tests first."""
    if config.getoption("dist") != "loadfile":
        return None
    from collections import OrderedDict

    from xdist.scheduler import LoadScopeScheduling

    class FilesAndSlurm(LoadScopeScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "tests/slurm" if path.startswith("tests/slurm/") else path

        def _assign_work_unit(self, node: object) -> None:
            if not self.ordered:  # the first assignment: the queue is complete
                self.workqueue = OrderedDict(sorted(self.workqueue.items(),
                                                    key=lambda unit: -SLOWEST_SCOPES.get(unit[0], 0)))
                self.ordered = True
            super()._assign_work_unit(node)

    return FilesAndSlurm(config, log)
