"""`hpctrain bench`: the measurements behind the numbers in docs/performance.md.

Every function runs on all ranks of the communicator it is given (start it with `hpctrain launch -n N --
bench ...`, or let the CLI launch itself) and returns, on every rank, a plain dict of results.

- `bench_allreduce`: bus and algorithm bandwidth per message size, hpctrain's bucketed sync beside a raw
  mpi4py `Allreduce` of the same bytes (like nccl-tests).
- `bench_train`: the training step of `hpctrain train` (the same `train_step`) beside torch DDP (gloo) on
  the same model, batch and data, in one launch; plus the step on one rank alone (for scaling
  efficiency) and the sync of all gradients beside one raw allreduce of the same bytes. A language model
  (`gpt[:...]`) steps on random token rows (batch, seq_len) and adds tokens/s, FLOPs per token, the summed
  peak FLOP/s every rank measures at once, and MFU, as `train` reports them.
"""

from __future__ import annotations

import itertools
import socket
import statistics
import time
from typing import Any, Callable, Iterator

import numpy as np

from ..comm import Comm, GradSync, self_comm, strategy_class
from ..base.rankenv import RankEnv, read_env
from ..base.errors import ConfigError
from ..control.tracing import Timeline
from .limit import InStepAllreduce, limit_figures, limit_steps
from .watch import current, progress

def parse_size(text: str) -> int:
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B")
    unit = t[-1] if t and t[-1] in units else ""
    try:
        value = int(float(t[: len(t) - len(unit)]) * units[unit])
    except ValueError:
        raise ConfigError(f"bad size {text!r} in --sizes: write e.g. 4K,64K,1M,16M") from None
    if value < 4:
        raise ConfigError(f"size {text!r} in --sizes is below one float32 (4 bytes)")
    return value


def median_time(comm: Comm, fn: Callable[[], Any], iters: int, warmup: int = 2) -> float:
    progress(f"timing {getattr(fn, '__name__', 'a step')}")
    for _ in range(warmup):
        fn()
    comm.barrier()
    times = []
    for _ in range(iters):
        progress()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    # the slowest rank's median is what a job sees
    return float(comm.allreduce_array([statistics.median(times)], op="max")[0])


