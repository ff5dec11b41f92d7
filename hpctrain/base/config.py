"""Configuration dataclasses, one per component.

The CLI and a TOML file (`--config run.toml`, same keys as the flags) both build these; every check lives in
`__post_init__` and names the field, the bad value and the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from .errors import ConfigError, one_of
from .sections import TRAIN_SECTIONS
from .window import parse_window

S = TypeVar("S")
HDF5_COMPRESSIONS = ("none", "lzf", "gzip")
NORMALIZATIONS = ("none", "standard", "minmax")
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


# fields renamed so that each name says one thing: {old spelling: new field}. The old flag and the old TOML key
# still work (with a note); a checkpoint's config written under the old name compares equal.
TRAIN_RENAMED = {"compress": "grad_compression"}
SHARD_RENAMED = {"compression": "hdf5_compression"}


# Each config's fields by section: the panels of `--help`, the `[tables]` of a TOML file and the reference's
# tables. Every field is in exactly one section (a test checks it). TrainConfig's are its section classes
# (base/sections.py), which its components receive.
SHARD_SECTIONS: dict[str, tuple[str, ...]] = {
    "output": ("source", "out", "shards", "val_fraction", "seed", "force", "fsync"),
    "storage": ("hdf5_compression", "chunk_rows", "normalize", "workers"),
    "images": ("image_size", "channels", "skip_bad", "label_column"),
    "text": ("tokenizer", "train_tokenizer", "seq_len", "text_field", "glob"),
}
SECTION_TITLES = {"run": "Run", "data": "Data", "model": "Model", "optimizer": "Optimizer and schedule",
                  "communication": "Communication", "zero": "Memory (ZeRO)",
                  "parallel": "Model parallelism (tensor, pipeline)", "precision": "Precision",
                  "checkpoint": "Checkpoint and resume", "watchdog": "Watchdog", "logging": "Logging",
                  "trace": "Timeline", "output": "Source and output", "storage": "Storage", "images": "Images", "text": "Text"}


def section_of(sections: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """{field: its section} for one of the *_SECTIONS tables."""
    return {name: section for section, names in sections.items() for name in names}


def section_panels(sections: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """{field: the title of its section}, for `--help`'s panels."""
    return {name: SECTION_TITLES[section] for name, section in section_of(sections).items()}


def flatten_sections(values: dict[str, Any], sections: dict[str, tuple[str, ...]]) -> dict[str, Any]:
    """A config file's keys with its `[section]` tables taken apart ({"optimizer": {"lr": 0.1}} -> {"lr": 0.1}).

    Flat keys at the top level still read. A key in the wrong section, or the same key twice, is refused."""
    out: dict[str, Any] = {}
    owner = section_of(sections)
    for key, value in values.items():
        name = key.replace("-", "_")
        if name in sections and isinstance(value, dict):
            for inner, item in value.items():
                field_name = TRAIN_RENAMED.get(inner.replace("-", "_"), inner.replace("-", "_"))
                if field_name in owner and owner[field_name] != name:
                    raise ConfigError(f"key {inner!r} is in section [{name}]; it belongs in [{owner[field_name]}]")
                if field_name in out:
                    raise ConfigError(f"key {inner!r} is given twice (in [{name}] and elsewhere): keep one")
                out[field_name] = item
        else:
            if name in out:
                raise ConfigError(f"key {key!r} is given twice (at the top and in a [section]): keep one")
            out[name] = value
    return out


def read_toml(text: str) -> dict[str, Any]:
    """Parse TOML text (tomllib; tomli before Python 3.11). Raises ValueError (TOMLDecodeError) on bad TOML."""
    try:
        import tomllib
    except ImportError:  # pragma: no cover - Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    return tomllib.loads(text)


def read_train_toml(text: str) -> dict[str, Any]:
    """A train config file's values as flat field names: `[sections]` taken apart, renamed keys upgraded.
    Raises ValueError on bad TOML, ConfigError on a key in the wrong section."""
    return TrainConfig.upgrade(flatten_sections(read_toml(text), TRAIN_SECTIONS))


def write_toml(values: dict[str, Any]) -> str:
    """TOML text for `values` (tomli-w: strings, numbers, lists and tables round-trip through read_toml)."""
    import tomli_w

    return tomli_w.dumps(values)


