"""A randomized end-to-end hang matrix for `hpctrain launch -n W -- train ...`.

A *case* is one ordinary, valid training configuration (world size, shard set, batch size, epochs,
`--max-steps`, accumulation, overlap, wire format, checkpoint interval, ...) plus one *event* at a random
moment: nothing, SIGTERM/SIGUSR2 to the launcher or to one rank, `kill -9` of one rank, or SIGSTOP of one
rank. `draw_case(seed, index, data)` is a pure function of (seed, index), so any failure reruns alone
(`python benchmarks/soak.py --seed S --case K`). `Harness.run_case` runs it and judges it against the
contract (README "Checkpoints and restart", "Hangs and failures", CONTRACT.md):

- no event: exit 0, summary `steps` = the expected total, `ranks_in_sync`;
- SIGTERM/SIGUSR2 (launcher or a rank): exit 3 (stopped, checkpoint written) or 0 (already finished)
  within 30 s of the signal; never killed by the signal, unless it reached a process that at that instant
  neither blocked nor caught it (its SigBlk/SigCgt in /proc, read just before sending): the first
  milliseconds of the launcher's interpreter, or of a rank's `env` wrapper before it blocks the signals.
  No program can see a signal then; the default action ends it, and the resume below must still be exact;
- `kill -9` of a rank: non-zero exit within 30 s (0 if it had already finished);
- SIGSTOP of a rank: non-zero exit within `--collective-timeout` + 30 s (0 if it had already finished);
- after any non-zero exit, the same command again (`--resume auto`) exits 0 with the expected `steps` and
  the `param_sha256` of an uninterrupted run of the same configuration (run once per configuration and
  cached); an exit 0 after an event must give that hash too;
- every run ends within its deadline (else it is a HANG: every process of it is killed by PID), and
  leaves no process behind.

Processes are found through /proc only (psutil is not installed): each run carries a unique
`HPCTRAIN_CHAOS_TOKEN` in its environment, which `mpirun` passes on to the ranks, so the launcher, mpirun
and every rank of a run are found even after one of them died and its children were re-parented. The
process that runs cases becomes a child subreaper (`PR_SET_CHILD_SUBREAPER`) while it does, so those
orphans become its children and are reaped here (PID 1 of this machine does not reap orphans).
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

from hpctrain.base.stop import EDGE_FLOOR_S

PYTHON = sys.executable
TOKEN_VAR = "HPCTRAIN_CHAOS_TOKEN"

# --- what a case may be ------------------------------------------------------------------------------

EVENTS = ("none", "term-launcher", "usr2-launcher", "term-rank", "usr2-rank", "kill9-rank", "stop-rank")
SIGNALS = {"term": signal.SIGTERM, "usr2": signal.SIGUSR2, "kill9": signal.SIGKILL, "stop": signal.SIGSTOP}
# Sources (name, samples): digits is real data; the small synthetic sets give short and empty last batches.
SOURCES = (("digits", 1797), ("digits", 1797), ("synthetic:39:5:3", 39), ("synthetic:203:8:4", 203),
           ("synthetic:97:16:10", 97))
VAL_FRACTIONS = (0.0, 0.1, 0.25)
BATCH_SIZES = (1, 2, 3, 5, 7, 8, 13, 16, 32, 50, 64, 100, 256)
MAX_TOTAL_STEPS = 300  # a step takes about a millisecond; start-up (import torch) dominates a run
SIGNAL_WINDOW_S = 30.0  # a stop signal or kill -9 must end the job within this
STOP_WINDOW_EXTRA_S = 30.0  # a SIGSTOPped rank: --collective-timeout (at the edges of a run EDGE_FLOOR_S) plus this

# --- data --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataSpec:
    """One shard set: `hpctrain shard SOURCE OUT --shards K --val-fraction F`."""

    source: str
    shards: int
    val_fraction: float

    @property
    def name(self) -> str:
        return f"{self.source.replace(':', '-')}_k{self.shards}_v{self.val_fraction:g}"

    def short(self) -> str:
        return f"{self.source}/{self.shards}sh/v{self.val_fraction:g}"


def feasible_shards(samples: int, val_fraction: float, world: int) -> list[int]:
    """Shard counts `shard` accepts (no more shards than samples in a non-empty split) that W divides."""
    n_val = int(round(samples * val_fraction))  # as hpctrain.data.sharding does
    limit = min(samples - n_val, n_val if n_val else samples, 12)
    return [world * m for m in (1, 2, 3, 4) if world * m <= limit]


class DataCache:
    """Shard sets built on first use (once per session, thread-safe) in ROOT, with their manifests."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._lock = threading.Lock()
        self._manifests: dict[DataSpec, dict] = {}

    def path(self, spec: DataSpec) -> Path:
        return self.root / spec.name

    def manifest(self, spec: DataSpec) -> dict:
        with self._lock:
            if spec not in self._manifests:
                out = self.path(spec)
                if not (out / "manifest.json").exists():
                    self._build(spec, out)
                self._manifests[spec] = json.loads((out / "manifest.json").read_text())
            return self._manifests[spec]

    def _build(self, spec: DataSpec, out: Path) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        cmd = [PYTHON, "-m", "hpctrain", "shard", spec.source, str(out), "--shards", str(spec.shards),
               "--val-fraction", str(spec.val_fraction)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=base_env())
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")


