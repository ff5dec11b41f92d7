"""Soak hpctrain with random chaos cases: `python benchmarks/soak.py --seed S --cases N [--jobs 1] [--out FILE.json]`.

Each case is a training configuration drawn from every option of `train` plus one event at a random moment,
or a combination hpctrain must refuse, or a pair of configurations that must give the same model
(tests/chaos/chaos.py says what is expected, chaos_space.py what is drawn). Prints one row per case (event,
moment or pair difference, exit codes, seconds, verdict, config), the failures with their evidence and a
one-line reproduction command each, the totals, and a per-option table (for each option value: cases,
passed, hangs, other failures; markdown, for docs/guides/hangs.md); exits 1 when any case fails. `--case K`
(repeatable) reruns single cases of the seed: the drawing is a pure function of (seed, index).

    make soak SEED=1 CASES=200
    python benchmarks/soak.py --seed 1 --case 17 --keep-runs    # one failing case, its run directory kept
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "chaos"))

from chaos import (ABORT, Harness, Outcome, draw_case, option_table, repro_command, subreaper,  # noqa: E402
                   table_header, table_row, totals)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=1, help="seed of the case drawing (default 1)")
    p.add_argument("--cases", type=int, default=10, help="run cases 0 .. N-1 of the seed (default 10)")
    p.add_argument("--case", type=int, action="append", default=None, help="run only case K (repeatable)")
    p.add_argument("--jobs", type=int, default=1,
                   help="cases at a time (default 1; more share the cores and make the time windows less fair)")
    p.add_argument("--deadline", type=float, default=120.0, help="seconds a run may take before it counts as a hang")
    p.add_argument("--out", type=Path, help="write every outcome and the totals as JSON")
    p.add_argument("--workdir", type=Path, help="shards, runs and logs (default: a new temporary directory)")
    p.add_argument("--keep-runs", action="store_true", help="keep the run directories of passing cases too")
    return p.parse_args(argv)


def interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_cases(harness: Harness, seed: int, indices: list[int], jobs: int) -> tuple[list[Outcome], list[str], bool]:
    """Run the cases (`jobs` at a time), printing each row as it ends; harness errors are collected. On Ctrl-C
    (or SIGTERM) the running cases are killed and the ones that had ended are returned: (outcomes, errors,
    interrupted)."""
    errors: list[str] = []
    done: dict[int, Outcome] = {}

    def one(index: int) -> None:
        if ABORT.is_set():
            return
        try:
            outcome = harness.run_case(draw_case(seed, index, harness.data))
        except Exception as exc:  # noqa: BLE001 - a harness error (e.g. `shard` failed) fails this case only
            errors.append(f"case {index}: harness error: {type(exc).__name__}: {exc}")
            print(f"{index:<4}  ERROR {type(exc).__name__}: {exc}", flush=True)
            return
        if not ABORT.is_set():  # a case cut short by the interruption is not an outcome
            done[index] = outcome
            print(table_row(outcome), flush=True)

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        futures = [pool.submit(one, i) for i in indices]
        try:
            for f in futures:
                f.result()
            interrupted = False
        except KeyboardInterrupt:  # the runs are in their own sessions: kill and reap them, then report
            ABORT.set()
            pool.shutdown(wait=True, cancel_futures=True)
            interrupted = True
    return [done[i] for i in indices if i in done], errors, interrupted


def print_report(outcomes: list[Outcome], errors: list[str], stray: list[str], sums: dict, elapsed: float,
                 deadline: float) -> None:
    """The failures with their evidence and reproduction commands, then the totals."""
    failed = [o for o in outcomes if not o.passed]
    for o in failed:
        print("\n" + o.report())
        print(f"  reproduce: {repro_command(o.case, deadline)}")
    seconds = [o.seconds for o in outcomes]
    print(f"\n{sums['cases']} cases in {elapsed:.0f} s (per case: mean {sum(seconds) / max(1, len(seconds)):.1f} s, "
          f"max {max(seconds, default=0):.1f} s): {sums['passed']} passed, {sums['failed']} failed; "
          f"hangs {sums['hangs']}, unexpected exit codes {sums['unexpected_exit_codes']}, "
          f"hash mismatches {sums['hash_mismatches']}, step mismatches {sums['step_mismatches']}, "
          f"ranks out of sync {sums['ranks_out_of_sync']}, left processes {sums['left_processes']}, "
          f"non-finite losses {sums['nonfinite_losses']}, staging failures {sums['staging_failures']}, "
          f"harness errors {len(errors)}; refused {sums['refused']} (judged wrongly refused or not: "
          f"{sums['refusal_mismatches']}); pairs {sums['pairs']} (mismatches {sums['pair_mismatches']}, largest "
          f"relative difference {fmt(sums['max_pair_rel_diff'])}); ended by a signal no process could see yet "
          f"(expected, resumed exactly) {sums['ended_by_an_unheld_signal']}")
    print("\nper option value (cases, passed, hangs, other failures):\n" + option_table(outcomes))
    if stray:
        print(f"STRAY PROCESSES after the soak: {stray}")
    for error in errors:
        print(error)
    if failed:
        print("reproduce: " + "; ".join(repro_command(o.case, deadline) for o in failed))


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM):  # also when started in the background, where SIGINT is ignored
        signal.signal(sig, interrupt)
    indices = args.case if args.case else list(range(args.cases))
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hpctrain-soak-"))
    harness = Harness(workdir, deadline_s=args.deadline, keep_runs=args.keep_runs)
    print(f"seed {args.seed}, {len(indices)} case(s), deadline {args.deadline:g} s, workdir {workdir}", flush=True)
    print(table_header(), flush=True)
    started = time.monotonic()
    with subreaper():
        outcomes, errors, interrupted = run_cases(harness, args.seed, indices, args.jobs)
    if interrupted:
        print(f"\ninterrupted after {len(outcomes)} of {len(indices)} cases: the running ones were killed and are "
              f"not counted; workdir {workdir}", flush=True)
    elapsed = time.monotonic() - started
    stray = harness.stray_processes()
    sums = dict(totals(outcomes), harness_errors=len(errors), stray_processes=len(stray))
    print_report(outcomes, errors, stray, sums, elapsed, args.deadline)
    if args.out:
        args.out.write_text(json.dumps({"seed": args.seed, "deadline_s": args.deadline, "workdir": str(workdir),
                                        "totals": sums, "seconds": elapsed, "interrupted": interrupted,
                                        "option_table": option_table(outcomes),
                                        "outcomes": [o.to_dict() for o in outcomes]}, indent=1, default=str))
    return 130 if interrupted else 1 if sums["failed"] or errors or stray else 0


if __name__ == "__main__":
    sys.exit(main())
