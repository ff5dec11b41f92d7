"""The in-process paths of benchmarks/gpu_check.sh, run under `mpirun -n 2` by benchmarks/gpu_paths.py.

Each path is one small check of one CUDA code path of hpctrain, run on every rank; the ranks' outcomes are
gathered (on a communicator of their own, so that a failed check cannot cross a collective of the next one) and
rank 0 prints one verdict. Protocol on stdout, rank 0 only: `INFO ...`, `PLAN item ...`, then for each item
`START item` and one of `PASS item (detail)`, `FAIL item: reason`, `SKIP item: reason`. An item is
`path/variant`; the variants of a path that communicates are
- `staged`: device gradients go through pinned host buffers, as on an MPI that is not CUDA-aware. hpctrain has
  no switch for this, so here GradSync's probe is told the MPI is not CUDA-aware (`forced_staging`);
- `cuda-aware`: device memory handed to MPI directly (SKIP when the MPI is not CUDA-aware);
- `cpu` with --device cpu (then every path runs once, on the CPU).
A path that does not communicate (fused optimizers, the MFU peak) runs once, its variant the device type.

    mpirun -n 2 python benchmarks/gpu_paths_worker.py --device cuda|cpu --work DIR [--paths SEL,...|--items I,...]
    python benchmarks/gpu_paths_worker.py --list
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import shutil
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "mpi" / "scripts"))  # comm_check: the allreduce facts, reused as they are

import torch  # noqa: E402

import comm_check  # noqa: E402
from gpu_paths import STAGING_NOTES, combine, select  # noqa: E402
from hpctrain.base.config import ZERO_REDUCERS, ShardConfig, TrainConfig  # noqa: E402
from hpctrain.base.rankenv import read_env, select_device  # noqa: E402
from hpctrain.comm import Comm, GradSync, ZeroSync, mpi_info, world  # noqa: E402
from hpctrain.comm import gradsync as gradsync_module  # noqa: E402
from hpctrain.compute.gpt import build_lm  # noqa: E402
from hpctrain.compute.models import mlp  # noqa: E402
from hpctrain.checkpoint import manager as ckpt  # noqa: E402
from hpctrain.control.lm import flops_and_peak  # noqa: E402
from hpctrain.control.precision import LossScaler  # noqa: E402
from hpctrain.control.step import make_optimizer, make_sync, param_sha256, train_step  # noqa: E402
from hpctrain.control.update import StepSetup  # noqa: E402
from hpctrain.control.trainer import train  # noqa: E402
from hpctrain.data.sharding import shard  # noqa: E402

# 2 KiB buckets cut mlp((32,), 10, hidden=(47,)) into [b2, W2] 480 elements (equal slices on 2 ranks), [b1] 47
# (unequal: Reduce_scatter and Allgatherv) and [W1] 1504 (a parameter alone: ZeRO 2 sends its gradient as is)
BUCKET_MB = 2 / 1024
DATA_SOURCE = "synthetic:640:32:10"
RESUMES: dict[str, dict[str, Any]] = {
    "plain": {},
    "zero2": {"zero": 2, "zero_reduce": "auto", "optimizer": "adam", "lr": 0.01},  # auto: the start-up timing too
    "powersgd": {"grad_compression": "powersgd:2"},
    "topk": {"grad_compression": "topk:0.1"},
    "fp16": {"precision": "fp16"},
    "zero3": {"zero": 3, "zero_reduce": "auto", "optimizer": "adam", "lr": 0.01},  # parameters sharded: gathered
    "zero3-fp16": {"zero": 3, "precision": "fp16", "optimizer": "adam", "lr": 0.01},  # ... and the loss scaler
}


class Skip(Exception):
    """The path cannot run here; the message says why."""


@dataclass(slots=True)
class Ctx:
    """What a check gets: the communicator, this rank's device, the variant and a scratch folder both ranks share."""

    comm: Comm
    device: torch.device
    variant: str
    work: Path

    def cfg(self, **kw: Any) -> TrainConfig:
        """A TrainConfig for make_sync/make_optimizer (its data and run_dir are not used)."""
        return TrainConfig.flat(data=self.work, run_dir=self.work, **kw)

    def check_staging(self, staging: bool, notes: list[str]) -> None:
        """On a GPU, the sync staged exactly when the variant says so (a failed CUDA-aware probe stages too)."""
        if self.device.type == "cuda" and staging != (self.variant == "staged"):
            raise AssertionError(f"the sync {'staged' if staging else 'did not stage'} in the {self.variant} "
                                 f"variant: {' '.join(notes) or 'no notes'}")

    def data(self) -> Path:
        """Shards of DATA_SOURCE (rank 0 writes them once per --work folder)."""
        out = self.work / "data"
        if self.comm.rank == 0 and not (out / "manifest.json").is_file():
            shard(ShardConfig(source=DATA_SOURCE, out=out, shards=2), show_progress=False, comm=Comm(None))
        self.comm.barrier()
        return out


