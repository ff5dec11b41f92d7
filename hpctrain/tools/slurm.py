"""Slurm: the batch script, the submission (through submitit), the job's supervisor, and job status.

The only module that imports submitit. Its parts, one per concern:

- `SubmitConfig`: what `hpctrain submit` asks for, checked in `__post_init__`.
- `render_sbatch(cfg, command)`: the batch script, a pure function (pinned by golden files). It is built by
  submitit's own sbatch writer, so the text `--dry-run` prints is byte for byte the file that is submitted.
  The script `exec`s the supervisor, which starts the ranks with `srun --mpi=pmix|pmi2 --kill-on-bad-exit=1`
  (or `mpirun` inside the allocation), each under the rank wrapper (`python -m hpctrain.tools.slurm rank`).
- `submit(cfg, command)`: `sbatch --test-only` first where the cluster allows it, then submitit's submission.
- `supervise(...)`: runs in the job (`python -m hpctrain.tools.slurm supervise`). It keeps a record of the job in
  the job folder (FOLDER/JOBID_hpctrain.jsonl) and decides what an exit means: 0 completed; 3 (every rank
  stopped on SIGTERM/SIGUSR2 and wrote one checkpoint together) is a preemption or a timeout, and the job
  requeues itself (`scontrol requeue`) up to `max_requeues` times to resume with `--resume auto`; any other
  code is a failure and never requeues.
- `run_rank(...)`: one rank's wrapper: forwards signals, notes the first failing rank, and turns the
  collective stop (exit 3) into exit 0 so --kill-on-bad-exit does not kill ranks still finishing theirs.
- `job_status`, `list_jobs`, `cancel`, `wait`: read that record together with what Slurm still knows
  (`scontrol show job`), since sacct needs slurmdbd, which many clusters (and the local one) lack.

Signals: Slurm sends SIGUSR2 `signal_delay_s` before the time limit to every task (`--signal=USR2@T`), and
`scancel --signal=USR2 JOB` does the same by hand; the trainer of every rank acts on it. With `mpirun` the
signal goes to the batch shell instead (`B:USR2`), that is to the supervisor, which hands it to mpirun, which
forwards it to every rank.

A stop signal must neither kill a process of the job nor vanish because it came early or late. Slurm signals
every process of the step (the rank wrapper and the program under it) from the moment it exists, seconds before
a trainer has imported torch and installed its handler, and SIGUSR2's default action is to terminate. So:
the wrapper starts with SIGUSR2 blocked (`env --block-signal=USR2`: pending, not lost, across exec) and takes
it over on its first line, before its own imports; it starts the program with SIGUSR2 ignored, and
`_StopRelay` keeps each SIGUSR2 and hands it on as soon as the program (or a process under it) has a handler
for it, read from /proc/PID/status; once the program has exited, SIGUSR2 is ignored, so a stop that comes after
the run's last step cannot turn a completed rank into a failed one. The supervisor does the same with srun or
mpirun. What no process of the job can see: a `scancel --signal=USR2 JOB` sent before the job's step exists
(the first fraction of a second, while the supervisor starts srun) is dropped by slurmd itself ("No steps in
jobid N to send signal 12"); `scancel --full` or `--batch` reaches the supervisor then.
"""

from __future__ import annotations

import signal
import sys

_EARLY: list[int] = []  # stop signals that reached this process before run_rank/supervise took them over


def _hold_early(signum: int, frame: object) -> None:
    _EARLY.append(signum)


# `python -m hpctrain.tools.slurm rank|supervise` is itself a process of the job: Slurm may signal it from its first
# instruction. Hold the stop signals from here, before the imports below, until run_rank/supervise take over.
if __name__ == "__main__" and sys.argv[1:2] in (["rank"], ["supervise"]):
    for _sig in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT) if sys.argv[1] == "rank" else (signal.SIGUSR2, signal.SIGTERM):
        signal.signal(_sig, _hold_early)
    # Started through `env --block-signal=USR2` (BLOCK_STOP): a SIGUSR2 that came meanwhile is pending; it
    # reaches _hold_early now. (Unblocked before any child starts: a child inherits the mask.)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR2})

import argparse  # noqa: E402 - after the early hold on purpose
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Sequence, TextIO  # noqa: E402

from ..base.rankenv import read_env  # noqa: E402
from ..base.errors import ConfigError, SubmissionError, one_of  # noqa: E402
from .launch import SUBCOMMANDS, descendants  # noqa: E402
from ..base.stop import STOP_EXIT  # noqa: E402 - every rank stopped at a step boundary and checkpointed

