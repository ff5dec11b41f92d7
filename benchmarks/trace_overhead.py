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
5. With `--split`, a run split by --tp/--pp instead of the reference MLP (`--model`, `--tp`, `--pp`,
   `--micro-batches`, `--batch-size`, `--seq-len`; one replica on tp x pp ranks): recorder off / on in
   alternating rounds as in 1, the records a step makes (a tensor-parallel step: one per activation sum, four
   per block and micro-batch, and the loss's; a pipeline: two per transfer) and what they cost at the unit
   cost of 3 (`records_per_step x record_us / step`), the bound that the noise of 1 cannot show. With
   `--calibrate` both variants run the recorder: the ratio the method reads when nothing differs.

    python benchmarks/trace_overhead.py [--blocks 15] [--steps 10] [--skip-sizes] [--json]
    python benchmarks/trace_overhead.py --split --model gpt:layers=4,dim=32,heads=2 --tp 2 [--pp 1] [--blocks 15] [--calibrate]
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


STUBS = {"begin": lambda *a, **k: 0, "end": lambda *a, **k: None, "post": lambda *a, **k: 0,
         "handoff": lambda *a, **k: None}


def recorder_on(on: bool) -> None:
    """The flight recorder as shipped, or (off) its calls replaced by no-op stubs on the instance: the call sites
    stay, the least a call costs."""
    from hpctrain.trace.flight import RECORDER

    for name, stub in STUBS.items():
        if on:
            RECORDER.__dict__.pop(name, None)
        else:
            setattr(RECORDER, name, stub)


def worker(blocks: int, steps: int) -> None:
    """One rank of the step-time comparison (under mpirun -n 2); rank 0 prints one JSON line."""
    import numpy as np
    import torch

    from hpctrain.base.config import TrainConfig
    from hpctrain.base.rankenv import read_env
    from hpctrain.base.window import parse_window
    from hpctrain.comm import world
    from hpctrain.compute.models import build_model
    from hpctrain.control.step import auto_overlap, make_sync, train_step
    from hpctrain.control.update import StepSetup
    from hpctrain.trace.spans import TRACER

    comm, env = world(), read_env()
    torch.set_num_threads(env.torch_threads())
    torch.manual_seed(0)
    model = build_model("mlp:2048,2048", (784,), 10)
    rng = np.random.default_rng(comm.rank)
    xs = [rng.standard_normal((64, 784), dtype=np.float32) for _ in range(8)]
    ys = [rng.integers(0, 10, 64) for _ in range(8)]
    cfg = TrainConfig.flat(data=".", run_dir=".", optimizer="sgd", lr=0.01)  # what `train` builds for these flags
    sync, opt = make_sync(cfg.communication, cfg.zero, cfg.optimizer, model, comm,
                          auto_overlap(env, "cpu"))
    setup = StepSetup(model=model, sync=sync, optimizer=opt, loss_fn=torch.nn.CrossEntropyLoss(reduction="sum"))
    counter = {"step": 0}

    def step() -> float:
        i = counter["step"] = counter["step"] + 1
        t0 = time.perf_counter()
        if TRACER.window is not None:
            TRACER.begin_step(i)
        train_step(setup, xs[i % 8], ys[i % 8], 64 * comm.size)
        comm.allreduce_array([0.0, 0.0, 0.0, 0.0], op="max")  # the checkpoint policy's agreement, every step
        return time.perf_counter() - t0

    def block(variant: str) -> float:
        recorder_on(variant != "off")
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


def split_worker(args: argparse.Namespace) -> None:
    """One rank of the split step-time comparison (under mpirun -n tp x pp, one replica): recorder off / on in
    alternating rounds; rank 0 prints one JSON line, with the records one step makes."""
    import torch

    from hpctrain.base.config import TrainConfig
    from hpctrain.base.rankenv import read_env
    from hpctrain.comm import world
    from hpctrain.control import hybrid
    from hpctrain.control.step import make_sync
    from hpctrain.control.update import StepSetup
    from hpctrain.parallel.layout import check_layout
    from hpctrain.parallel.stages import model_limits
    from hpctrain.bench.train import workload
    from hpctrain.trace.flight import RECORDER

    comm, env = world(), read_env()
    torch.set_num_threads(env.torch_threads())
    build, xs, ys = workload(0, args.model, args.batch_size, 784, 10, args.seq_len, 257)  # one replica: the same rows
    model = build()
    cfg = TrainConfig.flat(data=".", run_dir=".", optimizer="sgd", lr=0.01, tp=args.tp, pp=args.pp,
                      micro_batches=args.micro_batches, batch_size=args.batch_size)
    layout = check_layout(comm.size, args.tp, args.pp, model_limits(model, args.model))
    par = hybrid.split(cfg.parallel, comm, layout, model, device="cpu", precision="fp32",
                       batch_rows=args.batch_size, row=xs[0][0])
    stage = par.model(model)
    sync, opt = make_sync(cfg.communication, cfg.zero, cfg.optimizer, stage,
                          par.data, False, alone=par.tied)
    setup = StepSetup(model=stage, sync=sync, optimizer=opt, loss_fn=torch.nn.CrossEntropyLoss(reduction="sum"))
    counter = {"step": 0, "records": 0}

    def step() -> float:
        i = counter["step"] = counter["step"] + 1
        t0, entered = time.perf_counter(), RECORDER.entered
        par.step(setup, xs[i % 8], ys[i % 8], ys[0].size)
        counter["records"] = RECORDER.entered - entered or counter["records"]
        return time.perf_counter() - t0

    def block(variant: str) -> float:
        recorder_on(variant != "off" or args.calibrate)
        comm.barrier()
        times = [step() for _ in range(args.steps)]
        return float(comm.allreduce_array([statistics.median(times)], op="max")[0])

    for _ in range(2):
        block("on")  # warm-up
    out = {v: [] for v in ("off", "on")}
    for b in range(args.blocks):
        for v in (("off", "on") if b % 2 == 0 else ("on", "off")):
            out[v].append(block(v))
    sync.close()
    records = comm.allreduce_array([counter["records"]], op="max")[0]
    if comm.rank == 0:
        print(json.dumps({"blocks": out, "records_per_step": int(records), "micro_batches": par.micro,
                          "ranks": comm.size, "steps": args.steps, "threads": torch.get_num_threads()}))


def split_times(args: argparse.Namespace, record_us: float) -> dict:
    cmd = ["mpirun", "-n", str(args.tp * args.pp), "--oversubscribe", "--bind-to", "none", sys.executable, __file__,
           "--split-worker", "--blocks", str(args.blocks), "--steps", str(args.steps), "--model", args.model,
           "--tp", str(args.tp), "--pp", str(args.pp), "--micro-batches", str(args.micro_batches),
           "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len)] + (["--calibrate"] if args.calibrate else [])
    raw = json.loads(subprocess.run(cmd, capture_output=True, text=True, env=ENV, check=True).stdout.strip().splitlines()[-1])
    med = {v: statistics.median(t) * 1e3 for v, t in raw["blocks"].items()}
    pairs = [on / off for on, off in zip(raw["blocks"]["on"], raw["blocks"]["off"])]
    return {"median_step_ms": med, "on_over_off": med["on"] / med["off"], "blocks": len(pairs),
            "on_over_off_blocks": [min(pairs), statistics.median(pairs), max(pairs)], "steps_per_block": args.steps,
            "records_per_step": raw["records_per_step"], "micro_batches": raw["micro_batches"],
            "bound": raw["records_per_step"] * record_us * 1e-3 / med["on"]}


def unit_costs() -> dict:
    """The recorder's own cost, in one process: one collective's record (begin + end; the median of 5 x 100,000),
    a tensor-parallel sum's (of a group, with its micro-batch), a transfer's (post + end), and one traced step
    (begin_step, the 7 spans of a step of `train`, its 6 collectives copied at its end)."""
    import timeit

    import torch

    from hpctrain.base.window import parse_window
    from hpctrain.trace.flight import RECORDER
    from hpctrain.trace.spans import TRACER

    def record() -> None:
        RECORDER.end(RECORDER.begin("allreduce", 1, torch.float32, counter=0), 4096)

    group = RECORDER.group("benchmark", (0, 1))

    def tp_sum() -> None:
        RECORDER.end(RECORDER.begin("forward sum", -1, torch.float32, 4096, group=group, micro=RECORDER.micro))

    def transfer() -> None:
        RECORDER.end(RECORDER.post("send activations", 1, torch.float32, 4096, group, 3))

    per_record = statistics.median(timeit.repeat(record, number=100_000, repeat=5)) / 100_000
    per_sum = statistics.median(timeit.repeat(tp_sum, number=100_000, repeat=5)) / 100_000
    per_transfer = statistics.median(timeit.repeat(transfer, number=100_000, repeat=5)) / 100_000
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
    return {"record_us": per_record * 1e6, "tp_sum_record_us": per_sum * 1e6, "transfer_record_us": per_transfer * 1e6,
            "traced_step_us": per_step * 1e6}


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
    ap.add_argument("--split", action="store_true", help="a run split by --tp/--pp instead of the reference MLP")
    ap.add_argument("--split-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="gpt:layers=4,dim=32,heads=2")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--micro-batches", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--calibrate", action="store_true",
                    help="with --split: the recorder on in both variants (what the method reads when nothing differs)")
    args = ap.parse_args()
    if args.worker:
        worker(args.blocks, args.steps)
        return
    if args.split_worker:
        split_worker(args)
        return
    result = {"load_before": os.getloadavg(), "unit": unit_costs()}
    if args.split:
        split_main(args, result)
        return
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


def split_main(args: argparse.Namespace, result: dict) -> None:
    """--split: the unit costs and the split run's step time, recorder off / on."""
    result["split"] = split_times(args, result["unit"]["tp_sum_record_us"])
    result["load_after"] = os.getloadavg()
    if args.json:
        print(json.dumps(result))
        return
    u, s = result["unit"], result["split"]
    print(f"one tensor-parallel sum's record {u['tp_sum_record_us']:.2f} us; one transfer's {u['transfer_record_us']:.2f} us "
          f"(a collective's {u['record_us']:.2f} us)")
    print(f"{args.model}, --tp {args.tp} --pp {args.pp}, {s['micro_batches']} micro-batch(es) of {args.batch_size} rows "
          f"x {args.seq_len} tokens: {s['records_per_step']} records a step, {s['blocks']} rounds of "
          f"{s['steps_per_block']} steps per variant:")
    print("  " + ", ".join(f"{v} {ms:.2f} ms" for v, ms in s["median_step_ms"].items()))
    lo, mid, hi = s["on_over_off_blocks"]
    print(f"  flight recorder on / off: {s['on_over_off']:.4f} (per round {lo:.3f}-{hi:.3f}, median {mid:.4f}); "
          f"records x unit cost / step: {s['bound'] * 100:.3f} %")
    print(f"load average before {result['load_before'][0]:.1f}, after {result['load_after'][0]:.1f}")


if __name__ == "__main__":
    main()
