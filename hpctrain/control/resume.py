"""What a checkpoint of a run holds and how a run resumes from one: which checkpoint `--resume` names, what
changed in the config since, the state saved at a step boundary (`state`) and loaded back (`restore`).

The trainer asks on rank 0 (`resolve`: the latest complete checkpoint, verified, or the one named), and warns
about every change of the config since that checkpoint (`config_changes`) before it loads the state.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

from . import checkpoint as ckpt
from . import layoutfree, rngstate
from ..base.config import TrainConfig
from ..base.sections import ZeroConfig
from ..base.errors import CheckpointError, brief
from ..comm import checkpoint_entries, load_entries


def _threads() -> int:
    import torch

    return torch.get_num_threads()

# what may change between the segments of one run without changing what it computes
NOT_A_CHANGE = {"resume", "json", "progress", "run_dir", "epochs", "max_steps", "log_every", "checkpoint_every", "keep",
                "stage_to", "keep_staged", "tp", "pp", "micro_batches", "pipeline_schedule"}


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


def kept_reducer(zero: ZeroConfig, state: dict[str, Any] | None, world: int) -> str | None:
    """With --zero-reduce auto, the reducer the checkpoint's run chose (on the same world size), else None.

    auto times the reducers at start-up and keeps the fastest; on 3 or more ranks they sum in different
    orders, so a resume that chose anew could continue with other bits than the run it resumes."""
    if zero.zero_reduce != "auto" or state is None or state["meta"].get("world_size") != world:
        return None
    return state["meta"].get("zero_reduce")


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
    changed since. Returns every audit file's line count at the checkpoint."""
    cfg, comm, start = run.cfg, run.comm, run.start
    state = start.state
    meta = state["meta"]
    changes = config_changes(TrainConfig.upgrade(meta.get("config", {})), cfg.to_dict())
    planned = meta.get("schedule_steps")
    if cfg.schedule != "constant" and planned is not None and int(planned) != run.total_steps:
        changes.append(f"the {cfg.schedule} learning-rate schedule was planned over {planned} steps and now spans "
                       f"{run.total_steps} (--epochs, --max-steps or the world size changed): from step {start.step} "
                       "on, the learning rate follows the new plan")
    if comm.rank == 0:  # the console's first word on a resume: from where, and whether anything is left
        grown = f"; the run now ends at step {run.total_steps} (it was planned to {planned})" if (
            planned is not None and int(planned) != run.total_steps) else ""
        print(f"resumed from step {start.step} ({start.path}){grown}", file=sys.stderr, flush=True)
        if start.step >= run.total_steps:
            print(f"nothing left to do: step {start.step} is this run's last (of {run.total_steps}); raise "
                  "--epochs or --max-steps to train on", file=sys.stderr, flush=True)
    for change in changes:
        run.log.warning("config changed since the checkpoint: %s", change)
        if comm.rank == 0:
            print(f"warning: config changed since the checkpoint: {change}", file=sys.stderr)
    same = meta["world_size"] == comm.size and _layout(meta) == _layout_of(run)  # the same ranks in the same places
    if same:  # an elastic resume is not bit-identical anyway: nothing to add
        for change in thread_change(meta.get("torch_threads")):
            run.log.warning("%s", change)
            if comm.rank == 0:
                print(f"warning: {change}", file=sys.stderr)
    owns = [r.get("own") or {} for r in state["ranks"]]  # each rank's own state: optimizer slices, error feedback
    if run.par.plain and not meta.get("layout_free"):
        run.model.load_state_dict(state["model"])
        run.model.to(run.device)
        load_entries(run.optimizer, state["train"]["optimizer"], [own.get("optimizer") for own in owns])
    else:  # a split run's checkpoint, or a split run: whole tensors by name, this rank's share of each
        layoutfree.restore(run, state)
    run.scheduler.load_state_dict(state["train"]["scheduler"])
    if run.scaler is not None and "scaler" in state["train"]:
        run.scaler.load_state_dict(state["train"]["scaler"])
    if same:
        rngstate.restore(state["ranks"][comm.rank]["rng"])
        if owns[comm.rank].get("compress") is not None:
            unfit = run.sync.load_compressor_state(owns[comm.rank]["compress"])
            if unfit:
                run.log.warning("%s", unfit)
    elif any(own.get("compress") is not None for own in owns):
        run.log.warning("the error feedback of --grad-compression starts empty: the checkpoint holds %d ranks' "
                        "errors, this run has %d", meta["world_size"], comm.size)
    known = {**meta.get("audit_frozen", {}),
             **{f"rank-{r:04d}.txt": int(st["audit_lines"]) for r, st in enumerate(state["ranks"])}}
    run.audit_frozen = {name: n for name, n in known.items() if int(name[5:9]) >= comm.size}
    run.log.info("resumed from %s (step %d, epoch %d, step %d of the epoch)", start.path, start.step, start.epoch,
                 start.in_epoch)
    return known


def _layout(meta: dict[str, Any]) -> list[int]:
    """The (D, T, P) a checkpoint was written with (a data-parallel one's: (world size, 1, 1))."""
    return list(meta.get("layout", [meta["world_size"], 1, 1]))


def _layout_of(run: Any) -> list[int]:
    lay = run.par.layout
    return [lay.data, lay.tensor, lay.pipe]


def state(run: Any, sink: Any, epoch: int, in_epoch: int, segments: list[tuple[int, int]]) -> dict[str, Any]:
    """What a checkpoint at this step boundary holds (called only when one is written): a split run's model
    and optimizer layout-free, each rank its shares (layoutfree.split_state)."""
    split: dict[str, Any] = {}
    if run.par.plain:
        optimizer, shard = checkpoint_entries(run.optimizer)  # a sharded optimizer: the layout, and this rank's slices
        model = run.model.state_dict()
    else:
        optimizer, shard, split = layoutfree.split_state(run)
        model = {}
    compressor = run.sync.compressor_state()  # error feedback and warm starts: this rank's own
    if not run.par.plain:
        own = {**shard, "compress": compressor}
    else:
        own = None if shard is None and compressor is None else {"optimizer": shard, "compress": compressor}
    return dict(
        model_state=model, shard_state=own,
        train_state={"optimizer": optimizer, "scheduler": run.scheduler.state_dict(),
                     **({"scaler": run.scaler.state_dict()} if run.scaler is not None else {})},
        rank_state={"rng": rngstate.capture(), "audit_lines": sink.flush_audit()},
        meta={"epoch": epoch, "step_in_epoch": in_epoch, "world_size": run.comm.size, "segments": segments,
              "audit_frozen": run.audit_frozen, "data_fingerprint": run.shardset.fingerprint,
              "config": run.cfg.to_dict(), "schedule_steps": run.total_steps,
              "torch_threads": _threads(), "zero_reduce": getattr(run.sync, "reduce", None), **split},
    )