MPI_MODES = ("pmix", "pmi2", "mpirun")
# Slurm signals a rank's processes from their first instruction: the rank wrapper starts with SIGUSR2 blocked
# (pending, not lost, across exec), and unblocks it once its handler is in (GNU env, coreutils >= 8.31; the
# supervisor leaves it out on a node whose env cannot, see `_launchable`).
BLOCK_STOP = ("env", "--block-signal=USR2")
FINAL_STATES = ("completed", "failed", "cancelled", "timed_out", "preempted", "unknown")
# What a rank runs inside the image: bind the step's PMIx server directory (known only in the task), then
# exec apptainer with the arguments that follow. A constant string; user values only ever arrive as "$@".
CONTAINER_SH = 'exec apptainer exec --nv ${PMIX_SERVER_TMPDIR:+--bind "$PMIX_SERVER_TMPDIR"} "$@"'
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Options of `train` whose values are directories a container must see.
_PATH_OPTIONS = ("--data", "--run-dir")


@dataclass(kw_only=True, slots=True)
class SubmitConfig:
    """One `hpctrain submit`: the allocation, how ranks start, and where the job's files go."""

    nodes: int = 1
    """Nodes to allocate."""
    gpus: int = 0
    """GPUs per node; one rank per GPU."""
    tasks_per_node: int | None = None
    """Ranks per node; None means `gpus` (1 when gpus is 0)."""
    cpus_per_task: int = 1
    """CPUs per rank; also OMP_NUM_THREADS and the rank's torch threads."""
    partition: str | None = None
    """Slurm partition (None: the cluster's default)."""
    time: int = 60
    """Time limit in minutes; the job checkpoints and requeues itself before it."""
    account: str | None = None
    """Slurm account to charge."""
    container: Path | None = None
    """An Apptainer/Singularity image: every rank runs in `apptainer exec --nv IMAGE`."""
    folder: Path = Path("hpctrain-jobs")
    """Where the batch script, the logs (JOBID_RANK_log.out/.err) and the job record go."""
    env: tuple[str, ...] = ()
    """Extra environment of every rank, as K=V."""
    mpi: str = "pmix"
    """How ranks start: pmix or pmi2 (srun --mpi=...), or mpirun inside the allocation."""
    job_name: str = "hpctrain"
    """The Slurm job name."""
    signal_delay_s: int | None = None
    """Seconds before the time limit at which SIGUSR2 asks for a checkpoint (None: a quarter of the limit, at
    most 90)."""
    max_requeues: int = 10
    """How often the job may requeue itself after a checkpoint (preemption or time limit)."""
    binds: tuple[str, ...] = ()
    """Extra paths to bind into the container (the job folder and the command's --data/--run-dir always are)."""
    python: str = field(default_factory=lambda: sys.executable)
    """The Python that runs hpctrain on the nodes: the job's supervisor, and the ranks unless in a container."""
    container_python: str = "python3"
    """The Python inside the container that runs the ranks of an hpctrain subcommand."""

    def __post_init__(self) -> None:
        for name, value, low in (("--nodes", self.nodes, 1), ("--gpus", self.gpus, 0),
                                 ("--cpus-per-task", self.cpus_per_task, 1), ("--time", self.time, 1),
                                 ("--max-requeues", self.max_requeues, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"{name} {value!r} must be a whole number of at least {low}")
        if self.tasks_per_node is None:
            self.tasks_per_node = self.gpus or 1
        if not isinstance(self.tasks_per_node, int) or self.tasks_per_node < 1:
            raise ConfigError(f"--tasks-per-node {self.tasks_per_node!r} must be at least 1")
        if self.gpus and self.tasks_per_node > self.gpus:
            raise ConfigError(
                f"--tasks-per-node {self.tasks_per_node} with --gpus {self.gpus}: every rank needs a GPU of its own, "
                f"so use at most {self.gpus} tasks per node (or ask for --gpus {self.tasks_per_node})")
        if self.mpi not in MPI_MODES:
            raise one_of("--mpi", self.mpi, MPI_MODES)
        if self.signal_delay_s is None:
            self.signal_delay_s = min(90, self.time * 15)
        if not 1 <= self.signal_delay_s < self.time * 60:
            raise ConfigError(f"signal delay {self.signal_delay_s} s must be between 1 s and the time limit "
                              f"(--time {self.time} min): the checkpoint signal comes that long before the end")
        for item in self.env:
            name, eq, _ = item.partition("=")
            if not eq or not _ENV_NAME.match(name):
                raise ConfigError(f"--env {item!r} must be NAME=VALUE with a shell variable name, e.g. --env NCCL_DEBUG=INFO")
        if not self.job_name or any(c.isspace() for c in self.job_name):
            raise ConfigError(f"job name {self.job_name!r} must be one word")
        self.folder = Path(self.folder)
        if self.container is not None:
            self.container = Path(self.container)

    @property
    def world_size(self) -> int:
        return self.nodes * int(self.tasks_per_node or 1)


# -- rendering (pure) --------------------------------------------------------------------------------------

def rank_command(cfg: SubmitConfig, command: Sequence[str]) -> list[str]:
    """What every rank runs: an hpctrain subcommand through `python -m hpctrain`, or the program itself,
    inside `apptainer exec --nv IMAGE` when a container is given."""
    if not command:
        raise ConfigError("no COMMAND given: write e.g. `hpctrain submit --nodes 2 -- train --data data/ --run-dir runs/a`")
    python = cfg.python if cfg.container is None else cfg.container_python
    argv = [python, "-u", "-m", "hpctrain", *command] if command[0] in SUBCOMMANDS else list(command)
    if cfg.container is None:
        return argv
    # apptainer binds the working directory itself (the job runs where it was submitted), so relative paths
    # need nothing; absolute ones are bound one by one.
    binds = [str(cfg.folder), *(p for p in command_paths(command) if p.startswith("/")), *cfg.binds]
    return ["bash", "-c", CONTAINER_SH, "hpctrain-rank", "--bind", ",".join(dict.fromkeys(binds)),
            str(cfg.container), *argv]


def command_paths(command: Sequence[str]) -> list[str]:
    """The --data and --run-dir directories named in COMMAND (the container must see them)."""
    paths = []
    for i, arg in enumerate(command):
        for opt in _PATH_OPTIONS:
            if arg == opt and i + 1 < len(command):
                paths.append(command[i + 1])
            elif arg.startswith(opt + "="):
                paths.append(arg[len(opt) + 1:])
    return paths


def _launch_parts(cfg: SubmitConfig, command: Sequence[str]) -> list[list[str]]:
    """The launcher (srun or mpirun), the per-rank wrapper, and what each rank runs, as three argument lists.

    Each rank runs under `python -m hpctrain.tools.slurm rank`, which turns the collective stop (exit 3: every rank
    checkpointed together) into exit 0 plus a note in the job record: with --kill-on-bad-exit (and under
    mpirun) the first rank to exit 3 would otherwise kill the others while they are still finishing. It starts
    through `env --block-signal=USR2` (BLOCK_STOP), so a stop that comes while Python starts waits, pending,
    for the wrapper's first line instead of killing the rank.
    """
    if cfg.mpi == "mpirun":
        launcher = ["mpirun", "-n", str(cfg.world_size), "--map-by", f"ppr:{cfg.tasks_per_node}:node",
                    "--bind-to", "none"]
    else:
        folder = str(cfg.folder)
        launcher = ["srun", "--unbuffered", "--output", f"{folder}/%j_%t_log.out", "--error",
                    f"{folder}/%j_%t_log.err", f"--mpi={cfg.mpi}", "--kill-on-bad-exit=1"]
    wrapper = [*BLOCK_STOP, cfg.python, "-u", "-m", "hpctrain.tools.slurm", "rank", "--folder", str(cfg.folder), "--"]
    return [launcher, wrapper, rank_command(cfg, command)]


def sbatch_parameters(cfg: SubmitConfig, command: Sequence[str]) -> dict[str, Any]:
    """The keyword arguments of submitit's sbatch writer for this job (the valid ones are its parameters)."""
    setup = ["export CUDA_DEVICE_ORDER=PCI_BUS_ID", f"export OMP_NUM_THREADS={cfg.cpus_per_task}"]
    setup += [f"export {item.partition('=')[0]}={shlex.quote(item.partition('=')[2])}" for item in cfg.env]
    if cfg.container is not None:
        # apptainer refuses to bind a directory that does not exist yet (a new run directory).
        setup += [shlex.join(["mkdir", "-p", "--", *command_paths(command)])] if command_paths(command) else []
    extra: dict[str, Any] = {"requeue": True}
    if cfg.mpi == "mpirun":
        extra["signal"] = f"B:USR2@{cfg.signal_delay_s}"  # to the supervisor, which hands it to mpirun
    params: dict[str, Any] = dict(
        job_name=cfg.job_name, nodes=cfg.nodes, ntasks_per_node=cfg.tasks_per_node, cpus_per_task=cfg.cpus_per_task,
        time=cfg.time, signal_delay_s=cfg.signal_delay_s, setup=setup, use_srun=False, wckey=None,
        additional_parameters=extra,
    )
    if cfg.gpus:
        params["gpus_per_node"] = cfg.gpus
    if cfg.partition:
        params["partition"] = cfg.partition
    if cfg.account:
        params["account"] = cfg.account
    return params


def batch_command(cfg: SubmitConfig, command: Sequence[str]) -> str:
    """The script's last line: the supervisor replaces the batch shell and starts the ranks."""
    supervisor = [cfg.python, "-u", "-m", "hpctrain.tools.slurm", "supervise", "--folder", str(cfg.folder),
                  "--max-requeues", str(cfg.max_requeues), "--signal-delay", str(cfg.signal_delay_s), "--"]
    parts = [supervisor, *_launch_parts(cfg, command)]
    return "exec " + " \\\n    ".join(shlex.join(part) for part in parts)


def render_sbatch(cfg: SubmitConfig, command: Sequence[str]) -> str:
    """The batch script `hpctrain submit` writes for COMMAND (pure: no I/O, the same text every time)."""
    from submitit.slurm.slurm import _make_sbatch_string

    return _make_sbatch_string(command=batch_command(cfg, command), folder=cfg.folder,
                               **sbatch_parameters(cfg, command))


# -- submission ----------------------------------------------------------------------------------------------

def _record_path(folder: Path, job_id: str) -> Path:
    return Path(folder) / f"{job_id}_hpctrain.jsonl"


def _meta_path(folder: Path, job_id: str) -> Path:
    return Path(folder) / f"{job_id}_hpctrain.json"


def log_path(folder: Path, job_id: str, rank: int = 0, stream: str = "err") -> Path:
    """Rank `rank`'s stdout (`out`) or stderr (`err`) log of a job."""
    return Path(folder) / f"{job_id}_{rank}_log.{stream}"


def _run(argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 124, "", f"`{' '.join(argv)}` did not answer in {timeout:g} s "
                                           "(is slurmctld up? `scontrol ping`)")
    except FileNotFoundError:
        raise SubmissionError(
            f"`{argv[0]}` not found: this machine has no Slurm client. Run on a login node, start the local "
            "cluster with `make slurm-up` (slurm/cluster.sh up), or look at the script with --dry-run") from None


def test_only(script: str) -> str | None:
    """Ask Slurm whether it could run the script (`sbatch --test-only`); raise SubmissionError if not.

    Returns Slurm's answer, or None where the cluster does not allow the check.
    """
    with tempfile.NamedTemporaryFile("w", suffix=".sh", prefix="hpctrain-test-") as fh:
        fh.write(script)
        fh.flush()
        proc = _run(["sbatch", "--test-only", fh.name])
    text = (proc.stderr + proc.stdout).strip()
    if proc.returncode == 0:
        return text
    if re.search(r"not (supported|allowed|permitted)|disabled", text, re.I):
        return None
    raise SubmissionError(f"Slurm refuses this job: {text.replace(chr(10), ' ')} (check --nodes, --gpus, "
                          "--tasks-per-node, --partition and --time against `sinfo`)")


def submit(cfg: SubmitConfig, command: Sequence[str]) -> dict[str, Any]:
    """Submit COMMAND as a Slurm job through submitit; return {"job_id", "folder", "script", ...}."""
    cfg.folder = cfg.folder.resolve()
    script = render_sbatch(cfg, command)
    test_only(script)
    cfg.folder.mkdir(parents=True, exist_ok=True)
    import submitit

    try:
        executor = submitit.SlurmExecutor(folder=cfg.folder, python=shlex.quote(cfg.python))
        executor.update_parameters(**sbatch_parameters(cfg, command))
        submitted_at = time.time()
        # Our script is the command itself (no pickled function): submitit writes it and calls sbatch.
        job = executor._submit_command(batch_command(cfg, command))
    except RuntimeError as exc:
        raise SubmissionError(f"cannot submit: {exc}; start the local cluster with `make slurm-up` or use --dry-run") from None
    except Exception as exc:  # noqa: BLE001 - sbatch's own message is the useful part
        text = str(exc).strip().replace("\n", " ")
        raise SubmissionError(f"sbatch failed: {text}") from None
    info = {"job_id": str(job.job_id), "folder": str(cfg.folder), "script": str(job.paths.submission_file),
            "submitted_at": submitted_at, "command": list(command), "world_size": cfg.world_size,
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}}
    _meta_path(cfg.folder, info["job_id"]).write_text(json.dumps(info, indent=2) + "\n")
    return info


