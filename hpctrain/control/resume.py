"""How `hpctrain train` resumes: which checkpoint `--resume` names, what changed in the config since, the state
saved at a step boundary (`state`) and loaded back (`restore`), both through `checkpoint/state.py` as the
library's do (a run split over ranks with --tp/--pp: through `checkpoint/layoutfree.py`, in the same format).

The trainer asks on rank 0 (`resolve`: the latest complete checkpoint, verified, or the one named); before it
loads the state, it refuses a model the checkpoint's tensors do not fit and says on its first line what changed
since (the world size, the global batch, every setting), through `checkpoint/resume.py` as the library's
`Checkpointer` does. Where the run stands in its data is `data/position.py`'s `Position`, for both.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path
from typing import Any, Callable

from ..checkpoint import layoutfree
from ..checkpoint import manager as ckpt
from ..checkpoint import rng as rngstate
from ..checkpoint import state as ckptstate
from ..base.config import TrainConfig
from ..base.sections import ZeroConfig
from ..base.errors import CheckpointError, brief
from ..comm import Comm
from ..data.shardformat import ShardSet
from ..checkpoint.loader import Loaded, open_checkpoint
from ..checkpoint.resume import refuse_misfit, restore_own, resumed_line, shapes_of
from ..data.position import Position
from .runstate import Start
from .watchdog import Watchdog


def _threads() -> int:
    import torch

    return torch.get_num_threads()

# what may change between the segments of one run without changing what it computes
NOT_A_CHANGE = {"resume", "json", "progress", "run_dir", "epochs", "max_steps", "log_every", "checkpoint_every", "keep",
                "stage_to", "keep_staged", "tp", "pp", "micro_batches", "pipeline_schedule"}


def start_point(comm: Comm, shardset: ShardSet, path: Path | None, watchdog: Watchdog, *, data: Path,
                budget: float, data_ranks: int, batch: int) -> Start:
    """Where to start: fresh, or the checkpoint at `path` (opened: its small files read on rank 0, broadcast;
    `budget`: the watchdog's for rank 0's reading, `data`: --data, for the message). The epoch's segments are
    counted in data-parallel ranks (`data_ranks`: the readers' world) of `batch` samples each."""
    if path is None:
        return Start()
    with watchdog.waiting("opening the checkpoint", 0, budget=budget if comm.rank else None):
        state = open_checkpoint(path, comm, verified=True)
    meta = state.meta
    if meta["data_fingerprint"] != shardset.fingerprint:
        comm.agree(CheckpointError(
            f"checkpoint {str(path)!r} was written for another dataset (manifest fingerprint "
            f"{meta['data_fingerprint'][:12]}, --data {str(data)!r} has {shardset.fingerprint[:12]}): "
            "point --data at the original shards or start a new --run-dir"))
    return Start(step=int(meta["step"]), position=Position.from_meta(meta, data_ranks, batch),
                 resumed_from=int(meta["step"]), path=path, state=state)


def resolve(resume: str, run_dir: Path, warn: Callable[[str], Any]) -> Path | None:
    """The checkpoint directory to resume from (None: a fresh start): `--resume auto` takes the latest complete
    one in the run directory, `never` none, a path that one (verified: checksums read every byte)."""
    if resume == "never":
        return None
    if resume == "auto":
        return ckpt.latest(run_dir, warn=warn)
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"--resume {resume!r}: no such checkpoint directory; use auto, never or a RUN/checkpoints/step-* path")
    ckpt.verify(path)
    return path


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """`key: old -> new` for every setting that differs between a checkpoint's config and this run's (each value
    cut to a few dozen characters: the old ones come from the checkpoint's meta.json)."""
    return [f"{k}: {brief(old.get(k))} -> {brief(new.get(k))}" for k in sorted(set(old) | set(new))
            if k not in NOT_A_CHANGE and old.get(k) != new.get(k)]


def kept_reducer(zero: ZeroConfig, state: Loaded | None, world: int) -> str | None:
    """With --zero-reduce auto, the reducer the checkpoint's run chose (on the same world size), else None.

    auto times the reducers at start-up and keeps the fastest; on 3 or more ranks they sum in different
    orders, so a resume that chose anew could continue with other bits than the run it resumes."""
    if zero.reduce != "auto" or state is None or state.meta.get("world_size") != world:
        return None
    return state.meta.get("zero_reduce")


def thread_change(saved: int | None) -> list[str]:
    """The warning for a resume on another number of torch threads per rank (empty when the same or unknown):
    torch's CPU kernels split their sums by thread, so the run goes on correctly but no longer bit for bit."""
    now = _threads()
    if saved is None or int(saved) == now:
        return []
    return [f"torch threads per rank: {saved} -> {now} (the CPUs per rank changed): the run continues correctly, "
            "but not bit-identical to an uninterrupted run on one thread count; give each rank the CPUs it had "
            "(--cpus-per-task, or the same ranks per node) for an exact resume"]


