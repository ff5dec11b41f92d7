"""The sections of a training config: what each component of a run receives instead of the whole config.

`TrainConfig` (base/config.py) stays one flat set of fields, because the flags, the TOML keys and the
checkpoints' recorded configs are flat names; its defaults, checks and help text live there once. Each
section below names the fields of one concern, with their types, and `TrainConfig.section(Cls)` hands a
component its section as a frozen value: the optimizer factory gets `OptimizerConfig`, the gradient sync
`CommConfig` and `ZeroConfig`, the metrics sink `LoggingConfig`, and so on. The same sections are the panels
of `hpctrain train --help`, the `[tables]` of a config file and the tables of the generated reference. A
test checks that every field of TrainConfig is in exactly one section, with the same type.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path


@dataclass(frozen=True, slots=True)
class RunConfig:
    run_dir: Path
    epochs: int
    max_steps: int
    seed: int


@dataclass(frozen=True, slots=True)
class DataConfig:
    data: Path
    batch_size: int
    shuffle: bool
    stage_to: str | None
    keep_staged: bool
    audit_samples: bool


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model: str
    init_weights: Path | None


@dataclass(frozen=True, slots=True)
class OptimizerConfig:
    optimizer: str
    lr: float
    momentum: float
    weight_decay: float
    schedule: str
    warmup: int
    clip_grad: float
    accumulate: int


@dataclass(frozen=True, slots=True)
class CommConfig:
    bucket_mb: float
    grad_compression: str
    overlap: bool | None
    hierarchical: bool
    deterministic: bool


@dataclass(frozen=True, slots=True)
class ZeroConfig:
    zero: int
    zero_reduce: str


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    tp: int
    pp: int
    micro_batches: int
    pipeline_schedule: str


@dataclass(frozen=True, slots=True)
class PrecisionConfig:
    precision: str


@dataclass(frozen=True, slots=True)
class CheckpointConfig:
    checkpoint_every: int | str
    mtbf_hours: float
    keep: int
    resume: str


@dataclass(frozen=True, slots=True)
class WatchdogConfig:
    collective_timeout: float
    checkpoint_timeout: float


@dataclass(frozen=True, slots=True)
class LoggingConfig:
    log_every: int
    json: bool
    tensorboard: bool
    progress: bool


@dataclass(frozen=True, slots=True)
class TraceConfig:
    trace: str | None


# the section's name in a TOML file and in --help, and its class, in the order they are shown
TRAIN_SECTION_CLASSES: dict[str, type] = {
    "run": RunConfig, "data": DataConfig, "model": ModelConfig, "optimizer": OptimizerConfig,
    "communication": CommConfig, "zero": ZeroConfig, "parallel": ParallelConfig, "precision": PrecisionConfig,
    "checkpoint": CheckpointConfig, "watchdog": WatchdogConfig, "logging": LoggingConfig, "trace": TraceConfig,
}
TRAIN_SECTIONS: dict[str, tuple[str, ...]] = {name: tuple(f.name for f in fields(cls))
                                              for name, cls in TRAIN_SECTION_CLASSES.items()}
