#!/usr/bin/env python3
"""What seeing inside a run costs (issue 28): the flight recorder (always on), `--trace` over a window, the size of
RUN/trace.json, and how well the ranks' clocks are aligned.

1. Step time, recorder off / on / on and traced, alternating in one job (`--blocks` rounds of `--steps` steps
   each, the three variants in a rotating order; each block's median step, the slowest rank's; the median of
   the blocks per variant). Reference workload: MLP 784-2048-2048-10, batch 64 per rank, 2 ranks, SGD, the
   sync `train` builds, and per step the trainer's one small agreement (a 4-float allreduce, as the checkpoint
   policy does). "Off" replaces the recorder's three calls with no-op stubs on the instance (the call sites
   stay: the least a call costs); "traced" records every step of the block on the timeline (spans of every
   phase, the collectives copied from the ring at each step's end).
2. The size of RUN/trace.json: `hpctrain train --trace` over 50 steps of the reference MLP on 4 ranks, and a
   10,000-step run of a tiny model (mlp:16 on digits, batch 4) with `--trace every:10` (a ring of the last
   100 sampled steps) and with `--trace last:1000` (the largest window).
3. The recorder's own cost in one process (`unit_costs`): a collective's record, a traced step's bookkeeping;
   times the collectives per step over the step time, it bounds what 1 measures through the machine's noise.
4. The clocks: each traced run's summary (`trace.clock`): the largest offset measured against rank 0 (on one
   node every rank reads the same CLOCK_MONOTONIC, so the true offset is 0 and the measured one is the
   method's error), the error bound of the measurement (half the best ping-pong's round trip), and the change
   between start and end.

    python benchmarks/trace_overhead.py [--blocks 15] [--steps 10] [--skip-sizes] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
HPCTRAIN = [sys.executable, "-m", "hpctrain"]
VARIANTS = ("off", "on", "traced")


def worker(blocks: int, steps: int) -> None:
    """One rank of the step-time comparison (under mpirun -n 2); rank 0 prints one JSON line."""
    import numpy as np
    import torch

    from hpctrain.base.config import TrainConfig
    from hpctrain.base.rankenv import read_env
    from hpctrain.base.sections import CommConfig, OptimizerConfig, ZeroConfig
    from hpctrain.base.window import parse_window
    from hpctrain.comm import world
    from hpctrain.compute.models import build_model
    from hpctrain.control.step import auto_overlap, make_sync, train_step
    from hpctrain.trace.flight import RECORDER
    from hpctrain.trace.spans import TRACER

    comm, env = world(), read_env()
    torch.set_num_threads(env.torch_threads())
    torch.manual_seed(0)
    model = build_model("mlp:2048,2048", (784,), 10)
    rng = np.random.default_rng(comm.rank)
    xs = [rng.standard_normal((64, 784), dtype=np.float32) for _ in range(8)]
    ys = [rng.integers(0, 10, 64) for _ in range(8)]
    cfg = TrainConfig(data=".", run_dir=".", optimizer="sgd", lr=0.01)  # what `train` builds for these flags
    sync, opt = make_sync(cfg.section(CommConfig), cfg.section(ZeroConfig), cfg.section(OptimizerConfig), model, comm,
                          auto_overlap(env, "cpu"))
    loss_fn = torch.nn.CrossEntropyLoss(reduction="sum")
    stubs = {"begin": lambda *a, **k: 0, "end": lambda *a, **k: None, "handoff": lambda *a, **k: None}
    counter = {"step": 0}

    def step() -> float:
        i = counter["step"] = counter["step"] + 1
        t0 = time.perf_counter()
        if TRACER.window is not None:
            TRACER.begin_step(i)
        train_step(model, sync, opt, loss_fn, xs[i % 8], ys[i % 8], 64 * comm.size)
        comm.allreduce_array([0.0, 0.0, 0.0, 0.0], op="max")  # the checkpoint policy's agreement, every step
        return time.perf_counter() - t0

    def block(variant: str) -> float:
        for name, stub in stubs.items():
            if variant == "off":
                setattr(RECORDER, name, stub)
            else:
                RECORDER.__dict__.pop(name, None)
        TRACER.start(parse_window("last:1000") if variant == "traced" else None, comm.rank)
        comm.barrier()
        times = [step() for _ in range(steps)]
        TRACER.start(None)
        return float(comm.allreduce_array([statistics.median(times)], op="max")[0])

    for _ in range(3):
        block("on")  # warm-up
    out = {v: [] for v in VARIANTS}
    for b in range(blocks):
        order = VARIANTS[b % 3:] + VARIANTS[:b % 3]
        for v in order:
            out[v].append(block(v))
    sync.close()
    if comm.rank == 0:
        print(json.dumps({"blocks": out, "ranks": comm.size, "steps": steps, "threads": torch.get_num_threads()}))


def unit_costs() -> dict:
    """The recorder's own cost, in one process: one collective's record (begin + end; the median of 5 x 100,000),
    and one traced step (begin_step, the 7 spans of a step of `train`, its 6 collectives copied at its end)."""
    import timeit

    import torch

    from hpctrain.base.window import parse_window
    from hpctrain.trace.flight import RECORDER
    from hpctrain.trace.spans import TRACER

    def record() -> None:
        RECORDER.end(RECORDER.begin("allreduce", 1, torch.float32, counter=0), 4096)

    per_record = statistics.median(timeit.repeat(record, number=100_000, repeat=5)) / 100_000
    TRACER.start(parse_window("last:1000"))
    step = [0]

    def traced_step() -> None:
        step[0] += 1
        TRACER.begin_step(step[0])
        for name in ("data wait", "zero", "forward", "backward", "wait", "optimizer", "checkpoint stall"):
            TRACER.span(name, 1.0, 2.0)
        for _ in range(6):
            record()

    per_step = statistics.median(timeit.repeat(traced_step, number=2000, repeat=5)) / 2000 - 6 * per_record
    TRACER.start(None)
    return {"record_us": per_record * 1e6, "traced_step_us": per_step * 1e6}


def step_times(blocks: int, steps: int) -> dict:
    cmd = ["mpirun", "-n", "2", "--oversubscribe", "--bind-to", "none", sys.executable, __file__, "--worker",
           "--blocks", str(blocks), "--steps", str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, check=True)
    raw = json.loads(proc.stdout.strip().splitlines()[-1])
    med = {v: statistics.median(t) * 1e3 for v, t in raw["blocks"].items()}
    pairs_on = [on / off for on, off in zip(raw["blocks"]["on"], raw["blocks"]["off"])]
    pairs_tr = [tr / on for tr, on in zip(raw["blocks"]["traced"], raw["blocks"]["on"])]
    return {"median_step_ms": med, "on_over_off": med["on"] / med["off"], "traced_over_on": med["traced"] / med["on"],
            "on_over_off_blocks": [min(pairs_on), statistics.median(pairs_on), max(pairs_on)],
            "traced_over_on_blocks": [min(pairs_tr), statistics.median(pairs_tr), max(pairs_tr)],
            "blocks": len(pairs_on), "steps_per_block": steps}


def _run(args: list[str], timeout: float = 1800) -> None:
    subprocess.run([*HPCTRAIN, *args], capture_output=True, text=True, env=ENV, check=True, timeout=timeout)


def sizes(work: Path) -> dict:
    """trace.json sizes and clock figures of real traced runs."""
    out = {}
    ref, tiny = work / "ref", work / "digits"
    _run(["shard", "synthetic:15360:784:10", str(ref), "--shards", "4", "--val-fraction", "0"])
    _run(["shard", "digits", str(tiny), "--shards", "4", "--val-fraction", "0.1"])
    runs = {
        "reference MLP, 4 ranks, --trace 3:52 (50 steps)": (ref, ["--model", "mlp:2048,2048", "--batch-size", "64",
                                                                   "--max-steps", "55", "--trace", "3:52"]),
        "mlp:16, 4 ranks, 10,000 steps, --trace every:10": (tiny, ["--model", "mlp:16", "--batch-size", "4",
                                                                   "--epochs", "200", "--max-steps", "10000",
                                                                   "--trace", "every:10"]),
        "mlp:16, 4 ranks, 10,000 steps, --trace last:1000": (tiny, ["--model", "mlp:16", "--batch-size", "4",
                                                                    "--epochs", "200", "--max-steps", "10000",
                                                                    "--trace", "last:1000"]),
    }
    for i, (name, (data, extra)) in enumerate(runs.items()):
        run = work / f"run{i}"
        t0 = time.monotonic()
        _run(["launch", "-n", "4", "--", "train", "--data", str(data), "--run-dir", str(run), "--checkpoint-every", "0",
              "--log-every", "1000", *extra])
        summary = json.loads((run / "summary.json").read_text())
        out[name] = {"trace_json_bytes": (run / "trace.json").stat().st_size, "steps": summary["steps"],
                     "traced_steps": summary["trace"]["steps"], "clock": summary["trace"]["clock"],
                     "rank_file_bytes": sum(p.stat().st_size for p in (run / "trace").iterdir()),
                     "straggler": summary["straggler"]["verdict"], "wall_s": time.monotonic() - t0}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=15)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--skip-sizes", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.worker:
        worker(args.blocks, args.steps)
        return
    result = {"load_before": os.getloadavg(), "unit": unit_costs()}
    result["step"] = step_times(args.blocks, args.steps)
    if not args.skip_sizes:
        with tempfile.TemporaryDirectory() as tmp:
            result["sizes"] = sizes(Path(tmp))
    result["load_after"] = os.getloadavg()
    if args.json:
        print(json.dumps(result))
        return
    u, s = result["unit"], result["step"]
    print(f"one collective's record {u['record_us']:.2f} us; one traced step's spans and copy {u['traced_step_us']:.1f} us")
    print(f"step time, reference MLP, 2 ranks, {s['blocks']} rounds of {s['steps_per_block']} steps per variant:")
    print("  " + ", ".join(f"{v} {ms:.2f} ms" for v, ms in s["median_step_ms"].items()))
    lo, mid, hi = s["on_over_off_blocks"]
    print(f"  flight recorder on / off: {s['on_over_off']:.4f} (per round {lo:.3f}-{hi:.3f}, median {mid:.4f})")
    lo, mid, hi = s["traced_over_on_blocks"]
    print(f"  traced / untraced:        {s['traced_over_on']:.4f} (per round {lo:.3f}-{hi:.3f}, median {mid:.4f})")
    for name, r in result.get("sizes", {}).items():
        c = r["clock"]
        print(f"{name}: trace.json {r['trace_json_bytes'] / 1e6:.2f} MB ({r['traced_steps']} of {r['steps']} steps "
              f"kept), rank files {r['rank_file_bytes'] / 1e6:.2f} MB; clocks: offset <= {c['offset_max_us']:.1f} us, "
              f"error bound <= {c['error_max_us']:.1f} us, drift <= {c['drift_max_us']:.1f} us; {r['straggler']}")
    print(f"load average before {result['load_before'][0]:.1f}, after {result['load_after'][0]:.1f}")


if __name__ == "__main__":
    main()