def rank_samples(manifest: dict, world: int) -> list[int]:
    """Training samples of each rank: rank r reads shards r, r+W, r+2W, ... (README "Data")."""
    shards = manifest["splits"]["train"]["shards"]
    return [sum(int(s["samples"]) for s in shards[r::world]) for r in range(world)]


def steps_per_epoch(counts: list[int], batch_size: int, accumulate: int) -> int:
    """Every rank runs as many steps as the rank with the most samples needs."""
    return math.ceil(max(counts) / (batch_size * accumulate))


# --- a case ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One configuration and one event; every field is drawn from (seed, index) by `draw_case`."""

    seed: int
    index: int
    world: int
    data: DataSpec
    batch_size: int
    accumulate: int
    epochs: int
    max_steps: int
    overlap: bool
    compress: str
    checkpoint_every: int
    log_every: int
    collective_timeout: int
    train_seed: int
    steps_per_epoch: int
    expected_steps: int
    max_steps_note: str  # how max-steps was chosen, e.g. "end of epoch 2 - 1"
    event: str
    target_rank: int | None  # for the *-rank events
    anchor: str  # start-up, training (first step to summary.json) or end (summary.json to exit): see `EventPlan`
    fraction: float

    def train_args(self, data_dir: Path, run_dir: Path) -> list[str]:
        return ["--data", str(data_dir), "--run-dir", str(run_dir), "--batch-size", str(self.batch_size),
                "--accumulate", str(self.accumulate), "--epochs", str(self.epochs), "--max-steps", str(self.max_steps),
                "--overlap" if self.overlap else "--no-overlap", "--grad-compression", self.compress,
                "--checkpoint-every", str(self.checkpoint_every), "--log-every", str(self.log_every),
                "--collective-timeout", str(self.collective_timeout), "--seed", str(self.train_seed)]

    def config_key(self) -> tuple:
        """What determines the final parameters: the configuration without the event."""
        return (self.world, self.data, self.batch_size, self.accumulate, self.epochs, self.max_steps, self.overlap,
                self.compress, self.checkpoint_every, self.log_every, self.collective_timeout, self.train_seed)

    def summary(self) -> str:
        return (f"W{self.world} {self.data.short()} b{self.batch_size}x{self.accumulate} e{self.epochs} "
                f"max{self.max_steps} ({self.expected_steps} of {self.steps_per_epoch}/ep) "
                f"{'ovl' if self.overlap else 'noovl'} {self.compress} ck{self.checkpoint_every} "
                f"log{self.log_every} cto{self.collective_timeout}")

    def event_label(self) -> str:
        if self.event == "none":
            return "none"
        kind, target = self.event.split("-")
        who = "launcher" if target == "launcher" else f"rank {self.target_rank}"
        return f"{SIGNALS[kind].name if kind != 'kill9' else 'kill -9'} {who}"

    def window(self) -> float:
        """How long after the event the job may take to end."""
        if self.event == "stop-rank":  # a rank stopped in MPI_Init or MPI_Finalize: the edge deadline's turn
            return max(self.collective_timeout, EDGE_FLOOR_S) + STOP_WINDOW_EXTRA_S
        return SIGNAL_WINDOW_S


