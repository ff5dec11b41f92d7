"""The control layer: one data-parallel training run, read top to bottom.

`train(cfg)` runs on however many MPI ranks started it (one with no launcher): check inputs on every rank
and agree that they are good, build the model on rank 0 and broadcast it, then loop over epochs and
steps (read this rank's batch -> forward -> backward with bucketed, overlapped gradient allreduce ->
optimizer step), validate after every epoch, checkpoint by policy and on a stop signal, and write
metrics.jsonl, summary.json and model.pt.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import random
import signal
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from . import checkpoint as ckpt
from .comm import Comm, GradSync, world
from .config import TrainConfig, write_toml
from .data import ShardReader, ShardSet, epoch_remainder, load_manifest
from .durable import replacing, write_text
from .env import RankEnv, read_env, select_device
from .errors import CheckpointError, ConfigError, HpctrainError
from .models import build_model
from .progress import Progress
from .stop import FLAG as STOP
from .stop import STOP_EXIT, cancel_deadline, deadline
from .watchdog import Watchdog


class StopRequested(HpctrainError):
    """The run was asked to stop (SIGTERM/SIGUSR2) and wrote a checkpoint; resume with --resume auto.
    Every rank raises it together (they agreed to stop at the same step)."""

    exit_code = STOP_EXIT
    agreed = True


def param_sha256(model: Any) -> str:
    """sha256 over the model's state_dict tensors, in key order: equal on every rank when ranks are in sync."""
    import torch

    digest = hashlib.sha256()
    for key, tensor in model.state_dict().items():
        digest.update(key.encode())
        t = tensor.detach().cpu().contiguous().view(-1)
        if t.numel():
            digest.update(t.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def auto_overlap(env: RankEnv, device_type: str) -> bool:
    """Overlap communication with backward only where it pays: a GPU computes, or the rank owns a spare CPU.

    With one CPU per rank, the communication thread competes with backward for that CPU (and MPI polls
    while it waits): measured on the reference MLP, 2 ranks on 2 cores, overlap made steps slower.
    """
    return device_type == "cuda" or env.torch_threads() >= 2


def train_step(model: Any, sync: GradSync, optimizer: Any, loss_fn: Any, x: np.ndarray, y: np.ndarray,
               global_n: int, *, clip_grad: float = 0.0, device: Any = "cpu", accumulate: int = 1) -> float:
    """One data-parallel step; returns this rank's summed loss.

    The loss is this rank's sum of per-sample losses divided by the step's global sample count, so the
    summed allreduce leaves in every `.grad` the mean gradient over all samples of the step. A rank whose
    batch is empty still joins the allreduce (with zeros), so uneven data never hangs. With `accumulate`
    K > 1 the batch runs as K micro-batches and only the last one's backward starts the allreduce.
    """
    import torch

    sync.zero()
    loss_value = 0.0
    bounds = np.linspace(0, len(y), accumulate + 1).astype(int) if accumulate > 1 else (0, len(y))
    for i in range(len(bounds) - 1):
        lo, hi = bounds[i], bounds[i + 1]
        sync.enabled = i == len(bounds) - 2
        if hi == lo:
            continue
        xt = torch.from_numpy(x[lo:hi]).to(device, non_blocking=True)
        if xt.dtype != torch.float32:
            xt = xt.float()
        yt = torch.from_numpy(y[lo:hi]).to(device, non_blocking=True)
        loss_sum = loss_fn(model(xt), yt)
        (loss_sum / global_n).backward()
        loss_value += float(loss_sum.detach())
    sync.enabled = True
    sync.wait()
    if clip_grad:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
    optimizer.step()
    return loss_value


def _lr_factor(schedule: str, total: int) -> Any:
    if schedule == "cosine":
        return lambda s: 0.5 * (1.0 + math.cos(math.pi * min(s, total) / max(1, total)))
    if schedule == "step":
        return lambda s: 0.1 ** ((s >= total // 2) + (s >= (3 * total) // 4))
    return lambda s: 1.0


def _optimizer(cfg: TrainConfig, params: Any) -> Any:
    import torch

    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def _rng_state() -> dict[str, Any]:
    import torch

    state = {"torch": torch.get_rng_state(), "numpy": _np_state_out(np.random.get_state()), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _np_state_out(state: tuple) -> dict[str, Any]:
    import torch

    return {"name": state[0], "keys": torch.from_numpy(state[1].astype(np.int64)), "pos": int(state[2]),
            "has_gauss": int(state[3]), "cached": float(state[4])}


def _set_rng_state(state: dict[str, Any]) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    s = state["numpy"]
    np.random.set_state((s["name"], s["keys"].numpy().astype(np.uint32), s["pos"], s["has_gauss"], s["cached"]))
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _setup_logging(run_dir: Path, rank: int) -> logging.Logger:
    log = logging.getLogger(f"hpctrain.rank{rank}")
    log.setLevel(logging.INFO)
    log.propagate = False
    for h in list(log.handlers):
        log.removeHandler(h)
        h.close()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(run_dir / "logs" / f"rank-{rank:04d}.log")
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank {rank} %(levelname)s %(message)s"))
    log.addHandler(handler)
    return log


def _close_logging(log: logging.Logger) -> None:
    for handler in list(log.handlers):
        log.removeHandler(handler)
        handler.close()


def _resolve_resume(cfg: TrainConfig, warn: Any) -> Path | None:
    if cfg.resume == "never":
        return None
    if cfg.resume == "auto":
        return ckpt.latest(cfg.run_dir, warn=warn)
    path = Path(cfg.resume)
    if not path.is_dir():
        raise CheckpointError(f"--resume {cfg.resume!r}: no such checkpoint directory; use auto, never or a RUN/checkpoints/step-* path")
    ckpt.check(path)
    return path


def _config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    ignore = {"resume", "json", "progress", "run_dir", "epochs", "max_steps", "log_every", "checkpoint_every", "keep"}
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
            if k not in ignore and old.get(k) != new.get(k)]


def _truncate_lines(path: Path, keep: int) -> None:
    """Keep the first `keep` lines of a text file (drop what a resumed run will redo)."""
    if not path.exists():
        return
    with open(path, "rb") as fh:
        lines = fh.readlines()[:keep]
    with open(path, "wb") as fh:
        fh.writelines(lines)


def _keep_metrics(path: Path, last_step: int) -> None:
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= last_step]
    path.write_text("".join(line + "\n" for line in kept))


def train(cfg: TrainConfig, *, comm: Comm | None = None, env: RankEnv | None = None) -> dict[str, Any]:
    """Run one training job on every rank of `comm` (COMM_WORLD by default); return the summary.

    An unexpected failure is logged with its traceback in the rank's log (RUN/logs/rank-NNNN.log) and
    re-raised as one line that names that log.
    """
    try:
        if comm is None:  # MPI_Init waits for every rank: a rank stopped before it would hang the others there
            deadline(cfg.collective_timeout)  # until the watchdog takes over in _train
            comm = world()
        with contextlib.ExitStack() as stack:  # every thread, file and handler is undone here, on any exit
            return _train(cfg, comm, env or read_env(), stack)
    except HpctrainError as exc:
        error = exc
    except Exception as exc:
        rank = comm.rank if comm is not None else 0
        log_path = cfg.run_dir / "logs" / f"rank-{rank:04d}.log"
        if log_path.parent.is_dir():
            logging.getLogger(f"hpctrain.rank{rank}").exception("training failed")
            where = f"traceback in {log_path}"
        else:
            where = "before the run directory was created"
        error = HpctrainError(f"rank {rank}: {type(exc).__name__}: {exc} ({where})")
        error.__cause__ = exc
    finally:
        cancel_deadline()
    if comm is not None and comm.size > 1 and not error.agreed:
        _end_job(comm, error)
    raise error


def _end_job(comm: Comm, error: HpctrainError) -> None:
    """This rank failed alone (a corrupt chunk in its shard, a failed allreduce, a full disk): the others
    are already on their way into the next collective and would wait for it forever. Say why here, on
    this rank's stderr and log, then end every rank of the job (MPI_Abort) with the error's exit code."""
    text = str(error).replace("\n", " ")
    if not text.startswith(f"rank {comm.rank}"):
        text = f"rank {comm.rank}: {text}"
    logging.getLogger(f"hpctrain.rank{comm.rank}").error("%s; ending the job", text)
    print(f"error: {text}; ending the job (the other ranks would wait for this one)", file=sys.stderr, flush=True)
    comm.abort(error.exit_code)


def _train(cfg: TrainConfig, comm: Comm, env: RankEnv, stack: contextlib.ExitStack) -> dict[str, Any]:
    import torch

    torch.set_num_threads(env.torch_threads())
    if STOP.install():  # the CLI installed it at process start; library callers get it here
        stack.callback(STOP.restore)
    # every wait on other ranks from here on is watched; heartbeat files once the run directory exists
    watchdog = stack.enter_context(Watchdog(None, comm.rank, comm.size, timeout=cfg.collective_timeout,
                                            abort=comm.abort).start())
    cancel_deadline()  # MPI is up and the watchdog watches from here

    # -- check everything before anything is written --------------------------------------------------
    error: HpctrainError | None = None
    shards: ShardSet | None = None
    model = None
    resume_path: Path | None = None
    warnings: list[str] = []
    device = torch.device("cpu")
    try:
        device = torch.device(select_device(env, torch.cuda.device_count() if torch.cuda.is_available() else 0))
        shards = load_manifest(cfg.data)
        shards.check_world(comm.size)
        if cfg.tensorboard and comm.rank == 0:
            try:
                import tensorboard  # noqa: F401
            except ImportError:
                raise ConfigError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
        if cfg.init_weights is not None and not cfg.init_weights.is_file():
            raise ConfigError(f"--init-weights {str(cfg.init_weights)!r} not found")
        torch.manual_seed(cfg.seed)
        model = build_model(cfg.model, shards.x_shape, shards.num_classes)
    except HpctrainError as exc:
        error = exc
    watchdog.phase("start-up checks", 0)
    comm.agree(error)
    assert shards is not None and model is not None
    if comm.rank == 0:  # one rank finds and verifies the checkpoint: checksums read every byte
        try:
            resume_path = _resolve_resume(cfg, warnings.append)
        except HpctrainError as exc:
            error = exc
    watchdog.phase("start-up: rank 0 verifies the checkpoint", 0, budget=cfg.checkpoint_timeout)
    comm.agree(error if comm.rank == 0 else None)
    resume_path = comm.bcast(resume_path)
    watchdog.idle()

    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    log = _setup_logging(cfg.run_dir, comm.rank)
    stack.callback(_close_logging, log)
    watchdog.attach(cfg.run_dir, log.error)
    for w in warnings:
        log.warning(w)
        if comm.rank == 0:
            print(f"warning: {w}", file=sys.stderr)
    log.info("world %d, rank %d, local rank %d, pid %d, host %s, launcher %s, device %s, torch threads %d",
             comm.size, comm.rank, env.local_rank, os.getpid(), socket.gethostname(), env.launcher, device,
             torch.get_num_threads())
    if comm.rank == 0:
        _write_config(cfg)

    # -- build: model (rank 0's weights everywhere), optimizer, schedule, gradient sync, readers ----------
    if cfg.init_weights is not None and comm.rank == 0:
        try:
            model.load_state_dict(torch.load(cfg.init_weights, map_location="cpu", weights_only=True))
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            error = ConfigError(f"--init-weights {str(cfg.init_weights)!r} does not fit model {cfg.model!r}: {exc}")
    watchdog.phase("start-up broadcast of the model", 0)
    comm.agree(error if comm.rank == 0 else None)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        model.to(device)
    comm.broadcast_tensors(list(model.parameters()) + list(model.buffers()))
    watchdog.idle()
    torch.manual_seed(cfg.seed * 1_000_003 + comm.rank + 1)  # per-rank stream for dropout and the like

    # -- where to start: fresh, or a checkpoint (maybe written on another world size, mid-epoch) ------
    step, start_epoch, start_in_epoch, resumed_from = 0, 0, 0, None
    prior: list[tuple[int, int]] = []  # (world size, steps) of this epoch's earlier segments
    watchdog.phase("loading the checkpoint", 0, budget=cfg.checkpoint_timeout)
    state = _load_checkpoint(resume_path, comm, verified=True) if resume_path is not None else None
    watchdog.idle()
    meta = state["meta"] if state is not None else None
    if meta is not None:
        if meta["data_fingerprint"] != shards.fingerprint:
            comm.agree(CheckpointError(
                f"checkpoint {str(resume_path)!r} was written for another dataset (manifest fingerprint "
                f"{meta['data_fingerprint'][:12]}, --data {str(cfg.data)!r} has {shards.fingerprint[:12]}): "
                "point --data at the original shards or start a new --run-dir"))
        segments = [tuple(seg) for seg in meta.get("segments", [])]
        if not segments and meta["step_in_epoch"]:
            segments = [(meta["world_size"], meta["step_in_epoch"])]
        step, start_epoch, resumed_from = int(meta["step"]), int(meta["epoch"]), int(meta["step"])
        if segments and segments[-1][0] == comm.size:
            prior, start_in_epoch = segments[:-1], segments[-1][1]
        else:
            prior = segments  # elastic: a new segment of this epoch on this world size
    batch = cfg.batch_size * cfg.accumulate
    reader = ShardReader(shards, "train", rank=comm.rank, world=comm.size, batch_size=batch, shuffle=cfg.shuffle,
                         seed=cfg.seed)
    stack.callback(reader.close)
    first_reader = reader
    if prior:
        done = epoch_remainder(shards, "train", prior, batch_size=batch, shuffle=cfg.shuffle, seed=cfg.seed,
                               epoch=start_epoch)
        first_reader = ShardReader(shards, "train", rank=comm.rank, world=comm.size, batch_size=batch,
                                   shuffle=cfg.shuffle, seed=cfg.seed, exclude=done, segment=len(prior))
        stack.callback(first_reader.close)
        log.info("elastic resume: %d samples of epoch %d done on %s; %d left for %d ranks", len(done), start_epoch,
                 prior, int(first_reader.counts.sum()), comm.size)
    val_reader = (ShardReader(shards, "val", rank=comm.rank, world=comm.size, batch_size=max(cfg.batch_size, 256),
                              shuffle=False, prefetch=0) if "val" in shards.splits else None)
    if val_reader is not None:
        stack.callback(val_reader.close)
    steps_per_epoch = reader.steps_per_epoch
    if start_epoch < cfg.epochs:
        total_steps = (step + first_reader.steps_per_epoch - start_in_epoch
                       + (cfg.epochs - start_epoch - 1) * steps_per_epoch)
    else:
        total_steps = step
    if cfg.max_steps:
        total_steps = min(total_steps, max(cfg.max_steps, step))
    optimizer = _optimizer(cfg, model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_factor(cfg.schedule, total_steps))
    overlap = cfg.overlap if cfg.overlap is not None else auto_overlap(env, device.type)
    sync = GradSync(model.parameters(), comm, bucket_mb=cfg.bucket_mb, overlap=overlap, compress=cfg.compress,
                    hierarchical=cfg.hierarchical, deterministic=cfg.deterministic)
    stack.callback(sync.close)
    for note in sync.notes:
        log.warning(note)
    log.info("gradient sync: %d bucket(s) of up to %.1f MiB, overlap %s, wire %s", len(sync.buckets), cfg.bucket_mb,
             sync.overlap, cfg.compress)
    watchdog.phase("start-up: checkpoint manager", step)
    manager = ckpt.CheckpointManager(cfg.run_dir, comm, every=cfg.checkpoint_every, keep=cfg.keep,
                                     mtbf_hours=cfg.mtbf_hours, log=log.error,
                                     on_write=lambda: watchdog.phase("checkpoint write (waiting for every rank's part)",
                                                                     step, budget=cfg.checkpoint_timeout))
    watchdog.idle()
    loss_fn = torch.nn.CrossEntropyLoss(reduction="sum")

    metrics_path = cfg.run_dir / "metrics.jsonl"
    audit_dir = cfg.run_dir / "samples"
    audit_path = audit_dir / f"rank-{comm.rank:04d}.txt"
    timing_path = cfg.run_dir / "logs" / f"rank-{comm.rank:04d}.jsonl"
    audit_frozen: dict[str, int] = {}  # audit files of ranks beyond this world size (earlier segments)
    if state is not None:
        changes = _config_changes(meta.get("config", {}), cfg.to_dict())
        planned = meta.get("schedule_steps")
        if cfg.schedule != "constant" and planned is not None and int(planned) != total_steps:
            changes.append(f"the {cfg.schedule} learning-rate schedule was planned over {planned} steps and now spans "
                           f"{total_steps} (--epochs, --max-steps or the world size changed): from step {step} on, "
                           "the learning rate follows the new plan")
        for change in changes:
            log.warning("config changed since the checkpoint: %s", change)
            if comm.rank == 0:
                print(f"warning: config changed since the checkpoint: {change}", file=sys.stderr)
        model.load_state_dict(state["model"])
        model.to(device)
        optimizer.load_state_dict(state["train"]["optimizer"])
        scheduler.load_state_dict(state["train"]["scheduler"])
        if meta["world_size"] == comm.size:
            _set_rng_state(state["ranks"][comm.rank]["rng"])
        known = {**meta.get("audit_frozen", {}),
                 **{f"rank-{r:04d}.txt": int(st["audit_lines"]) for r, st in enumerate(state["ranks"])}}
        audit_frozen = {name: n for name, n in known.items() if int(name[5:9]) >= comm.size}
        if comm.rank == 0:
            _keep_metrics(metrics_path, step)
            if audit_dir.is_dir():  # drop what was trained after the checkpoint, on every rank's file
                for path in audit_dir.glob("rank-*.txt"):
                    if path.name in known:
                        _truncate_lines(path, known[path.name])
                    else:
                        path.unlink()
        _keep_metrics(timing_path, step)
        log.info("resumed from %s (step %d, epoch %d, step %d of the epoch)", resume_path, step, start_epoch,
                 start_in_epoch)
    else:
        for path in (metrics_path if comm.rank == 0 else None, timing_path):
            if path is not None and path.exists():
                path.unlink()
    if comm.rank == 0 and (cfg.run_dir / "summary.json").exists():
        (cfg.run_dir / "summary.json").unlink()  # a summary always describes the run that wrote it
    if cfg.audit_samples:
        audit_dir.mkdir(parents=True, exist_ok=True)
        if resumed_from is None and audit_path.exists():
            audit_path.unlink()
    watchdog.phase("start-up barrier", step)
    comm.barrier()
    watchdog.idle()

    metrics = stack.enter_context(open(metrics_path, "a")) if comm.rank == 0 else None
    tb = None
    if cfg.tensorboard and comm.rank == 0:
        from torch.utils.tensorboard import SummaryWriter

        tb = SummaryWriter(str(cfg.run_dir / "tensorboard"), purge_step=step or None)
        stack.callback(tb.close)
    timing = stack.enter_context(open(timing_path, "a"))  # this rank's own step timing: RUN/logs/rank-NNNN.jsonl
    audit_lines = 0
    if cfg.audit_samples and audit_path.exists():
        with open(audit_path, "rb") as fh:
            audit_lines = sum(1 for _ in fh)
    audit = stack.enter_context(open(audit_path, "a")) if cfg.audit_samples else None
    interactive = comm.rank == 0 and cfg.progress and not cfg.json and sys.stderr.isatty()
    bar = stack.enter_context(Progress(total_steps, "train", enabled=interactive, unit="steps"))
    bar.update(step)
    window = {"loss": 0.0, "n": 0.0, "t": time.perf_counter(), "step_s": 0.0, "comm_s": 0.0, "data_s": 0.0, "steps": 0}
    last_val: dict[str, float] = {}
    epoch_loss = {"sum": 0.0, "n": 0.0}
    train_start = time.perf_counter()
    samples_seen = 0
    stop_signal: int | None = None

    def state_for(epoch: int, in_epoch: int, segments: list[tuple[int, int]]) -> dict[str, Any]:
        if audit is not None:
            audit.flush()  # the line count in the checkpoint must be on disk
        return dict(
            model_state=model.state_dict(),
            train_state={"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
            rank_state={"rng": _rng_state(), "audit_lines": audit_lines},
            meta={"epoch": epoch, "step_in_epoch": in_epoch, "world_size": comm.size, "segments": segments,
                  "audit_frozen": audit_frozen, "data_fingerprint": shards.fingerprint, "config": cfg.to_dict(),
                  "schedule_steps": total_steps},
        )

    epoch = start_epoch
    while step < total_steps:
        model.train()
        first = start_in_epoch if epoch == start_epoch else 0
        r = first_reader if epoch == start_epoch else reader
        done_before = prior if epoch == start_epoch else []
        batches = r.epoch(epoch, first)
        in_epoch = first
        t_data = time.perf_counter()
        for batch in batches:
            t0 = time.perf_counter()
            data_s = t0 - t_data
            sizes = r.step_sizes(in_epoch)
            global_n = int(sizes.sum())
            n_local = len(batch.y)
            watchdog.phase("gradient allreduce", step + 1)
            loss_value = train_step(model, sync, optimizer, loss_fn, batch.x, batch.y, global_n,
                                    clip_grad=cfg.clip_grad, device=device, accumulate=cfg.accumulate)
            watchdog.idle()
            scheduler.step()
            step += 1
            in_epoch += 1
            samples_seen += global_n
            if audit is not None and n_local:
                np.savetxt(audit, np.column_stack([np.full(n_local, epoch), batch.index]), fmt="%d")
                audit_lines += n_local
            t1 = time.perf_counter()
            window["loss"] += loss_value
            window["n"] += n_local
            window["step_s"] += t1 - t0
            window["comm_s"] += sync.comm_seconds
            window["data_s"] += data_s
            window["steps"] += 1
            epoch_loss["sum"] += loss_value
            epoch_loss["n"] += n_local
            end_of_epoch = in_epoch == r.steps_per_epoch
            last = step >= total_steps
            if step % cfg.log_every == 0 or end_of_epoch or last:
                watchdog.phase("metrics reduction", step)
                loss_tot, n_tot = comm.allreduce_array([window["loss"], window["n"]])
                watchdog.idle()
                elapsed = time.perf_counter() - window["t"]
                record = {
                    "step": step, "epoch": epoch, "loss": loss_tot / max(1.0, n_tot),
                    "lr": scheduler.get_last_lr()[0],
                    "samples_per_s": n_tot / max(elapsed, 1e-9),
                    "step_ms": 1000 * window["step_s"] / window["steps"],
                    "comm_ms": 1000 * window["comm_s"] / window["steps"],
                    "data_ms": 1000 * window["data_s"] / window["steps"],
                }
                timing.write(json.dumps({
                    "step": step, "epoch": epoch, "rank": comm.rank, "step_ms": record["step_ms"],
                    "compute_ms": record["step_ms"] - record["comm_ms"], "comm_ms": record["comm_ms"],
                    "data_ms": record["data_ms"], "samples": int(window["n"])}) + "\n")
                timing.flush()
                if end_of_epoch and val_reader is not None:
                    last_val = evaluate(model, val_reader, comm, watchdog=watchdog, step=step)
                    record.update(last_val)
                if end_of_epoch:
                    watchdog.phase("epoch loss reduction", step)
                    e_loss, e_n = comm.allreduce_array([epoch_loss["sum"], epoch_loss["n"]])
                    watchdog.idle()
                    record["epoch_train_loss"] = e_loss / max(1.0, e_n)
                    epoch_loss = {"sum": 0.0, "n": 0.0}
                if metrics is not None:
                    metrics.write(json.dumps(record) + "\n")
                    metrics.flush()
                log.info("step %d epoch %d loss %.4f %s", step, epoch, record["loss"],
                         " ".join(f"{k} {v:.4f}" for k, v in last_val.items()) if end_of_epoch else "")
                if tb is not None:
                    for key, value in record.items():
                        if key not in ("step", "epoch"):
                            tb.add_scalar(key, value, step)
                if comm.rank == 0 and not interactive and not cfg.json:  # Slurm logs: a plain line per --log-every
                    val = f"  val_loss {last_val['val_loss']:.4f}  val_accuracy {last_val['val_accuracy']:.4f}" if end_of_epoch and last_val else ""
                    print(f"epoch {epoch} step {step}/{total_steps}  loss {record['loss']:.4f}{val}  "
                          f"{record['samples_per_s']:.0f} samples/s", file=sys.stderr, flush=True)
                window = {"loss": 0.0, "n": 0.0, "t": time.perf_counter(), "step_s": 0.0, "comm_s": 0.0,
                          "data_s": 0.0, "steps": 0}
            bar.update(1, loss=f"{loss_value / max(1, n_local):.4f}", epoch=epoch)
            position = (epoch + 1, 0, []) if end_of_epoch else (epoch, in_epoch, [*done_before, (comm.size, in_epoch)])
            watchdog.phase("stop/checkpoint agreement", step)
            if manager.save(step, lambda: state_for(*position), stop_requested=STOP.requested, final=last):
                stop_signal = STOP.signum or signal.SIGTERM
                watchdog.idle()
                break
            watchdog.idle()
            t_data = time.perf_counter()
            if last:
                break
        batches.close()
        if stop_signal is not None:
            break
        epoch += 1
    manager.wait()
    watchdog.idle()
    if stop_signal is not None:
        name = signal.Signals(stop_signal).name
        log.warning("stopped by %s at step %d; checkpoint written", name, step)
        raise StopRequested(f"stopped by {name} at step {step}; checkpoint written to "
                            f"{cfg.run_dir / 'checkpoints' / ckpt.step_dir_name(step)}; continue with --resume auto")

    if STOP.requested:  # came after the last step's boundary: nothing left to stop, the run is complete
        log.warning("%s arrived after the last step; the run completed", signal.Signals(STOP.signum).name)
    train_time = time.perf_counter() - train_start
    if not last_val and val_reader is not None:
        last_val = evaluate(model, val_reader, comm, watchdog=watchdog, step=step)
    digest = param_sha256(model)
    watchdog.phase("summary reductions", step)
    hashes = comm.allgather(digest)
    e_loss, e_n = comm.allreduce_array([epoch_loss["sum"], epoch_loss["n"]])
    final_loss = _last_train_loss(metrics_path, comm) if e_n == 0 else e_loss / e_n
    watchdog.idle()
    summary = {
        "world_size": comm.size,
        "epochs": math.ceil(step / max(1, steps_per_epoch)),
        "steps": step,
        "global_batch_size": cfg.batch_size * cfg.accumulate * comm.size,
        "train_loss": final_loss,
        "val_loss": last_val.get("val_loss"),
        "val_accuracy": last_val.get("val_accuracy"),
        "samples_per_s": samples_seen / max(train_time, 1e-9) if samples_seen else None,
        "train_time_s": train_time,
        "param_sha256": digest,
        "ranks_in_sync": len(set(hashes)) == 1,
        "resumed_from": resumed_from,
        "model": cfg.model,
        "data": str(cfg.data),
        "data_fingerprint": shards.fingerprint,
        "checkpoint": {"saves": manager.saves, "stall_s": manager.stall_seconds, "write_s": manager.write_seconds,
                       "write_cpu_s": manager.write_cpu_seconds,
                       "async_stall_median_s": statistics.median(manager.async_stalls) if manager.async_stalls else None,
                       "interval_s": manager.interval_seconds() if cfg.checkpoint_every == "auto" else None},
    }
    if comm.rank == 0:
        with replacing(cfg.run_dir / "model.pt") as tmp:
            torch.save(model.state_dict(), tmp)
        write_text(cfg.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    log.info("done: %s", json.dumps(summary))
    if not summary["ranks_in_sync"]:
        error = HpctrainError(f"ranks ended with different parameters ({sorted(set(hashes))}); this is a bug, please report it")
        error.agreed = True  # every rank saw the same hashes
        raise error
    return summary


def _last_train_loss(metrics_path: Path, comm: Comm) -> float | None:
    value = None
    if comm.rank == 0 and metrics_path.exists():
        for line in metrics_path.read_text().splitlines():
            value = json.loads(line).get("epoch_train_loss", value)
    return comm.bcast(value)


def evaluate(model: Any, reader: ShardReader, comm: Comm, *, watchdog: Watchdog | None = None,
             step: int = 0) -> dict[str, float]:
    """Validation loss and accuracy over all ranks' validation shards. Only the final reduction is a wait
    on other ranks (watched); the pass itself, however long, is this rank's own work."""
    import torch

    model.eval()
    loss_sum = correct = n = 0.0
    loss_fn = torch.nn.CrossEntropyLoss(reduction="sum")
    with torch.no_grad():
        for batch in reader.epoch(0):
            if not len(batch.y):
                continue
            device = next(model.parameters()).device
            x = torch.from_numpy(batch.x).to(device).float()
            y = torch.from_numpy(batch.y).to(device)
            out = model(x)
            loss_sum += float(loss_fn(out, y))
            correct += float((out.argmax(1) == y).sum())
            n += len(y)
    model.train()
    if watchdog is not None:
        watchdog.phase("validation reduction", step)
    loss_sum, correct, n = comm.allreduce_array([loss_sum, correct, n])
    if watchdog is not None:
        watchdog.idle()
    return {"val_loss": loss_sum / max(n, 1.0), "val_accuracy": correct / max(n, 1.0)}


def _load_checkpoint(path: Path, comm: Comm, *, verified: bool = False) -> dict[str, Any]:
    """Rank 0 reads the checkpoint (verifying its checksums unless it just did) and broadcasts it: one
    reader per job, kinder to a parallel filesystem than W ranks reading every file. The trees go out
    pickled, the tensors' bytes by MPI_Bcast straight from their buffers (pickling them was 2.6x slower;
    `python benchmarks/checkpoint_load.py`)."""
    import torch

    state, error = None, None
    if comm.rank == 0:
        try:
            state = ckpt.load_files(path, verified=verified)
        except HpctrainError as exc:
            error = exc
    comm.agree(error if comm.rank == 0 else None)
    if comm.size == 1:
        return state
    skeleton, tensors = ckpt.split_tensors(state) if comm.rank == 0 else (None, [])
    skeleton, specs = comm.bcast((skeleton, [(t.dtype, tuple(t.shape)) for t in tensors]) if comm.rank == 0 else None)
    if comm.rank != 0:
        tensors = [torch.empty(shape, dtype=dtype) for dtype, shape in specs]
    comm.broadcast_tensors([t.reshape(-1).view(torch.uint8) for t in tensors if t.numel()])
    return ckpt.join_tensors(skeleton, dict(enumerate(tensors)), str(path))


def _write_config(cfg: TrainConfig) -> None:
    """The resolved config, as TOML beside the run: `hpctrain train --config RUN/config.toml` repeats it."""
    write_text(cfg.run_dir / "config.toml", write_toml(cfg.to_dict()))


