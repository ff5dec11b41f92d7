"""`hpctrain bench allreduce | train | data | startup`: the benchmarks behind docs/performance.md."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any, Optional

import typer

from ..base.config import TRAIN_RENAMED, TRAIN_SECTIONS, check_across, section_panels, sections_of
from ..base.errors import ConfigError
from ..base.sections import (CommConfig, ModelConfig, OptimizerConfig, ParallelConfig, WatchdogConfig, ZeroConfig,
                             check_batch_size, train_options)
from .common import handle_errors, is_rank0
from .helpformat import App
from .options import config_parameters, take_renamed, with_signature

app = App(help="Measure allreduce bandwidth and training step time.", no_args_is_help=True)


def _relaunch(n: int) -> None:
    """Started without a launcher and asked for n > 1 ranks: run this same command under `hpctrain launch`."""
    from ..base.rankenv import read_env
    from ..tools.launch import launch

    if n > 1 and not read_env().under_launcher:
        argv = sys.argv[1:]
        cleaned, skip = [], False
        for i, a in enumerate(argv):
            if skip:
                skip = False
                continue
            if a in ("-n", "--np"):
                skip = True
                continue
            if a.startswith("--np="):
                continue
            cleaned.append(a)
        raise typer.Exit(launch(n, cleaned))


def _as_train(collective_timeout: float) -> None:
    """As train: host memory tuned before torch's first allocation (the step measured is train's), and the process
    gone within the edge budget after the benchmark, even if MPI_Finalize waits for a rank that is stuck."""
    from ..base.hostmem import tune_host_memory
    from ..base.stop import FLAG, edge_budget

    tune_host_memory()
    FLAG.exit_budget = edge_budget(collective_timeout)


@app.command()
@handle_errors
def allreduce(
    sizes: Annotated[str, typer.Option(help="Message sizes in bytes (K, M, G suffixes).")] = "4K,64K,1M,16M,64M",
    n: Annotated[int, typer.Option("-n", "--np", help="Ranks to launch when not already under a launcher.")] = 2,
    bucket_mb: Annotated[float, typer.Option(help="hpctrain bucket size in MiB.")] = 25.0,
    collective_timeout: Annotated[float, typer.Option(help="End the job when a rank makes no progress for this many seconds (0: never), as train's watchdog does.")] = 300.0,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Allreduce time, algorithm and bus bandwidth per size: hpctrain's bucketed sync beside raw mpi4py.

    Example: hpctrain bench allreduce -n 2 --sizes 4K,1M,16M --json
    """
    _relaunch(n)
    _as_train(collective_timeout)
    from ..bench.train import bench_allreduce, parse_size
    from ..bench.watch import watched

    with watched(collective_timeout) as comm:
        result = bench_allreduce(comm, [parse_size(s) for s in sizes.split(",") if s.strip()], bucket_mb=bucket_mb)
    if not is_rank0():
        return
    if json_out:
        print(json.dumps(result))
        return
    print(f"allreduce on {result['world_size']} ranks (float32, in place); busbw = algbw x 2(n-1)/n")
    print(f"{'bytes':>12} {'raw ms':>9} {'raw busbw':>10} {'hpctrain ms':>12} {'busbw':>9} {'ratio':>6}")
    for r in result["sizes"]:
        print(f"{r['bytes']:>12} {r['raw_ms']:>9.3f} {r['raw_busbw_gbs']:>8.2f}GB/s {r['hpctrain_ms']:>12.3f} "
              f"{r['hpctrain_busbw_gbs']:>7.2f}GB/s {r['ratio']:>6.2f}")


# the options `bench train` shares with `train`: generated from the same sections' fields (name, help, check),
# with the benchmark's own defaults for the reference model and batch
TRAINING_OPTIONS = ("model", "batch_size", "optimizer", "bucket_mb", "grad_compression", "overlap", "zero", "tp", "pp",
                    "micro_batches", "pipeline_schedule", "collective_timeout")