def _positive(name: str, value: float, example: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} {value!r} must be a positive number, e.g. {name} {example}")


def _non_negative(name: str, value: float, example: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{name} {value!r} must be zero or more, e.g. {name} {example}")


@dataclass(kw_only=True, slots=True)
class ShardConfig:
    """How `hpctrain shard` turns a SOURCE into per-rank HDF5 shards."""

    source: str
    """The SOURCE: digits, synthetic:N[:D[:C]], FILE.npz, FILE.h5/.hdf5, FILE.csv, imagefolder:DIR, mnist:DIR,
    cifar10:DIR or FILE.parquet; text for language models: text:PATH (a file or a directory of them),
    FILE.jsonl or parquet:PATH (a text column), tokenized and packed into rows of --seq-len + 1 tokens."""
    out: Path
    """The output directory (created; must not exist unless `force`)."""
    shards: int = 8
    """Shards per split; train on a world size that divides it."""
    val_fraction: float = 0.2
    """Fraction of the samples held out for validation (0 for none)."""
    seed: int = 0
    """Seed of the split and of the synthetic source."""
    hdf5_compression: str = "none"
    """HDF5 compression filter of every dataset: none, lzf or gzip (with the shuffle filter; was --compression)."""
    chunk_rows: int | None = None
    """Rows per HDF5 chunk (default: about 1 MiB per chunk of x)."""
    force: bool = False
    """Replace an existing OUT."""
    normalize: str = "none"
    """none, standard ((x - mean) / std) or minmax (to [0, 1]), per feature, from a streaming pass over the
    training samples; applied while writing (stored as float32) and recorded in the manifest."""
    image_size: str | None = None
    """Image sources: scale to cover and center-crop every image to H or HxW pixels."""
    channels: int | None = None
    """Image sources: 1 (grayscale) or 3 (RGB); default: what the images are."""
    skip_bad: bool = False
    """Image sources: skip unreadable images (counted in the manifest) instead of stopping."""
    workers: int = 0
    """Worker processes (0: one per CPU) that decode images, or, for an HDF5 source in a process started
    alone, each write their share of the shard files."""
    label_column: str | None = None
    """FILE.parquet: the label column (default: the last column)."""
    tokenizer: str = "bytes"
    """Text: bytes (ids 0..255 are the UTF-8 bytes, 256 ends a document) or a Hugging Face tokenizer.json
    (needs `pip install tokenizers`), stored beside the shards."""
    train_tokenizer: int = 0
    """Text: first train a byte-level BPE tokenizer with this many ids on the training documents (needs
    tokenizers), stored as OUT/tokenizer.json; 0: use --tokenizer."""
    seq_len: int = 1024
    """Text: tokens a model reads per row (each row stores seq_len + 1: the targets are shifted by one)."""
    text_field: str = "text"
    """Text: the JSONL field or Parquet column that holds each document's text."""
    glob: str | None = None
    """Text in a directory: which files to read (default **/*.txt, **/*.jsonl or **/*.parquet)."""
    fsync: bool = False
    """Make every file durable (fsync) before OUT is renamed into place; the command then waits for the disk.
    Without it, as with cp or h5repack, a crash of this node in the moments after `shard` returns can leave
    a file torn, which `hpctrain verify` (sha256) and the per-chunk fletcher32 checks detect."""

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        if not isinstance(self.shards, int) or self.shards < 1:
            raise ConfigError(f"--shards {self.shards!r} must be a whole number of at least 1, e.g. --shards 8")
        if not (isinstance(self.val_fraction, (int, float)) and 0 <= self.val_fraction < 1):
            raise ConfigError(f"--val-fraction {self.val_fraction!r} must be in [0, 1), e.g. --val-fraction 0.2")
        if self.hdf5_compression not in HDF5_COMPRESSIONS:
            raise one_of("--hdf5-compression", self.hdf5_compression, HDF5_COMPRESSIONS)
        if self.normalize not in NORMALIZATIONS:
            raise one_of("--normalize", self.normalize, NORMALIZATIONS)
        if self.channels is not None and self.channels not in (1, 3):
            raise ConfigError(f"--channels {self.channels!r} must be 1 (grayscale) or 3 (RGB)")
        if not isinstance(self.workers, int) or self.workers < 0:
            raise ConfigError(f"--workers {self.workers!r} must be 0 (one per CPU) or more")
        if self.chunk_rows is not None and self.chunk_rows < 1:
            raise ConfigError(f"--chunk-rows {self.chunk_rows!r} must be at least 1, or left out for automatic")
        if not isinstance(self.seq_len, int) or isinstance(self.seq_len, bool) or self.seq_len < 1:
            raise ConfigError(f"--seq-len {self.seq_len!r} must be a whole number of at least 1, e.g. --seq-len 1024")
        if not isinstance(self.train_tokenizer, int) or self.train_tokenizer < 0 or 0 < self.train_tokenizer < 258:
            raise ConfigError(f"--train-tokenizer {self.train_tokenizer!r} must be 0 (none) or a vocabulary of at "
                              "least 258 ids (256 bytes, end-of-text and one merge), e.g. --train-tokenizer 4096")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """One training run: data, model, optimization, checkpointing and gradient sync."""

    data: Path
    """Directory written by `hpctrain shard` (holds manifest.json)."""
    run_dir: Path
    """Where metrics, checkpoints, logs and the final model go."""
    model: str = "mlp"
    """mlp, mlp:H1,H2[:dropout=P], cnn, module.path:factory or path/to/file.py:factory."""
    epochs: int = 10
    """Passes over the training data."""
    max_steps: int = 0
    """Stop after this many optimizer steps in total (0: no limit)."""
    batch_size: int = 32
    """Samples per data-parallel rank per step; the global batch is batch_size x D, where D is the world size
    (divided by tp x pp when the model is split)."""
    lr: float = 0.05
    """Peak learning rate."""
    optimizer: str = "sgd"
    """sgd, adam or adamw."""
    momentum: float = 0.9
    """SGD momentum (ignored by adam/adamw)."""
    weight_decay: float = 0.0
    """Weight decay (decoupled for adamw)."""
    seed: int = 0
    """Seed of model initialization, shuffling and dropout."""
    schedule: str = "constant"
    """Learning-rate schedule: constant, cosine (to zero at the last step) or step (x0.1 at 1/2 and 3/4)."""
    warmup: int = 0
    """Raise the learning rate linearly over the first this many steps (0: none); transformers usually need it."""
    clip_grad: float = 0.0
    """Clip the global gradient norm to this value (0: no clipping)."""
    shuffle: bool = True
    """Shuffle each rank's samples every epoch (a pure function of seed, epoch, rank and world size)."""
    stage_to: str | None = None
    """Copy this rank's train and val shard files into this node-local directory first (DIR, or auto:
    $SLURM_TMPDIR, else $TMPDIR), check each copy's sha256 against the manifest, read the copies, and remove
    them at the end; the ranks of a node copy at the same time, each its own files."""
    keep_staged: bool = False
    """Keep the copies made by --stage-to after the run; a later run of the same --run-dir and --data with the
    same DIR re-uses the copies that still verify."""
    init_weights: Path | None = None
    """A state_dict (.pt) to start from instead of a fresh initialization."""
    checkpoint_every: int | str = "auto"
    """Write a checkpoint every this many steps; 0: only at the end and on a stop signal; auto: at the
    Young/Daly interval sqrt(2 x measured checkpoint cost x mtbf_hours)."""
    mtbf_hours: float = 24.0
    """Mean time between failures assumed by --checkpoint-every auto."""
    keep: int = 2
    """Complete checkpoints to keep (at least 2)."""
    resume: str = "auto"
    """auto (latest complete checkpoint in run_dir, else fresh), never, or a checkpoint directory."""
    bucket_mb: float = 25.0
    """Size of one gradient bucket in MiB (25 measured best on the reference MLP; see docs/performance.md)."""
    grad_compression: str = "none"
    """Wire format of the gradient sum (was --compress): none, fp16, bf16, powersgd[:RANK] (low rank, default 4)
    or topk[:FRACTION] (the largest entries, default 0.01); the last two with error feedback."""
    overlap: bool | None = None
    """Start each bucket's allreduce during backward on a communication thread; None (auto): only when the
    rank computes on a GPU (on CPUs the thread competes with torch's threads: slower at 1 and 8 threads a rank)."""
    accumulate: int = 1
    """Micro-batches of batch_size per optimizer step; gradients are synced only on the last."""
    hierarchical: bool = False
    """Reduce within each node first, allreduce between node leaders, broadcast within the node."""
    deterministic: bool = False
    """Sum gradients in rank order, the same bits in every run whatever MPI's algorithm (costs bandwidth)."""
    precision: str = "fp32"
    """Compute precision of forward and backward: fp32, bf16 or fp16 (autocast on CPU and CUDA; the weights and
    the optimizer stay fp32; fp16 adds a loss scale whose skip decision all ranks agree on)."""
    zero: int = 0
    """Shard training state across ranks (ZeRO): 0 none; 1 optimizer state (each rank steps only the slices
    it owns, then parameters are allgathered); 2 also gradients (reduce-scattered, full buckets freed once
    sent); 3 also parameters (each module's gathered only for its forward and backward). sgd, adam and
    adamw all work; checkpoints resume on any world size and stage (hpctrain plan: the bytes per rank)."""
    zero_reduce: str = "auto"
    """How --zero 1-3 sums each bucket into the ranks' slices: reduce-scatter-block, reduce-scatter,
    allreduce (each rank keeps its slice), ring (W-1 Sendrecv exchanges of one slice each, summed by torch),
    or auto (time each at start-up, keep the fastest)."""
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
    audit_samples: bool = False
    """Write RUN/samples/rank-NNNN.txt with every sample id each rank trained on."""
    collective_timeout: float = 300.0
    """Abort the job when a collective waits longer than this many seconds (0: never), saying which ranks
    it waits for."""
    checkpoint_timeout: float = 1800.0
    """Abort the job when a checkpoint write, with the wait for every rank's part, takes longer than this
    many seconds (0: never); a slow parallel filesystem needs more than a collective does."""
    tensorboard: bool = False
    """Also write TensorBoard event files to RUN/tensorboard (needs the tensorboard package)."""
    log_every: int = 10
    """Log metrics every this many steps (and at the end of every epoch)."""
    json: bool = False
    """Print the summary as one JSON object."""
    progress: bool = True
    """Show a progress bar on rank 0 when the output is a terminal."""
    trace: str | None = None
    """Record a timeline of every rank over a window of steps: A:B (steps A to B), last:N (the run's last N
    steps) or every:N (one step in N, the last 100 kept); at most 1,000 steps. Each rank writes
    RUN/trace/rank-NNNN.json; the end of the run merges them into RUN/trace.json (open it in ui.perfetto.dev)
    and names a straggler in summary.json. Off by default; the flight recorder of collectives is always on."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Keys from a config file that no flag has (kept in the resolved config)."""

    def __post_init__(self) -> None:
        self.data = Path(self.data)
        self.run_dir = Path(self.run_dir)
        if self.init_weights is not None:
            self.init_weights = Path(self.init_weights)
        for name, value in (("--epochs", self.epochs), ("--batch-size", self.batch_size), ("--log-every", self.log_every),
                            ("--accumulate", self.accumulate)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} {value!r} must be a whole number of at least 1")
        if isinstance(self.checkpoint_every, str) and self.checkpoint_every != "auto":
            try:
                self.checkpoint_every = int(self.checkpoint_every)
            except ValueError:
                raise ConfigError(f"--checkpoint-every {self.checkpoint_every!r} must be auto or a whole number of steps (0: none)") from None
        _positive("--mtbf-hours", self.mtbf_hours, "24")
        _non_negative("--collective-timeout", self.collective_timeout, "300")
        _non_negative("--checkpoint-timeout", self.checkpoint_timeout, "1800")
        checked = [("--max-steps", self.max_steps), ("--warmup", self.warmup)]
        if self.checkpoint_every != "auto":
            checked.append(("--checkpoint-every", self.checkpoint_every))
        for name, value in checked:
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} {value!r} must be a whole number, 0 or more")
        _positive("--lr", self.lr, "0.05")
        _positive("--bucket-mb", self.bucket_mb, "4")
        _non_negative("--momentum", self.momentum, "0.9")
        _non_negative("--weight-decay", self.weight_decay, "0.0001")
        _non_negative("--clip-grad", self.clip_grad, "1.0")
        if self.optimizer not in OPTIMIZERS:
            raise one_of("optimizer", self.optimizer, OPTIMIZERS)
        if self.schedule not in SCHEDULES:
            raise one_of("schedule", self.schedule, SCHEDULES)
        kind, _ = parse_grad_compression(self.grad_compression)
        if self.zero not in ZERO_STAGES or isinstance(self.zero, bool):
            raise ConfigError(f"--zero {self.zero!r} must be 0 (no sharding), 1 (optimizer state), 2 (also gradients) "
                              "or 3 (also parameters)")
        if self.precision not in PRECISIONS:
            raise one_of("--precision", self.precision, PRECISIONS)
        if self.zero_reduce not in ZERO_REDUCERS:
            raise one_of("--zero-reduce", self.zero_reduce, ZERO_REDUCERS)
        if self.zero and kind in ("powersgd", "topk"):
            raise ConfigError(f"--grad-compression {self.grad_compression} does not combine with --zero {self.zero} "
                              "(ZeRO sums each rank's slice; PowerSGD and top-k need whole gradients): drop one of them")
        if self.zero and self.hierarchical:
            raise ConfigError(f"--zero {self.zero} does not combine with --hierarchical (ZeRO reduce-scatters over "
                              "all ranks at once): drop one of them")
        if not isinstance(self.keep, int) or self.keep < 2:
            raise ConfigError(f"--keep {self.keep!r} must be at least 2, so a complete checkpoint always survives")
        if self.stage_to is not None and (not isinstance(self.stage_to, str) or not self.stage_to.strip()):
            raise ConfigError(f"--stage-to {self.stage_to!r} must name a node-local directory (e.g. /tmp or /dev/shm) "
                              "or be auto ($SLURM_TMPDIR, else $TMPDIR)")
        if self.keep_staged and self.stage_to is None:
            raise ConfigError("--keep-staged keeps the copies that --stage-to makes: add --stage-to DIR|auto, "
                              "or drop --keep-staged")
        for name, value in (("--tp", self.tp), ("--pp", self.pp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} {value!r} must be a whole number of at least 1 (1: not split)")
        if not isinstance(self.micro_batches, int) or isinstance(self.micro_batches, bool) or self.micro_batches < 0:
            raise ConfigError(f"--micro-batches {self.micro_batches!r} must be 0 (auto) or a whole number of at least 1")
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise one_of("--pipeline-schedule", self.pipeline_schedule, PIPELINE_SCHEDULES)
        if self.tp * self.pp > 1 and self.zero == 3:
            raise ConfigError(f"--zero 3 does not combine with --tp {self.tp} --pp {self.pp} (stage 3 gathers whole "
                              "modules, a split run holds shares of them): use --zero 2, which shards the gradients "
                              "and optimizer state over the data-parallel ranks")
        if self.tp * self.pp > 1 and self.stage_to is not None:
            raise ConfigError("--stage-to does not combine with --tp/--pp (the ranks of one replica read the same "
                              "files and would copy them to the same place): drop one of them")
        if self.micro_batches > self.batch_size * self.accumulate:
            raise ConfigError(f"--micro-batches {self.micro_batches} is more than the {self.batch_size * self.accumulate} "
                              "rows of a step (--batch-size x --accumulate): use at most that many")
        if not self.resume:
            raise ConfigError("--resume '' is empty: use auto, never, or a checkpoint directory")
        if self.trace is not None:
            parse_window(self.trace)

    @staticmethod
    def upgrade(values: dict[str, Any]) -> dict[str, Any]:
        """`values` (a config file's, or an old checkpoint's) with renamed keys under their new names."""
        return {TRAIN_RENAMED.get(k, k): v for k, v in values.items()}

    def section(self, cls: type[S]) -> S:
        """This config's section `cls` (one of base/sections.py's), the value a component receives."""
        return cls(**{f.name: getattr(self, f.name) for f in fields(cls)})

    def to_sections(self) -> dict[str, Any]:
        """`to_dict()` grouped into the `[sections]` of TRAIN_SECTIONS (keys no field has stay at the top)."""
        flat = self.to_dict()
        out: dict[str, Any] = {k: v for k, v in flat.items() if k not in section_of(TRAIN_SECTIONS)}
        for section, names in TRAIN_SECTIONS.items():
            table = {name: flat[name] for name in names if name in flat}
            if table:
                out[section] = table
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain values (paths as strings, None dropped) for config.toml, checkpoints and summaries."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "extra":
                continue
            if isinstance(value, Path):
                value = str(value)
            if value is not None:
                out[f.name] = value
        out.update(self.extra)
        return out
