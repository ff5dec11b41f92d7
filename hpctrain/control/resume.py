"""Where a resumed run starts from: which checkpoint `--resume` names, and what changed in the config since.

The trainer asks on rank 0 (`resolve`: the latest complete checkpoint, verified, or the one named), and warns
about every change of the config since that checkpoint (`config_changes`) before it loads the state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from . import checkpoint as ckpt
from ..base.config import TrainConfig
from ..base.errors import CheckpointError

# what may change between the segments of one run without changing what it computes
NOT_A_CHANGE = {"resume", "json", "progress", "run_dir", "epochs", "max_steps", "log_every", "checkpoint_every", "keep",
                "stage_to", "keep_staged"}


def resolve(cfg: TrainConfig, warn: Callable[[str], Any]) -> Path | None:
    """The checkpoint directory to resume from (None: a fresh start): `--resume auto` takes the latest complete
    one in the run directory, `never` none, a path that one (verified: checksums read every byte)."""
    if cfg.resume == "never":
        return None
    if cfg.resume == "auto":
        return ckpt.latest(cfg.run_dir, warn=warn)
    path = Path(cfg.resume)
    if not path.is_dir():
        raise CheckpointError(f"--resume {cfg.resume!r}: no such checkpoint directory; use auto, never or a RUN/checkpoints/step-* path")
    ckpt.verify(path)
    return path


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """`key: old -> new` for every setting that differs between a checkpoint's config and this run's."""
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
            if k not in NOT_A_CHANGE and old.get(k) != new.get(k)]
