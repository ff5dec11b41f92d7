"""The processes of one chaos run: found through /proc, signalled, killed and reaped by PID.

Processes are found through /proc only (psutil is not installed): each run carries a unique
`HPCTRAIN_CHAOS_TOKEN` in its environment, which `mpirun` passes on to the ranks, so the launcher, mpirun
and every rank of a run are found even after one of them died and its children were re-parented (a warm rank
of the suite is found as its stand-in, which passes signals on to the copy and dies with it; SIGSTOP, which it
cannot pass on, is sent to both). The
process that runs cases becomes a child subreaper (`PR_SET_CHILD_SUBREAPER`) while it does, so those
orphans become its children and are reaped here (PID 1 of this machine does not reap orphans).

`run_job` runs one `hpctrain launch` command to its end or its deadline and delivers one event (a signal
to the launcher or to one rank) at its planned moment; whatever happens, every process of the run is
killed and reaped before it returns.
"""

from __future__ import annotations

import ctypes
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

STARTUP = Path(__file__).resolve().parents[1] / "startup"
sys.path.insert(0, str(STARTUP))
from warmranks import SOCKET_VAR, copy_of, with_copy  # noqa: E402

PYTHON = sys.executable
TOKEN_VAR = "HPCTRAIN_CHAOS_TOKEN"
SIGNALS = {"term": signal.SIGTERM, "usr2": signal.SIGUSR2, "kill9": signal.SIGKILL, "stop": signal.SIGSTOP}

@dataclass
class Proc:
    pid: int
    ppid: int
    state: str  # R, S, T (stopped), Z (zombie), ...
    name: str
    rank: int | None  # OMPI_COMM_WORLD_RANK, for processes mpirun started


def base_env(token: str | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a run: no MPI rank variables of ours, root allowed, the run's token."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_WORLD", "PMIX_", TOKEN_VAR))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1")
    env.update(extra or {})
    if env.get(SOCKET_VAR):  # the suite's warm ranks: their hand-over runs from tests/startup's sitecustomize
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(STARTUP), env.get("PYTHONPATH")]))
    if token:
        env[TOKEN_VAR] = token
    return env


