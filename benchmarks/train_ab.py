#!/usr/bin/env python3
"""Two sets of `train` flags against each other from outside, alternating (A B, then B A, ...): each round the
wall time of a long minus a short `hpctrain launch -n 2 -- train` run of the reference MLP (batch 64 per rank, as
`step_limit.py` runs it) over the step difference, and the same difference of the loop's own `train_time_s`.
Prints each set's median and B / A per round.

    python benchmarks/train_ab.py --a "--zero 1 --zero-reduce ring" --b "--zero 1 --zero-reduce allreduce"
    python benchmarks/train_ab.py --a "" --b "--zero 1" --rounds 6 --long 440

(2026-12-06: `--zero-reduce ring` against `allreduce` at stage 1, 5 rounds: allreduce / ring 1.01-1.12, the ring
faster in 5 of 5; docs/performance.md.)
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_limit import RANKS, _shard, _train_step_ms  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="flags of run A, as one string (\"\" for the defaults)")
    ap.add_argument("--b", required=True, help="flags of run B")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--long", type=int, default=440, help="steps of the long run (the short one: 40)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.long <= 40 or args.rounds < 1:
        raise SystemExit(f"--long {args.long} must be more than 40 and --rounds {args.rounds} at least 1")
    flags = {"A": tuple(shlex.split(args.a)), "B": tuple(shlex.split(args.b))}
    wall: dict[str, list[float]] = {"A": [], "B": []}
    loop: dict[str, list[float]] = {"A": [], "B": []}
    with tempfile.TemporaryDirectory() as tmp:
        data = _shard(Path(tmp))
        for r in range(args.rounds):
            for k in ("A", "B") if r % 2 == 0 else ("B", "A"):
                wall_ms, loop_ms = _train_step_ms(data, Path(tmp) / f"{k}{r}", args.long, flags[k])
                wall[k].append(wall_ms)
                loop[k].append(loop_ms)
            print(f"round {r + 1}/{args.rounds}: A {wall['A'][-1]:.2f} ms, B {wall['B'][-1]:.2f} ms", file=sys.stderr,
                  flush=True)
    ratios = [b / a for a, b in zip(wall["A"], wall["B"])]
    result = {"a": args.a, "b": args.b, "rounds": args.rounds, "step_ms": {k: statistics.median(v) for k, v in wall.items()},
              "loop_step_ms": {k: statistics.median(v) for k, v in loop.items()}, "per_round_ms": wall,
              "b_over_a": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                           "rounds": ratios}}
    if args.json:
        print(json.dumps(result))
        return
    print(f"reference MLP, {RANKS} ranks, {args.rounds} alternating rounds (median of the {args.long}- minus 40-step "
          "difference):")
    for k, name in (("A", args.a), ("B", args.b)):
        print(f"  {k} {name or '(defaults)'!s:<40} {result['step_ms'][k]:7.2f} ms (loop {result['loop_step_ms'][k]:.2f})")
    print(f"  B / A  {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}; per round "
          + ", ".join(f"{x:.3f}" for x in ratios) + ")")


if __name__ == "__main__":
    main()