# -- inside the job --------------------------------------------------------------------------------------------

def record(folder: Path, job_id: str, event: str, **fields: Any) -> None:
    """Append one event to the job's record (one JSON object a line; appends of one line are atomic)."""
    line = json.dumps({"time": time.time(), "event": event, **fields}) + "\n"
    with open(_record_path(folder, job_id), "a") as fh:
        fh.write(line)
        fh.flush()
        os.fsync(fh.fileno())


def read_record(folder: Path, job_id: str) -> list[dict[str, Any]]:
    path = _record_path(folder, job_id)
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a killed writer
            continue
    return events


def parse_duration(text: str) -> int | None:
    """Seconds in Slurm's [days-]hh:mm:ss / mm:ss / ss; None for UNLIMITED, INVALID, NOT_SET."""
    text = text.strip()
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(?:(\d+):)?(\d+)", text)
    if not m:
        return None
    days, a, b, c = m.groups()
    parts = [int(x) for x in (a, b) if x is not None] + [int(c)]
    while len(parts) < 3:
        parts.insert(0, 0)
    h, mi, s = parts
    return int(days or 0) * 86400 + h * 3600 + mi * 60 + s


def slurm_job(job_id: str) -> dict[str, str] | None:
    """What Slurm still knows about a job (`scontrol show job -o`), or None once it has forgotten it."""
    try:
        # a controller that is down makes scontrol retry for a minute: the record alone tells then
        proc = _run(["scontrol", "show", "job", "-o", str(job_id)], timeout=10)
    except SubmissionError:  # no Slurm client here
        return None
    if proc.returncode != 0 or "JobId=" not in proc.stdout:
        return None
    info: dict[str, str] = {}
    for token in shlex.split(proc.stdout.strip().splitlines()[0]):
        key, eq, value = token.partition("=")
        if eq and key not in info:
            info[key] = value
    return info