def draw_case(seed: int, index: int, data: DataCache) -> Case:
    """Case `index` of `seed`: a pure function of both (the manifests it reads are built deterministically).

    The event is drawn first, from its own stream, so `event_of` can tell the event without building data.
    """
    event, rng = event_of(seed, index), random.Random(f"hpctrain-chaos:{seed}:{index}:config")
    world = rng.choice((2, 3, 4) if event == "stop-rank" else (1, 2, 2, 3, 4))
    source, samples = rng.choice(SOURCES)
    val_fraction = rng.choice(VAL_FRACTIONS)
    if not feasible_shards(samples, val_fraction, world):
        val_fraction = 0.0  # too few validation samples for any shard count this world size can share
    spec = DataSpec(source, rng.choice(feasible_shards(samples, val_fraction, world)), val_fraction)
    counts = rank_samples(data.manifest(spec), world)
    accumulate = rng.choice((1, 1, 2, 3))
    # mostly batches that split a rank's data into several steps, sometimes one larger than all of it
    fitting = [b for b in BATCH_SIZES if b * accumulate <= max(counts) // 2] or [1]
    batch_size = rng.choice(fitting if rng.random() < 0.85 else BATCH_SIZES)
    epochs = rng.randint(1, 3)
    spe = steps_per_epoch(counts, batch_size, accumulate)
    max_steps, note = draw_max_steps(rng, spe, epochs)
    expected = min(spe * epochs, max_steps) if max_steps else spe * epochs
    target = rng.randrange(world) if event.endswith("-rank") else None
    return Case(seed=seed, index=index, world=world, data=spec, batch_size=batch_size, accumulate=accumulate,
                epochs=epochs, max_steps=max_steps, overlap=rng.random() < 0.5, compress=rng.choice(("none", "fp16", "bf16")),
                checkpoint_every=rng.choice((0, 0, 1, 2, 3, 5, 10)), log_every=rng.choice((1, 2, 5, 10, 25, 100)),
                collective_timeout=rng.choice((10, 15, 20)), train_seed=rng.randrange(100), steps_per_epoch=spe,
                expected_steps=expected, max_steps_note=note, event=event, target_rank=target,
                anchor=rng.choices(("start", "train", "end"), weights=(3, 5, 2))[0], fraction=round(rng.random(), 3))


def event_of(seed: int, index: int) -> str:
    return random.Random(f"hpctrain-chaos:{seed}:{index}:event").choice(EVENTS)


def draw_max_steps(rng: random.Random, spe: int, epochs: int) -> tuple[int, str]:
    """0 (all epochs), a step 0-3 before an epoch's end (the reader prefetches 2 batches ahead), or any step.

    Totals stay under MAX_TOTAL_STEPS so that a run is start-up plus a few seconds.
    """
    natural = spe * epochs
    mode = rng.choice(("none", "end", "end", "any"))
    ends = [e for e in range(1, epochs + 1) if e * spe <= MAX_TOTAL_STEPS]
    if mode == "none" and natural <= MAX_TOTAL_STEPS:
        return 0, "all epochs"
    if mode in ("none", "end") and ends:
        epoch, before = rng.choice(ends), rng.choice(range(min(4, spe)))  # stays inside that epoch
        return epoch * spe - before, f"end of epoch {epoch} - {before}"
    steps = rng.randint(1, min(natural, MAX_TOTAL_STEPS))
    return steps, "anywhere"


# --- processes ---------------------------------------------------------------------------------------


@dataclass
class Proc:
    pid: int
    ppid: int
    state: str  # R, S, T (stopped), Z (zombie), ...
    name: str
    rank: int | None  # OMPI_COMM_WORLD_RANK, for processes mpirun started


def base_env(token: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_WORLD", "PMIX_", TOKEN_VAR))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1")
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
    """Whether `pid` blocks or catches `sig` now (SigBlk | SigCgt in /proc/PID/status)."""
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
    name: str  # ref (the uninterrupted reference), run (with the event), resume
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

    def exit_label(self) -> str:
        if self.hung:
            return "HANG"
        label = signal.Signals(-self.rc).name if self.rc is not None and self.rc < 0 else str(self.rc)
        return label + ("(unheld)" if self.died_of_an_unheld_stop() else "")

    def died_of_an_unheld_stop(self) -> bool:
        """A stop signal (not kill -9 or SIGSTOP, which nothing can hold) ended the run by its default action."""
        stop = self.plan is not None and self.plan.event.split("-")[0] in ("term", "usr2")
        return stop and self.event_unheld and self.rc not in (0, 3)


def run_job(name: str, argv: list[str], run_dir: Path, log_dir: Path, *, deadline_s: float, token: str,
            plan: EventPlan | None = None, expected_steps: int = 0) -> RunResult:
    """Run `argv` (an `hpctrain launch` command) to its end or its deadline, delivering `plan`'s event.

    Whatever happens (a hang, an exception, Ctrl-C) every process of the run is killed and reaped before
    this returns.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    out, err = log_dir / f"{name}.stdout", log_dir / f"{name}.stderr"
    start = time.monotonic()
    with open(out, "w") as fout, open(err, "w") as ferr:
        proc = subprocess.Popen(argv, stdout=fout, stderr=ferr, stdin=subprocess.DEVNULL, env=base_env(token),
                                start_new_session=True)
    with _ACTIVE_LOCK:
        _ACTIVE_LAUNCHERS.add(proc.pid)
    result = RunResult(name, shlex.join(argv), None, 0.0, plan=plan)
    seen: set[int] = set()
    cutoff = start + deadline_s
    fresh = not (run_dir / "metrics.jsonl").exists()  # a resumed run appends to the old one
    stopped_pid: int | None = None
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
                    result.event_unheld = not holds(pid, SIGNALS[plan.event.split("-")[0]])
                    result.event_delivered = send(pid, SIGNALS[plan.event.split("-")[0]])
                    result.event_at_s, result.event_pid = now - start, pid
                    if plan.event == "stop-rank":
                        stopped_pid = pid
                    if result.event_delivered:
                        cutoff = min(cutoff, now + plan.window_s)
            if ABORT.is_set():
                result.hang_reason = f"{name}: interrupted (Ctrl-C)"
                break
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
            if stopped_pid is not None:
                send(stopped_pid, signal.SIGCONT)  # a stopped rank the job left behind must be able to die
            result.leftovers = leftovers(token)
            if result.leftovers:
                kill_all(token, proc)
        result.seconds = time.monotonic() - start
        result.rc = None if result.hung else proc.returncode
        with _ACTIVE_LOCK:
            _ACTIVE_LAUNCHERS.discard(proc.pid)
        reap_orphans(seen | {p.pid for p in scan(token).values()})
    result.summary = read_json(run_dir / "summary.json")
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


# --- judging a case ----------------------------------------------------------------------------------


@dataclass
class Failure:
    kind: str  # hang | exit | steps | hash | sync | leftover
    text: str


@dataclass
class Reference:
    """An uninterrupted run of one configuration: its hash, and its timing for placing events."""

    result: RunResult
    failures: list[Failure]

    @property
    def ok(self) -> bool:
        return not self.failures


@dataclass
class Outcome:
    case: Case
    runs: list[RunResult]
    failures: list[Failure]
    seconds: float
    reference_cached: bool = False

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def verdict(self) -> str:
        if self.passed:
            return "PASS"
        return "HANG" if any(f.kind == "hang" for f in self.failures) else "FAIL"

    @property
    def event_run(self) -> RunResult | None:
        return next((r for r in self.runs if r.name == "run"), None)

    def exits(self) -> str:
        return " ".join(f"{r.name}:{r.exit_label()}" for r in self.runs)

    def moment(self) -> str:
        run = self.event_run
        return run.moment if run is not None and self.case.event != "none" else "-"

    def report(self) -> str:
        """Everything needed to understand a failure: reasons, commands, stderr and rank-log tails."""
        lines = [f"case {self.case.index} of seed {self.case.seed}: {self.verdict}: {self.case.summary()}; "
                 f"event {self.case.event_label()} ({self.case.anchor} x{self.case.fraction}) at {self.moment()}"]
        lines += [f"  [{f.kind}] {f.text}" for f in self.failures]
        for run in self.runs:
            lines.append(f"  {run.name}: exit {run.exit_label()} after {run.seconds:.1f} s: {run.command}")
            if run.killed:
                lines.append(f"  {run.name}: killed {len(run.killed)} processes: {', '.join(run.killed)}")
            if run.stderr_tail and (run.hung or run.rc not in (0, 3)):
                lines.append(f"  {run.name} stderr (tail):\n" + indent(run.stderr_tail, 6))
                for name, text in run.rank_logs.items():
                    lines.append(f"  {run.name} {name} (tail):\n" + indent(text, 6))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"case": asdict(self.case), "verdict": self.verdict, "seconds": round(self.seconds, 2),
                "exits": self.exits(), "moment": self.moment(), "reference_cached": self.reference_cached,
                "failures": [asdict(f) for f in self.failures],
                "runs": [asdict(r) for r in self.runs]}


def indent(text: str, n: int) -> str:
    return "\n".join(" " * n + line for line in text.splitlines())


def check_finished(run: RunResult, case: Case, want_hash: str | None) -> list[Failure]:
    """A run that exited 0: the summary has the expected steps, ranks agree, and the reference's hash."""
    s = run.summary
    if s is None:
        return [Failure("exit", f"{run.name}: exit 0 but no readable summary.json")]
    failures = []
    if s.get("steps") != case.expected_steps:
        failures.append(Failure("steps", f"{run.name}: summary steps {s.get('steps')}, expected {case.expected_steps}"))
    if s.get("ranks_in_sync") is not True:
        failures.append(Failure("sync", f"{run.name}: ranks_in_sync is {s.get('ranks_in_sync')}"))
    if want_hash is not None and s.get("param_sha256") != want_hash:
        failures.append(Failure("hash", f"{run.name}: param_sha256 {str(s.get('param_sha256'))[:16]} differs from the "
                                        f"uninterrupted run's {want_hash[:16]}"))
    return failures


def check_ended(run: RunResult, case: Case) -> list[Failure]:
    """Hangs, processes left behind, and exit codes the event does not allow."""
    failures = []
    if run.hung:
        failures.append(Failure("hang", run.hang_reason + (f"; killed {len(run.killed)} processes" if run.killed else "")))
        return failures
    if run.leftovers:
        failures.append(Failure("leftover", f"{run.name}: processes left behind after exit: {'; '.join(run.leftovers)}"))
    event = case.event if run.event_delivered else "none"
    kind = event.split("-")[0]
    allowed = {"none": {0}, "term": {0, 3}, "usr2": {0, 3}}.get(kind)
    if allowed is not None and kind != "none" and run.event_unheld:  # nothing could see it: the default action
        allowed = allowed | {-SIGNALS[kind], 128 + SIGNALS[kind]}
    if allowed is not None and run.rc not in allowed:
        failures.append(Failure("exit", f"{run.name}: exit {run.exit_label()} after {case.event_label() if event != 'none' else 'no event'}"
                                        f" (expected {' or '.join(map(str, sorted(allowed)))}); stderr: {last_line(run.stderr_tail)}"))
    return failures


def last_line(text: str) -> str:
    """The last line that says something (mpirun frames its messages in lines of dashes)."""
    lines = [line.strip() for line in text.splitlines() if any(ch.isalpha() for ch in line)]
    return lines[-1][:300] if lines else "(empty)"


class Harness:
    """Runs and judges cases; holds the session's shard sets and reference runs (one per configuration)."""

    def __init__(self, workdir: Path, *, deadline_s: float = 120.0, keep_runs: bool = False):
        self.workdir = Path(workdir)
        self.data = DataCache(self.workdir / "data")
        self.deadline_s = deadline_s
        self.keep_runs = keep_runs
        self.session = uuid.uuid4().hex[:12]
        self._refs: dict[tuple, Reference] = {}
        self._ref_locks: dict[tuple, threading.Lock] = {}
        self._lock = threading.Lock()

    def token(self, label: str) -> str:
        return f"{self.session}-{label}-{uuid.uuid4().hex[:8]}"

    def command(self, case: Case, run_dir: Path) -> list[str]:
        return [PYTHON, "-m", "hpctrain", "launch", "-n", str(case.world), "--", "train",
                *case.train_args(self.data.path(case.data), run_dir)]

    def run_case(self, case: Case) -> Outcome:
        start = time.monotonic()
        case_dir = self.workdir / "cases" / f"seed{case.seed}-case{case.index}"
        shutil.rmtree(case_dir, ignore_errors=True)
        run_dir = case_dir / "run"
        runs: list[RunResult] = []
        if case.event == "none":
            run = self._run(case, "run", run_dir, case_dir)
            runs.append(run)
            failures = check_ended(run, case) + (check_finished(run, case, None) if run.rc == 0 else [])
            with self._lock:
                self._refs.setdefault(case.config_key(), Reference(run, failures))
            cached = False
        else:
            ref, cached = self.reference(case)
            if not cached:
                runs.append(ref.result)
            if not ref.ok:
                failures = [Failure(f.kind, f"uninterrupted reference: {f.text}") for f in ref.failures]
            else:
                failures = self._interrupted(case, ref, run_dir, case_dir, runs)
        outcome = Outcome(case, runs, failures, time.monotonic() - start, reference_cached=cached)
        if outcome.passed and not self.keep_runs:
            shutil.rmtree(case_dir, ignore_errors=True)
        return outcome

    def _interrupted(self, case: Case, ref: Reference, run_dir: Path, case_dir: Path, runs: list[RunResult]) -> list[Failure]:
        """The event run, then (after a non-zero exit) the resume, judged against the reference."""
        want = ref.result.summary["param_sha256"]
        run = self._run(case, "run", run_dir, case_dir, plan=self.plan(case, ref.result))
        runs.append(run)
        failures = check_ended(run, case)
        if run.hung:
            return failures
        if run.rc == 0:
            return failures + check_finished(run, case, want)
        resume = self._run(case, "resume", run_dir, case_dir)
        runs.append(resume)
        failures += check_ended(resume, case)
        if resume.rc == 0:
            failures += check_finished(resume, case, want)
        return failures

    def plan(self, case: Case, ref: RunResult) -> EventPlan:
        """Place the event on this machine's time scale: a fraction of its phase in the reference run."""
        marks = {"start": 0.0, "train": ref.train_start_s, "end": ref.summary_at_s, "exit": ref.seconds}
        order = ["start", "train", "end", "exit"]
        begin, end = marks[case.anchor], marks[order[order.index(case.anchor) + 1]]
        if begin is None or end is None:  # the reference was not seen in that phase: a fraction of all of it
            return EventPlan(case.event, case.target_rank, case.fraction * ref.seconds, "start", case.window())
        return EventPlan(case.event, case.target_rank, case.fraction * max(0.0, end - begin), case.anchor, case.window())

    def reference(self, case: Case) -> tuple[Reference, bool]:
        """The uninterrupted run of the case's configuration, run once per session (and whether cached)."""
        key = case.config_key()
        with self._lock:
            lock = self._ref_locks.setdefault(key, threading.Lock())
        with lock:
            with self._lock:
                if key in self._refs:
                    return self._refs[key], True
            ref_dir = self.workdir / "refs" / f"seed{case.seed}-case{case.index}"
            shutil.rmtree(ref_dir, ignore_errors=True)
            run = self._run(case, "ref", ref_dir / "run", ref_dir)
            failures = check_ended(run, case) + (check_finished(run, case, None) if run.rc == 0 else [])
            if run.rc == 0 and run.summary is None:
                failures.append(Failure("exit", "reference: no summary"))
            reference = Reference(run, failures)
            with self._lock:
                self._refs[key] = reference
            return reference, False

    def _run(self, case: Case, name: str, run_dir: Path, log_dir: Path, plan: EventPlan | None = None) -> RunResult:
        return run_job(name, self.command(case, run_dir), run_dir, log_dir, deadline_s=self.deadline_s,
                       token=self.token(f"s{case.seed}c{case.index}{name}"), plan=plan,
                       expected_steps=case.expected_steps)

    def stray_processes(self) -> list[str]:
        """Any process of this session still alive (there should be none)."""
        return [f"{p.pid} {p.name} state {p.state}" for p in scan(self.session).values() if p.state != "Z"]


# --- presenting results ------------------------------------------------------------------------------

COLUMNS = (("#", 4), ("config", 74), ("event", 16), ("moment", 34), ("exits", 26), ("sec", 6), ("verdict", 7))


def table_header() -> str:
    return "  ".join(name.ljust(width) for name, width in COLUMNS).rstrip()


def table_row(o: Outcome) -> str:
    cells = (str(o.case.index), o.case.summary(), o.case.event_label(), o.moment(), o.exits(), f"{o.seconds:.1f}", o.verdict)
    return "  ".join(c.ljust(w) for c, (_, w) in zip(cells, COLUMNS)).rstrip()


def totals(outcomes: list[Outcome]) -> dict[str, int]:
    """Cases with a hang, with an unexpected exit code, with a hash mismatch, and any failure at all."""
    def count(kind: str) -> int:
        return sum(any(f.kind == kind for f in o.failures) for o in outcomes)

    return {"cases": len(outcomes), "passed": sum(o.passed for o in outcomes), "failed": sum(not o.passed for o in outcomes),
            "hangs": count("hang"), "unexpected_exit_codes": count("exit"), "hash_mismatches": count("hash"),
            "step_mismatches": count("steps"), "ranks_out_of_sync": count("sync"), "left_processes": count("leftover"),
            "ended_by_an_unheld_signal": sum(any(r.died_of_an_unheld_stop() for r in o.runs) for o in outcomes)}


def repro_command(case: Case, deadline_s: float | None = None) -> str:
    extra = f" --deadline {deadline_s:g}" if deadline_s is not None and deadline_s != 120 else ""
    return f"python benchmarks/soak.py --seed {case.seed} --case {case.index}{extra}"
