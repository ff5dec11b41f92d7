"""The sections of a training config, one dataclass per component: each field's default, help and check.

`TrainConfig` (base/config.py) is made of these (`cfg.optimizer.lr`, `cfg.zero.stage`) and adds only the checks
that span two sections; the trainer hands each component its section (`cfg.optimizer` to the optimizer factory,
`cfg.communication` and `cfg.zero` to the gradient sync, `cfg.logging` to the metrics sink). The flags, the TOML
keys and the config a checkpoint records are flat names (`--lr`, `lr = 0.1`, `"zero": 1`): `TRAIN_FLAT` maps
each to its section and field, so a field whose flat name would repeat its section (`zero.zero`) has a name of
its own (`zero.stage`) while its flag stays `--zero`. The same sections are the panels of `hpctrain train
--help`, the `[tables]` of a config file and the tables of the generated reference.
"""

from __future__ import annotations

import math
from dataclasses import Field, dataclass, fields
from pathlib import Path

from .errors import ConfigError, one_of
from .window import parse_window

OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "cosine", "step")
PRECISIONS = ("fp32", "bf16", "fp16")
ZERO_STAGES = (0, 1, 2, 3)
ZERO_REDUCERS = ("auto", "reduce-scatter-block", "reduce-scatter", "allreduce", "ring")
PIPELINE_SCHEDULES = ("1f1b", "gpipe")


def parse_grad_compression(spec: str) -> tuple[str, float]:
    """(kind, parameter) of a --grad-compression value: none, fp16, bf16, powersgd[:RANK], topk[:FRACTION]."""
    kind, _, arg = str(spec).partition(":")
    if kind in ("none", "fp16", "bf16") and not arg:
        return kind, 0.0
    try:
        if kind == "powersgd":
            rank = int(arg) if arg else 4
            if rank >= 1:
                return kind, float(rank)
        elif kind == "topk":
            fraction = float(arg) if arg else 0.01
            if 0 < fraction <= 1:
                return kind, fraction
    except ValueError:
        pass
    raise ConfigError(f"--grad-compression {spec!r}: choose none, fp16, bf16, powersgd[:RANK] (a whole number, e.g. "
                      "powersgd:4) or topk[:FRACTION] (in (0, 1], e.g. topk:0.01)")


def _positive(name: str, value: float, example: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} {value!r} must be a positive number, e.g. {name} {example}")