class _StopRelay:
    """Hands the stop signal (SIGUSR2) to a child process only once the child can take it.

    The child starts with SIGUSR2 ignored (`start`), so a stop that reaches it directly (Slurm signals every
    process of the step) before it has a handler, say while Python imports torch, neither kills it nor counts:
    this process keeps every SIGUSR2 it gets and hands it on as soon as the child, or a process under it (a
    shell script's program), catches SIGUSR2 (SigCgt in /proc/PID/status). Where /proc cannot tell, it hands
    it on at once. SIGTERM and SIGINT go to the child at once: their default action is what they ask for.
    Every handler only sets a flag or sends a signal, so duplicates (Slurm's own copy and ours) are harmless.
    """

    def __init__(self, passed: Sequence[int]) -> None:
        self.passed = tuple(passed)  # signals handed on at once
        self.proc: subprocess.Popen | None = None
        self.pending = 0  # SIGUSR2s received and not yet handed on
        self.delivered = 0  # SIGUSR2s handed on to a process that catches it
        self.received: list[int] = []
        self._passed_early: list[int] = []  # SIGTERM/SIGINT that came before the child existed
        self._owner = os.getpid()
        self._proc_fs = os.path.isdir(f"/proc/{self._owner}")
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        """Take this relay's signals over from the early hold, replaying what it caught of them."""
        mine = (signal.SIGUSR2, *self.passed)
        for sig in mine:
            self._previous[sig] = signal.signal(sig, self._handle)
        early = [sig for sig in _EARLY if sig in mine]
        _EARLY[:] = [sig for sig in _EARLY if sig not in mine]
        for sig in early:
            self._handle(sig, None)

    def start(self, argv: Sequence[str]) -> subprocess.Popen:
        """Start the child with SIGUSR2 ignored, then hand on whatever arrived meanwhile."""
        self.proc = subprocess.Popen(list(argv), preexec_fn=_ignore_stop_signal)
        for sig in self._passed_early:
            self._send(self.proc.pid, sig)
        self._passed_early.clear()
        self.relay()
        return self.proc

    def _handle(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._owner:  # in the child between fork and exec: not this process's signal
            return
        self.received.append(signum)
        if signum != signal.SIGUSR2:
            if self.proc is None:
                self._passed_early.append(signum)
            elif self.proc.returncode is None:
                self._send(self.proc.pid, signum)
            return
        self.pending += 1
        self.relay()

    def relay(self) -> None:
        """Hand the held SIGUSR2 on if a process of the child can take it now."""
        if not self.pending or self.proc is None or self.proc.returncode is not None:
            return
        targets = self._catchers(self.proc.pid)
        if targets:
            self.pending = 0
            self.delivered += 1
            for pid in targets:
                self._send(pid, signal.SIGUSR2)

    def _catchers(self, pid: int) -> list[int]:
        if not self._proc_fs:
            return [pid]
        if _catches(pid, signal.SIGUSR2):
            return [pid]
        return [p for p in descendants(pid) if _catches(p, signal.SIGUSR2)]

    def wait(self) -> int:
        """Wait for the child, relaying a held SIGUSR2 while it starts; then ignore SIGUSR2 (a stop after the end
        must not kill this process while it records and exits). Returns the child's code, 128+N for signal N."""
        assert self.proc is not None
        polls = 0  # while a SIGUSR2 is held: look often at first (a trainer installs its handler within seconds)
        while True:
            polls = polls + 1 if self.pending else 0
            try:
                code = self.proc.wait(timeout=0.5 if not self.pending or polls > 200 else 0.05)
                break
            except subprocess.TimeoutExpired:
                self.relay()
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        return code if code >= 0 else 128 - code

    def restore(self) -> None:
        """Give the signals back to their previous handlers (in a job process: the early hold, see `main`)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @staticmethod
    def _send(pid: int, signum: int) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _ignore_stop_signal() -> None:
    """In the child, before exec: SIGUSR2 ignored until the program installs its own handler (exec keeps an
    ignored signal ignored), so a stop during its start-up waits in the parent instead of killing it."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def _catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (its SigCgt mask in /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _launchable(launcher: Sequence[str]) -> list[str]:
    """`launcher` as this node can run it: without BLOCK_STOP before the rank wrapper where `env` cannot block
    signals (coreutils before 8.31, e.g. RHEL 8), saying so; the ranks then start as they did before it."""
    argv, n = list(launcher), len(BLOCK_STOP)
    at = next((i for i in range(len(argv) - n) if tuple(argv[i:i + n]) == BLOCK_STOP
               and argv[i + n + 1:i + n + 5] == ["-u", "-m", "hpctrain.tools.slurm", "rank"]), None)
    if at is None:
        return argv
    try:
        works = subprocess.run([*BLOCK_STOP, "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        works = False
    if works:
        return argv
    print(f"hpctrain: `{' '.join(BLOCK_STOP)}` does not work on this node (GNU coreutils >= 8.31 has it); ranks "
          "start without it: a SIGUSR2 in a rank's first few milliseconds may end that rank", file=sys.stderr, flush=True)
    return argv[:at] + argv[at + n:]


def supervise(folder: Path, launcher: Sequence[str], *, max_requeues: int, signal_delay_s: int) -> int:
    """Run the ranks through `launcher`, record what happened, and requeue after a checkpointed stop.

    Runs as the batch shell of the job (the script `exec`s it). Returns the exit code of the job step.
    """
    # SIGUSR2 reaches the supervisor from `B:USR2@T` (mpirun) or `scancel --full/--batch`: srun and mpirun
    # forward it to every rank, so it goes to the launcher once the launcher handles it. SIGTERM reaches the
    # ranks from Slurm directly (scancel, preemption); here it must not kill the supervisor before the ranks
    # have written their checkpoint.
    relay = _StopRelay(passed=())
    relay.install()
    previous_term = signal.signal(signal.SIGTERM, lambda s, f: relay.received.append(s))
    relay.received.extend(_EARLY)  # a SIGTERM held before this line
    _EARLY.clear()
    try:
        return _supervise(relay, folder, launcher, max_requeues=max_requeues, signal_delay_s=signal_delay_s)
    finally:
        relay.restore()
        signal.signal(signal.SIGTERM, previous_term)


def _supervise(relay: _StopRelay, folder: Path, launcher: Sequence[str], *, max_requeues: int,
               signal_delay_s: int) -> int:
    env = read_env()
    job_id = env.job_id or "local"
    folder = Path(folder)
    restart = env.restart_count
    record(folder, job_id, "start", restart=restart, node=env.node_name, pid=os.getpid())
    launcher = _launchable(launcher)
    print(f"hpctrain: job {job_id} start {restart} on {env.node_name}: {shlex.join(launcher)}", file=sys.stderr, flush=True)
    relay.start(launcher)
    code = relay.wait()
    events = [e for e in read_record(folder, job_id) if e.get("restart") == restart]
    stopped = any(e.get("event") == "ranks_stopped" for e in events)
    failed = [e for e in events if e.get("event") == "rank_failed"]
    if code == 0 and not stopped:
        record(folder, job_id, "completed", restart=restart, exit_code=0)
        return 0
    if code == 0:
        code = STOP_EXIT
    if code != STOP_EXIT:
        first = min(failed, key=lambda e: (e["exit_code"] >= 128, e["time"]), default=None)
        if first is not None:
            code = first["exit_code"]
        rank = None if first is None else first.get("rank")
        record(folder, job_id, "failed", restart=restart, exit_code=code, rank=rank)
        print(f"hpctrain: job {job_id} failed (rank {rank}, exit code {code}); not requeued", file=sys.stderr, flush=True)
        return code
    # Every rank stopped at a step boundary and the checkpoint is complete. Why?
    info = slurm_job(job_id) or {}
    state = info.get("JobState", "")
    if state and state != "RUNNING":
        # Slurm ends the job itself: preemption (Slurm requeues or cancels it) or scancel (COMPLETING/CANCELLED).
        slurm_preempts = "PREEMPT" in state or "REQUEUE" in state
        record(folder, job_id, "preempted" if slurm_preempts else "cancelled", restart=restart, exit_code=code,
               slurm_state=state)
        return code
    left = _time_left(job_id)
    reason = stop_reason(left, signal_delay_s)
    if restart >= max_requeues:
        record(folder, job_id, "stopped", reason=reason, restart=restart, exit_code=code,
               note=f"requeue limit {max_requeues} reached")
        print(f"hpctrain: job {job_id} stopped ({reason}); requeue limit {max_requeues} reached", file=sys.stderr, flush=True)
        return code
    record(folder, job_id, "requeued", reason=reason, restart=restart, exit_code=code, time_left_s=left)
    print(f"hpctrain: job {job_id} stopped ({reason}) after a checkpoint; requeueing", file=sys.stderr, flush=True)
    proc_rq = _run(["scontrol", "requeue", job_id])
    if proc_rq.returncode != 0:
        record(folder, job_id, "stopped", reason=reason, restart=restart, exit_code=code,
               note=f"scontrol requeue failed: {(proc_rq.stderr or proc_rq.stdout).strip()}")
        return code
    # Slurm now ends this allocation (SIGTERM, then SIGKILL): leave on the first. Returning before that
    # would end the job as COMPLETED instead of requeued.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(60)
    return code


def run_rank(folder: Path, argv: Sequence[str]) -> int:
    """Run one rank's command; a checkpointed stop (exit 3) becomes exit 0 and, on rank 0, a record event.

    Holds SIGUSR2 until the command handles it (see `_StopRelay`): Slurm signals this wrapper and the command
    alike, and a trainer still importing torch would otherwise die of it. SIGTERM and SIGINT are passed on at
    once (Slurm may signal only this process, as mpirun does).
    """
    relay = _StopRelay(passed=(signal.SIGTERM, signal.SIGINT))
    relay.install()
    try:
        env = read_env()
        relay.start(argv)
        code = relay.wait()
    finally:
        relay.restore()
    rank = env.rank or 0
    if relay.pending:
        print(f"hpctrain: rank {rank}: a SIGUSR2 came while the program did not handle it (not yet, or no longer "
              f"after its last step); it exited with code {code}", file=sys.stderr, flush=True)
    elif relay.delivered and code == 0:
        print(f"hpctrain: rank {rank}: SIGUSR2 was handed to the program, which then completed (exit 0) instead of "
              "stopping: the signal came after its last step", file=sys.stderr, flush=True)
    if code == STOP_EXIT:
        if rank == 0:
            record(folder, env.job_id or "local", "ranks_stopped", restart=env.restart_count, exit_code=code)
        return 0
    if code:  # srun reports only the largest code (often a rank it killed); keep who failed first, and how
        record(folder, env.job_id or "local", "rank_failed", restart=env.restart_count, rank=env.rank, exit_code=code)
    return code


def stop_reason(time_left_s: int | None, signal_delay_s: int) -> str:
    """Why every rank stopped: "timeout" when the job was near its time limit (Slurm's USR2 comes
    `signal_delay_s` before it; 30 s of slack for the step to finish), else "preempted" (scancel --signal,
    a preemption, an admin)."""
    return "timeout" if time_left_s is not None and time_left_s <= signal_delay_s + 30 else "preempted"


def _time_left(job_id: str) -> int | None:
    proc = _run(["squeue", "-h", "-j", str(job_id), "-o", "%L"], timeout=10)
    return parse_duration(proc.stdout) if proc.returncode == 0 else None


# -- status, listing, logs, cancel ---------------------------------------------------------------------------

_PENDING = ("PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SUSPENDED")
_RUNNING = ("RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING", "RESIZING")
_SLURM_FINAL = {"COMPLETED": "completed", "FAILED": "failed", "CANCELLED": "cancelled", "TIMEOUT": "timed_out",
                "PREEMPTED": "preempted", "NODE_FAIL": "failed", "OUT_OF_MEMORY": "failed", "BOOT_FAIL": "failed",
                "DEADLINE": "timed_out"}


def _check_job_id(job_id: str) -> str:
    job_id = str(job_id).strip()
    if not re.fullmatch(r"\d+(_\d+)?", job_id):
        raise ConfigError(f"job id {job_id!r} is not a Slurm job id: use the number `hpctrain submit` printed "
                          "(see `hpctrain jobs`)")
    return job_id


def job_status(folder: Path, job_id: str) -> dict[str, Any]:
    """The job's state, told apart as pending, running, requeued (why), completed, failed, cancelled,
    timed_out, preempted or unknown, from the job's record and what Slurm still knows."""
    job_id = _check_job_id(job_id)
    events = read_record(folder, job_id)
    meta = _meta_path(folder, job_id)
    if meta.exists():  # a cluster whose state was wiped reuses job ids: older events are another job's
        submitted = json.loads(meta.read_text()).get("submitted_at", 0)
        events = [e for e in events if e.get("time", 0) >= submitted - 1]
    slurm = slurm_job(job_id)
    slurm_state = (slurm or {}).get("JobState")
    restarts = int((slurm or {}).get("Restarts", 0) or 0)
    # The supervisor's events decide; the ranks' own notes (ranks_stopped, rank_failed) only feed them.
    main = [e for e in events if e.get("event") not in ("ranks_stopped", "rank_failed")]
    last = main[-1] if main else {}
    starts = [e for e in events if e.get("event") == "start"]
    out: dict[str, Any] = {"job_id": job_id, "slurm_state": slurm_state, "restarts": max(restarts, len(starts) - 1, 0),
                           "last_event": last.get("event"), "reason": last.get("reason"),
                           "exit_code": last.get("exit_code"), "events": events}
    if slurm_state in _PENDING:
        if last.get("event") == "requeued" or restarts:
            out.update(state="requeued", reason=last.get("reason") if last.get("event") == "requeued" else "slurm")
        else:
            out["state"] = "pending"
    elif slurm_state in _RUNNING and last.get("event") in (None, "start", "requeued"):
        out["state"] = "running"
    elif last.get("event") == "completed":
        out["state"] = "completed"
    elif last.get("event") == "failed":
        out["state"] = "failed"
    elif last.get("event") == "cancelled" or slurm_state == "CANCELLED":
        out["state"] = "cancelled"
    elif last.get("event") == "requeued" and slurm_state in _SLURM_FINAL:  # the requeued job never restarted
        out["state"] = _SLURM_FINAL[slurm_state]
    elif last.get("event") in ("stopped", "requeued"):
        out["state"] = "timed_out" if last.get("reason") == "timeout" else "preempted"
    elif last.get("event") == "preempted":
        out["state"] = "preempted"
    elif slurm_state in _SLURM_FINAL:
        out["state"] = _SLURM_FINAL[slurm_state]
    elif slurm_state in _RUNNING:
        out["state"] = "running"
    else:
        out["state"] = "unknown"
    if out["exit_code"] is None and slurm and slurm.get("ExitCode") and out["state"] in FINAL_STATES:
        out["exit_code"] = int(slurm["ExitCode"].split(":")[0])
    return out


def list_jobs(folder: Path) -> list[dict[str, Any]]:
    """The hpctrain jobs submitted into `folder`, oldest first, each with its state."""
    jobs = []
    for meta in sorted(Path(folder).glob("*_hpctrain.json"), key=lambda p: int(p.name.split("_")[0])):
        info = json.loads(meta.read_text())
        status = job_status(folder, info["job_id"])
        jobs.append({"job_id": info["job_id"], "state": status["state"], "reason": status["reason"],
                     "restarts": status["restarts"], "submitted_at": info.get("submitted_at"),
                     "command": info.get("command")})
    return jobs


def cancel(folder: Path, job_id: str) -> None:
    """Cancel a job (scancel): its ranks get SIGTERM, checkpoint at the next step boundary, and it ends."""
    import submitit

    job_id = _check_job_id(job_id)
    job = submitit.SlurmJob(folder=Path(folder), job_id=job_id)
    try:
        job.cancel(check=True)
    except subprocess.CalledProcessError as exc:
        raise SubmissionError(f"scancel {job_id} failed: {(exc.stderr or exc.output or b'').decode().strip()}") from None


def exit_code(status: dict[str, Any]) -> int:
    """The code `--wait` returns for a finished job: 0 completed, the ranks' code on failure, 3 when it stopped
    with a checkpoint and was not requeued, 1 otherwise."""
    if status["state"] == "completed":
        return 0
    code = status.get("exit_code")
    return int(code) if isinstance(code, int) and code else 1


def follow(paths: Sequence[Path], positions: dict[Path, int], stream: TextIO) -> None:
    """Print what was appended to `paths` since the last call."""
    for path in paths:
        try:
            with open(path, "rb") as fh:
                fh.seek(positions.get(path, 0))
                data = fh.read()
                positions[path] = fh.tell()
        except FileNotFoundError:
            continue
        if data:
            stream.write(data.decode(errors="replace"))
            stream.flush()


def wait(folder: Path, job_id: str, *, stream: TextIO | None = None, poll_s: float = 1.0,
         timeout_s: float | None = None) -> dict[str, Any]:
    """Follow rank 0's log until the job has finished (through any requeues); return its final status."""
    job_id = _check_job_id(job_id)
    positions: dict[Path, int] = {}
    paths = [log_path(folder, job_id, 0, "err")]
    start = time.monotonic()
    while True:
        status = job_status(folder, job_id)
        if stream is not None:
            follow(paths, positions, stream)
        if status["state"] in FINAL_STATES and status["state"] != "unknown":
            return status
        if status["state"] == "unknown" and status["slurm_state"] is None and not status["events"] and \
                time.monotonic() - start > 30:
            return status
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise SubmissionError(f"job {job_id} still {status['state']} after {timeout_s:.0f} s")
        time.sleep(poll_s)


# -- `python -m hpctrain.tools.slurm supervise` -------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpctrain.tools.slurm", description="hpctrain's in-job supervisor")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sup = sub.add_parser("supervise", help="start the ranks, record the outcome, requeue after a checkpoint")
    sup.add_argument("--folder", type=Path, required=True)
    sup.add_argument("--max-requeues", type=int, default=10)
    sup.add_argument("--signal-delay", type=int, default=90)
    sup.add_argument("argv", nargs=argparse.REMAINDER)
    rank = sub.add_parser("rank", help="run one rank; a checkpointed stop (exit 3) exits 0 and is recorded")
    rank.add_argument("--folder", type=Path, required=True)
    rank.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not command:
        parser.error("no command after --")
    try:
        if args.cmd == "rank":
            return run_rank(args.folder, command)
        return supervise(args.folder, command, max_requeues=args.max_requeues, signal_delay_s=args.signal_delay)
    finally:
        # This process is done with the ranks: a stop that comes now (after the run's last step) must not kill
        # it on its way out (Python resets its own handlers to the default action while it exits).
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)


if __name__ == "__main__":
    sys.exit(main())
