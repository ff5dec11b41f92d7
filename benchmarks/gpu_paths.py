"""The driver of benchmarks/gpu_check.sh: every CUDA path of hpctrain on 2 ranks sharing one GPU, one verdict
line per path (`PASS path/variant (detail)`, `FAIL path/variant: reason`, `SKIP path/variant: reason`) and a
tally (`N passed, M failed, K skipped`); exit 1 when any path failed, 2 on bad arguments.

    python benchmarks/gpu_paths.py [--device cuda|cpu] [--paths zero2,topk,...] [--out DIR] [--list]

With `--device cpu` the same paths run on the CPU (variant `cpu`): tests/mpi/test_gpu_paths_mpi.py runs a
subset that way, so the driver cannot rot between the rare occasions a GPU is at hand.

What runs where:
- gpu_paths_worker.py under `mpirun -n 2`, one process per rank for all of its paths (so `import torch` and
  CUDA start-up are paid once): allreduce modes (tests/mpi/scripts/comm_check.py, reused), ZeRO 1/2/3 against
  stage 0, PowerSGD and top-k, the fp16 loss scaler, fused optimizers, the MFU peak, and resume of each kind
  through the trainer. A path that takes the job down (a failed trainer run ends it with MPI_Abort) or gives no
  verdict within --path-timeout-s (a rank stuck in a collective) is a FAIL, and the worker is started again
  for the paths left.
- Here, as a user runs them: `hpctrain shard synthetic:...` and `hpctrain train` on 2 ranks (train-cli),
  `hpctrain bench train --json` (bench-train; its JSON is printed and written to --out), and the same at ZeRO
  stage 3 with the prefetch (bench-zero3: the gathers' time and the part of it the step waited for).

This module imports nothing beyond the standard library (no torch): it only launches and tallies.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "gpu_paths_worker.py"
HERE_PATHS = ("train-cli", "bench-train", "bench-zero3")  # the paths this process runs itself
VERDICT = re.compile(r"^(PASS|FAIL|SKIP) ([^\s:]+)")  # group 2: the item (path/variant)
STAGING_NOTES = ("staging gradients through pinned host buffers", "staging through the host")  # GradSync.notes
NO_SWITCH = ("hpctrain has no switch that forces staging on a CUDA-aware MPI (the proposed HPCTRAIN_CUDA_AWARE=0: "
             "see benchmarks/gpu_check.sh)")


def select(selectors: list[str], names: list[str]) -> list[str]:
    """The names chosen by `selectors`, in catalogue order: a selector is a name or the prefix before a '-'
    (`zero2` is every zero2-* path, `resume` every resume-*). Raises ValueError naming the valid ones."""
    if not selectors:
        return list(names)
    chosen: set[str] = set()
    for sel in selectors:
        hits = {n for n in names if n == sel or n.startswith(sel + "-")}
        if not hits:
            raise ValueError(f"unknown path {sel!r}: choose from {', '.join(names)} (or a prefix: zero2, resume, ...)")
        chosen |= hits
    return [n for n in names if n in chosen]


def combine(item: str, outcomes: list[tuple[str, str]], seconds: float) -> str:
    """One verdict line from every rank's (PASS|FAIL|SKIP, detail or reason): a FAIL on any rank fails the path
    and names that rank; a path that some ranks skipped and others ran fails too (they must agree)."""
    failed = [(rank, why) for rank, (kind, why) in enumerate(outcomes) if kind == "FAIL"]
    if failed:
        return f"FAIL {item}: rank {failed[0][0]}: {failed[0][1]}"
    kinds = {kind for kind, _ in outcomes}
    if kinds == {"SKIP"}:
        return f"SKIP {item}: {outcomes[0][1]}"
    if kinds != {"PASS"}:
        return f"FAIL {item}: the ranks disagree on whether the path can run: {outcomes}"
    return f"PASS {item} ({outcomes[0][1]}; {seconds:.1f} s)"


def verdict_item(line: str) -> str | None:
    """The item (path/variant) a verdict line is about; None for any other line."""
    m = VERDICT.match(line)
    return m.group(2) if m else None


def tally(verdicts: list[str]) -> tuple[int, int, int]:
    """(passed, failed, skipped) of verdict lines."""
    kinds = [line.split(" ", 1)[0] for line in verdicts]
    return kinds.count("PASS"), kinds.count("FAIL"), kinds.count("SKIP")


def _env(device: str) -> dict[str, str]:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the trainer picks a GPU whenever torch sees one
    return env


def _mpirun(args: argparse.Namespace, *cmd: str) -> list[str]:
    return [args.mpirun, "-n", str(args.np), "--oversubscribe", "--bind-to", "none", args.python, *cmd]


class Driver:
    """Launches, watches and tallies; `verdicts` holds every line printed so far."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.env = _env(args.device)
        self.deadline = time.monotonic() + args.budget_s
        self.verdicts: list[str] = []
        self.bad_input = False  # the worker refused the --paths given

    def say(self, line: str) -> None:
        print(line, flush=True)
        if verdict_item(line) is not None:
            self.verdicts.append(line)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    # -- the worker: in-process paths under mpirun -------------------------------------------------
    def worker(self, selectors: list[str]) -> None:
        """Run the worker's paths; start it again for those left after a path took the job down or hung."""
        plan = self._launch(["--paths", ",".join(selectors)])
        for _ in range(self.args.relaunches):
            if not plan or self.left() < 5:
                break
            plan = self._launch(["--items", ",".join(plan)])
        for item in plan or []:
            self.say(f"FAIL {item}: not run: the worker was started {self.args.relaunches + 1} times, or the time "
                     f"budget of {self.args.budget_s:.0f} s is spent")

    def _launch(self, spec: list[str]) -> list[str] | None:
        """One worker job; returns the items it left without a verdict (None: it never printed its plan)."""
        cmd = _mpirun(self.args, str(WORKER), "--device", self.args.device, "--work", str(self.args.work), *spec)
        err = tempfile.TemporaryFile("w+")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=self.env, cwd=ROOT)
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
        plan: list[str] | None = None
        done: set[str] = set()
        current, since, why = None, time.monotonic(), ""
        while True:
            try:
                line = lines.get(timeout=max(0.01, min(self.left(), since + self.args.path_timeout_s - time.monotonic())))
            except queue.Empty:
                why = ("timed out" if self.left() > 0 else "the time budget is spent") + \
                    f" after {time.monotonic() - since:.0f} s in this path (a rank stuck in a collective?)"
                _stop(proc)
                break
            if line is None:
                break
            if line.startswith("PLAN "):
                plan = line.split()[1:]
            elif line.startswith("START "):
                current, since = line.split()[1], time.monotonic()
            else:
                if (item := verdict_item(line)) is not None:
                    done.add(item)
                    current, since = None, time.monotonic()
                self.say(line)
        rc = proc.wait()
        err.seek(0)
        everything = [ln for ln in err.read().splitlines() if ln.strip()]
        tail = everything[-12:]
        if rc not in (0, 2) and tail:
            print("worker stderr, last lines:\n  " + "\n  ".join(tail), file=sys.stderr, flush=True)
        if plan is None:
            self.bad_input = rc == 2  # the worker refused --paths; its error names the valid ones
            self.say(_telling(everything) if self.bad_input else f"FAIL worker: it exited {rc} before naming its "
                     f"paths: {_telling(everything)}")
            return None
        if current is not None:
            self.say(f"FAIL {current}: {why or f'the job ended (exit {rc}) during this path'}: {_telling(everything)}")
            done.add(current)
        return [item for item in plan if item not in done]

    # -- the CLI paths ------------------------------------------------------------------------------
    def _run(self, cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
        """Run `cmd` to its end; past `timeout` stop it and every rank it started, and raise TimeoutExpired."""
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env, cwd=ROOT)
        try:
            out, err = proc.communicate(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            _stop(proc)
            raise
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    def _variant_verdicts(self, path: str, staged: bool | None, detail: str, note: str = "") -> None:
        """PASS the variant that ran and SKIP the other one (on a GPU), saying why it could not run; a CUDA-aware
        MPI whose start-up probe failed (the sync staged anyway) fails the cuda-aware variant instead."""
        if staged is None:
            self.say(f"PASS {path}/cpu ({detail})")
            return
        ran, other = ("staged", "cuda-aware") if staged else ("cuda-aware", "staged")
        self.say(f"PASS {path}/{ran} ({detail})")
        if staged and STAGING_NOTES[1] in note:
            self.say(f"FAIL {path}/cuda-aware: the MPI says it is CUDA-aware but the sync staged: {note}")
        elif staged:
            self.say(f"SKIP {path}/cuda-aware: the sync staged ({note or 'the MPI is not CUDA-aware'})")
        else:
            self.say(f"SKIP {path}/staged: {NO_SWITCH}")

    def train_cli(self) -> None:
        """`hpctrain shard synthetic:...` and `hpctrain train` on 2 ranks, as a user runs them (there is no
        --device flag: each rank takes its GPU when torch sees one)."""
        data, run = self.args.work / "cli-data", self.args.work / "cli-run"
        item = f"train-cli/{self.args.device}"
        try:
            shard = self._run([self.args.python, "-m", "hpctrain", "shard", "synthetic:640:32:10", str(data),
                               "--shards", "2", "--force"], self.left())
            proc = self._run(_mpirun(self.args, "-m", "hpctrain", "train", "--data", str(data), "--run-dir", str(run),
                                     "--model", "mlp:47", "--max-steps", "6", "--batch-size", "16", "--checkpoint-every",
                                     "0", "--json"), self.left())
        except subprocess.TimeoutExpired:
            self.say(f"FAIL {item}: the time budget of {self.args.budget_s:.0f} s is spent")
            return
        for step, done in (("hpctrain shard", shard), ("hpctrain train", proc)):
            if done.returncode != 0:
                self.say(f"FAIL {item}: {step} exited {done.returncode}: {_last_line(done.stderr)}")
                return
        summary = json.loads(next(ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("{")))
        log = (run / "logs" / "rank-0000.log").read_text()
        device = re.search(r"device (\S+), torch threads", log)
        device = device.group(1) if device else "?"
        problems = [what for what, bad in (
            (f"steps {summary['steps']}, not 6", summary["steps"] != 6),
            (f"world size {summary['world_size']}, not {self.args.np}", summary["world_size"] != self.args.np),
            ("the ranks' parameters differ", not summary["ranks_in_sync"]),
            (f"rank 0 trained on {device}, not {self.args.device}", not device.startswith(self.args.device)))
            if bad]
        if problems:
            self.say(f"FAIL {item}: " + "; ".join(problems))
            return
        notes = [ln.split(": ", 1)[-1] for ln in log.splitlines() if any(n in ln for n in STAGING_NOTES)]
        staged = bool(notes) if self.args.device == "cuda" else None
        self._variant_verdicts("train-cli", staged, f"6 steps on {summary['world_size']} ranks, {device}, "
                                                    f"param_sha256 {summary['param_sha256'][:12]}", " ".join(notes[:1]))

    def _bench(self, path: str, *extra: str) -> dict[str, Any] | None:
        """`hpctrain bench train --json` with `extra` on 2 ranks: its result (the JSON printed and written to
        --out as PATH.json), or None after a FAIL verdict for `path`."""
        item = f"{path}/{self.args.device}"
        try:
            proc = self._run(_mpirun(self.args, "-m", "hpctrain", "bench", "train", "--device", self.args.device,
                                     *extra, "--rounds", "3", "--steps", "10", "--json"), self.left())
        except subprocess.TimeoutExpired:
            self.say(f"FAIL {item}: the time budget of {self.args.budget_s:.0f} s is spent")
            return None
        if proc.returncode != 0:
            self.say(f"FAIL {item}: hpctrain bench train {' '.join(extra)} exited {proc.returncode}: "
                     f"{_last_line(proc.stderr)}")
            return None
        text = next(ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("{"))
        print(f"JSON {path} {text}", flush=True)
        (self.args.out / f"{path.replace('-', '_')}.json").write_text(text + "\n")
        return json.loads(text)

    def bench_train(self) -> None:
        """`hpctrain bench train --json`: the reference step (MLP 784-2048-2048-10, batch 64 per rank)."""
        result = self._bench("bench-train", "--baseline", "none")
        if result is None:
            return
        hp = result["hpctrain"]
        if not str(result["device"]).startswith(self.args.device) or not hp["step_ms"] > 0:
            self.say(f"FAIL bench-train/{self.args.device}: device {result['device']}, step {hp['step_ms']} ms")
            return
        staged = bool(result["staging"]) if self.args.device == "cuda" else None
        self._variant_verdicts("bench-train", staged, f"step {hp['step_ms']:.2f} ms, {hp['samples_per_s']:.0f} "
                                                      f"samples/s, exposed comm {hp['comm_ms']:.2f} ms, {result['device']}")

    def bench_zero3(self) -> None:
        """`hpctrain bench train --zero 3 --overlap --json`: the reference step with its parameters sharded, beside
        stage 0, and the time its parameter gathers took against the part of it forward and backward waited for
        (what the prefetch on the communication thread did not hide)."""
        result = self._bench("bench-zero3", "--zero", "3", "--overlap")
        if result is None:
            return
        phases = result["phases_ms"]
        if not str(result["device"]).startswith(self.args.device) or result["zero"] != 3 or "gathers" not in phases:
            self.say(f"FAIL bench-zero3/{self.args.device}: device {result['device']}, zero {result['zero']}, "
                     f"phases {sorted(phases)}")
            return
        gathers, waited = phases["gathers"], phases["gather_wait"]
        hidden = 1.0 - waited / gathers if gathers > 0 else 0.0
        staged = bool(result["staging"]) if self.args.device == "cuda" else None
        self._variant_verdicts("bench-zero3", staged, f"step {result['hpctrain']['step_ms']:.2f} ms, "
                               f"{result['step_over_stage0']:.2f}x stage 0; gathers {gathers:.2f} ms per step, "
                               f"{waited:.2f} ms of it waited for ({hidden:.0%} hidden by the prefetch)")


def _pump(stream: Any, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line.rstrip("\n"))
    lines.put(None)


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc), found before any is killed: mpirun's ranks outlive it otherwise."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _stop(proc: subprocess.Popen) -> None:
    """Stop mpirun (SIGTERM ends its ranks at once), then SIGKILL whatever of its tree is still there."""
    tree = _descendants(proc.pid)
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    for pid in [proc.pid, *tree]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def _telling(lines: list[str]) -> str:
    """The line of a stderr tail that says most: an error of hpctrain's or Python's, else one of MPI's about an
    abort or a signal, else the last line."""
    lines = [ln.strip() for ln in lines if ln.strip("- \n")]
    for pattern, pick in ((r"^(error|[A-Za-z.]*(Error|Exception))\b", -1), (r"MPI_ABORT|Killed|signal", 0)):
        telling = [ln for ln in lines if re.search(pattern, ln)]
        if telling:  # the last error raised; the first line of MPI's banner about an abort
            return telling[pick][:1000]
    return lines[-1][:1000] if lines else "(nothing on stderr)"


