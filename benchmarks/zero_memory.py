#!/usr/bin/env python3
"""ZeRO's memory and step time (issues 16 and 29): one `hpctrain bench train` launch per stage, side by side,
and `hpctrain plan`'s figures beside what was measured.

Memory: --ranks ranks, Adam, an MLP of at least 70 M parameters (784-4096x5-10: 70.4 M). Each stage (0-3) runs in
its own launch, so that each process's peak RSS is that stage's alone; the bench reads, per rank, the bytes
of parameters, gradients and optimizer state held between two steps, and the peak RSS so far (the largest
rank of each). Prints the ratios of stages 1-3 to stage 0, and the plan's parameter + gradient + optimizer
bytes and peak against the measured ones.

Step time: `hpctrain bench train -n 2 --zero 2` and `--zero 3` on the reference MLP (784-2048-2048-10, batch 64),
each timing the stage beside stage 0 in one launch, rounds alternating; stage 3 also with --overlap (the
gathers on the communication thread, the next unit prefetched) and its phases (the gathers' time, and the
part of it the step waited for).

    python benchmarks/zero_memory.py [--ranks 4] [--model mlp:4096,4096,4096,4096,4096] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def bench(args: list[str]) -> dict:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [sys.executable, "-m", "hpctrain", "bench", "train", "--json", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--model", default="mlp:4096,4096,4096,4096,4096")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--time-rounds", type=int, default=3, help="rounds of the step-time comparison")
    parser.add_argument("--json", action="store_true")
    opts = parser.parse_args()

    memory, plans = {}, {}
    for stage in (0, 1, 2, 3):
        result = bench(["-n", str(opts.ranks), "--zero", str(stage), "--optimizer", "adam", "--model", opts.model,
                        "--steps", str(opts.steps), "--rounds", "1", "--baseline", "none"])
        memory[stage] = dict(result["memory"], parameters=result["parameters"], step_ms=result["hpctrain"]["step_ms"])
        plans[stage] = plan(opts.model, opts.ranks, stage)
    base = memory[0]
    state = {s: m["params_mib"] + m["grads_and_optimizer_mib"] for s, m in memory.items()}
    ratios = {f"stage{s}": {"grads_and_optimizer": memory[s]["grads_and_optimizer_mib"] / base["grads_and_optimizer_mib"],
                            "params_grads_optimizer": state[s] / state[0],
                            "peak_rss": memory[s]["peak_rss_mib"] / base["peak_rss_mib"]} for s in (1, 2, 3)}
    versus_plan = {f"stage{s}": {"measured_mib": state[s], "plan_mib": plans[s]["state"] / 2**20,
                                 "measured_over_plan": state[s] / (plans[s]["state"] / 2**20),
                                 "peak_rss_mib": memory[s]["peak_rss_mib"], "plan_peak_mib": plans[s]["peak"] / 2**20}
                   for s in (0, 1, 2, 3)}
    timing = {}
    for stage, overlap in ((2, None), (3, None), (3, True)):
        args = ["-n", "2", "--zero", str(stage), "--rounds", str(opts.time_rounds), "--steps", "30"]
        t = bench(args + (["--overlap"] if overlap else []))
        timing[f"stage{stage}" + ("_overlap" if overlap else "")] = {
            "model": t["model"], "step_ms": t["hpctrain"]["step_ms"], "stage0_ms": t["stage0"]["step_ms"],
            "over_stage0": t["step_over_stage0"], "overlap": t["overlap"], "reducer": t["zero_reduce"],
            "reducer_probe": t["zero_reduce_probe"], "phases_ms": t["phases_ms"]}
    out = {"ranks": opts.ranks, "model": opts.model, "memory": memory, "ratios_to_stage0": ratios,
           "plan_vs_measured": versus_plan, "step_time": timing}
    if opts.json:
        print(json.dumps(out))
        return
    print(f"{opts.model} ({base['parameters']:,} parameters), Adam, {opts.ranks} ranks; MiB per rank (largest rank)")
    print(f"{'stage':>5} {'params':>9} {'grads':>9} {'optimizer':>10} {'p+g+o':>9} {'plan':>9} {'peak RSS':>9} {'plan':>9}")
    for s, m in memory.items():
        v = versus_plan[f"stage{s}"]
        print(f"{s:>5} {m['params_mib']:>9.1f} {m['grads_mib']:>9.1f} {m['optimizer_mib']:>10.1f} "
              f"{state[s]:>9.1f} {v['plan_mib']:>9.1f} {m['peak_rss_mib']:>9.0f} {v['plan_peak_mib']:>9.0f}")
    for s in (1, 2, 3):
        r = ratios[f"stage{s}"]
        print(f"stage {s} / stage 0: params+grads+optimizer {r['params_grads_optimizer']:.3f}x, grads+optimizer "
              f"{r['grads_and_optimizer']:.3f}x, peak RSS {r['peak_rss']:.3f}x")
    for name, t in timing.items():
        phases = ", ".join(f"{k} {v:.1f}" for k, v in t["phases_ms"].items())
        print(f"step time, {t['model']}, 2 ranks, {name}: {t['step_ms']:.1f} ms vs stage 0 {t['stage0_ms']:.1f} ms "
              f"({t['over_stage0']:.2f}x; overlap {t['overlap']}; {t['reducer']}); phases (ms): {phases}")


def plan(model: str, ranks: int, stage: int) -> dict:
    """`hpctrain plan`'s figures for the bench's step (Adam, micro-batch 64) at `stage` on `ranks` ranks."""
    cmd = [sys.executable, "-m", "hpctrain", "plan", "--model", model, "--world", str(ranks), "--optimizer", "adam",
           "--batch-size", "64", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout)["stages"][stage]


if __name__ == "__main__":
    main()