def _non_negative(name: str, value: float, example: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{name} {value!r} must be zero or more, e.g. {name} {example}")


def _whole(name: str, value: object, least: int, what: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ConfigError(f"{name} {value!r} must be {what}")


def check_batch_size(value: object) -> None:
    """DataConfig's check of --batch-size, also for the commands that take a batch size without data (`plan`,
    `bench train`)."""
    _whole("--batch-size", value, 1, "a whole number of at least 1")


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """Where the run writes, how long it lasts and its seed."""

    run_dir: Path
    """Where metrics, checkpoints, logs and the final model go."""
    epochs: int = 10
    """Passes over the training data."""
    max_steps: int = 0
    """Stop after this many optimizer steps in total (0: no limit)."""
    seed: int = 0
    """Seed of model initialization, shuffling and dropout."""

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        _whole("--epochs", self.epochs, 1, "a whole number of at least 1")
        _whole("--max-steps", self.max_steps, 0, "a whole number, 0 or more")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """The shards a run reads, in batches of what size, and where they are staged."""

    path: Path
    """Directory written by `hpctrain shard` (holds manifest.json)."""
    batch_size: int = 32
    """Samples per data-parallel rank per step; the global batch is batch_size x D, where D is the world size
    (divided by tp x pp when the model is split)."""
    shuffle: bool = True
    """Shuffle each rank's samples every epoch (a pure function of seed, epoch, rank and world size)."""
    stage_to: str | None = None
    """Copy this rank's train and val shard files into this node-local directory first (DIR, or auto:
    $SLURM_TMPDIR, else $TMPDIR), check each copy's sha256 against the manifest, read the copies, and remove
    them at the end; the ranks of a node copy at the same time, each its own files."""
    keep_staged: bool = False
    """Keep the copies made by --stage-to after the run; a later run of the same --run-dir and --data with the
    same DIR re-uses the copies that still verify."""
    audit_samples: bool = False
    """Write RUN/samples/rank-NNNN.txt with every sample id each rank trained on."""

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        check_batch_size(self.batch_size)
        if self.stage_to is not None and (not isinstance(self.stage_to, str) or not self.stage_to.strip()):
            raise ConfigError(f"--stage-to {self.stage_to!r} must name a node-local directory (e.g. /tmp or /dev/shm) "
                              "or be auto ($SLURM_TMPDIR, else $TMPDIR)")
        if self.keep_staged and self.stage_to is None:
            raise ConfigError("--keep-staged keeps the copies that --stage-to makes: add --stage-to DIR|auto, "
                              "or drop --keep-staged")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Which model, and the weights it starts from."""

    spec: str = "mlp"
    """mlp, mlp:H1,H2[:dropout=P], cnn, gpt[:layers=L,dim=D,heads=H] (a language model, on token shards),
    module.path:factory or path/to/file.py:factory."""
    init_weights: Path | None = None
    """A state_dict (.pt) to start from instead of a fresh initialization."""

    def __post_init__(self) -> None:
        if self.init_weights is not None:
            self.init_weights = Path(self.init_weights)


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """The optimizer, its learning-rate schedule and how many micro-batches make one of its steps."""

    name: str = "sgd"
    """sgd, adam or adamw."""
    lr: float = 0.05
    """Peak learning rate."""
    momentum: float = 0.9
    """SGD momentum (ignored by adam/adamw)."""
    weight_decay: float = 0.0
    """Weight decay (decoupled for adamw)."""
    schedule: str = "constant"
    """Learning-rate schedule: constant, cosine (to zero at the last step) or step (x0.1 at 1/2 and 3/4)."""
    warmup: int = 0
    """Raise the learning rate linearly over the first this many steps (0: none); transformers usually need it."""
    clip_grad: float = 0.0
    """Clip the global gradient norm to this value (0: no clipping)."""
    accumulate: int = 1
    """Micro-batches of batch_size per optimizer step; gradients are synced only on the last."""

    def __post_init__(self) -> None:
        _whole("--accumulate", self.accumulate, 1, "a whole number of at least 1")
        _whole("--warmup", self.warmup, 0, "a whole number, 0 or more")
        _positive("--lr", self.lr, "0.05")
        _non_negative("--momentum", self.momentum, "0.9")
        _non_negative("--weight-decay", self.weight_decay, "0.0001")
        _non_negative("--clip-grad", self.clip_grad, "1.0")
        if self.name not in OPTIMIZERS:
            raise one_of("optimizer", self.name, OPTIMIZERS)
        if self.schedule not in SCHEDULES:
            raise one_of("schedule", self.schedule, SCHEDULES)


@dataclass(kw_only=True, slots=True)
class CommConfig:
    """How the ranks' gradients are summed: buckets, wire format, overlap and the order of the sum."""

    bucket_mb: float = 25.0
    """Size of one gradient bucket in MiB (25 measured best on the reference MLP; see docs/performance.md)."""
    grad_compression: str = "none"
    """Wire format of the gradient sum (was --compress): none, fp16, bf16, powersgd[:RANK] (low rank, default 4)
    or topk[:FRACTION] (the largest entries, default 0.01); the last two with error feedback."""
    overlap: bool | None = None
    """Start each bucket's allreduce during backward on a communication thread; None (auto): only when the
    rank computes on a GPU (on CPUs the thread competes with torch's threads: slower at 1 and 8 threads a rank)."""
    hierarchical: bool = False
    """Reduce within each node first, allreduce between node leaders, broadcast within the node."""
    deterministic: bool = False
    """Sum gradients in rank order, the same bits in every run whatever MPI's algorithm (costs bandwidth)."""

    def __post_init__(self) -> None:
        _positive("--bucket-mb", self.bucket_mb, "4")
        parse_grad_compression(self.grad_compression)


@dataclass(kw_only=True, slots=True)
class ZeroConfig:
    """Which training state is sharded across the ranks (ZeRO), and how the shards are summed."""

    stage: int = 0
    """Shard training state across ranks (ZeRO): 0 none; 1 optimizer state (each rank steps only the slices
    it owns, then parameters are allgathered); 2 also gradients (reduce-scattered, full buckets freed once
    sent); 3 also parameters (each module's gathered only for its forward and backward). sgd, adam and
    adamw all work; checkpoints resume on any world size and stage (hpctrain plan: the bytes per rank)."""
    reduce: str = "auto"
    """How --zero 1-3 sums each bucket into the ranks' slices: reduce-scatter-block, reduce-scatter,
    allreduce (each rank keeps its slice), ring (W-1 Sendrecv exchanges of one slice each, summed by torch),
    or auto (time each at start-up, keep the fastest)."""

    def __post_init__(self) -> None:
        if self.stage not in ZERO_STAGES or isinstance(self.stage, bool):
            raise ConfigError(f"--zero {self.stage!r} must be 0 (no sharding), 1 (optimizer state), 2 (also gradients) "
                              "or 3 (also parameters)")
        if self.reduce not in ZERO_REDUCERS:
            raise one_of("--zero-reduce", self.reduce, ZERO_REDUCERS)


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """How one model replica is split over ranks: tensor-parallel ranks, pipeline stages and their schedule."""

    tp: int = 1
    """Tensor-parallel ranks per model replica (the built-in gpt only): attention heads, MLP units and the
    vocabulary split over them. The world is D x tp x pp ranks; D data-parallel replicas."""
    pp: int = 1
    """Pipeline stages per model replica: the model's blocks (the gpt's layers, an nn.Sequential's children)
    cut into pp consecutive stages."""
    micro_batches: int = 0
    """Micro-batches each step's batch is split into for the pipeline (0: 1 without one, 4 x pp with one); the
    bubble is (pp - 1) / (micro_batches + pp - 1)."""
    pipeline_schedule: str = "1f1b"
    """1f1b (one forward, one backward: at most pp micro-batches' activations alive) or gpipe (every forward,
    then every backward)."""

    def __post_init__(self) -> None:
        for name, value in (("--tp", self.tp), ("--pp", self.pp)):
            _whole(name, value, 1, "a whole number of at least 1 (1: not split)")
        _whole("--micro-batches", self.micro_batches, 0, "0 (auto) or a whole number of at least 1")
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise one_of("--pipeline-schedule", self.pipeline_schedule, PIPELINE_SCHEDULES)


@dataclass(kw_only=True, slots=True)
class PrecisionConfig:
    """The precision forward and backward compute in."""

    compute: str = "fp32"
    """Compute precision of forward and backward: fp32, bf16 or fp16 (autocast on CPU and CUDA; the weights and
    the optimizer stay fp32; fp16 adds a loss scale whose skip decision all ranks agree on)."""

    def __post_init__(self) -> None:
        if self.compute not in PRECISIONS:
            raise one_of("--precision", self.compute, PRECISIONS)


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """When checkpoints are written, how many are kept, and which one a run resumes from."""

    checkpoint_every: int | str = "auto"
    """Write a checkpoint every this many steps; 0: only at the end and on a stop signal; auto: at the
    Young/Daly interval sqrt(2 x measured checkpoint cost x mtbf_hours)."""
    mtbf_hours: float = 24.0
    """Mean time between failures assumed by --checkpoint-every auto."""
    keep: int = 2
    """Complete checkpoints to keep (at least 2)."""
    resume: str = "auto"
    """auto (latest complete checkpoint in run_dir, else fresh), never, or a checkpoint directory."""

    def __post_init__(self) -> None:
        if isinstance(self.checkpoint_every, str) and self.checkpoint_every != "auto":
            try:
                self.checkpoint_every = int(self.checkpoint_every)
            except ValueError:
                raise ConfigError(f"--checkpoint-every {self.checkpoint_every!r} must be auto or a whole number of steps (0: none)") from None
        _positive("--mtbf-hours", self.mtbf_hours, "24")
        if self.checkpoint_every != "auto":
            _whole("--checkpoint-every", self.checkpoint_every, 0, "a whole number, 0 or more")
        if not isinstance(self.keep, int) or self.keep < 2:
            raise ConfigError(f"--keep {self.keep!r} must be at least 2, so a complete checkpoint always survives")
        if not self.resume:
            raise ConfigError("--resume '' is empty: use auto, never, or a checkpoint directory")


@dataclass(kw_only=True, slots=True)
class WatchdogConfig:
    """How long a rank waits for the others before the job is ended, saying for whom."""

    collective_timeout: float = 300.0
    """Abort the job when a collective waits longer than this many seconds (0: never), saying which ranks
    it waits for."""
    checkpoint_timeout: float = 1800.0
    """Abort the job when a checkpoint write, with the wait for every rank's part, takes longer than this
    many seconds (0: never); a slow parallel filesystem needs more than a collective does."""

    def __post_init__(self) -> None:
        _non_negative("--collective-timeout", self.collective_timeout, "300")
        _non_negative("--checkpoint-timeout", self.checkpoint_timeout, "1800")


@dataclass(kw_only=True, slots=True)
class LoggingConfig:
    """What a run prints and writes about its progress."""

    log_every: int = 10
    """Log metrics every this many steps (and at the end of every epoch)."""
    json: bool = False
    """Print the summary as one JSON object."""
    tensorboard: bool = False
    """Also write TensorBoard event files to RUN/tensorboard (needs the tensorboard package)."""
    progress: bool = True
    """Show a progress bar on rank 0 when the output is a terminal."""

    def __post_init__(self) -> None:
        _whole("--log-every", self.log_every, 1, "a whole number of at least 1")


@dataclass(kw_only=True, slots=True)
class TraceConfig:
    """The window of steps whose timeline every rank records."""

    window: str | None = None
    """Record a timeline of every rank over a window of steps: A:B (steps A to B), last:N (the run's last N
    steps) or every:N (one step in N, the last 100 kept); at most 1,000 steps. Each rank writes
    RUN/trace/rank-NNNN.json; the end of the run merges them into RUN/trace.json (open it in ui.perfetto.dev)
    and names a straggler in summary.json. Off by default; the flight recorder of collectives is always on."""

    def __post_init__(self) -> None:
        if self.window is not None:
            parse_window(self.window)


# the section's name in a TOML file, in --help and on TrainConfig (`cfg.zero`), and its class, in the order shown
TRAIN_SECTION_CLASSES: dict[str, type] = {
    "run": RunConfig, "data": DataConfig, "model": ModelConfig, "optimizer": OptimizerConfig,
    "communication": CommConfig, "zero": ZeroConfig, "parallel": ParallelConfig, "precision": PrecisionConfig,
    "checkpoint": CheckpointConfig, "watchdog": WatchdogConfig, "logging": LoggingConfig, "trace": TraceConfig,
}
# {flat name: (section, field)}: every field of every section under the name its flag, its TOML key and the
# recorded config use, in the order `--help`, the sweep keys and `to_dict()` list them. A field whose name would
# repeat its section has one of its own (`zero.stage`), while its flat name stays (`--zero`). A test checks that
# this table names every section field once.
TRAIN_FLAT: dict[str, tuple[str, str]] = {
    "data": ("data", "path"), "run_dir": ("run", "run_dir"), "model": ("model", "spec"), "epochs": ("run", "epochs"),
    "max_steps": ("run", "max_steps"), "batch_size": ("data", "batch_size"), "lr": ("optimizer", "lr"),
    "optimizer": ("optimizer", "name"), "momentum": ("optimizer", "momentum"),
    "weight_decay": ("optimizer", "weight_decay"), "seed": ("run", "seed"), "schedule": ("optimizer", "schedule"),
    "warmup": ("optimizer", "warmup"), "clip_grad": ("optimizer", "clip_grad"), "shuffle": ("data", "shuffle"),
    "stage_to": ("data", "stage_to"), "keep_staged": ("data", "keep_staged"), "init_weights": ("model", "init_weights"),
    "checkpoint_every": ("checkpoint", "checkpoint_every"), "mtbf_hours": ("checkpoint", "mtbf_hours"),
    "keep": ("checkpoint", "keep"), "resume": ("checkpoint", "resume"), "bucket_mb": ("communication", "bucket_mb"),
    "grad_compression": ("communication", "grad_compression"), "overlap": ("communication", "overlap"),
    "accumulate": ("optimizer", "accumulate"), "hierarchical": ("communication", "hierarchical"),
    "deterministic": ("communication", "deterministic"), "precision": ("precision", "compute"),
    "zero": ("zero", "stage"), "zero_reduce": ("zero", "reduce"), "tp": ("parallel", "tp"), "pp": ("parallel", "pp"),
    "micro_batches": ("parallel", "micro_batches"), "pipeline_schedule": ("parallel", "pipeline_schedule"),
    "audit_samples": ("data", "audit_samples"), "collective_timeout": ("watchdog", "collective_timeout"),
    "checkpoint_timeout": ("watchdog", "checkpoint_timeout"), "tensorboard": ("logging", "tensorboard"),
    "log_every": ("logging", "log_every"), "json": ("logging", "json"), "progress": ("logging", "progress"),
    "trace": ("trace", "window"),
}
_FLAT_OF = {where: flat for flat, where in TRAIN_FLAT.items()}
# {section: its flat names, in the section's field order}: the keys of each `[table]` of a config file
TRAIN_SECTIONS: dict[str, tuple[str, ...]] = {
    section: tuple(_FLAT_OF[(section, f.name)] for f in fields(cls)) for section, cls in TRAIN_SECTION_CLASSES.items()}


def train_options(names: tuple[str, ...] | None = None) -> dict[str, tuple[type, Field]]:
    """{flat name: (section class, its field)} of the flat `names` (all, in section order, when None): what the
    commands that take training options (`train`, `bench train`, `plan`) generate their options from."""
    by_class = {(section, f.name): (cls, f) for section, cls in TRAIN_SECTION_CLASSES.items() for f in fields(cls)}
    return {flat: by_class[TRAIN_FLAT[flat]] for flat in (TRAIN_FLAT if names is None else names)}
