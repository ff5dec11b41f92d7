"""Configuration dataclasses, one per component.

The CLI and a TOML file (`--config run.toml`, same keys as the flags) both build these; every check lives in
`__post_init__` and names the field, the bad value and the fix. `TrainConfig` is made of the sections of
base/sections.py and checks here only what spans two of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError, one_of
from .sections import (OPTIMIZERS, PIPELINE_SCHEDULES, PRECISIONS, SCHEDULES, TRAIN_FLAT, TRAIN_SECTIONS,  # noqa: F401
                       ZERO_REDUCERS, ZERO_STAGES, CheckpointConfig, CommConfig, DataConfig, LoggingConfig,
                       TRAIN_SECTION_CLASSES, ModelConfig, OptimizerConfig, ParallelConfig, PrecisionConfig,
                       RunConfig, TraceConfig, WatchdogConfig, ZeroConfig, parse_grad_compression)

HDF5_COMPRESSIONS = ("none", "lzf", "gzip")
NORMALIZATIONS = ("none", "standard", "minmax")
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


def zero_refusal(stage: int, grad_compression: str, hierarchical: bool) -> ConfigError | None:
    """Why ZeRO `stage` cannot run with this gradient sum (None when it can): the one statement of these
    refusals, for the config and for a gradient sync built without one."""
    if stage and parse_grad_compression(grad_compression)[0] in ("powersgd", "topk"):
        return ConfigError(f"--grad-compression {grad_compression} does not combine with --zero {stage} (ZeRO sums "
                           "each rank's slice; PowerSGD and top-k need whole gradients): drop one of them")
    if stage and hierarchical:
        return ConfigError(f"--zero {stage} does not combine with --hierarchical (ZeRO reduce-scatters over "
                           "all ranks at once): drop one of them")
    return None


def sections_of(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Flat names (`{"lr": 0.1, "zero": 1}`) as each section's keyword arguments (`{"optimizer": {"lr": 0.1},
    "zero": {"stage": 1}, "run": {}, ...}`, every section present). An unknown name is refused, listing the
    valid ones."""
    unknown = sorted(k for k in values if k not in TRAIN_FLAT)
    if unknown:
        raise ConfigError(f"unknown training option(s) {', '.join(unknown)}: choose from {', '.join(TRAIN_FLAT)}")
    parts: dict[str, dict[str, Any]] = {section: {} for section in TRAIN_SECTION_CLASSES}
    for name, value in values.items():
        section, key = TRAIN_FLAT[name]
        parts[section][key] = value
    return parts


def check_across(zero: ZeroConfig, communication: CommConfig, parallel: ParallelConfig, *, rows: int,
                 staged: bool) -> None:
    """The checks that span sections (each section checks itself): ZeRO against the gradient sum and the model
    split, the split against staging, the pipeline's micro-batches against the `rows` of a step."""
    refusal = zero_refusal(zero.stage, communication.grad_compression, communication.hierarchical)
    if refusal is not None:
        raise refusal
    tp, pp = parallel.tp, parallel.pp
    if tp * pp > 1 and zero.stage == 3:
        raise ConfigError(f"--zero 3 does not combine with --tp {tp} --pp {pp} (stage 3 gathers whole "
                          "modules, a split run holds shares of them): use --zero 2, which shards the gradients "
                          "and optimizer state over the data-parallel ranks")
    if tp * pp > 1 and staged:
        raise ConfigError("--stage-to does not combine with --tp/--pp (the ranks of one replica read the same "
                          "files and would copy them to the same place): drop one of them")
    if parallel.micro_batches > rows:
        raise ConfigError(f"--micro-batches {parallel.micro_batches} is more than the {rows} "
                          "rows of a step (--batch-size x --accumulate): use at most that many")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """One training run: its sections (`cfg.optimizer.lr`, `cfg.zero.stage`), each checked by itself, and the
    checks that span two of them. Build one from flat names (flags, TOML keys, a checkpoint's recorded config)
    with `TrainConfig.flat(lr=0.1, ...)` or `from_flat(values)`."""

    run: RunConfig
    data: DataConfig
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    communication: CommConfig = field(default_factory=CommConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    extra: dict[str, Any] = field(default_factory=dict)
    """Keys from a config file that no flag has (kept in the resolved config)."""

    def __post_init__(self) -> None:
        check_across(self.zero, self.communication, self.parallel, rows=self.data.batch_size * self.optimizer.accumulate,
                     staged=self.data.stage_to is not None)

    @classmethod
    def from_flat(cls, values: dict[str, Any]) -> TrainConfig:
        """The config of flat names (`{"lr": 0.1, "zero": 1}`: the flags', a TOML file's, a checkpoint's), renamed
        keys upgraded; `extra` holds the keys no flag has. An unknown name is refused, listing the valid ones."""
        given = cls.upgrade(values)
        extra = dict(given.pop("extra", None) or {})
        parts = {section: kw for section, kw in sections_of(given).items() if kw}
        return cls(**{section: TRAIN_SECTION_CLASSES[section](**kw) for section, kw in parts.items()}, extra=extra)

    @classmethod
    def flat(cls, **values: Any) -> TrainConfig:
        """`from_flat(values)`: `TrainConfig.flat(data="d", run_dir="r", lr=0.1)`."""
        return cls.from_flat(values)

    @staticmethod
    def upgrade(values: dict[str, Any]) -> dict[str, Any]:
        """`values` (a config file's, or an old checkpoint's) with renamed keys under their new names."""
        return {TRAIN_RENAMED.get(k, k): v for k, v in values.items()}

    def to_sections(self) -> dict[str, Any]:
        """`to_dict()` grouped into the `[sections]` of TRAIN_SECTIONS (keys no field has stay at the top)."""
        flat = self.to_dict()
        out: dict[str, Any] = {k: v for k, v in flat.items() if k not in TRAIN_FLAT}
        for section, names in TRAIN_SECTIONS.items():
            table = {name: flat[name] for name in names if name in flat}
            if table:
                out[section] = table
        return out

    def to_dict(self) -> dict[str, Any]:
        """Flat names and plain values (paths as strings, None dropped) for config.toml, checkpoints and
        summaries: the same keys as the flags, whatever the sections call their fields."""
        out: dict[str, Any] = {}
        for name, (section, key) in TRAIN_FLAT.items():
            value = getattr(getattr(self, section), key)
            if isinstance(value, Path):
                value = str(value)
            if value is not None:
                out[name] = value
        out.update(self.extra)
        return out