def read_proc(pid: int) -> tuple[int, str, str] | None:
    """(ppid, state, name) from /proc/PID/stat, or None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name = text[text.index("(") + 1:text.rindex(")")]
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), fields[0], name


def scan(token_prefix: str) -> dict[int, Proc]:
    """Every live process whose environment holds a token starting with `token_prefix` (zombies have none)."""
    marker = f"{TOKEN_VAR}={token_prefix}".encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if marker not in environ:
            continue
        info = read_proc(pid)
        if info is None:
            continue
        rank = None
        for item in environ.split(b"\0"):
            if item.startswith(b"OMPI_COMM_WORLD_RANK="):
                rank = int(item.split(b"=", 1)[1])
        found[pid] = Proc(pid, info[0], info[1], info[2], rank)
    return found


def rank_processes(procs: dict[int, Proc]) -> dict[int, Proc]:
    """The rank processes mpirun started: those with a rank whose parent has none (not their own children)."""
    ranks: dict[int, Proc] = {}
    for p in sorted(procs.values(), key=lambda p: p.pid):
        parent = procs.get(p.ppid)
        if p.rank is not None and (parent is None or parent.rank is None) and p.rank not in ranks:
            ranks[p.rank] = p
    return ranks


def holds(pid: int, sig: int) -> bool:
    """Whether `pid` blocks or catches `sig` now (SigBlk | SigCgt in /proc/PID/status). A warm rank of the suite
    holds it when both its stand-in (which catches every signal to pass it on, once its copy exists) and the
    copy do: either dies of a signal it does not hold, and the other with it."""
    copy = copy_of(pid)
    return _holds(pid, sig) and (copy is None or _holds(copy, sig))


def _holds(pid: int, sig: int) -> bool:
    masks = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("SigBlk:", "SigCgt:")):
                masks |= int(line.split()[1], 16)
    except OSError:
        return True
    return bool(masks >> (sig - 1) & 1)


def send(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


_ACTIVE_LAUNCHERS: set[int] = set()  # launcher PIDs that a Popen owns (and will reap) right now
_ACTIVE_LOCK = threading.Lock()
ABORT = threading.Event()  # set on Ctrl-C: every running job is killed and reaped, no new one starts


def kill_all(token: str, launcher: subprocess.Popen) -> list[str]:
    """SIGKILL every process of a run, ranks first, then mpirun, then the launcher; returns what was killed."""
    killed: list[str] = []
    for _ in range(100):
        procs = {p.pid: p for p in scan(token).values() if p.state != "Z"}
        if launcher.poll() is None and launcher.pid not in procs:
            procs[launcher.pid] = Proc(launcher.pid, os.getpid(), "?", "launcher", None)
        if not procs:
            break
        order = sorted(procs.values(), key=lambda p: (p.rank is None, p.pid == launcher.pid, p.pid))
        for p in order:
            send(p.pid, signal.SIGCONT)
            if send(p.pid, signal.SIGKILL):
                label = f"{p.pid} {p.name}" + (f" (rank {p.rank})" if p.rank is not None else "")
                if label not in killed:
                    killed.append(label)
        time.sleep(0.1)
    try:
        launcher.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    return killed


_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37
ORPHAN_NAMES = ("mpirun", "orterun", "orted", "python", "python3", "hpctrain")


def _subreaper() -> bool:
    value = ctypes.c_int(0)
    _libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(value), 0, 0, 0)
    return bool(value.value)


@contextmanager
def subreaper() -> Iterator[None]:
    """While inside, orphans of our runs (mpirun after its launcher died) become our children to reap."""
    was = _subreaper()
    if not was:
        _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    try:
        yield
    finally:
        reap_orphans()
        if not was:
            _libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def reap_orphans(pids: set[int] | None = None) -> list[int]:
    """Reap zombie children that no Popen owns: the given PIDs, or any of our runs' process names."""
    me, reaped = os.getpid(), []
    candidates = pids if pids is not None else {int(e) for e in os.listdir("/proc") if e.isdigit()}
    with _ACTIVE_LOCK:
        owned = set(_ACTIVE_LAUNCHERS)
    for pid in candidates - owned:
        info = read_proc(pid)
        if info is None or info[0] != me or info[1] != "Z":
            continue
        if pids is None and not info[2].startswith(ORPHAN_NAMES):
            continue
        try:
            os.waitpid(pid, os.WNOHANG)
            reaped.append(pid)
        except ChildProcessError:
            pass
    return reaped


# --- one run of a command ----------------------------------------------------------------------------


@dataclass
class EventPlan:
    """When and to whom. The event comes `delay_s` after the run reaches its anchor: "start" the launch,
    "train" the first step (metrics.jsonl appears), "end" the summary (summary.json appears). Start-up takes
    seconds and training often a fraction of one, so anchoring on phases (each delay a fraction of that
    phase in the reference run) spreads events over start-up, training, validation, checkpoint writes, the
    final save and the exit instead of mostly over `import torch`."""

    event: str
    target_rank: int | None
    delay_s: float
    anchor: str
    window_s: float


@dataclass
class RunResult:
    name: str  # ref (the uninterrupted reference), run (with the event), resume, pair (the partner configuration)
    command: str
    rc: int | None  # None: hung (killed by the harness)
    seconds: float
    hung: bool = False
    hang_reason: str = ""
    killed: list[str] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)
    train_start_s: float | None = None  # when metrics.jsonl appeared: the training loop began
    summary_at_s: float | None = None  # when summary.json appeared: training, validation and final save done
    plan: EventPlan | None = None
    event_delivered: bool = False
    event_unheld: bool = False  # the target neither blocked nor caught the signal when it was sent
    event_at_s: float | None = None
    event_pid: int | None = None
    moment: str = ""
    summary: dict | None = None
    stderr_tail: str = ""
    rank_logs: dict[str, str] = field(default_factory=dict)
    run_dir: str = ""
    error_lines: list[str] = field(default_factory=list)  # console lines (stdout and stderr) starting "error:"

    def exit_label(self) -> str:
        if self.hung:
            return "HANG"
        label = signal.Signals(-self.rc).name if self.rc is not None and self.rc < 0 else str(self.rc)
        return label + ("(unheld)" if self.died_of_an_unheld_stop() else "")

    def died_of_an_unheld_stop(self) -> bool:
        """A stop signal (not kill -9 or SIGSTOP, which nothing can hold) ended the run by its default action."""
        stop = self.plan is not None and self.plan.event.split("-")[0] in ("term", "usr2")
        return stop and self.event_unheld and self.rc not in (0, 3)