def _last_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--paths", default="", help="comma-separated names or prefixes (default: all; --list)")
    parser.add_argument("--list", action="store_true", help="print every path's name and exit")
    parser.add_argument("--out", type=Path, default=None, help="where bench-train's JSON goes (default: --work)")
    parser.add_argument("--work", type=Path, default=None, help="scratch directory (default: a new temporary one)")
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop starting work after this many seconds")
    parser.add_argument("--path-timeout-s", type=float, default=90.0, help="a path with no verdict by then fails")
    parser.add_argument("--relaunches", type=int, default=6, help="worker restarts after a path took the job down")
    parser.add_argument("--np", type=int, default=2, help="ranks (they share the one GPU)")
    parser.add_argument("--mpirun", default=os.environ.get("MPIRUN", "mpirun"))
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args(argv)
    args.work = args.work or Path(tempfile.mkdtemp(prefix="gpu_paths-"))
    args.out = args.out or args.work
    for folder in (args.work, args.out):
        folder.mkdir(parents=True, exist_ok=True)
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.list:
        listed = subprocess.run([args.python, str(WORKER), "--list"], env=_env(args.device), cwd=ROOT)
        print("\n".join(HERE_PATHS))
        return listed.returncode
    selectors = [s.strip() for s in args.paths.split(",") if s.strip()]
    here = [s for s in selectors if any(n == s or n.startswith(s + "-") for n in HERE_PATHS)]
    for_worker = [s for s in selectors if s not in here]  # the worker checks these names (it knows its own)
    driver = Driver(args)
    print(f"INFO work {args.work}, out {args.out}, budget {args.budget_s:.0f} s", flush=True)
    if for_worker or not selectors:
        driver.worker(for_worker)
        if driver.bad_input:
            return 2
    for path in select(here, list(HERE_PATHS)) if here or not selectors else []:
        try:
            getattr(driver, path.replace("-", "_"))()
        except Exception as exc:  # noqa: BLE001 - output it did not expect (no JSON, no log): a verdict, not a crash
            driver.say(f"FAIL {path}/{args.device}: {type(exc).__name__}: {exc}")
    passed, failed, skipped = tally(driver.verdicts)
    print(f"{passed} passed, {failed} failed, {skipped} skipped", flush=True)
    return 1 if failed or not driver.verdicts else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
