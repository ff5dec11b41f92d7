"""What every entry path does when it resumes from a checkpoint, `hpctrain train` (`control/resume.py`) and the
library's `Checkpointer` (`api.py`) alike: refuse a model the checkpoint's tensors do not fit before anything is
loaded (`refuse_misfit`), put back what a rank saved of its own (`restore_own`: RNG streams, error feedback), and
say on the resume's first line what changed since (`resumed_line`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from ..base.errors import CheckpointError, brief
from ..comm import Comm
from . import rng as rngstate
from . import state as ckptstate
from .boxes import is_ref
from .format import REF
from .loader import Loaded


def shapes_of(model: Any) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of `model`'s state_dict."""
    return {k: tuple(getattr(v, "shape", ())) for k, v in model.state_dict(keep_vars=True).items()}


def model_misfit(loaded: Loaded, ours: dict[str, tuple[int, ...]], *, keys: bool = True) -> str | None:
    """How a model of the tensors `ours` (name: shape) differs from the one a checkpoint holds (its shapes, and
    with `keys` its names), in a few words; None when it fits. Asked before any tensor is loaded, so that another
    model is refused in one line, not by torch's load_state_dict on every rank."""
    saved = {k: tuple(loaded.reader.shape(v[REF]) if is_ref(v) else getattr(v, "shape", ())) for k, v in loaded.model.items()}
    missing, unexpected = (sorted(set(saved) - set(ours)), sorted(set(ours) - set(saved))) if keys else ([], [])
    shapes = [f"{k} {saved[k]} there, {ours[k]} here" for k in ours if k in saved and saved[k] != ours[k]]
    parts = ([f"shapes differ: {', '.join(shapes[:2])}"] if shapes else []) + (
        [f"the checkpoint has {brief(missing[:3])} this model lacks"] if missing else []) + (
        [f"this model has {brief(unexpected[:3])} the checkpoint lacks"] if unexpected else [])
    return "; ".join(parts) or None


def resumed_line(step: int, path: Path, meta: dict[str, Any], *, world: int, global_batch: int | None,
                 changes: list[str]) -> str:
    """A resume's first line on the console: from where, and what changed since the checkpoint (the world size,
    the global batch, every setting in `changes`), whichever entry path resumes."""
    was = meta.get("global_batch")
    changed = ([f"world size {meta['world_size']} -> {world}"] if int(meta["world_size"]) != world else []) + (
        [f"global batch {was} -> {global_batch}"] if None not in (was, global_batch) and int(was) != global_batch
        else []) + changes
    return f"resumed from step {step} ({path})" + (f"; changed since: {', '.join(changed)}" if changed else "")


def refuse_misfit(loaded: Loaded, shapes: dict[str, tuple[int, ...]], comm: Comm, *, ours: str, fix: str,
                  keys: bool = True) -> None:
    """Raise on every rank, in one line, when a model of the tensors `shapes` (`ours`: how the message names it)
    does not fit the checkpoint's (`fix`: what to do; `keys`: compare names too); before anything is loaded."""
    misfit = model_misfit(loaded, shapes, keys=keys)
    comm.agree(CheckpointError(f"checkpoint {str(loaded.path)!r} does not fit {ours} ({misfit}): {fix}")
               if misfit else None)


def restore_own(loaded: Loaded, comm: Comm, sync: Any, *, same: bool, warn: Callable[[str], Any]) -> dict | None:
    """Put back what this rank saved of its own (RNG streams, error feedback) when the world is the one that
    wrote it (`same`); returns it (None on another world: the streams start afresh, `warn` says so of the
    error feedback)."""
    if not same:
        if any("compress" in r for r in loaded.ranks):
            warn(f"the error feedback of the gradient compression starts empty: the checkpoint holds "
                 f"{loaded.meta['world_size']} ranks' errors, this run has {comm.size}")
        return None
    mine = ckptstate.rank_state(loaded, comm.rank)
    rngstate.restore(mine["rng"])
    if sync is not None and mine.get("compress") is not None:
        unfit = sync.load_compressor_state(mine["compress"])
        if unfit:
            warn(unfit)
    return mine
