#!/usr/bin/env python3
"""ZeRO's memory and step time (issue 16): one `hpctrain bench train` launch per stage, side by side.

Memory: --ranks ranks, Adam, an MLP of at least 70 M parameters (784-4096x5-10: 70.3 M). Each stage runs in
its own launch, so that each process's peak RSS is that stage's alone; the bench reads, per rank, the bytes
of parameters, gradients and optimizer state held between two steps, and the peak RSS so far (the largest
rank of each). Prints the ratios of stages 1 and 2 to stage 0.

Step time: `hpctrain bench train -n 2 --zero 2` on the reference MLP (784-2048-2048-10, batch 64), which
times stage 2 beside stage 0 in one launch, rounds alternating.

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

    memory = {}
    for stage in (0, 1, 2):
        result = bench(["-n", str(opts.ranks), "--zero", str(stage), "--optimizer", "adam", "--model", opts.model,
                        "--steps", str(opts.steps), "--rounds", "1", "--baseline", "none"])
        memory[stage] = dict(result["memory"], parameters=result["parameters"], step_ms=result["hpctrain"]["step_ms"])
    base = memory[0]
    ratios = {f"stage{s}": {"grads_and_optimizer": memory[s]["grads_and_optimizer_mib"] / base["grads_and_optimizer_mib"],
                            "peak_rss": memory[s]["peak_rss_mib"] / base["peak_rss_mib"]} for s in (1, 2)}
    timing = bench(["-n", "2", "--zero", "2", "--rounds", str(opts.time_rounds), "--steps", "30"])
    out = {"ranks": opts.ranks, "model": opts.model, "memory": memory, "ratios_to_stage0": ratios,
           "step_time": {"model": timing["model"], "stage2_ms": timing["hpctrain"]["step_ms"],
                         "stage0_ms": timing["stage0"]["step_ms"], "stage2_over_stage0": timing["step_over_stage0"],
                         "reducer": timing["zero_reduce"], "reducer_probe": timing["zero_reduce_probe"]}}
    if opts.json:
        print(json.dumps(out))
        return
    print(f"{opts.model} ({base['parameters']:,} parameters), Adam, {opts.ranks} ranks; MiB per rank (largest rank)")
    print(f"{'stage':>5} {'params':>9} {'grads':>9} {'optimizer':>10} {'grads+opt':>10} {'peak RSS':>9}")
    for s, m in memory.items():
        print(f"{s:>5} {m['params_mib']:>9.1f} {m['grads_mib']:>9.1f} {m['optimizer_mib']:>10.1f} "
              f"{m['grads_and_optimizer_mib']:>10.1f} {m['peak_rss_mib']:>9.0f}")
    for s in (1, 2):
        print(f"stage {s} / stage 0: grads+optimizer {ratios[f'stage{s}']['grads_and_optimizer']:.3f}x, "
              f"peak RSS {ratios[f'stage{s}']['peak_rss']:.3f}x")
    t = out["step_time"]
    print(f"step time, {t['model']}, 2 ranks: stage 2 {t['stage2_ms']:.1f} ms, stage 0 {t['stage0_ms']:.1f} ms "
          f"({t['stage2_over_stage0']:.2f}x; gradients summed by {t['reducer']}: {t['reducer_probe']})")


if __name__ == "__main__":
    main()