PROGRESS_WINDOW_S = 20.0  # past its deadline a run with no event is a hang only if its files stood still this long
HARD_CAP = 3  # ... and never past this many deadlines


def _progressing(run_dir: Path) -> bool:
    """Whether the run moved in the last PROGRESS_WINDOW_S seconds: it wrote its metrics or a rank log, or a
    rank entered a new wait (every step enters the gradient allreduce: its heartbeat's `since`). A heartbeat
    alone is no sign: the watchdog's thread beats in a hung rank too."""
    times = [f.stat().st_mtime for f in [run_dir / "metrics.jsonl", *(run_dir / "logs").glob("rank-*.log")]
             if f.exists()]
    for beat in (run_dir / "logs").glob("rank-*.heartbeat"):
        try:
            times.append(float(json.loads(beat.read_text())["since"]))
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return time.time() - max(times, default=0.0) < PROGRESS_WINDOW_S


def run_job(name: str, argv: list[str], run_dir: Path, log_dir: Path, *, deadline_s: float, token: str,
            plan: EventPlan | None = None, expected_steps: int = 0, env: dict[str, str] | None = None) -> RunResult:
    """Run `argv` (an `hpctrain launch` command) to its end or its deadline, delivering `plan`'s event.

    Whatever happens (a hang, an exception, Ctrl-C) every process of the run is killed and reaped before
    this returns.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    out, err = log_dir / f"{name}.stdout", log_dir / f"{name}.stderr"
    start = time.monotonic()
    with open(out, "w") as fout, open(err, "w") as ferr:
        proc = subprocess.Popen(argv, stdout=fout, stderr=ferr, stdin=subprocess.DEVNULL, env=base_env(token, env),
                                start_new_session=True)
    with _ACTIVE_LOCK:
        _ACTIVE_LAUNCHERS.add(proc.pid)
    result = RunResult(name, shlex.join(argv), None, 0.0, plan=plan, run_dir=str(run_dir))
    seen: set[int] = set()
    cutoff = start + deadline_s
    fresh = not (run_dir / "metrics.jsonl").exists()  # a resumed run appends to the old one
    stopped: list[int] = []
    try:
        next_scan = 0.0
        while proc.poll() is None:
            now = time.monotonic()
            if fresh and result.train_start_s is None and (run_dir / "metrics.jsonl").exists():
                result.train_start_s = now - start
            if fresh and result.summary_at_s is None and (run_dir / "summary.json").exists():
                result.summary_at_s = now - start
            procs = None
            if now >= next_scan:  # remember every process of the run, to reap it even once orphaned
                procs = scan(token)
                seen.update(procs)
                next_scan = now + 0.25
            if plan is not None and result.event_at_s is None and due(plan, now - start, result):
                procs = procs if procs is not None else scan(token)
                pid = proc.pid if plan.target_rank is None else getattr(rank_processes(procs).get(plan.target_rank), "pid", None)
                if pid is not None:  # a rank not started yet is waited for
                    result.moment = moment(run_dir, now - start, result.train_start_s, expected_steps)
                    sig = SIGNALS[plan.event.split("-")[0]]
                    result.event_unheld = not holds(pid, sig)
                    if sig == signal.SIGSTOP:  # a warm rank's stand-in cannot pass it on: its copy is stopped too
                        stopped = with_copy(pid)
                        for p in stopped[:-1]:
                            send(p, sig)
                    result.event_delivered = send(pid, sig)
                    result.event_at_s, result.event_pid = now - start, pid
                    if result.event_delivered:
                        cutoff = min(cutoff, now + plan.window_s)
            if ABORT.is_set():
                result.hang_reason = f"{name}: interrupted (Ctrl-C)"
                break
            if now >= cutoff and not result.event_delivered and now < start + HARD_CAP * deadline_s \
                    and _progressing(run_dir):  # slow on a loaded node, not hung: give it more time
                cutoff = now + PROGRESS_WINDOW_S
            if now >= cutoff:
                result.hung = True
                after = (f"{plan.window_s:.0f} s after {plan.event} at +{result.event_at_s:.1f}s"
                         if result.event_delivered else f"past its {deadline_s:.0f} s deadline")
                result.hang_reason = f"{name}: still running {after}; {progress(run_dir, expected_steps)}"
                break
            time.sleep(0.01)
        if plan is not None and result.event_at_s is None:
            result.moment = f"{time.monotonic() - start:.1f}s ended first (not delivered)"
    finally:
        if result.hung or proc.poll() is None:  # cut off, or an exception (Ctrl-C) left it running
            result.hung = True
            result.hang_reason = result.hang_reason or f"{name}: interrupted by the harness"
            result.killed = kill_all(token, proc)
        else:
            for pid in stopped:
                send(pid, signal.SIGCONT)  # a stopped rank the job left behind must be able to die
            result.leftovers = leftovers(token)
            if result.leftovers:
                kill_all(token, proc)
        result.seconds = time.monotonic() - start
        result.rc = None if result.hung else proc.returncode
        with _ACTIVE_LOCK:
            _ACTIVE_LAUNCHERS.discard(proc.pid)
        reap_orphans(seen | {p.pid for p in scan(token).values()})
    return _collect(result, run_dir, out, err)


def _collect(result: RunResult, run_dir: Path, out: Path, err: Path) -> RunResult:
    """What the run left: its summary, the console's error lines, the tails of stderr and the rank logs."""
    result.summary = read_json(run_dir / "summary.json")
    console = out.read_text(errors="replace").splitlines() + err.read_text(errors="replace").splitlines()
    result.error_lines = [line.strip()[:400] for line in console if line.startswith("error:")][:10]
    result.stderr_tail = tail(err.read_text(errors="replace"), 25)
    result.rank_logs = {p.name: tail(p.read_text(errors="replace"), 8) for p in sorted((run_dir / "logs").glob("rank-*.log"))}
    return result


