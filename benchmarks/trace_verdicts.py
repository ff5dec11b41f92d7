#!/usr/bin/env python3
"""Does the timeline name the straggler, and does the flight recorder name the hang? (issue 28)

Stragglers: `--runs` runs with one rank of 4 slowed and as many clean ones, alternating. The workload is the
reference MLP (784-2048-2048-10, batch 64 per rank) on 4 ranks, steps 6-35 traced; a clean run first measures
the median step, and each injected run then makes a random rank sleep `--factor` times that long in its data
path before every step (HPCTRAIN_TEST_STRAGGLER: the rank is (1 + factor) times as slow). An injected run
passes when summary.json's verdict names that rank and the data wait; a clean one when it says "no straggler".
With `--pp 2` the 4 ranks are a pipeline of 2 stages with D = 2 (#54): every rank is slowed in turn, one clean
run before each round of 4, and the tally is per slowed rank.

Hangs: `--runs` runs of 4 ranks where a random rank never enters the collective of a random gradient bucket at a
random step (HPCTRAIN_TEST_HANG), with `--collective-timeout 5`; with `--sigstop`, as many more where a random
rank is stopped (SIGSTOP) at a random moment of training instead. A run passes when `hpctrain report RUN` names
the collective where the ranks diverge (its bucket and step, for the test hook) and the rank that never
arrived (for SIGSTOP: the stopped rank, named by its silent heartbeat as the one that left no record, or, when
mpirun's teardown continued it and it dumped late, as the rank that did not run).

    python benchmarks/trace_verdicts.py [--runs 10] [--factor 0.5] [--seed 28] [--sigstop] [--pp 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
HPCTRAIN = [sys.executable, "-m", "hpctrain"]
RANKS = 4
TRAIN = ["--model", "mlp:2048,2048", "--batch-size", "64", "--checkpoint-every", "0", "--log-every", "10"]
BUCKETS = 4  # the reference MLP's gradient buckets at --bucket-mb 25 (three large weights alone, the rest packed)


def _train(data: Path, run: Path, extra: list[str], env: dict[str, str] | None = None, timeout: float = 600
           ) -> subprocess.CompletedProcess:
    return subprocess.run([*HPCTRAIN, "launch", "-n", str(RANKS), "--", "train", "--data", str(data), "--run-dir",
                           str(run), *TRAIN, *extra], capture_output=True, text=True, env=env or ENV, timeout=timeout)


def stragglers(work: Path, runs: int, factor: float, rng: random.Random, pp: int = 1) -> list[dict]:
    """`runs` injected runs, each after a clean one; with a pipeline (pp > 1) `runs` per rank, every rank in
    turn, one clean run before each round."""
    out: list[dict] = []
    cycle = RANKS + 1 if pp > 1 else 2  # a clean run first: each injection is sized on the clean run before it
    clean_step_ms = 100.0
    for i in range(cycle * runs):
        injected = i % cycle != 0
        run = work / f"straggler{i}"
        rank, sleep = None, 0.0
        env = dict(ENV)
        if injected:
            rank = i % cycle - 1 if pp > 1 else rng.randrange(RANKS)
            sleep = factor * clean_step_ms / 1e3
            env["HPCTRAIN_TEST_STRAGGLER"] = f"{rank}:{sleep:.4f}"
        piped = ["--pp", str(pp)] if pp > 1 else []
        proc = _train(work / "data", run, ["--max-steps", "36", "--trace", "6:35", *piped], env)
        if proc.returncode:
            out.append({"injected": injected, "rank": rank, "ok": False, "error": proc.stderr[-500:],
                        "step_ms": clean_step_ms})
            print(f"  run {i} failed: {proc.stderr[-300:]}", flush=True)
            continue
        found = json.loads((run / "summary.json").read_text())["straggler"]
        # a pipelined run's verdict ends with a note on the bubble: "no straggler (a pipeline: ...)"
        ok = (found["rank"] == rank and found["phase"] == "data wait") if injected else \
            found["verdict"].startswith("no straggler")
        clean_step_ms = found["step_ms"] if not injected else clean_step_ms
        out.append({"injected": injected, "rank": rank, "sleep_ms": sleep * 1e3, "verdict": found["verdict"], "ok": ok,
                    "step_ms": clean_step_ms})
        print(f"  {'injected rank %d +%.1f ms' % (rank, sleep * 1e3) if injected else 'clean':<26} "
              f"{'ok  ' if ok else 'MISS'} {found['verdict']}", flush=True)
    return out


def hangs(work: Path, runs: int, rng: random.Random, sigstop: bool) -> list[dict]:
    out = []
    for i in range(runs * (2 if sigstop else 1)):
        stop = sigstop and i % 2 == 1
        run = work / f"hang{i}"
        rank, step, bucket = rng.randrange(RANKS), rng.randint(3, 12), rng.randrange(BUCKETS)
        env = dict(ENV)
        extra = ["--max-steps", "200", "--collective-timeout", "5"]
        if stop:
            proc = _stopped(work / "data", run, extra, rank, rng.uniform(0.5, 3.0))
        else:
            env["HPCTRAIN_TEST_HANG"] = f"{rank}:{step}:{bucket}"
            proc = _train(work / "data", run, extra, env)
        report = subprocess.run([*HPCTRAIN, "report", str(run)], capture_output=True, text=True, env=ENV)
        line = next((l for l in report.stdout.splitlines() if l.startswith("flight records:")), "")
        if stop:
            named = (f"rank {rank} left no flight record" in line and "silent" in line) or f"rank {rank} did not run for" in line
            ok = named and "diverge at collective #" in line
        else:
            ok = (f"of bucket {bucket} " in line and f"at step {step} " in line
                  and re.search(rf"\brank {rank} never arrived", line) is not None)
        what = f"SIGSTOP rank {rank}" if stop else f"rank {rank} skips bucket {bucket} at step {step}"
        out.append({"what": what, "exit": proc.returncode, "line": line, "ok": ok})
        print(f"  {what:<34} {'ok  ' if ok else 'MISS'} {line[:400]}", flush=True)
    return out


def _stopped(data: Path, run: Path, extra: list[str], rank: int, after: float) -> subprocess.CompletedProcess:
    """A run whose rank `rank` is stopped (SIGSTOP) `after` seconds after its first logged step; the watchdog
    ends the job. The stopped process is continued at the end, so that nothing is left behind."""
    proc = subprocess.Popen([*HPCTRAIN, "launch", "-n", str(RANKS), "--", "train", "--data", str(data), "--run-dir",
                             str(run), *TRAIN, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    pid = None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if (run / "metrics.jsonl").exists() and (run / "logs" / f"rank-{rank:04d}.heartbeat").exists():
            time.sleep(after)
            pid = json.loads((run / "logs" / f"rank-{rank:04d}.heartbeat").read_text())["pid"]
            os.kill(pid, signal.SIGSTOP)
            break
        time.sleep(0.1)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--factor", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=28)
    ap.add_argument("--sigstop", action="store_true")
    ap.add_argument("--only", choices=("stragglers", "hangs"))
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages of the 4 ranks (2: D = 2); every rank slowed "
                    "--runs times")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    result: dict = {"load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        subprocess.run([*HPCTRAIN, "shard", "synthetic:15360:784:10", str(work / "data"), "--shards", str(RANKS),
                        "--val-fraction", "0"], check=True, capture_output=True, env=ENV)
        if args.only != "hangs":
            print(f"stragglers ({args.runs} injected, one rank {1 + args.factor:g}x as slow; {args.runs} clean):")
            result["stragglers"] = stragglers(work, args.runs, args.factor, rng, args.pp)
        if args.only != "stragglers":
            print(f"hangs ({args.runs} by the test hook" + (f", {args.runs} by SIGSTOP" if args.sigstop else "") + "):")
            result["hangs"] = hangs(work, args.runs, rng, args.sigstop)
    result["load_after"] = os.getloadavg()
    s, h = result.get("stragglers", []), result.get("hangs", [])
    inj, clean = [r for r in s if r["injected"]], [r for r in s if not r["injected"]]
    if s:
        print(f"straggler named with its phase: {sum(r['ok'] for r in inj)} of {len(inj)}; "
              f"'no straggler' on clean runs: {sum(r['ok'] for r in clean)} of {len(clean)}")
        if args.pp > 1:
            print("named per slowed rank: " + ", ".join(
                f"rank {k} {sum(r['ok'] for r in inj if r['rank'] == k)} of {sum(r['rank'] == k for r in inj)}"
                for k in range(RANKS)))
    if h:
        hook, stop = [r for r in h if "SIGSTOP" not in r["what"]], [r for r in h if "SIGSTOP" in r["what"]]
        print(f"hang diagnosed (collective and missing rank): {sum(r['ok'] for r in hook)} of {len(hook)} by the test "
              f"hook" + (f", {sum(r['ok'] for r in stop)} of {len(stop)} by SIGSTOP" if stop else ""))
    print(f"load average before {result['load_before'][0]:.1f}, after {result['load_after'][0]:.1f}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
