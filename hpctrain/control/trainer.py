"""The control layer: one data-parallel training run, read top to bottom in `_train`.

`train(cfg)` runs on however many MPI ranks started it (one with no launcher): check inputs on every rank
and agree that they are good (with --stage-to: copy this rank's shard files to node-local disk and read
them there), build the model on rank 0 and broadcast it, find where to start (fresh, or
a checkpoint, maybe of another world size), then loop over epochs and steps (read this rank's batch ->
forward -> backward with bucketed, overlapped gradient allreduce -> optimizer step), validate after every
epoch, checkpoint by policy and on a stop signal, and write metrics.jsonl, summary.json and model.pt.
Each step of that list is one function below; `Run` (runstate.py) holds what they build. A model split over
the ranks (--tp, --pp) is cut after the broadcast, and its step, validation and whole model go through
`hybrid.Parallel`; the readers and the gradient sync then run over the data-parallel group.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import sys
import time
from typing import Any


from ..checkpoint import manager as ckpt
from . import hybrid, lm, resume, runlog
from . import plan as memplan
from ..comm import Comm, strategy_class, world
from ..base.config import TrainConfig
from ..data import staging
from ..data.reader import ShardReader
from ..data.shardformat import ShardSet, load_manifest
from ..base.durable import write_failure, write_text
from ..base.hostmem import host_tuning_line
from ..base.rankenv import RankEnv, read_env, select_device
from ..base.errors import ConfigError, HpctrainError
from .runlog import RunLog
from ..base.stop import FLAG as STOP
from ..base.stop import STOP_EXIT, cancel_deadline, deadline, edge_budget
from ..data.position import Cursor
from .precision import LossScaler
from .step import auto_overlap, lr_factor, make_sync
from .runstate import Inputs, Outcome, Run
from .tracing import Timeline
from .update import StepSetup
from .watchdog import Watchdog, end_job


class StopRequested(HpctrainError):
    """The run was asked to stop (a stop signal, `base.stop`) and wrote a checkpoint; resume with --resume auto.
    Every rank raises it together (they agreed to stop at the same step)."""

    exit_code = STOP_EXIT
    agreed = True
    label = ""


def train(cfg: TrainConfig, *, comm: Comm | None = None, env: RankEnv | None = None) -> dict[str, Any]:
    """Run one training job on every rank of `comm` (COMM_WORLD by default); return the summary.

    An unexpected failure is logged with its traceback in the rank's log (RUN/logs/rank-NNNN.log) and
    re-raised as one line that names that log.
    """
    import torch  # noqa: F401 - before the deadline below: on a busy node the import alone can outlast it

    try:
        if comm is None:  # MPI_Init waits for every rank: a rank stopped before it would hang the others there
            deadline(edge_budget(cfg.watchdog.collective_timeout))  # until the watchdog takes over in _train
            comm = world()
        comm = comm.as_world()  # the ranks its flight records name are the run's own (for one split from another too)
        with contextlib.ExitStack() as stack:  # every thread, file and handler is undone here, on any exit
            try:
                return _train(cfg, comm, env or read_env(), stack)
            except HpctrainError:
                raise
            except Exception:  # the traceback into the rank's log while its handler is still open
                logging.getLogger(f"hpctrain.rank{comm.rank}").exception("training failed")
                raise
    except HpctrainError as exc:
        error = exc
    except Exception as exc:
        rank = comm.rank if comm is not None else 0
        log_path = cfg.run.run_dir / "logs" / f"rank-{rank:04d}.log"
        where = f"traceback in {log_path}" if log_path.is_file() else "before the run directory was created"
        error = HpctrainError(f"rank {rank}: {type(exc).__name__}: {exc} ({where})")
        error.__cause__ = exc
    finally:
        cancel_deadline()
    if comm is not None and comm.size > 1 and not error.agreed:
        end_job(comm, error)
    raise error


def _agree_at_start_up(comm: Comm, error: HpctrainError | None, step: int) -> None:
    """Raise on every rank when any rank failed its checks, or was asked to stop (a stop signal during start-up:
    there is nothing new to save before the first step, so the job ends here rather than after a start-up
    that can take minutes on a busy node, a launcher's --grace later). A collective."""
    if error is None and STOP.requested:
        name = signal.Signals(STOP.signum or signal.SIGTERM).name
        error = StopRequested(f"stopped by {name} during start-up, before step {step + 1}: nothing new to save; "
                              "run the same command to continue")
    comm.agree(error)


def _train(cfg: TrainConfig, comm: Comm, env: RankEnv, stack: contextlib.ExitStack) -> dict[str, Any]:
    """One rank's run, top to bottom; `stack` undoes everything it sets up."""
    import torch

    torch.set_num_threads(env.torch_threads())
    runtime = memplan.warm_runtime(cfg.optimizer.name)  # this process before any model or data: the plan's runtime
    if STOP.install():  # the CLI installed it at process start; library callers get it here
        stack.callback(STOP.restore)
    # every wait on other ranks from here on is watched; heartbeat files once the run directory exists
    watchdog = stack.enter_context(Watchdog(None, comm.rank, comm.size, timeout=cfg.watchdog.collective_timeout,
                                            abort=comm.abort).start())
    watchdog.at_edge(edge_budget(cfg.watchdog.collective_timeout))  # start-up, until the first step is done
    cancel_deadline()  # MPI is up and the watchdog watches from here
    inputs = _check_inputs(cfg, comm, env, watchdog)
    shardset, model, device = inputs.shardset, inputs.model, inputs.device  # the shards staged, the model split below
    log = _open_run_dir(cfg, comm, env, device, watchdog, stack, inputs.warnings)
    timeline = Timeline(cfg.run.run_dir, cfg.trace.window, comm, env=env, watchdog=watchdog)  # --trace, and the test hooks
    stack.callback(timeline.abandon)
    staged = staging.Staged()
    if inputs.plan is not None:  # --stage-to: this rank's files copied to node-local disk, read there, removed on exit
        with watchdog.waiting("staging the shards (every rank copies its own)", 0, budget=cfg.watchdog.checkpoint_timeout):
            shardset, staged = staging.stage(inputs.plan, shardset, comm, keep=cfg.data.keep_staged, on_exit=stack.callback,
                                             log=log.info)
    _share_initial_weights(cfg, comm, model, device, watchdog)
    with watchdog.waiting("start-up: splitting the model over the ranks (--tp/--pp)", 0):
        par = hybrid.split(cfg.parallel, comm, inputs.layout, model, device=device,
                           precision=cfg.precision.compute, batch_rows=cfg.data.batch_size * cfg.optimizer.accumulate,
                           row=hybrid.sample_row(shardset), seed=cfg.run.seed, watchdog=watchdog)
    model = par.model(model)  # a split run keeps its stage only: the whole model is freed here
    start = resume.start_point(comm, shardset, inputs.resume_path, watchdog, data=cfg.data.path,
                               budget=cfg.watchdog.checkpoint_timeout, data_ranks=par.data.size,
                               batch=cfg.data.batch_size * cfg.optimizer.accumulate)
    run = _build(cfg, comm, env, log, watchdog, shardset, model, device, start, stack, par)
    run.staged, run.timeline = staged, timeline
    timeline.warn_outside(start.step, run.total_steps, log)
    work = memplan.Workload(cfg.optimizer.name, cfg.precision.compute, cfg.data.batch_size, cfg.communication.bucket_mb,
                            cfg.optimizer.momentum)
    planned = memplan.for_run(cfg.model.spec, shardset, world=comm.size, zero=cfg.zero.stage, runtime=runtime,
                              work=work) if par.plain else (
        "no memory plan: the plan does not model a run split with --tp/--pp")
    run.plan = planned if isinstance(planned, memplan.Plan) else None
    log.info("%s", memplan.line(planned) if run.plan is not None else planned)
    audit_lines = resume.restore(run) if start.state is not None else None
    runlog.prepare(cfg.run.run_dir, cfg.data.audit_samples, comm.rank, start.step, audit_lines)
    with watchdog.waiting("start-up agreement", start.step):
        _agree_at_start_up(comm, None, start.step)
    sink = RunLog(cfg.run.run_dir, cfg.logging, cfg.data.audit_samples, comm.rank, log, stack,
                  total_steps=run.total_steps, step=start.step, rates=run.rates)
    outcome = _loop(run, sink)
    return _finish(run, sink, outcome)


def _check_inputs(cfg: TrainConfig, comm: Comm, env: RankEnv, watchdog: Watchdog) -> Inputs:
    """Check everything before anything is written, on every rank, and agree; then rank 0 alone finds and
    verifies the checkpoint to resume from (checksums read every byte)."""
    import torch

    error: HpctrainError | None = None
    shardset, model, resume_path, warnings, plan, layout = None, None, None, [], None, None
    device = torch.device("cpu")
    try:
        device = torch.device(select_device(env, torch.cuda.device_count() if torch.cuda.is_available() else 0))
        shardset = load_manifest(cfg.data.path)
        if cfg.parallel.tp * cfg.parallel.pp == 1:  # else the layout's check below: D must divide the shards
            shardset.check_world(comm.size)
        if cfg.data.stage_to is not None:
            plan = staging.plan(shardset, cfg.data.stage_to, env, comm.rank, comm.size, owner=str(cfg.run.run_dir.resolve()))
        if cfg.logging.tensorboard and comm.rank == 0:
            try:
                import tensorboard  # noqa: F401
            except ImportError:
                raise ConfigError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
        if cfg.model.init_weights is not None and not cfg.model.init_weights.is_file():
            raise ConfigError(f"--init-weights {str(cfg.model.init_weights)!r} not found")
        torch.manual_seed(cfg.run.seed)
        model = lm.build(cfg.model.spec, shardset)  # a classifier of the samples, or a language model of the tokens
        layout = hybrid.layout_for(cfg.parallel, comm.size, model, cfg.model.spec, shardset)
    except HpctrainError as exc:
        error = exc
    with watchdog.waiting("start-up checks", 0):
        _agree_at_start_up(comm, error, 0)
        if plan is not None:  # --stage-to: room in DIR for what every rank of the node that stages there copies
            comm.agree(staging.space_error(plan, comm))
        if comm.rank == 0:
            try:
                resume_path = resume.resolve(cfg.checkpoint.resume, cfg.run.run_dir, warnings.append)
            except HpctrainError as exc:
                error = exc
    # the others wait for rank 0's own work (hashing every byte): the checkpoint budget; rank 0 waits for nobody
    with watchdog.waiting("start-up: rank 0 verifies the checkpoint", 0,
                          budget=cfg.watchdog.checkpoint_timeout if comm.rank else None):
        comm.agree(error if comm.rank == 0 else None)
        resume_path = comm.bcast(resume_path)
    return Inputs(shardset=shardset, model=model, device=device, resume_path=resume_path, warnings=warnings, plan=plan,
                  layout=layout)


def _open_run_dir(cfg: TrainConfig, comm: Comm, env: RankEnv, device: Any, watchdog: Watchdog,
                  stack: contextlib.ExitStack, warnings: list[str]) -> logging.Logger:
    """The run directory, this rank's log in it (and the watchdog's heartbeats), config.toml on rank 0."""
    import torch

    cfg.run.run_dir.mkdir(parents=True, exist_ok=True)
    log = runlog.setup_logging(cfg.run.run_dir, comm.rank)
    stack.callback(runlog.close_logging, log)
    watchdog.attach(cfg.run.run_dir, log.error)
    for w in warnings:
        log.warning(w)
        if comm.rank == 0:
            print(f"warning: {w}", file=sys.stderr)
    log.info("world %d, rank %d, local rank %d, pid %d, host %s, launcher %s, device %s, torch threads %d",
             comm.size, comm.rank, env.local_rank, os.getpid(), socket.gethostname(), env.launcher, device,
             torch.get_num_threads())
    log.info("%s", host_tuning_line())
    if comm.rank == 0:
        runlog.write_config(cfg.run.run_dir, cfg.to_sections())
    return log


def _share_initial_weights(cfg: TrainConfig, comm: Comm, model: Any, device: Any, watchdog: Watchdog) -> None:
    """Rank 0's weights (its own initialization, or --init-weights) on every rank, on the rank's device."""
    import torch

    error = None
    if cfg.model.init_weights is not None and comm.rank == 0:
        try:
            model.load_state_dict(torch.load(cfg.model.init_weights, map_location="cpu", weights_only=True))
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            error = ConfigError(f"--init-weights {str(cfg.model.init_weights)!r} does not fit model {cfg.model.spec!r}: {exc}")
    with watchdog.waiting("start-up broadcast of the model", 0):
        comm.agree(error if comm.rank == 0 else None)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            model.to(device)
        comm.broadcast_tensors(list(model.parameters()) + list(model.buffers()))
    torch.manual_seed(cfg.run.seed * 1_000_003 + comm.rank + 1)  # per-rank stream for dropout and the like


def _build(cfg: TrainConfig, comm: Comm, env: RankEnv, log: logging.Logger, watchdog: Watchdog, shardset: ShardSet,
           model: Any, device: Any, start: Any, stack: contextlib.ExitStack, par: hybrid.Parallel) -> Run:
    """Readers of this replica's shards (over the data-parallel group), optimizer, LR schedule over the planned
    steps, gradient sync and checkpoint manager."""
    import torch

    batch, dp = cfg.data.batch_size * cfg.optimizer.accumulate, par.data
    cursor = stack.enter_context(contextlib.closing(Cursor(ShardReader(
        shardset, "train", rank=dp.rank, world=dp.size, batch_size=batch, shuffle=cfg.data.shuffle, seed=cfg.run.seed),
        start.position)))
    if cursor.prior:
        log.info("elastic resume: epoch %d begun on %s (data-parallel ranks, steps); %d samples left for %d ranks",
                 cursor.epoch, cursor.prior, int(cursor.reader.counts.sum()), dp.size)
    val_reader = None
    if "val" in shardset.splits:
        val_reader = stack.enter_context(contextlib.closing(ShardReader(
            shardset, "val", rank=dp.rank, world=dp.size, batch_size=max(cfg.data.batch_size, 256), shuffle=False,
            prefetch=0)))
    total_steps = start.step + cursor.steps_to(cfg.run.epochs)
    if cfg.run.max_steps:
        total_steps = min(total_steps, max(cfg.run.max_steps, start.step))
    overlap = cfg.communication.overlap if cfg.communication.overlap is not None else auto_overlap(device.type)
    sharded = strategy_class(cfg.zero.stage).sharded
    with watchdog.waiting("start-up: gradient sync" + (" (ZeRO times its collectives here)" if sharded else ""),
                          start.step):
        kept = resume.kept_reducer(cfg.zero, start.state, comm.size)
        sync, optimizer = make_sync(cfg.communication, cfg.zero, cfg.optimizer,
                                    model, dp, overlap, reduce=kept, alone=par.tied)
        stack.callback(sync.close)
    scheduler = torch.optim.lr_scheduler.LambdaLR(getattr(optimizer, "inner", optimizer),
                                                  lr_factor(cfg.optimizer.schedule, total_steps, cfg.optimizer.warmup))
    for note in sync.notes:
        log.warning(note)
    if kept:  # the same sums as the run this checkpoint is from
        log.info("--zero-reduce auto: keeping %s, the reducer of the run the checkpoint is from", kept)
    log.info("gradient sync: %d bucket(s) of up to %.1f MiB, overlap %s, wire %s, zero stage %d", len(sync.buckets),
             cfg.communication.bucket_mb, sync.overlap, cfg.communication.grad_compression, cfg.zero.stage)
    with watchdog.waiting("start-up: checkpoint manager", start.step):
        manager = ckpt.CheckpointManager(
            cfg.run.run_dir, comm, every=cfg.checkpoint.checkpoint_every, keep=cfg.checkpoint.keep, mtbf_hours=cfg.checkpoint.mtbf_hours, log=log.error,
            on_write=lambda: watchdog.phase("checkpoint write (waiting for every rank's part)",
                                            budget=cfg.watchdog.checkpoint_timeout))
    rates = lm.rates(cfg.precision.compute, shardset, model, comm, device, flops=par.flops_per_token, watchdog=watchdog)
    return Run(cfg=cfg, comm=comm, log=log, watchdog=watchdog, shardset=shardset, model=model, device=device,
               start=start, cursor=cursor, val_reader=val_reader, optimizer=optimizer, scheduler=scheduler, sync=sync,
               manager=manager, loss_fn=torch.nn.CrossEntropyLoss(reduction="sum"), total_steps=total_steps,
               rates=rates, scaler=LossScaler() if cfg.precision.compute == "fp16" else None, par=par)


def _loop(run: Run, sink: RunLog) -> Outcome:
    """Epochs and steps until the planned total, a stop, or the end; a checkpoint at every boundary the
    policy asks for, on a stop and at the last step."""
    cfg, comm, watchdog, start = run.cfg, run.comm, run.watchdog, run.start
    out, cursor = Outcome(step=start.step), run.cursor
    setup = StepSetup(model=run.model, sync=run.sync, optimizer=run.optimizer, loss_fn=run.loss_fn, device=run.device,
                      clip_grad=cfg.optimizer.clip_grad, accumulate=cfg.optimizer.accumulate, precision=cfg.precision.compute,
                      scaler=run.scaler)
    while out.step < run.total_steps:
        epoch = cursor.epoch
        run.model.train()
        batches = run.timeline.batches(cursor.batches(), out.step)  # each step marked on the timeline
        t_data = time.perf_counter()
        for batch in batches:
            t0 = time.perf_counter()
            reader, index = cursor.current
            rows = int(reader.step_sizes(index).sum())
            with watchdog.waiting("gradient allreduce", out.step + 1):
                loss = run.par.step(setup, batch.x, batch.y, rows * run.rates.targets, step=out.step + 1)
            if out.step == start.step:  # the first step is done: the steady state's deadline from here on
                watchdog.at_edge(None)
            run.scheduler.step()
            out.step, out.samples = out.step + 1, out.samples + rows
            index = batch.index if run.par.reporter else batch.index[:0]  # one rank per replica counts its samples
            out.epoch_loss, out.epoch_n = out.epoch_loss + loss, out.epoch_n + batch.y.size * run.par.reporter
            sink.step(epoch, index, loss, time.perf_counter() - t0, run.sync.comm_seconds, t0 - t_data)
            end_of_epoch, last = cursor.position.epoch > epoch, out.step >= run.total_steps
            if sink.due(out.step, end_of_epoch, last):
                _log_window(run, sink, out, epoch, end_of_epoch)
            with watchdog.waiting("stop/checkpoint agreement", out.step):
                stopping = run.manager.save(out.step, lambda: resume.state(run, sink), stop_requested=STOP.requested,
                                            final=last)
            if stopping:
                out.stop_signal = STOP.signum or signal.SIGTERM
                break
            t_data = time.perf_counter()
            if last:
                break
        batches.close()
        if out.stop_signal is not None:
            break
    run.manager.wait()
    watchdog.idle()
    return out


def _log_window(run: Run, sink: RunLog, out: Outcome, epoch: int, end_of_epoch: bool) -> None:
    """A logged step: the window's loss over all ranks; at an epoch's end validation and the epoch's loss."""
    comm, watchdog = run.comm, run.watchdog
    with watchdog.waiting("metrics reduction", out.step):
        loss_tot, n_tot = comm.allreduce_array([sink.window.loss, sink.window.n])
    ended = time.perf_counter()
    extra: dict[str, float] = {"wire_bytes_per_step": run.sync.wire_bytes}  # this rank's gradient payload
    if end_of_epoch and run.val_reader is not None:
        started = time.perf_counter()
        watchdog.at_edge(edge_budget(run.cfg.watchdog.collective_timeout))  # its reduction waits for the slowest rank's pass
        out.last_val = run.par.evaluate(run.model, run.val_reader, watchdog=watchdog, step=out.step,
                                        precision=run.cfg.precision.compute, every_batch=run.sync.strategy.gathers_in_forward)
        watchdog.at_edge(None)
        out.last_val.update(run.rates.validation(out.last_val))
        out.val_step = out.step
        out.paused += time.perf_counter() - started
        extra.update(out.last_val)
    if end_of_epoch:
        with watchdog.waiting("epoch loss reduction", out.step):
            e_loss, e_n = comm.allreduce_array([out.epoch_loss, out.epoch_n])
        extra["epoch_train_loss"] = e_loss / max(1.0, e_n)
        out.epoch_loss = out.epoch_n = 0.0
    sink.write(out.step, epoch, loss_tot, n_tot, run.scheduler.get_last_lr()[0], extra, ended=ended)


def _stopped(run: Run, step: int, name: str) -> None:
    """After the stop's checkpoint: record the stop (RUN/stopped.json, which says who asked and so whether to
    requeue) and raise StopRequested."""
    path = run.cfg.run.run_dir / "checkpoints" / ckpt.step_dir_name(step)
    with run.watchdog.waiting("stop: who asked", step):
        by = runlog.record_stop(run.comm, run.cfg.run.run_dir, step)
    run.log.warning("stopped by %s at step %d (asked by the %s); checkpoint written", name, step, by)
    raise StopRequested(f"stopped by {name} at step {step}: checkpoint written to {path}; run the same command "
                        "to continue")


def _finish(run: Run, sink: RunLog, out: Outcome) -> dict[str, Any]:
    """Stop with exit 3 after a stop; else the final validation, the ranks' agreement on the parameters,
    summary.json and model.pt."""
    import torch

    cfg, comm, watchdog, step = run.cfg, run.comm, run.watchdog, out.step
    watchdog.at_edge(edge_budget(cfg.watchdog.collective_timeout))  # the end: the final validation is each rank's own work
    if out.stop_signal is not None:
        _stopped(run, step, signal.Signals(out.stop_signal).name)
    if STOP.requested:  # came after the last step's boundary: nothing left to stop, the run is complete
        run.log.warning("%s arrived after the last step; the run completed", signal.Signals(STOP.signum).name)
    train_time = time.perf_counter() - out.started
    # the rates count training only, as the per-window ones do: not validation, not checkpoint stalls
    paused = out.paused + run.manager.stall_seconds
    samples_per_s = out.samples / max(train_time - paused, 1e-9) if out.samples else None
    if out.val_step != step and run.val_reader is not None:  # the final model's, not an earlier epoch's
        out.last_val = run.par.evaluate(run.model, run.val_reader, watchdog=watchdog, step=step, precision=cfg.precision.compute,
                                        every_batch=run.sync.strategy.gathers_in_forward)
        out.last_val.update(run.rates.validation(out.last_val))
    traced = run.timeline.close()  # with --trace: RUN/trace.json and the straggler verdict (rank 0)
    with watchdog.waiting("memory reductions", step):
        memory = memplan.measured(run.sync, run.optimizer, comm, run.log.info)  # before the final model is written
        unplanned = memplan.departure(run.plan, memory) if run.plan is not None else None
        if unplanned:
            run.log.warning("%s", unplanned)
            if comm.rank == 0:
                print(f"warning: {unplanned}", file=sys.stderr)
    with watchdog.waiting("summary reductions; the final model (ZeRO 3 gathers it unit by unit)", step):
        model_file, digest, in_sync = run.par.finish_state(run.model, run.sync, cfg.run.run_dir / "model.pt")
        e_loss, e_n = comm.allreduce_array([out.epoch_loss, out.epoch_n])
        final_loss = sink.last_epoch_loss(comm) if e_n == 0 else e_loss / e_n
    m = run.manager
    summary = {
        "world_size": comm.size, "epochs": run.cursor.position.epochs_begun(), "steps": step,
        "global_batch_size": cfg.data.batch_size * cfg.optimizer.accumulate * run.par.data.size, "train_loss": final_loss,
        "val_loss": out.last_val.get("val_loss"), "val_accuracy": out.last_val.get("val_accuracy"),
        "samples_per_s": samples_per_s, "train_time_s": train_time, "paused_s": paused,
        "param_sha256": digest, "ranks_in_sync": in_sync, "resumed_from": run.start.resumed_from,
        "model": cfg.model.spec, "data": str(cfg.data.path), "data_fingerprint": run.shardset.fingerprint,
        "staged_bytes": run.staged.total_bytes, "staging_s": run.staged.max_seconds, "precision": cfg.precision.compute,
        "grad_compression": cfg.communication.grad_compression, "wire_bytes_per_step": run.sync.wire_bytes,
        "zero": cfg.zero.stage, "zero_reduce": getattr(run.sync, "reduce", None), **run.par.summary(),
        "skipped_steps": run.scaler.skipped if run.scaler is not None else 0,
        "torch_threads": torch.get_num_threads(), **run.rates.summary(samples_per_s or 0.0, out.last_val),
        "checkpoint": m.summary(cfg.checkpoint.checkpoint_every == "auto", train_time), **traced,
        "memory": {**memory, "plan": memplan.as_dict(run.plan) if run.plan is not None else None},
    }
    if comm.rank == 0:
        path = cfg.run.run_dir / "model.pt"
        try:
            model_file.close()  # written tensor by tensor by finish_state; a failure to write is raised here
            path = cfg.run.run_dir / "summary.json"
            write_text(path, json.dumps(summary, indent=2) + "\n")
        except OSError as exc:  # a full disk: one line that says which file, and the free bytes
            raise write_failure(exc, path) from exc
    run.log.info("done: %s", json.dumps(summary))
    if not in_sync:
        error = HpctrainError("ranks ended with different parameters (the replicas, or the tensor-parallel ranks' "
                              "whole tensors, differ); this is a bug, please report it")
        error.agreed = True  # every rank saw the same hashes
        raise error
    return summary