def restore(run: Any) -> dict[str, int]:
    """Load the checkpoint's state into the run (RNG streams only on the world size that wrote them); say what
    changed since, on the first line. Another model is refused before anything is loaded. Returns every audit
    file's line count at the checkpoint."""
    cfg, comm, start = run.cfg, run.comm, run.start
    loaded = start.state
    meta = loaded.meta
    old = TrainConfig.upgrade(meta.get("config", {}))
    shapes = shapes_of(run.model) if run.par.plain else {k: tuple(s) for k, (s, _) in run.model.whole.items()}
    refuse_misfit(loaded, shapes, comm, ours=f"--model {cfg.model.spec!r} (it holds {old.get('model')!r})",
                  fix=f"start a new --run-dir for this model, or resume with --model {old.get('model')!r}",
                  keys=run.par.plain)  # a split run's names: `layoutfree` refuses a missing one in one line
    _say_resumed(run, old)
    same = meta["world_size"] == comm.size and _layout(meta) == _layout_of(run)  # the same ranks in the same places
    if same:  # an elastic resume is not bit-identical anyway: nothing to add
        for change in thread_change(meta.get("torch_threads")):
            run.log.warning("%s", change)
            if comm.rank == 0:
                print(f"warning: {change}", file=sys.stderr)
    if run.par.plain:
        ckptstate.restore(loaded, run.model, run.optimizer, run.sync, scheduler=run.scheduler, scaler=run.scaler,
                          warn=lambda text: _warn(run, text))
    else:  # this rank's share of each whole tensor, whatever layout wrote them
        layoutfree.restore(loaded, run.model, run.optimizer)
        ckptstate.restore_schedule(loaded, run.scheduler, run.scaler)
    if any(t.device != run.device for t in (*run.model.parameters(), *run.model.buffers())):
        run.model.to(run.device)  # only what a restore left elsewhere: a released ZeRO 3 parameter refuses `.to`
    restore_own(loaded, comm, run.sync, same=same, warn=lambda text: run.log.warning("%s", text))
    known = {**meta.get("audit_frozen", {}),
             **{f"rank-{r:04d}.txt": int(st["audit_lines"]) for r, st in enumerate(loaded.ranks)}}
    run.audit_frozen = {name: n for name, n in known.items() if int(name[5:9]) >= comm.size}
    run.log.info("resumed from %s (step %d, epoch %d, step %d of the epoch); read %d bytes of its tensors; peak RSS "
                 "so far %d", start.path, start.step, start.position.epoch, start.position.in_epoch,
                 loaded.reader.bytes_read, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    loaded.reader.close()
    return known


def _say_resumed(run: Any, old: dict[str, Any]) -> None:
    """The console's first word on a resume (rank 0): from where, what changed since the checkpoint (`old`: its
    config), where the run now ends, and whether anything is left; the log gets every change."""
    cfg, comm, start, meta = run.cfg, run.comm, run.start, run.start.state.meta
    changes = config_changes(old, cfg.to_dict())
    was = {"global_batch": int(old.get("batch_size") or 0) * int(old.get("accumulate") or 1) * _layout(meta)[0] or None,
           **meta}
    line = resumed_line(start.step, start.path, was, world=comm.size, changes=changes,
                        global_batch=run.cursor.meta(run.par.data.size)["global_batch"])
    planned = meta.get("schedule_steps")
    notes = []
    if cfg.optimizer.schedule != "constant" and planned is not None and int(planned) != run.total_steps:
        notes.append(f"the {cfg.optimizer.schedule} learning-rate schedule was planned over {planned} steps and now spans "
                     f"{run.total_steps} (--epochs, --max-steps or the world size changed): from step {start.step} "
                     "on, the learning rate follows the new plan")
    for change in changes + notes:
        run.log.warning("config changed since the checkpoint: %s", change)
    if comm.rank != 0:
        return
    grown = f"; the run now ends at step {run.total_steps} (it was planned to {planned})" if (
        planned is not None and int(planned) != run.total_steps) else ""
    print(line + grown, file=sys.stderr, flush=True)
    if start.step >= run.total_steps:
        print(f"nothing left to do: step {start.step} is this run's last (of {run.total_steps}); raise "
              "--epochs or --max-steps to train on", file=sys.stderr, flush=True)
    for note in notes:
        print(f"warning: {note}", file=sys.stderr)


def _layout(meta: dict[str, Any]) -> list[int]:
    """The (D, T, P) a checkpoint was written with (a data-parallel one's: (world size, 1, 1))."""
    return list(meta.get("layout", [meta["world_size"], 1, 1]))


def _layout_of(run: Any) -> list[int]:
    lay = run.par.layout
    return [lay.data, lay.tensor, lay.pipe]


def _warn(run: Any, text: str) -> None:
    """A warning in every rank's log and once on the console (rank 0)."""
    run.log.warning("%s", text)
    if run.comm.rank == 0:
        print(f"warning: {text}", file=sys.stderr)


def state(run: Any, sink: Any) -> dict[str, Any]:
    """What a checkpoint at this step boundary holds (called only when one is written): a split run's model
    and optimizer as each rank's shares of the whole tensors (`layoutfree.capture`)."""
    rank_state = {"rng": rngstate.capture(), "audit_lines": sink.flush_audit()}
    meta = {**run.cursor.meta(run.par.data.size), "world_size": run.comm.size,
            "audit_frozen": run.audit_frozen, "data_fingerprint": run.shardset.fingerprint,
            "config": run.cfg.to_dict(), "schedule_steps": run.total_steps, "layout": _layout_of(run),
            "torch_threads": _threads(), "zero_reduce": getattr(run.sync, "reduce", None)}
    if not run.par.plain:
        return layoutfree.capture(run, rank_state=rank_state, meta=meta)
    return ckptstate.capture(run.model, run.optimizer, run.sync, scheduler=run.scheduler, scaler=run.scaler,
                             rank_state=rank_state, meta=meta)
