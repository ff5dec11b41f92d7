"""What one rank's training run is made of, as the trainer (`trainer`) builds and runs it: where it starts
(`Start`), what it is built of (`Run`), and what its loop leaves for the summary (`Outcome`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..base.config import TrainConfig
from ..comm import Comm, GradSync
from ..data import staging
from ..data.position import Cursor, Position
from ..data.reader import ShardReader
from ..data.shardformat import ShardSet
from ..checkpoint import manager as ckpt
from ..checkpoint.loader import Loaded
from . import lm
from .hybrid import Parallel
from .plan import Plan
from .precision import LossScaler
from .tracing import Timeline
from .watchdog import Watchdog


@dataclass(slots=True)
class Start:
    """Where the run starts: step 0, or a checkpoint (maybe written on another world size, mid-epoch)."""

    step: int = 0
    position: Position = field(default_factory=Position)  # the epoch, and the steps of it already done
    resumed_from: int | None = None
    path: Path | None = None
    state: Loaded | None = None  # the checkpoint, opened (its tensors are read by `resume.restore`)


@dataclass(slots=True, kw_only=True)
class Inputs:
    """What the start-up checks found and every rank agreed on (`trainer._check_inputs`)."""

    shardset: ShardSet
    model: Any  # built on every rank from the seed; rank 0's weights replace it next
    device: Any
    resume_path: Path | None  # the checkpoint to resume from, verified by rank 0; None: a fresh start
    warnings: list[str]  # for the run's log, once it exists
    plan: staging.StagePlan | None  # --stage-to: what this rank copies where
    layout: Any  # the (D, T, P) layout of the ranks (--tp, --pp)


@dataclass(slots=True, kw_only=True)
class Run:
    """What one rank's run is made of, built once by `_build`."""

    cfg: TrainConfig
    comm: Comm
    log: logging.Logger
    watchdog: Watchdog
    shardset: ShardSet
    model: Any
    device: Any
    start: Start
    cursor: Cursor  # where the run stands in its data, and its readers from there
    val_reader: ShardReader | None
    optimizer: Any
    scheduler: Any
    sync: GradSync
    manager: ckpt.CheckpointManager
    loss_fn: Any
    total_steps: int
    rates: lm.Rates  # targets per sample (seq_len for token rows), and what tokens_per_s and mfu need
    scaler: LossScaler | None  # fp16's loss scale
    audit_frozen: dict[str, int] = field(default_factory=dict)  # audit files of ranks beyond this world size
    staged: staging.Staged = field(default_factory=staging.Staged)  # what --stage-to copied
    timeline: Timeline | None = None  # --trace
    par: Parallel | None = None  # how the run is split over the ranks (plain data parallelism, or --tp/--pp)
    plan: Plan | None = None  # the memory plan (hpctrain plan) the run logs and checks its peak against


@dataclass(slots=True)
class Outcome:
    """What the loop leaves for the summary."""

    step: int
    started: float = field(default_factory=time.perf_counter)
    samples: int = 0
    epoch_loss: float = 0.0  # this rank's summed loss and samples in the current epoch
    epoch_n: float = 0.0
    last_val: dict[str, float] = field(default_factory=dict)
    paused: float = 0.0  # seconds of validation inside the loop (not training: the rates leave them out)
    val_step: int = -1  # the step whose model last_val measured
    stop_signal: int | None = None