def bench_allreduce(comm: Comm, sizes: list[int], *, bucket_mb: float = 25.0, iters: int | None = None) -> dict[str, Any]:
    """Allreduce time and bandwidth per size: raw mpi4py vs hpctrain's bucketed GradSync."""
    import torch

    from ..base.progress import Progress

    rows = []
    n = comm.size
    bar = Progress(len(sizes), "bench allreduce", enabled=comm.rank == 0, unit="sizes")
    for size in sizes:
        bar.update(0, size=f"{size} B")
        count = max(1, size // 4)
        reps = iters or int(min(200, max(5, (64 << 20) // max(size, 1) // 4)))
        raw = np.ones(count, np.float32)
        raw_s = median_time(comm, lambda: comm.allreduce_inplace(raw), reps)
        param = torch.nn.Parameter(torch.zeros(count))
        sync = GradSync([param], comm, bucket_mb=bucket_mb, overlap=False)
        hp_s = median_time(comm, sync.wait, reps)
        sync.close()
        bus = 2 * (n - 1) / n if n > 1 else 1.0
        rows.append({
            "bytes": count * 4,
            "raw_ms": raw_s * 1e3, "hpctrain_ms": hp_s * 1e3,
            "raw_algbw_gbs": count * 4 / raw_s / 1e9, "raw_busbw_gbs": count * 4 / raw_s / 1e9 * bus,
            "hpctrain_algbw_gbs": count * 4 / hp_s / 1e9, "hpctrain_busbw_gbs": count * 4 / hp_s / 1e9 * bus,
            "ratio": hp_s / raw_s,
        })
        bar.update(1)
    bar.close()
    return {"world_size": n, "bucket_mb": bucket_mb, "sizes": rows}


def bench_train(comm: Comm, *, model_spec: str = "mlp:2048,2048", input_dim: int = 784, classes: int = 10,
                batch_size: int = 64, steps: int = 30, rounds: int = 3, bucket_mb: float = 25.0,
                baseline: str | None = "ddp", overlap: bool | None = None, compress: str = "none",
                device: str = "cpu", zero: int = 0, optimizer: str = "sgd", seq_len: int = 128,
                vocab: int = 257, trace: str | None = None) -> dict[str, Any]:
    """Step time of hpctrain's training step vs DDP-gloo on the same model/batch/data, plus scaling, and the
    memory each rank holds. With `zero` 1 or 2 the step runs at that ZeRO stage and is timed beside stage 0
    (built after the memory of the sharded step has been read, so that the peak RSS is the sharded run's).
    A language model spec (`gpt[:...]`) takes rows of `seq_len` random tokens below `vocab` instead of
    `input_dim` features and `classes` labels (see `workload`). `trace`: see `_phases`."""
    import torch

    from ..control.step import train_step

    env = read_env()
    torch.set_num_threads(env.torch_threads())
    fresh_model, xs, ys = workload(comm.rank, model_spec, batch_size, input_dim, classes, seq_len, vocab)
    batches = itertools.cycle(list(zip(xs, ys)))  # one cycle for both steps: each takes the next batch
    loss_fn = torch.nn.CrossEntropyLoss(reduction="sum")

    # hpctrain: the exact step `hpctrain train` runs
    device, overlap = _device_and_overlap(env, device, overlap)
    global_n = ys[0].size * comm.size  # targets of the step: one per sample, or one per token of a row
    comm_times: list[float] = []

    def stepper(stage: int, times: list[float] | None = None) -> tuple[Callable[[], None], Any, Any, Any]:
        setup = _step_setup(fresh_model().to(device), comm, stage, optimizer, loss_fn, device, bucket_mb=bucket_mb,
                            overlap=overlap, compress=compress)

        def step(phases: dict[str, float] | None = None) -> None:
            x, y = next(batches)
            train_step(setup, x, y, global_n, phases=phases)
            if times is not None:
                times.append(setup.sync.comm_seconds)

        return step, setup.model, setup.sync, setup.optimizer

    hp_step, model, sync, opt = stepper(zero, comm_times)
    params = sum(p.numel() for p in model.parameters())
    for _ in range(2):
        hp_step()  # the optimizer state exists from the first step on
    memory = _memory(comm, model, sync, opt)
    lm = _lm_rates(comm, model, device, seq_len) if _is_lm(model_spec) else None
    if strategy_class(zero).sharded:
        other, _, stage0_sync, _ = stepper(0)
    else:
        other = _ddp_baseline(comm, env, baseline, device, fresh_model, batches)
    limits, in_step = limit_steps(fresh_model, xs, ys, optimizer=optimizer, device=device, global_n=global_n,
                                  comm=comm, overlap=overlap)
    times = _timed_rounds(comm, {"hpctrain": hp_step, **limits, "other": other}, steps, rounds, warmed=comm_times.clear,
                          in_step=in_step)
    hp_times, other_times, hp_ms = times["hpctrain"], times.get("other", []), statistics.median(times["hpctrain"]) * 1e3
    phases, traced = _phases(comm, hp_step, steps, hp_ms, trace)  # with trace: TRACE/trace.json, and its verdict
    result: dict[str, Any] = {
        "world_size": comm.size, "model": model_spec, "parameters": params, "batch_size": batch_size,
        "torch_threads": torch.get_num_threads(), "device": str(device), "staging": sync.staging,
        "bucket_mb": bucket_mb, "overlap": overlap, "compress": compress, "zero": zero, "optimizer": optimizer,
        "memory": memory,
        "hpctrain": {"step_ms": hp_ms, "samples_per_s": batch_size * comm.size / hp_ms * 1e3,
                     "comm_ms": statistics.median(comm_times) * 1e3 if comm_times else 0.0},
        "wire_bytes_per_step": sync.wire_bytes, "phases_ms": phases, **traced, "trace_dir": trace,
    }
    if lm is not None:  # MFU as `train` reports it: tokens/s x FLOPs per token / all ranks' peak
        result.update(lm, vocab=vocab, tokens_per_s=global_n / hp_ms * 1e3)
        result["mfu"] = result["tokens_per_s"] * lm["flops_per_token"] / lm["peak_flops"]
    raw_ms = _raw_allreduce_ms(comm, params) if comm.size > 1 else None
    result.update(limit_figures(hp_times, times["plain"], in_step, raw_ms, overlap, times.get("handwritten")))
    if strategy_class(zero).sharded:
        return _beside_stage0(result, other_times, sync, stage0_sync)
    if other:
        ddp_ms = statistics.median(other_times) * 1e3
        result["ddp"] = {"step_ms": ddp_ms, "samples_per_s": batch_size * comm.size / ddp_ms * 1e3}
        result["ddp_over_hpctrain"] = ddp_ms / hp_ms
        progress("DDP teardown (gloo)")
        torch.distributed.destroy_process_group()
    result.update(_scaling(comm, model, sync, opt, loss_fn, xs, ys, params, device, bucket_mb=bucket_mb, steps=steps,
                           rounds=rounds, global_n=global_n, hp_ms=hp_ms, raw_ms=raw_ms))
    result["self_world_over_plain"] = result["self_world_step_ms"] / result["plain_torch_step_ms"]
    return result


def _beside_stage0(result: dict[str, Any], stage0_times: list[float], sync: Any, stage0_sync: Any) -> dict[str, Any]:
    """A sharded step's result with stage 0's step time beside it (closes both syncs)."""
    stage0_ms = statistics.median(stage0_times) * 1e3
    result["stage0"] = {"step_ms": stage0_ms,
                        "samples_per_s": result["batch_size"] * result["world_size"] / stage0_ms * 1e3}
    result["step_over_stage0"] = result["hpctrain"]["step_ms"] / stage0_ms
    result["zero_reduce"], result["zero_reduce_probe"] = sync.reduce, sync.probe
    stage0_sync.close()
    sync.close()
    return result


def _phases(comm: Comm, step: Callable[..., None], steps: int, step_ms: float,
            trace: str | None) -> tuple[dict[str, float], dict[str, Any]]:
    """Where a step's time goes (ms per step, the slowest rank's per phase): zero, forward, backward, hooks,
    wait, optimizer, and `other` (data, Python, the rest of the step beside the timed one); with `trace` (a
    directory), the pass on every rank's timeline, merged into TRACE/trace.json: its summary entries."""
    phases: dict[str, float] = {}
    progress("the phases of a step")
    timeline = Timeline(trace, f"1:{steps}", comm) if trace is not None else None
    comm.barrier()
    for i in range(steps):
        progress()
        if timeline is not None:
            timeline.step(i + 1)
        step(phases)
    traced = timeline.close() if timeline is not None else {}
    names = ("zero", "forward", "backward", "hooks", "wait", "optimizer")
    values = comm.allreduce_array([phases.get(k, 0.0) / steps * 1e3 for k in names], op="max")
    out = dict(zip(names, (float(v) for v in values)))
    out["other"] = max(0.0, step_ms - sum(out.values()))
    if "gathers" in phases:  # ZeRO 3, inside forward and backward: the gathers, and the part they were waited for
        got = comm.allreduce_array([phases["gathers"] / steps * 1e3, phases["gather_wait"] / steps * 1e3], op="max")
        out.update(gathers=float(got[0]), gather_wait=float(got[1]))
    return out, traced


def _scaling(comm: Comm, model: Any, sync: GradSync, opt: Any, loss_fn: Any, xs: list[Any], ys: list[Any],
             params: int, device: Any, *, bucket_mb: float, steps: int, rounds: int, global_n: int,
             hp_ms: float, raw_ms: float | None) -> dict[str, Any]:
    """The sync of all gradients beside one raw allreduce, the step of one rank alone, and hpctrain's step
    with every rank its own world at once (closes `sync`)."""
    from ..control.step import train_step
    from ..control.update import StepSetup

    out: dict[str, Any] = {}
    if comm.size > 1:
        out.update(_sync_beside_raw(comm, sync, raw_ms))
    sync.close()

    def solo_step(solo: GradSync) -> None:
        train_step(StepSetup(model=model, sync=solo, optimizer=opt, loss_fn=loss_fn, device=device), xs[0], ys[0],
                   ys[0].size)

    one_ms = _one_rank_alone_ms(comm, model, solo_step, bucket_mb=bucket_mb, steps=steps, rounds=rounds)
    out["single_rank_step_ms"] = one_ms
    out["self_world_step_ms"] = _every_rank_alone_ms(comm, model, solo_step, bucket_mb=bucket_mb, steps=steps,
                                                       rounds=rounds)
    out["scaling_efficiency"] = (global_n / hp_ms) / (comm.size * ys[0].size / one_ms)
    return out


def _step_setup(model: Any, comm: Comm, zero: int, optimizer: str, loss_fn: Any, device: Any,
                **sync_args: Any) -> Any:
    """The step of `model` with the gradient sync and optimizer `hpctrain train` builds for `--zero`, `--optimizer`
    (lr 0.01)."""
    from ..base.config import check_across
    from ..base.sections import CommConfig, OptimizerConfig, ParallelConfig, ZeroConfig
    from ..control.step import make_sync
    from ..control.update import StepSetup

    wire = CommConfig(bucket_mb=sync_args["bucket_mb"], grad_compression=sync_args["compress"])
    sharding = ZeroConfig(stage=zero)
    check_across(sharding, wire, ParallelConfig(), rows=1, staged=False)
    sync, opt = make_sync(wire, sharding, OptimizerConfig(name=optimizer, lr=0.01), model, comm, sync_args["overlap"])
    return StepSetup(model=model, sync=sync, optimizer=opt, loss_fn=loss_fn, device=device)


def _memory(comm: Comm, model: Any, sync: Any, opt: Any) -> dict[str, float]:
    """MiB this rank holds in parameters, gradients and optimizer state between two steps, and the peak
    RSS of the process so far; each the largest over the ranks."""
    import resource

    params = sync.param_bytes()  # at ZeRO 3: this rank's slices (no unit is gathered between steps)
    if hasattr(opt, "state_bytes"):
        state = opt.state_bytes()
    else:
        state = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if hasattr(v, "numel"))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    values = comm.allreduce_array([params, sync.grad_bytes(), state, peak], op="max") / 2**20
    return {"params_mib": float(values[0]), "grads_mib": float(values[1]), "optimizer_mib": float(values[2]),
            "grads_and_optimizer_mib": float(values[1] + values[2]), "peak_rss_mib": float(values[3])}


def _is_lm(model_spec: str) -> bool:
    """Whether `model_spec` names a language model (`gpt`, `gpt:...`)."""
    return model_spec.partition(":")[0] == "gpt"


def workload(rank: int, model_spec: str, batch_size: int, input_dim: int, classes: int, seq_len: int,
              vocab: int) -> tuple[Callable[[], Any], list[Any], list[Any]]:
    """A builder of the model (seeded, so every rank and every call builds the same weights) and eight
    batches seeded by the rank: a classifier's random features and labels, or a language model's rows of
    random token ids, inputs and targets both int64 (batch_size, seq_len), as `train` feeds them."""
    import torch

    rng = np.random.default_rng(rank)
    if _is_lm(model_spec):
        from ..compute.gpt import build_lm

        def build() -> Any:
            return build_lm(model_spec, seq_len, vocab)

        xs = [rng.integers(0, vocab, (batch_size, seq_len), dtype=np.int64) for _ in range(8)]
        ys = [rng.integers(0, vocab, (batch_size, seq_len), dtype=np.int64) for _ in range(8)]
    else:
        from ..compute.models import build_model

        def build() -> Any:
            return build_model(model_spec, (input_dim,), classes)

        xs = [rng.standard_normal((batch_size, input_dim), dtype=np.float32) for _ in range(8)]
        ys = [rng.integers(0, classes, batch_size) for _ in range(8)]

    def fresh_model() -> Any:
        torch.manual_seed(0)
        return build()

    return fresh_model, xs, ys


def _lm_rates(comm: Comm, model: Any, device: Any, seq_len: int) -> dict[str, Any]:
    """The GPT's seq_len, training FLOPs per token (`compute.gpt.flops_per_token`) and the peak float32
    matmul FLOP/s of all ranks' devices, each rank measuring its own at once (as `train` does at start-up:
    ranks that share cores measure the share they will train on), summed; as in `train`, measuring is never a
    budgeted wait (a loaded node slows it as much as it likes)."""
    from ..control.lm import flops_and_peak

    fpt, peak = flops_and_peak(model, seq_len, comm, device, "fp32", watchdog=current())
    progress("start-up, after the peak FLOP/s")
    return {"seq_len": seq_len, "flops_per_token": fpt, "peak_flops": peak}


def _device_and_overlap(env: RankEnv, device: str, overlap: bool | None) -> tuple[Any, bool]:
    """This rank's device (`cuda`: its own GPU, made current) and the overlap `hpctrain train` would pick."""
    import torch

    if device == "cuda":
        from ..base.rankenv import select_device

        device = select_device(env, torch.cuda.device_count())
        torch.cuda.set_device(device)
    if overlap is None:
        from ..control.step import auto_overlap

        overlap = auto_overlap(torch.device(device).type)
    return device, overlap


def _ddp_baseline(comm: Comm, env: RankEnv, baseline: str | None, device: Any, fresh_model: Callable[[], Any],
                  batches: Iterator[tuple[Any, Any]]) -> Callable[[], None] | None:
    """The baseline's step: torch DDP over gloo on the same model and batches (CPU, 2+ ranks), else None."""
    import torch

    if baseline == "ddp" and comm.size > 1 and device == "cpu":
        import torch.distributed as dist

        port = 0
        if comm.rank == 0:
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
        host, port = comm.bcast((socket.gethostname() if comm.size > env.local_size else "127.0.0.1", port))
        progress("DDP start-up (gloo)")
        dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=comm.rank, world_size=comm.size)
        ddp_model = torch.nn.parallel.DistributedDataParallel(fresh_model())
        ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=0.01, momentum=0.9)
        ddp_loss = torch.nn.CrossEntropyLoss()

        def ddp_step() -> None:  # the baseline as DDP users write it
            x, y = next(batches)
            ddp_opt.zero_grad(set_to_none=True)
            out, target = ddp_model(torch.from_numpy(x)), torch.from_numpy(y)
            if out.dim() > 2:  # a language model's logits (batch, tokens, vocabulary): one target per token
                out, target = out.reshape(-1, out.shape[-1]), target.reshape(-1)
            ddp_loss(out, target).backward()
            ddp_opt.step()

        return ddp_step
    if baseline not in (None, "none", "ddp"):
        raise ConfigError(f"unknown --baseline {baseline!r}: choose ddp or none")
    return None


def _timed_rounds(comm: Comm, named: dict[str, Callable[[], None] | None], steps: int, rounds: int, *,
                  warmed: Callable[[], None], in_step: InStepAllreduce | None = None) -> dict[str, list[float]]:
    """Median step times per round (seconds, the slowest rank's) of each named step, alternating within every
    round in the given order (the first is hpctrain's); `warmed` runs after the warm-up steps of all; `in_step`
    (the limit's allreduce, timed in the steps of one of them) keeps each round's figure."""
    from ..base.progress import Progress

    named = {k: fn for k, fn in named.items() if fn is not None}
    bar = Progress(rounds, "bench train", enabled=comm.rank == 0, unit="rounds")
    times: dict[str, list[float]] = {k: [] for k in named}
    for _ in range(2):
        for fn in named.values():
            fn()
    warmed()
    if in_step is not None:
        in_step.seconds.clear()
    first = next(iter(named))
    for _ in range(rounds):
        for name, fn in named.items():
            times[name].append(median_time(comm, fn, steps, warmup=1))
        if in_step is not None:
            in_step.end_round()
        bar.update(1, hpctrain_ms=f"{times[first][-1] * 1e3:.1f}")
    bar.close()
    return times


def _raw_allreduce_ms(comm: Comm, params: int) -> float:
    """One raw mpi4py `Allreduce` of all gradient bytes (float32, host memory: the bound for the staging path
    too), back to back, the slowest rank's median (beside the sync alone, timed the same way; the limit's
    allreduce is timed in the step: `limit.InStepAllreduce`)."""
    flat = np.ones(params, np.float32)
    return median_time(comm, lambda: comm.allreduce_inplace(flat), 20) * 1e3


def _sync_beside_raw(comm: Comm, sync: GradSync, raw_ms: float) -> dict[str, float]:
    """The sync of all gradients alone, beside one raw allreduce of the same bytes."""
    sync_times = []
    progress("the sync alone")
    for _ in range(22):
        progress()
        # no zero(): it drops the gradients, and a wait would then time allocating zeros, not the sync
        comm.barrier()
        t0 = time.perf_counter()
        sync.wait()
        sync_times.append(time.perf_counter() - t0)
    sync_ms = float(comm.allreduce_array([statistics.median(sync_times[2:])], op="max")[0]) * 1e3
    return {"sync_ms": sync_ms, "raw_allreduce_ms": raw_ms, "sync_over_raw": sync_ms / raw_ms}


def _one_rank_alone_ms(comm: Comm, model: Any, solo_step: Callable[[GradSync], None], *, bucket_mb: float,
                       steps: int, rounds: int) -> float:
    """Rank 0's step time with itself as the world (COMM_SELF), on every rank; the others wait meanwhile
    without spinning (an MPI barrier busy-polls and would steal rank 0's CPU)."""
    progress("rank 0's step alone" if comm.rank == 0 else "waiting for rank 0 to time its step alone")
    if comm.rank == 0:
        solo = GradSync(model.parameters(), self_comm(), bucket_mb=bucket_mb)
        solo_times = []
        for _ in range(rounds):
            for _ in range(2):
                solo_step(solo)
            ts = []
            for _ in range(steps):
                progress()
                t0 = time.perf_counter()
                solo_step(solo)
                ts.append(time.perf_counter() - t0)
            solo_times.append(statistics.median(ts))
        solo.close()
        one_ms = statistics.median(solo_times) * 1e3
    else:
        one_ms = 0.0
    comm.idle_barrier(None if comm.rank == 0 else 0.005)
    return float(comm.bcast(one_ms))


def _every_rank_alone_ms(comm: Comm, model: Any, solo_step: Callable[[GradSync], None], *, bucket_mb: float,
                         steps: int, rounds: int) -> float:
    """hpctrain's step with no communication, every rank computing it at the same time, each with itself as
    the world (`self_world_step_ms`: hpctrain's own per-step work beside the plain torch limit). The slowest
    rank's median."""
    solo = GradSync(model.parameters(), self_comm(), bucket_mb=bucket_mb)
    times = []
    progress("every rank's step alone, each its own world")
    for _ in range(rounds):
        comm.barrier()
        for _ in range(2):
            solo_step(solo)
        for _ in range(steps):
            progress()
            t0 = time.perf_counter()
            solo_step(solo)
            times.append(time.perf_counter() - t0)
    solo.close()
    comm.barrier()
    return float(comm.allreduce_array([statistics.median(times) * 1e3], op="max")[0])