def due(plan: EventPlan, elapsed: float, run: RunResult) -> bool:
    """`delay_s` into the anchor's phase, or at its end when this run gets there sooner than the reference did."""
    begin = {"start": 0.0, "train": run.train_start_s, "end": run.summary_at_s}[plan.anchor]
    end = {"start": run.train_start_s, "train": run.summary_at_s, "end": None}[plan.anchor]
    return begin is not None and (elapsed >= begin + plan.delay_s or end is not None)


def leftovers(token: str, grace_s: float = 5.0) -> list[str]:
    """Processes of the run still alive `grace_s` after the launcher exited."""
    end = time.monotonic() + grace_s
    while True:
        alive = [p for p in scan(token).values() if p.state != "Z"]
        if not alive or time.monotonic() >= end:
            return [f"{p.pid} {p.name} state {p.state}" + (f" rank {p.rank}" if p.rank is not None else "") for p in alive]
        time.sleep(0.1)


def moment(run_dir: Path, elapsed: float, train_start: float | None, expected: int) -> str:
    """Where the run was when the event came: start-up, training (last logged step), checkpoint write, end."""
    if train_start is None:
        return f"{elapsed:.1f}s start-up"
    if (run_dir / "summary.json").exists():
        return f"{elapsed:.1f}s after summary"
    last = last_logged_step(run_dir)
    if any((run_dir / "checkpoints").glob(".tmp-step-*")):
        phase = "ckpt write"
    elif last >= expected:
        phase = "final save"
    else:
        phase = "training"
    return f"{elapsed:.1f}s {phase} (logged {last}/{expected})"


def progress(run_dir: Path, expected: int) -> str:
    beats = []
    for path in sorted((run_dir / "logs").glob("rank-*.heartbeat")):
        beat = read_json(path) or {}
        beats.append(f"rank {beat.get('rank')} step {beat.get('step')} phase {beat.get('phase')}")
    return f"last logged step {last_logged_step(run_dir)}/{expected}" + (f"; heartbeats: {', '.join(beats)}" if beats else "")


def last_logged_step(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue
    return 0


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def tail(text: str, lines: int) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])