@app.command()
@handle_errors
def train(
    ctx: typer.Context,
    input_dim: Annotated[int, typer.Option(help="Input features (classifiers).")] = 784,
    seq_len: Annotated[int, typer.Option(help="Tokens per row (language models).")] = 128,
    vocab: Annotated[int, typer.Option(help="Vocabulary size of the random tokens (language models; 257: bytes).")] = 257,
    steps: Annotated[int, typer.Option(help="Measured steps per round.")] = 30,
    rounds: Annotated[int, typer.Option(help="Rounds, each alternating hpctrain, the plain torch limit and the baseline.")] = 5,
    baseline: Annotated[Optional[str], typer.Option(help="ddp (torch DDP, gloo) or none.")] = "ddp",
    device: Annotated[str, typer.Option(help="cpu, or cuda (one GPU per local rank; DDP baseline skipped).")] = "cpu",
    n: Annotated[int, typer.Option("-n", "--np", help="Ranks to launch when not already under a launcher.")] = 2,
    trace: Annotated[Optional[str], typer.Option(help="A directory: record every rank's timeline of the phases pass (--steps steps) into DIR/trace.json, with the straggler verdict.", metavar="DIR")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    **values: Any,
) -> None:
    """Training step time of hpctrain against the honest limit and beside torch DDP (gloo), one-rank scaling,
    sync vs raw allreduce, and the memory per rank (parameters, gradients, optimizer state, peak RSS).

    The limit is what a user would otherwise run: a plain torch step of the same model, optimizer and batch
    on every rank at once, plus one raw Allreduce of all gradient bytes where overlap cannot hide it, timed
    in the step (back to back it runs from warm caches: that ratio is printed beside);
    `step_over_limit` is the median over rounds that alternate the two. Beside them, the data-parallel loop a
    user writes by hand (the plain step with one raw Allreduce per gradient): it also pays the ranks' waits
    for each other's slowest step, which the limit leaves out.

    The options shared with `train` are its own (help and checks); the model defaults to the reference,
    mlp:2048,2048 on --input-dim inputs (a gpt spec steps on random token rows), and the optimizer steps at lr
    0.01 (sgd with momentum 0.9).

    With --zero 1-3 the step runs sharded and is timed beside stage 0 (at stage 3 the phases add the time of
    the parameter gathers and the part of it the step waited for: what prefetch, with --overlap, hides);
    compare the memory of two runs, one per stage, with benchmarks/zero_memory.py.

    Example: hpctrain bench train -n 2 --baseline ddp --json

    Example: hpctrain bench train -n 4 --zero 2 --optimizer adam --model mlp:8192,8192 --steps 3 --rounds 1

    Example: hpctrain bench train -n 2 --model gpt:layers=2,dim=128,heads=4 --seq-len 128 --batch-size 32

    Example: hpctrain bench train -n 4 --baseline none --trace bench-trace

    With --tp/--pp the model is split over the ranks as `train` splits it: the step, the measured and the
    expected pipeline bubble, each stage's phases, and the parameters and optimizer state per rank beside the
    whole model's.

    Example: hpctrain bench train -n 4 --tp 2 --pp 2 --model gpt:layers=4,dim=128,heads=4 --batch-size 16
    """
    take_renamed(ctx, values, TRAIN_RENAMED)
    s = sections_of(values)  # each section checks its own values, check_across what spans them
    wire, sharding, split = CommConfig(**s["communication"]), ZeroConfig(**s["zero"]), ParallelConfig(**s["parallel"])
    check_batch_size(values["batch_size"])
    check_across(sharding, wire, split, rows=values["batch_size"], staged=False)
    optimizer, model = OptimizerConfig(**s["optimizer"]).name, ModelConfig(**s["model"]).spec
    timeout = WatchdogConfig(**s["watchdog"]).collective_timeout
    if split.tp * split.pp > 1 and device != "cpu":
        raise ConfigError("bench train --tp/--pp measures on the CPU for now: drop --device cuda")
    _relaunch(n)
    _as_train(timeout)
    from ..bench.train import bench_train
    from ..bench.watch import watched

    if split.tp * split.pp > 1:
        _train_split(timeout, json_out, model_spec=model, parallel=split, wire=wire, sharding=sharding,
                     optimizer=optimizer, batch_size=values["batch_size"], steps=steps, rounds=rounds,
                     input_dim=input_dim, seq_len=seq_len, vocab=vocab)
        return
    with watched(timeout) as comm:
        result = bench_train(comm, model_spec=model, input_dim=input_dim, batch_size=values["batch_size"], steps=steps,
                             rounds=rounds, bucket_mb=wire.bucket_mb, baseline=baseline, overlap=wire.overlap,
                             compress=wire.grad_compression, device=device, zero=sharding.stage, optimizer=optimizer,
                             seq_len=seq_len, vocab=vocab, trace=trace)
    if not is_rank0():
        return
    if json_out:
        print(json.dumps(result))
        return
    _print_train(result)


with_signature(train, config_parameters(train_options(TRAINING_OPTIONS), renamed=TRAIN_RENAMED,
                                        panels=section_panels(TRAIN_SECTIONS),
                                        defaults={"model": "mlp:2048,2048", "batch_size": 64}))


def _print_train(result: dict) -> None:
    """`bench train`'s result as a reader wants it."""
    hp = result["hpctrain"]
    rows = f" of {result['seq_len']} tokens" if "seq_len" in result else ""
    print(f"{result['model']} ({result['parameters']:,} parameters), batch {result['batch_size']}{rows}/rank, "
          f"{result['world_size']} ranks, {result['torch_threads']} torch thread(s) per rank")
    print(f"  hpctrain step      {hp['step_ms']:8.2f} ms  {hp['samples_per_s']:9.0f} samples/s  (exposed comm {hp['comm_ms']:.2f} ms)")
    if "mfu" in result:
        print(f"  tokens/s           {result['tokens_per_s']:8.0f}     {result['flops_per_token'] / 1e6:.2f} MFLOP/token, "
              f"peak {result['peak_flops'] / 1e9:.1f} GFLOP/s (all ranks, measured), MFU {result['mfu']:.3f}")
    mem = result["memory"]
    print(f"  memory per rank    params {mem['params_mib']:.1f} MiB, grads {mem['grads_mib']:.1f} MiB, optimizer "
          f"{mem['optimizer_mib']:.1f} MiB, peak RSS {mem['peak_rss_mib']:.0f} MiB (zero stage {result['zero']})")
    spread = result["step_over_limit_rounds"]
    comm = f", plus one raw allreduce in the step: {result['limit_comm_ms']:.2f} ms" if result["limit_comm_ms"] else ""
    print(f"  limit              {result['limit_step_ms']:8.2f} ms  (plain torch step on every rank at once: "
          f"{result['plain_torch_step_ms']:.2f} ms{comm}); "
          f"step / limit {result['step_over_limit']:.2f} (rounds {min(spread):.2f}-{max(spread):.2f})")
    if "step_over_limit_back_to_back" in result:
        print(f"                     with the allreduce timed back to back instead ({result['raw_allreduce_ms']:.2f} ms, "
              f"from warm caches): step / limit {result['step_over_limit_back_to_back']:.2f}")
    phases = ", ".join(f"{k} {v:.2f}" for k, v in result["phases_ms"].items())
    if "handwritten_step_ms" in result:
        print(f"  hand-written loop  {result['handwritten_step_ms']:8.2f} ms  (plain step + one raw Allreduce per gradient: "
              f"{result['handwritten_over_limit']:.2f}x the limit); step / hand-written {result['step_over_handwritten']:.2f}")
    if "stage0" in result:
        print(f"  stage 0 step       {result['stage0']['step_ms']:8.2f} ms  (stage {result['zero']} / stage 0: "
              f"{result['step_over_stage0']:.2f}x; gradients summed by {result['zero_reduce']})")
        print(f"  where a step goes  {phases} (ms, slowest rank)")
        return
    if "ddp" in result:
        print(f"  DDP (gloo) step    {result['ddp']['step_ms']:8.2f} ms  {result['ddp']['samples_per_s']:9.0f} samples/s")
        print(f"  DDP / hpctrain     {result['ddp_over_hpctrain']:8.2f}x")
    if "sync_ms" in result:
        print(f"  sync all grads     {result['sync_ms']:8.2f} ms  vs one raw Allreduce {result['raw_allreduce_ms']:.2f} ms "
              f"({result['sync_over_raw']:.2f}x)")
    print(f"  one rank alone     {result['single_rank_step_ms']:8.2f} ms  scaling efficiency {result['scaling_efficiency']:.2f}")
    print(f"  one rank, own world{result['self_world_step_ms']:8.2f} ms  (hpctrain's step on every rank at once, no "
          f"communication: {result['self_world_over_plain']:.2f}x plain torch)")
    print(f"  where a step goes  {phases} (ms, slowest rank); {result['wire_bytes_per_step']:,} bytes on the wire")
    if "trace" in result:
        print(f"  timeline           {result['trace_dir']}/{result['trace']['file']} ({result['trace']['bytes']:,} bytes): "
              f"{result['straggler']['verdict']}")


def _train_split(collective_timeout: float, json_out: bool, **options: Any) -> None:
    """`bench train --tp/--pp`: the split step, measured on every rank; printed by rank 0."""
    from ..bench.parallel import bench_parallel
    from ..bench.watch import watched

    with watched(collective_timeout) as comm:
        result = bench_parallel(comm, **options)
    if is_rank0():
        print(json.dumps(result)) if json_out else _print_parallel(result)


def _print_parallel(result: dict) -> None:
    """`bench train --tp/--pp`'s result as a reader wants it."""
    lay, mem = result["layout"], result["memory"]
    pipe = f", {result['micro_batches']} micro-batches ({result['pipeline_schedule']})" if lay["pipe"] > 1 else ""
    print(f"{result['model']}, batch {result['batch_size']}/replica, (D,T,P) = ({lay['data']},{lay['tensor']},"
          f"{lay['pipe']}){pipe}, {result['torch_threads']} torch thread(s) per rank")
    spread = result["step_ms_rounds"]
    print(f"  step               {result['step_ms']:8.2f} ms  {result['samples_per_s']:9.0f} samples/s  (rounds "
          f"{min(spread):.1f}-{max(spread):.1f} ms)")
    print(f"  bubble             {result['bubble']:8.3f}     expected (P-1)/(M+P-1) = {result['expected_bubble']:.3f}")
    print(f"  memory per rank    {mem['params_and_optimizer_mib']:.2f} MiB parameters + optimizer state, "
          f"{mem['ratio_to_whole']:.3f}x the whole model's {mem['whole_mib']:.2f} MiB")
    print("  stage  forward  backward  p2p wait  grad sync  optimizer  schedule   bubble   (ms per step, slowest rank)")
    for s in result["stages"]:
        print(f"  {s['stage']:>5} {s['forward']:8.2f} {s['backward']:9.2f} {s['pipeline_wait']:9.2f} {s['wait']:10.2f} "
              f"{s['optimizer']:10.2f} {s['schedule']:9.2f} {s['bubble']:8.3f}")


@app.command()
@handle_errors
def data(
    directory: Annotated[str, typer.Argument(help="A directory written by `hpctrain shard`.")],
    batch_size: Annotated[int, typer.Option(help="Samples per batch.")] = 256,
    epochs: Annotated[int, typer.Option(help="Epochs to time (median).")] = 2,
    shuffle: Annotated[bool, typer.Option("--shuffle/--no-shuffle", help="Time the shuffled order.")] = True,
    n: Annotated[int, typer.Option("-n", "--np", help="Ranks to launch when not already under a launcher.")] = 1,
    collective_timeout: Annotated[float, typer.Option(help="End the job when a rank makes no progress for this many seconds (0: never), as train's watchdog does.")] = 300.0,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Reader throughput beside a raw contiguous h5py read of the same shards, and each epoch's wait for its
    first batch (what a training step waits at an epoch's start). A rank's split that one 64 MiB window holds
    is read at the first epoch only and held: later epochs gather from memory (the output says so).

    Example: hpctrain bench data data/ -n 2 --epochs 6 --json
    """
    _relaunch(n)
    _as_train(collective_timeout)
    from ..bench.data import bench_data
    from ..bench.watch import watched
    from ..comm import Comm, world
    from ..base.rankenv import read_env

    with watched(collective_timeout, world if read_env().under_launcher else lambda: Comm(None)) as comm:
        result = bench_data(comm, directory, batch_size=batch_size, epochs=epochs, shuffle=shuffle)
    if not is_rank0():
        return
    if json_out:
        print(json.dumps(result))
        return
    print(f"{result['samples']} samples of {result['sample_bytes']} bytes on {result['world_size']} rank(s), "
          f"batch {result['batch_size']}, shuffle {result['shuffle']}")
    print(f"  raw contiguous h5py  {result['raw_samples_per_s']:12.0f} samples/s  {result['raw_mb_per_s']:8.1f} MB/s")
    print(f"  hpctrain reader      {result['reader_samples_per_s']:12.0f} samples/s  {result['reader_mb_per_s']:8.1f} MB/s"
          f"  ({result['reader_over_raw']:.2f}x raw)")
    if result["held"]:
        print("  (one window holds each rank's split: read at the first epoch, held in memory after it)")
    print("  first batch of each epoch " + ", ".join(f"{v:.1f}" for v in result["first_batch_ms"]) + " ms")


@app.command()
@handle_errors
def startup(
    n: Annotated[int, typer.Option("-n", "--np", help="Ranks of the measured run.")] = 2,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Time from `hpctrain launch -n N -- train` to its first step, and its parts: import torch, the
    torch._dynamo import of torch.optim's first step, MPI init, and ours (the rest). Runs the real command
    twice on the digits dataset: as a user does, and under Python's import timer for the parts.

    Example: hpctrain bench startup -n 2
    """
    from ..bench.startup import format_startup, measure_startup

    result = measure_startup(n)
    print(json.dumps(result) if json_out else format_startup(result))