@contextlib.contextmanager
def forced_staging(on: bool) -> Any:
    """For the staged variant: GradSync's (and so ZeroSync's) probe is told the MPI is not CUDA-aware, as an MPI
    that is not would answer. hpctrain has no switch for this (benchmarks/gpu_check.sh says which one it needs)."""
    saved = gradsync_module.cuda_aware
    if on:
        gradsync_module.cuda_aware = lambda: False
    try:
        yield
    finally:
        gradsync_module.cuda_aware = saved


# -- helpers ---------------------------------------------------------------------------------------------
def small_model(ctx: Ctx) -> Any:
    torch.manual_seed(0)
    return mlp((32,), 10, hidden=(47,)).to(ctx.device)


def batch(ctx: Ctx, step: int, n: int = 16) -> tuple[Any, Any]:
    """This rank's batch of a learnable rule (the label is the largest of the first 10 features)."""
    gen = torch.Generator().manual_seed(1000 * step + ctx.comm.rank)
    x = torch.randn(n, 32, generator=gen)
    return x.numpy(), x[:, :10].argmax(1).numpy()


def run_steps(ctx: Ctx, model: Any, sync: Any, opt: Any, count: int, *, fixed: bool = False,
              accumulate: int = 1) -> list[float]:
    """`count` steps of `hpctrain train`'s own step (of `accumulate` micro-batches); the mean loss over all ranks
    of each."""
    loss_fn = torch.nn.CrossEntropyLoss(reduction="sum")
    losses = []
    for step in range(count):
        x, y = batch(ctx, 0 if fixed else step)
        n = len(y) * ctx.comm.size
        loss = train_step(StepSetup(model=model, sync=sync, optimizer=opt, loss_fn=loss_fn, device=ctx.device,
                                    accumulate=accumulate), x, y, n)
        losses.append(float(ctx.comm.allreduce_array([loss])[0]) / n)
    return losses


def whole(model: Any, sync: Any) -> Any:
    """The model's state as one flat float64 CPU tensor, read through the sync: at ZeRO stage 3 a released
    parameter holds no bytes (it reads NaN), and the sync gathers each unit while its keys are read."""
    state = param_sha256(model, sync, keep=True)[1]
    return torch.cat([t.reshape(-1).double() for t in state.values()])


def roundtrip(obj: Any) -> Any:
    """`obj` through torch.save and torch.load onto the CPU, as a checkpoint carries it."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, map_location="cpu", weights_only=True)


def ranks_agree(ctx: Ctx, value: Any) -> bool:
    return len(set(ctx.comm.allgather(value))) == 1


# -- the paths -------------------------------------------------------------------------------------------
def allreduce_path(mode: str) -> Callable[[Ctx], str]:
    def check(ctx: Ctx) -> str:
        sync = comm_check.run(mode, ctx.comm, str(ctx.device))
        ctx.check_staging(sync.staging, sync.notes)
        return f"exact sums in {len(sync.buckets)} buckets over 3 steps, staging {sync.staging}"
    return check


def sync_for(cfg: TrainConfig, model: Any, comm: Comm) -> tuple[Any, Any]:
    """The sync and optimizer `hpctrain train` builds for `cfg` (overlapped), from its sections."""
    return make_sync(cfg.communication, cfg.zero, cfg.optimizer, model, comm,
                     overlap=True)


def zero_path(stage: int, how: str, accumulate: int = 1) -> Callable[[Ctx], str]:
    """ZeRO `stage` summing by `how` against stage 0; with `accumulate`, in micro-batches (at stage 3 the
    micro-batches after the first gather their units from the parameters already on the host, staged)."""
    def check(ctx: Ctx) -> str:
        params, reducer = {}, ""
        for zero in (0, stage):
            model = small_model(ctx)
            cfg = ctx.cfg(optimizer="adam", lr=0.01, zero=zero, zero_reduce=how, bucket_mb=BUCKET_MB)
            sync, opt = sync_for(cfg, model, ctx.comm)
            ctx.check_staging(sync.staging, sync.notes)
            run_steps(ctx, model, sync, opt, 4, accumulate=accumulate)
            params[zero] = whole(model, sync)  # at stage 3 a collective: each unit gathered while it is read
            sync.close()
            reducer = getattr(sync, "reduce", reducer)
        if not ranks_agree(ctx, params[stage].numpy().tobytes()):
            raise AssertionError(f"the ranks' parameters differ after ZeRO {stage}'s allgather")
        diff = float((params[0] - params[stage]).abs().max())
        if not diff <= 1e-5:
            raise AssertionError(f"max |ZeRO {stage} - stage 0| = {diff:.3g} after 4 Adam steps (limit 1e-5)")
        start = torch.cat([t.detach().reshape(-1).double().cpu() for t in small_model(ctx).state_dict().values()])
        if not float((params[0].cpu() - start).abs().max()) > 0:
            raise AssertionError("no parameter moved in 4 Adam steps: the steps trained nothing")
        steps = f"4 Adam steps of {accumulate} micro-batches" if accumulate > 1 else "4 Adam steps"
        return f"{steps} by {reducer} within {diff:.1e} of stage 0, buckets of 480/47/1504, ranks identical"
    return check


def compress_path(spec: str) -> Callable[[Ctx], str]:
    def check(ctx: Ctx) -> str:
        model = small_model(ctx)
        cfg = ctx.cfg(grad_compression=spec, bucket_mb=BUCKET_MB, lr=0.1)
        sync, opt = sync_for(cfg, model, ctx.comm)
        ctx.check_staging(sync.staging, sync.notes)
        losses, digests = [], []
        for _ in range(12):
            losses += run_steps(ctx, model, sync, opt, 1, fixed=True)
            digests.append(param_sha256(model))
        everyone = ctx.comm.allgather(digests)
        differ = [s + 1 for s in range(len(digests)) if len({d[s] for d in everyone}) > 1]
        if differ:
            raise AssertionError(f"the ranks' parameters differ from step {differ[0]} on")
        if not losses[-1] < 0.8 * losses[0]:
            raise AssertionError(f"the loss went {losses[0]:.4f} -> {losses[-1]:.4f} in 12 steps on a fixed batch")
        where = reload_compressor(ctx, model, sync, opt, cfg)
        sync.close()
        return (f"12 steps, ranks bit-identical, loss {losses[0]:.3f} -> {losses[-1]:.3f}, {sync.wire_bytes} wire "
                f"bytes/step; its state reloaded from a checkpoint's CPU tensors onto {where} steps the same bits")
    return check


def reload_compressor(ctx: Ctx, model: Any, sync: Any, opt: Any, cfg: TrainConfig) -> str:
    """A twin of the model whose sync loads the compressor state as a checkpoint hands it over (CPU tensors) takes
    the same next step as the original; returns where the loaded state lives."""
    state = roundtrip(sync.compressor_state())
    twin = small_model(ctx)
    twin.load_state_dict(model.state_dict())
    twin_sync, twin_opt = sync_for(cfg, twin, ctx.comm)
    twin_opt.load_state_dict(roundtrip(opt.state_dict()))
    twin_sync.load_compressor_state(state)
    devices = sorted({str(t.device) for t in twin_sync.compressor_state()["errors"].values()})
    run_steps(ctx, model, sync, opt, 1, fixed=True)
    run_steps(ctx, twin, twin_sync, twin_opt, 1, fixed=True)
    twin_sync.close()
    if param_sha256(twin) != param_sha256(model):
        raise AssertionError(f"after loading the compressor state (on {devices}) the next step differs")
    return ",".join(devices)


def fp16_scaler(ctx: Ctx) -> str:
    """The last rank alone finds an inf: every rank skips the step and halves the scale (with ZeRO, the inf sits in
    rank 0's slice, so the last rank's own slice is clean); the scale then grows back after 2 good steps."""
    comm = ctx.comm
    makers = {"allreduce": lambda p: GradSync([p], comm, overlap=False),
              "ZeRO 1": lambda p: ZeroSync([p], comm, stage=1, overlap=False, reduce="reduce-scatter"),
              "ZeRO 2": lambda p: ZeroSync([p], comm, stage=2, overlap=False, reduce="reduce-scatter")}
    for name, make in makers.items():
        param = torch.nn.Parameter(torch.zeros(10, device=ctx.device))
        sync = make(param)
        ctx.check_staging(sync.staging, sync.notes)
        scaler = LossScaler(scale=1024.0, interval=2)
        results = []
        for step in range(3):
            sync.zero()
            grad = torch.ones(10, device=ctx.device)
            if step == 0 and comm.rank == comm.size - 1:
                grad[0] = math.inf
            (param * grad).sum().backward()
            sync.wait()
            results.append((scaler.unscale(sync.grad_tensors(), comm), scaler.scale))
        grads = torch.cat([g.reshape(-1) for g in sync.grad_tensors()])
        sync.close()
        if results != [(False, 512.0), (True, 512.0), (True, 1024.0)]:
            raise AssertionError(f"{name}: (stepped, scale) per step {results}, not a skip then two steps")
        if not torch.allclose(grads, torch.full_like(grads, comm.size / 512.0)):
            raise AssertionError(f"{name}: the gradients were not unscaled by the scale in use: {grads.tolist()}")
    again = LossScaler()
    again.load_state_dict(roundtrip(scaler.state_dict()))
    if again.state_dict() != scaler.state_dict():
        raise AssertionError(f"the scaler's state {scaler.state_dict()} came back from a checkpoint as {again.state_dict()}")
    return f"an inf on rank {comm.size - 1} alone skipped the step on every rank (allreduce, ZeRO 1, ZeRO 2); scale 1024 -> 512 -> 1024 and back from a checkpoint"


def fused_path(name: str) -> Callable[[Ctx], str]:
    def check(ctx: Ctx) -> str:
        gen = torch.Generator().manual_seed(0)
        shapes = [(64, 32), (64,), (10, 64)]
        start = [torch.randn(s, generator=gen) for s in shapes]
        grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(3)]
        ours = [torch.nn.Parameter(t.clone().to(ctx.device)) for t in start]  # clone: on the CPU .to() is no copy
        theirs = [torch.nn.Parameter(t.clone().to(ctx.device)) for t in start]
        cfg = ctx.cfg(optimizer=name, lr=0.01, weight_decay=0.01)
        fused = make_optimizer(cfg.optimizer, ours)
        if fused.defaults.get("fused") is not True:
            raise AssertionError(f"make_optimizer gave {type(fused).__name__} with fused={fused.defaults.get('fused')}")
        kind = type(fused)
        extra = {"momentum": cfg.optimizer.momentum} if name == "sgd" else {}
        plain = kind(theirs, lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay, foreach=False, fused=False, **extra)
        for step_grads in grads:
            for p, q, g in zip(ours, theirs, step_grads):
                p.grad, q.grad = g.to(ctx.device), g.to(ctx.device)
            fused.step()
            plain.step()
        diff = max(float((p - q).abs().max() / q.abs().max()) for p, q in zip(ours, theirs))
        if not diff <= 1e-5:
            raise AssertionError(f"fused {kind.__name__} is {diff:.3g} (relative) from the unfused after 3 steps")
        return f"fused {kind.__name__} on {ctx.device}: 3 steps within {diff:.1e} of the unfused one"
    return check


def mfu_peak(ctx: Ctx) -> str:
    """The MFU denominator as `train` measures it (every rank at once, summed): plausible for the device."""
    cuda = ctx.device.type == "cuda"
    precision, floor = ("bf16", 10e12) if cuda else ("fp32", 1e9)
    torch.manual_seed(0)
    model = build_lm("gpt:layers=2,dim=64,heads=4", 64, 257).to(ctx.device)
    per_token, peak = flops_and_peak(model, 64, ctx.comm, ctx.device, precision)
    if not per_token > 0:
        raise AssertionError(f"{per_token} training FLOPs per token")
    if not peak > floor:
        raise AssertionError(f"peak {peak / 1e12:.3f} TFLOP/s ({precision}, {ctx.comm.size} ranks summed) is under "
                             f"{floor / 1e12:g} TFLOP/s")
    return f"peak {peak / 1e12:.2f} TFLOP/s {precision} over {ctx.comm.size} ranks; {per_token / 1e6:.2f} MFLOP per token"


def resume_path(kind: str) -> Callable[[Ctx], str]:
    def check(ctx: Ctx) -> str:
        base = dict(data=ctx.data(), model="mlp:47", epochs=2, batch_size=16, checkpoint_every=0, bucket_mb=BUCKET_MB,
                    progress=False, json=True, log_every=100, collective_timeout=60.0, **RESUMES[kind])
        here = ctx.work / f"resume-{kind}-{ctx.variant}"
        if ctx.comm.rank == 0:
            shutil.rmtree(here, ignore_errors=True)  # what an earlier, aborted worker left
        ctx.comm.barrier()
        straight = train(TrainConfig.flat(run_dir=here / "straight", max_steps=8, **base), comm=ctx.comm)
        train(TrainConfig.flat(run_dir=here / "resumed", max_steps=4, **base), comm=ctx.comm)
        resumed = train(TrainConfig.flat(run_dir=here / "resumed", max_steps=8, **base), comm=ctx.comm)
        if resumed["resumed_from"] != 4:
            raise AssertionError(f"the second segment resumed from {resumed['resumed_from']}, not step 4")
        if resumed["param_sha256"] != straight["param_sha256"]:
            raise AssertionError(f"param_sha256 {resumed['param_sha256'][:12]} after 4 + 4 steps, "
                                 f"{straight['param_sha256'][:12]} after 8 straight")
        log = (here / "resumed" / "logs" / f"rank-{ctx.comm.rank:04d}.log").read_text()
        ctx.check_staging(any(note in log for note in STAGING_NOTES), [])
        extra = ""
        if kind.endswith("fp16"):
            scalers = [ckpt.load_files(ckpt.latest(here / run))["train"]["scaler"] for run in ("straight", "resumed")]
            if scalers[0] != scalers[1]:
                raise AssertionError(f"loss scaler at step 8: {scalers[0]} straight, {scalers[1]} resumed")
            extra = f", loss scaler {scalers[1]} in both"
        return f"8 steps = 4 + 4 resumed, param_sha256 {resumed['param_sha256'][:12]}{extra}"
    return check


def catalogue() -> dict[str, tuple[Callable[[Ctx], str], bool]]:
    """Every path: name -> (check, whether it communicates: then it runs staged and CUDA-aware)."""
    paths: dict[str, tuple[Callable[[Ctx], str], bool]] = {}
    for mode in comm_check.MODES:
        paths[f"allreduce-{mode}"] = (allreduce_path(mode), True)
    for stage in (1, 2, 3):
        for how in ZERO_REDUCERS[1:]:
            paths[f"zero{stage}-{how}"] = (zero_path(stage, how), True)
    paths["zero3-accumulate"] = (zero_path(3, "auto", accumulate=2), True)
    paths["powersgd"] = (compress_path("powersgd:2"), True)
    paths["topk"] = (compress_path("topk:0.1"), True)
    paths["fp16-scaler"] = (fp16_scaler, True)
    for name in ("sgd", "adam", "adamw"):
        paths[f"fused-{name}"] = (fused_path(name), False)
    paths["mfu-peak"] = (mfu_peak, False)
    for kind in RESUMES:
        paths[f"resume-{kind}"] = (resume_path(kind), True)
    return paths


def items_of(names: list[str], paths: dict[str, Any], device: str) -> list[str]:
    variants = ("staged", "cuda-aware") if device == "cuda" else ("cpu",)
    out = [f"{n}/{v}" for v in variants for n in names if paths[n][1]]
    return out + [f"{n}/{device}" for n in names if not paths[n][1]]


def outcome(check: Callable[[Ctx], str], ctx: Ctx, aware: bool | None, library: str) -> tuple[str, str]:
    """(PASS, detail), (SKIP, reason) or (FAIL, reason) of one check on this rank."""
    if ctx.variant == "cuda-aware" and not aware:
        return "SKIP", f"the MPI is not CUDA-aware ({library}; hpctrain.comm.cuda_aware() says {aware})"
    try:
        with forced_staging(ctx.variant == "staged"):
            return "PASS", check(ctx)
    except Skip as exc:
        return "SKIP", str(exc)
    except Exception as exc:  # noqa: BLE001 - every failure is a verdict, with its traceback on stderr
        traceback.print_exc()
        return "FAIL", " ".join(f"{type(exc).__name__}: {exc}".split())[:600]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu_paths"))
    parser.add_argument("--paths", default="")
    parser.add_argument("--items", default="")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args(argv)
    paths = catalogue()
    if args.list:
        print("\n".join(paths))
        return 0
    try:
        names = select([s for s in args.paths.split(",") if s], list(paths))
    except ValueError as exc:
        print(f"error: {exc}; the driver runs train-cli and bench-train itself", file=sys.stderr)
        return 2
    comm = world()
    verdicts = Comm(comm.mpi.Dup())  # a failed check must not leave a collective for the next one to match
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    items = args.items.split(",") if args.items else items_of(names, paths, args.device)
    device = torch.device("cpu")
    if args.device == "cuda" and torch.cuda.is_available():
        device = torch.device(select_device(read_env(), torch.cuda.device_count()))
        torch.cuda.set_device(device)
    info = mpi_info()
    aware = info.cuda_aware if device.type == "cuda" else None  # hpctrain.comm.cuda_aware()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "no GPU"
    say(f"INFO torch {torch.__version__}, {comm.size} ranks on {device} ({gpu}); {info.library}, MPI "
        f"{info.mpi_version}, mpi4py {info.mpi4py_version}, thread level {info.thread_level}, CUDA-aware {aware}",
        flush=True)
    say("PLAN " + " ".join(items), flush=True)
    args.work.mkdir(parents=True, exist_ok=True)
    for item in items:
        name, variant = item.split("/")
        say(f"START {item}", flush=True)
        start = time.perf_counter()
        if args.device == "cuda" and device.type != "cuda":
            mine = ("FAIL", "no GPU visible to torch (torch.cuda.is_available() is False)")
        else:
            mine = outcome(paths[name][0], Ctx(comm, device, variant, args.work), aware, info.library)
        say(combine(item, verdicts.allgather(mine), time.perf_counter() - start), flush=True)
    comm.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
