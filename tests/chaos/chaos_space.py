"""What a chaos case may be: every option of `hpctrain train`, and the pure drawing of one case.

`SPACE` maps every field of `hpctrain.base.config.TrainConfig` (one field per `train` option) to how it is
drawn (`Drawn`) or why it is not (`Excluded`); tests/chaos/test_space.py fails when a field is in neither,
or the table names a field TrainConfig does not have. The table is also the order of the drawing: each
`Drawn.draw` sees the options drawn before it (the learning rate sees the optimizer, the reducer the ZeRO
stage). A drawn value of None means "not passed" (the default, or auto where the default is auto).

A case is that configuration on W ranks plus one event. Besides, from streams of their own:
- about `REFUSED_FRACTION` of the cases are a combination hpctrain refuses (`REFUSALS`): they must exit 2
  before the first step with exactly one `error:` line that says why; they get no event;
- about `PAIR_FRACTION` of the no-event cases also run a partner configuration that differs in one axis
  (`PAIRS`: ZeRO stage, overlap, bucket size, hierarchical, in fp32 compute and wire; or the same
  --deterministic run again) and must end with the same model, within `PAIR_RTOL` of the largest parameter
  (bit-identical for --deterministic).

`draw_case(seed, index, data)` is a pure function of (seed, index): the shard sizes it reads are those
`hpctrain shard` writes (computed for the classifier sources, read from the built token shards).
"""

from __future__ import annotations

import math
import random
from dataclasses import MISSING, dataclass, field
from typing import Any, Callable

from hpctrain.base.sections import train_options
from hpctrain.base.stop import EDGE_FLOOR_S

EVENTS = ("none", "term-launcher", "usr2-launcher", "term-rank", "usr2-rank", "kill9-rank", "stop-rank")
TOKENS = "stdlib:32"  # text:DIR of a few standard-library files (chaos_data.STDLIB_FILES), --seq-len 32
# source: (samples, features); None for token rows, counted once built. Repeats weight the choice.
SOURCE_INFO: dict[str, tuple[int, int] | None] = {"digits": (1797, 64), "synthetic:39:5:3": (39, 5),
                                                   "synthetic:203:8:4": (203, 8), "synthetic:97:16:10": (97, 16),
                                                   TOKENS: None}
SOURCES = ("digits", "digits", "synthetic:39:5:3", "synthetic:203:8:4", "synthetic:97:16:10", TOKENS, TOKENS)
VAL_FRACTIONS = (0.0, 0.1, 0.25)
TOKEN_VAL_FRACTIONS = (0.0, 0.25)  # documents: 0.25 holds out keyword.py (33 rows of 33 tokens)
TOKEN_SHARDS = (4, 12)
BATCH_SIZES = (1, 2, 3, 5, 7, 8, 13, 16, 32, 50, 64, 100, 256)
MLPS = ("mlp", "mlp", "mlp:16", "mlp:64,32", "mlp:32:dropout=0.2")
GPTS = ("gpt:layers=1,dim=32,heads=2", "gpt:layers=1,dim=32,heads=2", "gpt:layers=2,dim=16,heads=2",
        "gpt:layers=1,dim=32,heads=4,dropout=0.1")
OTHER_MODEL = {"classifier": "mlp:7", "lm": "gpt:layers=1,dim=8,heads=2"}  # weights that fit no drawn model
BUCKETS_MB = (25.0, 25.0, 1.0, 0.01, 0.002)  # 0.002 MiB = 524 floats: ZeRO slices cut through parameters
MAX_TOTAL_STEPS = 300  # a step takes milliseconds; start-up (import torch) dominates a run
MAX_LM_STEPS = 100  # a GPT step takes ~10 ms here (more on a loaded machine or with 4 ranks on 2 cores)
SIGNAL_WINDOW_S = 30.0  # a stop signal or kill -9 must end the job within this
STOP_WINDOW_EXTRA_S = 30.0  # a SIGSTOPped rank: --collective-timeout (at the edges of a run EDGE_FLOOR_S) plus this
REFUSED_FRACTION = 0.08
PAIR_FRACTION = 0.5
# max |a - b| / max |a| of a pair's final parameters (fp32 compute and wire). Summation order differs between the
# axes (bucket boundaries, reduce-scatter or allreduce, MPI's algorithm at 3-4 ranks), and Adam amplifies it:
# 4.0e-6 measured over 258 Adam steps on 3 ranks (seed 6, case 41); a bug (a bucket not summed or scaled, a
# stale slice) differs by far more, at every step
PAIR_RTOL = 1e-4
# placeholders the harness fills in per run (chaos.Harness.paths)
STAGE_DIR, STAGE_MISSING = "{stage}", "{stage}/missing"
WEIGHTS, WEIGHTS_OTHER, WEIGHTS_MISSING = "{weights}", "{weights_other}", "{stage}/no-such-weights.pt"
DEFAULTS = {name: f.default for name, (_, f) in train_options().items() if f.default is not MISSING}


@dataclass(frozen=True)
class DataSpec:
    """One shard set: `hpctrain shard SOURCE OUT --shards K --val-fraction F` (token rows for TOKENS)."""

    source: str
    shards: int
    val_fraction: float

    @property
    def name(self) -> str:
        return f"{self.source.replace(':', '-')}_k{self.shards}_v{self.val_fraction:g}"

    @property
    def lm(self) -> bool:
        return SOURCE_INFO[self.source] is None

    @property
    def features(self) -> int:
        return 0 if self.lm else SOURCE_INFO[self.source][1]

    def short(self) -> str:
        return f"{self.source}/{self.shards}sh/v{self.val_fraction:g}"


def feasible_shards(samples: int, val_fraction: float, world: int) -> list[int]:
    """Shard counts `shard` accepts (no more shards than samples in a non-empty split) that W divides."""
    n_val = int(round(samples * val_fraction))  # as hpctrain.data.sharding does
    limit = min(samples - n_val, n_val if n_val else samples, 12)
    return [world * m for m in (1, 2, 3, 4) if world * m <= limit]


def classifier_shard_sizes(spec: DataSpec) -> list[int]:
    """Train samples of each shard, as `hpctrain shard` cuts them (hpctrain.data.sharding.assign)."""
    n = SOURCE_INFO[spec.source][0]
    n_train = n - int(round(n * spec.val_fraction))
    return [(n_train * (k + 1)) // spec.shards - (n_train * k) // spec.shards for k in range(spec.shards)]


def rank_samples(shard_sizes: list[int], world: int) -> list[int]:
    """Training samples of each rank: rank r reads shards r, r+W, r+2W, ... (README "Data")."""
    return [sum(shard_sizes[r::world]) for r in range(world)]


def steps_per_epoch(counts: list[int], batch_size: int, accumulate: int) -> int:
    """Every rank runs as many steps as the rank with the most samples needs."""
    return math.ceil(max(counts) / (batch_size * accumulate))


# --- the table ---------------------------------------------------------------------------------------


@dataclass
class Draft:
    """A case while it is drawn: what each `Drawn.draw` may look at, and the options drawn so far."""

    rng: random.Random
    world: int
    data: DataSpec
    counts: list[int]  # training samples per rank
    event: str
    opts: dict[str, Any] = field(default_factory=dict)
    steps_per_epoch: int = 0
    expected_steps: int = 0
    note: str = ""
    sizes: list[int] = field(default_factory=list)  # training samples per shard
    salt: str = ""  # seed:index, for the streams of options drawn apart from `rng`
    _layout_rng: random.Random | None = None

    def pick(self, *choices: Any) -> Any:
        return self.rng.choice(choices)

    @property
    def layout_rng(self) -> random.Random:
        """The stream of --tp/--pp and the pipeline's options: one of their own, so that adding them left every
        other option of the earlier cases as it was drawn."""
        if self._layout_rng is None:
            self._layout_rng = random.Random(f"hpctrain-chaos:{self.salt}:layout")
        return self._layout_rng


@dataclass(frozen=True)
class Drawn:
    how: str  # what is drawn, for the README
    draw: Callable[[Draft], Any] | None  # None: drawn with the case's shard set (data)
    tabulate: bool = True  # a row per value in the soak's per-option table (False: too many values)


@dataclass(frozen=True)
class Excluded:
    reason: str


def _model(d: Draft) -> str:
    if d.data.lm:
        return d.pick(*GPTS)
    square = math.isqrt(d.data.features) ** 2 == d.data.features
    return d.pick(*MLPS, *(("cnn",) if square else ()))


def _batch_size(d: Draft) -> int:
    """Mostly batches that split a rank's data into several steps, sometimes one larger than all of it."""
    fitting = [b for b in BATCH_SIZES if b * d.opts["accumulate"] <= max(d.counts) // 2] or [1]
    return d.rng.choice(fitting if d.rng.random() < 0.85 else BATCH_SIZES)


def _max_steps(d: Draft) -> int:
    """0 (all epochs), a step 0-3 before an epoch's end (the reader prefetches 2 batches ahead), or any step.

    Totals stay under MAX_TOTAL_STEPS (MAX_LM_STEPS for token data) so that a run is start-up plus a few
    seconds.
    """
    spe = d.steps_per_epoch = steps_per_epoch(d.counts, d.opts["batch_size"], d.opts["accumulate"])
    epochs, rng, cap = d.opts["epochs"], d.rng, MAX_LM_STEPS if d.data.lm else MAX_TOTAL_STEPS
    natural = spe * epochs
    mode = rng.choice(("none", "end", "end", "any"))
    ends = [e for e in range(1, epochs + 1) if e * spe <= cap]
    if mode == "none" and natural <= cap:
        steps, d.note = 0, "all epochs"
    elif mode in ("none", "end") and ends:
        epoch, before = rng.choice(ends), rng.choice(range(min(4, spe)))  # stays inside that epoch
        steps, d.note = epoch * spe - before, f"end of epoch {epoch} - {before}"
    else:
        steps, d.note = rng.randint(1, min(natural, cap)), "anywhere"
    d.expected_steps = min(natural, steps) if steps else natural
    return steps


def _tp(d: Draft) -> int | None:
    """2 for about one in three GPT cases on an even world (every drawn GPT has 2 or 4 heads), else 1."""
    split = d.data.lm and d.world % 2 == 0 and d.layout_rng.random() < 0.35
    return 2 if split else None


def _pp(d: Draft) -> int | None:
    """2 for about one in four cases whose world (over --tp) is even and whose model has 2+ blocks; the ranks'
    sample counts are then those of the D = W / (tp x pp) data-parallel ranks."""
    tp = d.opts["tp"] or 1
    one_block = d.opts["model"].startswith("gpt:layers=1")
    pp = 2 if (d.world // tp) % 2 == 0 and not one_block and d.layout_rng.random() < 0.25 else None
    split = tp * (pp or 1)
    if split > 1 and len(d.sizes) % (d.world // split) == 0:
        d.counts = rank_samples(d.sizes, d.world // split)
    return pp


def _lr(d: Draft) -> float:
    return d.pick(0.01, 0.05, 0.1) if d.opts["optimizer"] == "sgd" else d.pick(0.001, 0.003, 0.01)


def _unsplit(d: Draft, value: Any) -> Any:
    """`value`, or None in a case split by --tp/--pp (drawn all the same: the stream stays as it was)."""
    return None if (d.opts["tp"] or 1) * (d.opts["pp"] or 1) > 1 else value


def _zero(d: Draft, stage: int) -> int:
    """`stage`, or 2 for 3 in a case split by --tp/--pp (which refuses --zero 3; drawn all the same: the stream
    stays as it was)."""
    return 2 if stage == 3 and (d.opts["tp"] or 1) * (d.opts["pp"] or 1) > 1 else stage


def _checkpoint_timeout(d: Draft) -> float | None:
    # a stopped rank in a checkpoint write is waited for this long: short enough for the event's window
    return d.pick(10.0, 20.0, 30.0) if d.event == "stop-rank" else d.pick(None, None, 60.0, 0.0)


def _trace(d: Draft) -> str | None:
    # a stream of its own, seeded by what was drawn before: drawing it from the case's stream would move the
    # target rank and the moment of every event of the fixed sample (tests/chaos/test_chaos.py)
    return random.Random(repr(sorted(d.opts.items(), key=str))).choice((None, None, None, "1:5", "last:3", "every:2"))


SPACE: dict[str, Drawn | Excluded] = {
    "data": Drawn("a shard set: digits, synthetic sets with short and empty last batches, or token rows of a "
                  "few standard-library files (`text:DIR --seq-len 32`); 1-12 shards W divides; val split or none",
                  None),
    "model": Drawn("mlp, mlp:16, mlp:64,32, mlp:32:dropout=0.2, cnn (square features); token data: "
                   "gpt:layers=1,dim=32,heads=2 (or heads=4,dropout=0.1), gpt:layers=2,dim=16,heads=2", _model),
    "tp": Drawn("1; 2 in about a third of the GPT cases on 2 or 4 ranks (a stream of its own)", _tp),
    "pp": Drawn("1; 2 in about a quarter of the cases whose W / tp is even, but a 1-layer GPT", _pp),
    "epochs": Drawn("1-3", lambda d: d.rng.randint(1, 3)),
    "accumulate": Drawn("1, 2, 3", lambda d: d.pick(1, 1, 2, 3)),
    "batch_size": Drawn("1-256, mostly several steps per epoch", _batch_size),
    "max_steps": Drawn("0, 0-3 steps before an epoch's end, or anywhere; at most 300 steps (100 for token data)",
                       _max_steps,
                       tabulate=False),
    "seed": Drawn("0-99", lambda d: d.rng.randrange(100), tabulate=False),
    "optimizer": Drawn("sgd, adam, adamw", lambda d: d.pick("sgd", "sgd", "adam", "adamw")),
    "lr": Drawn("sgd 0.01-0.1, adam/adamw 0.001-0.01", _lr),
    "momentum": Drawn("0, 0.5, 0.9", lambda d: d.pick(0.0, 0.5, 0.9)),
    "weight_decay": Drawn("0, 1e-4, 0.01", lambda d: d.pick(0.0, 0.0, 1e-4, 0.01)),
    "schedule": Drawn("constant, cosine, step", lambda d: d.pick("constant", "constant", "cosine", "step")),
    "warmup": Drawn("0, 3, 20 steps", lambda d: d.pick(0, 0, 0, 3, 20)),
    "clip_grad": Drawn("0 (none), 0.5, 2", lambda d: d.pick(0.0, 0.0, 0.5, 2.0)),
    "shuffle": Drawn("on, off", lambda d: d.rng.random() < 0.7),
    "zero": Drawn("0, 1, 2, 3 (2 for 3 with --tp/--pp: refused)", lambda d: _zero(d, d.pick(0, 0, 0, 1, 2, 3))),
    "zero_reduce": Drawn("with --zero 1-3: auto, reduce-scatter-block, reduce-scatter, allreduce",
                         lambda d: d.pick(None, "reduce-scatter-block", "reduce-scatter", "allreduce")
                         if d.opts["zero"] else None),
    "grad_compression": Drawn("none, fp16, bf16, powersgd, powersgd:2, topk, topk:0.1 (16-bit only with --zero)",
                              lambda d: d.pick("none", "none", "fp16", "bf16", *(() if d.opts["zero"] else (
                                  "powersgd", "powersgd:2", "topk", "topk:0.1")))),
    "hierarchical": Drawn("on, off (off with --zero)", lambda d: not d.opts["zero"] and d.rng.random() < 0.2),
    "deterministic": Drawn("on, off", lambda d: d.rng.random() < 0.2),
    "overlap": Drawn("on, off, auto", lambda d: d.pick(True, False, None)),
    "bucket_mb": Drawn("25, 1, 0.01, 0.002 MiB", lambda d: d.pick(*BUCKETS_MB)),
    "precision": Drawn("fp32, bf16, fp16", lambda d: d.pick("fp32", "fp32", "bf16", "fp16")),
    "checkpoint_every": Drawn("auto, 0, 1, 2, 3, 5, 10", lambda d: d.pick("auto", 0, 0, 1, 2, 3, 5, 10)),
    "mtbf_hours": Drawn("with auto: 24, 0.01, 0.001 (a checkpoint every few steps)",
                        lambda d: d.pick(None, 0.01, 0.001) if d.opts["checkpoint_every"] == "auto" else None),
    "keep": Drawn("2, 3", lambda d: d.pick(None, 2, 3)),
    "log_every": Drawn("1, 2, 5, 10, 25, 100", lambda d: d.pick(1, 2, 5, 10, 25, 100)),
    "collective_timeout": Drawn("10, 15, 20 s", lambda d: d.pick(10, 15, 20)),
    "checkpoint_timeout": Drawn("1800, 60, 0 (never); 10-30 s when a rank is stopped", _checkpoint_timeout),
    "stage_to": Drawn("none, a per-run directory, auto ($TMPDIR set to one); none with --tp/--pp (refused)",
                      lambda d: _unsplit(d, d.pick(None, None, None, None, STAGE_DIR, "auto"))),
    "keep_staged": Drawn("on, off with --stage-to", lambda d: d.rng.random() < 0.5 if d.opts["stage_to"] else None),
    "audit_samples": Drawn("on, off", lambda d: d.rng.random() < 0.2),
    "init_weights": Drawn("none, or a state_dict of the case's model saved once per model and data",
                          lambda d: WEIGHTS if d.rng.random() < 0.15 else None),
    "trace": Drawn("none, 1:5, last:3, every:2 (from the options drawn before it: the sample's events stay put)",
                   _trace),
    "micro_batches": Drawn("with --pp: auto (4 x pp, at most the step's rows), 1, 3 (when a step has 3 rows)",
                           lambda d: d.layout_rng.choice((None, 1, 3) if d.opts["batch_size"] * d.opts["accumulate"] >= 3
                                                         else (None, 1)) if d.opts["pp"] else None),
    "pipeline_schedule": Drawn("with --pp: 1f1b, gpipe", lambda d: d.layout_rng.choice((None, "gpipe"))
                               if d.opts["pp"] else None),
    "run_dir": Excluded("set by the harness: a fresh directory per case, shared by the interrupted run and its "
                        "resume"),
    "resume": Excluded("the harness's protocol: the first run starts in an empty run directory and the second "
                       "must continue from its checkpoint, which is auto; never or a PATH would not test the resume"),
    "tensorboard": Excluded("output only (event files); needs the optional tensorboard package, which is this "
                            "machine's, not the seed's, so a draw could not tell whether it must run or be refused"),
    "json": Excluded("output only: the summary printed as JSON instead of lines; the harness reads summary.json"),
    "progress": Excluded("not a flag (train leaves it out); a bar only when stdout is a terminal, a file here"),
    "extra": Excluded("not a flag: the keys of a --config file that no flag has"),
}


# --- combinations hpctrain refuses, and pairs that must give the same model ---------------------------


@dataclass(frozen=True)
class Refusal:
    """A change to a valid draft that hpctrain must refuse: `where` it does so ("config": TrainConfig's
    checks; "start-up": the ranks' checks before the first step) and a fragment of its one error line."""

    where: str
    fragment: str
    apply: Callable[[Draft], None]
    needs: str = ""  # the data it needs: "flat" (features not square), "lm", "classifier", "indivisible"


UNSPLIT = dict(tp=None, pp=None, micro_batches=None, pipeline_schedule=None)  # refusals of one whole model per rank


def _set(**values: Any) -> Callable[[Draft], None]:
    return lambda d: d.opts.update(values)


def _zero_compressed(d: Draft) -> None:
    d.opts.update(zero=d.pick(1, 2, 3), grad_compression=d.pick("powersgd", "topk:0.1"), hierarchical=False)


def _zero_hierarchical(d: Draft) -> None:
    wire = d.opts["grad_compression"]
    d.opts.update(zero=d.pick(1, 2, 3), hierarchical=True,
                  grad_compression=wire if wire in ("none", "fp16", "bf16") else "none")


REFUSALS: dict[str, Refusal] = {
    "zero+compression": Refusal("config", "does not combine with --zero", _zero_compressed),
    "zero+hierarchical": Refusal("config", "does not combine with --hierarchical", _zero_hierarchical),
    "keep-staged alone": Refusal("config", "--keep-staged keeps the copies", _set(stage_to=None, keep_staged=True)),
    "keep 1": Refusal("config", "--keep 1 must be at least 2", _set(keep=1)),
    "stage-to missing": Refusal("start-up", "is not a directory", _set(stage_to=STAGE_MISSING, **UNSPLIT)),
    "init-weights missing": Refusal("start-up", "not found", _set(init_weights=WEIGHTS_MISSING)),
    "init-weights of another model": Refusal("start-up", "does not fit model", _set(init_weights=WEIGHTS_OTHER)),
    "cnn on flat features": Refusal("start-up", "model 'cnn' needs images", _set(model="cnn", init_weights=None), "flat"),
    "gpt on classifier data": Refusal("start-up", "unknown model 'gpt", _set(model=GPTS[0], init_weights=None),
                                      "classifier"),
    "mlp on token data": Refusal("start-up", "token shards need `--model gpt`", _set(model="mlp", init_weights=None), "lm"),
    "gpt heads": Refusal("start-up", "is not divisible by heads",
                         _set(model="gpt:layers=1,dim=30,heads=4", init_weights=None), "lm"),
    "shards W does not divide": Refusal("start-up", "ranks cannot share them evenly", _set(**UNSPLIT), "indivisible"),
}


@dataclass(frozen=True)
class Pair:
    """One axis that must not change the model: `prepare` makes a drafted configuration one the tolerance
    is stated for, `partner` gives the other configuration; `exact`: the same param_sha256 (else PAIR_RTOL)."""

    prepare: Callable[[dict], None]
    partner: Callable[[random.Random, dict], dict]
    exact: bool = False


def _comparable(**more: Any) -> Callable[[dict], None]:
    """fp32 compute and wire: what PAIR_RTOL is stated for (16-bit or compressed gradients round differently)."""
    return lambda o: o.update(precision="fp32", grad_compression="none", **more)


def _other_stage(rng: random.Random, o: dict) -> dict:
    split = (o.get("tp") or 1) * (o.get("pp") or 1) > 1  # a split run refuses --zero 3
    stage = rng.choice([s for s in (0, 1, 2, 3) if s != o["zero"] and not (split and s == 3)])
    return dict(o, zero=stage, zero_reduce=o["zero_reduce"] if stage else None)


def _other_overlap(rng: random.Random, o: dict) -> dict:
    return dict(o, overlap=rng.choice((True, False)) if o["overlap"] is None else not o["overlap"])


PAIRS: dict[str, Pair] = {
    "zero": Pair(_comparable(hierarchical=False), _other_stage),
    "overlap": Pair(_comparable(), _other_overlap),
    "bucket_mb": Pair(_comparable(), lambda r, o: dict(o, bucket_mb=r.choice([b for b in BUCKETS_MB if b != o["bucket_mb"]]))),
    "hierarchical": Pair(_comparable(zero=0, zero_reduce=None), lambda r, o: dict(o, hierarchical=not o["hierarchical"])),
    "deterministic": Pair(lambda o: o.update(deterministic=True), lambda r, o: dict(o), exact=True),
}


# --- a case ------------------------------------------------------------------------------------------

Options = tuple[tuple[str, Any], ...]  # (TrainConfig field, value) in SPACE order; None: not passed


@dataclass(frozen=True)
class Case:
    """One configuration and one event; every field is drawn from (seed, index) by `draw_case`."""

    seed: int
    index: int
    world: int
    data: DataSpec
    options: Options
    steps_per_epoch: int
    expected_steps: int
    max_steps_note: str  # how max-steps was chosen, e.g. "end of epoch 2 - 1"
    event: str
    target_rank: int | None  # for the *-rank events
    anchor: str  # start-up, training (first step to summary.json) or end (summary.json to exit): see `EventPlan`
    fraction: float
    refusal: str | None = None  # a REFUSALS key: hpctrain must refuse this configuration
    pair: str | None = None  # a PAIRS key: the partner configuration must give the same model
    partner: Options = ()

    def opt(self, name: str) -> Any:
        """The drawn value of option `name`, or TrainConfig's default when it is not passed."""
        value = dict(self.options).get(name)
        return DEFAULTS.get(name) if value is None else value

    def train_args(self, data_dir: str, run_dir: str, paths: dict[str, str], partner: bool = False) -> list[str]:
        """`train`'s arguments; placeholders ({stage}, {weights}, ...) filled in from `paths`."""
        args = ["--data", data_dir, "--run-dir", run_dir]
        for name, value in self.partner if partner else self.options:
            flag = "--" + name.replace("_", "-")
            if value is None:
                continue
            if isinstance(value, bool):
                args.append(flag if value else flag.replace("--", "--no-", 1))
            else:
                text = str(value)
                args += [flag, text.format_map(paths) if text.startswith("{") else text]
        return args

    def config_key(self) -> tuple:
        """What determines the final parameters: the configuration without the event."""
        return self.world, self.data, self.options

    def summary(self) -> str:
        shown = ("batch_size", "accumulate", "epochs", "max_steps")
        rest = " ".join(f"{name}={value}" for name, value in self.options
                        if name not in shown and value is not None and value != DEFAULTS.get(name))
        return (f"W{self.world} {self.data.short()} b{self.opt('batch_size')}x{self.opt('accumulate')} "
                f"e{self.opt('epochs')} max{self.opt('max_steps')} ({self.expected_steps} of {self.steps_per_epoch}/ep) "
                f"{rest}")

    def window(self) -> float:
        """How long after the event the job may take to end."""
        if self.event == "stop-rank":  # a rank stopped in MPI_Init or MPI_Finalize: the edge deadline's turn
            return max(self.opt("collective_timeout"), self.opt("checkpoint_timeout"), EDGE_FLOOR_S) + STOP_WINDOW_EXTRA_S
        return SIGNAL_WINDOW_S

    def event_label(self) -> str:
        if self.refusal:
            return f"refused: {self.refusal}"
        if self.event == "none":
            return f"none, pair {self.pair}" if self.pair else "none"
        kind, target = self.event.split("-")
        who = "launcher" if target == "launcher" else f"rank {self.target_rank}"
        return f"{'kill -9' if kind == 'kill9' else {'term': 'SIGTERM', 'usr2': 'SIGUSR2', 'stop': 'SIGSTOP'}[kind]} {who}"


def refusal_of(seed: int, index: int) -> str | None:
    rng = random.Random(f"hpctrain-chaos:{seed}:{index}:refusal")
    return rng.choice(sorted(REFUSALS)) if rng.random() < REFUSED_FRACTION else None


def event_of(seed: int, index: int) -> str:
    """The case's event (none for a refused case: it ends before anything could happen)."""
    event = random.Random(f"hpctrain-chaos:{seed}:{index}:event").choice(EVENTS)
    return "none" if refusal_of(seed, index) else event


def draw_data(rng: random.Random, world: int, needs: str) -> DataSpec:
    """A shard set that W ranks share (or, `needs` "indivisible", one they cannot)."""
    sources = [s for s in SOURCES if {"lm": s == TOKENS, "classifier": s != TOKENS, "indivisible": s != TOKENS,
                                      "flat": s != TOKENS and math.isqrt(SOURCE_INFO[s][1]) ** 2 != SOURCE_INFO[s][1]
                                      }.get(needs, True)]
    source = rng.choice(sources)
    if SOURCE_INFO[source] is None:
        shards = [k for k in TOKEN_SHARDS if k % world == 0]
        return DataSpec(source, rng.choice(shards), rng.choice(TOKEN_VAL_FRACTIONS))
    samples = SOURCE_INFO[source][0]
    val_fraction = rng.choice(VAL_FRACTIONS)
    if needs == "indivisible":
        return DataSpec(source, rng.choice([k for k in range(2, 13) if k % world]), 0.0)
    if not feasible_shards(samples, val_fraction, world):
        val_fraction = 0.0  # too few validation samples for any shard count this world size can share
    return DataSpec(source, rng.choice(feasible_shards(samples, val_fraction, world)), val_fraction)


def draw_case(seed: int, index: int, data: Any) -> Case:
    """Case `index` of `seed`: a pure function of both. `data.train_shard_sizes(spec)` gives each shard's
    training samples (chaos_data.DataCache). The event, the refusal and the pair come from streams of their
    own, so `event_of` can tell the event without any data."""
    event, refusal = event_of(seed, index), refusal_of(seed, index)
    needs = REFUSALS[refusal].needs if refusal else ""
    rng = random.Random(f"hpctrain-chaos:{seed}:{index}:config")
    world = rng.choice((2, 3, 4) if event == "stop-rank" or needs == "indivisible" else (1, 2, 2, 3, 4))
    spec = draw_data(rng, world, needs)
    sizes = data.train_shard_sizes(spec)
    d = Draft(rng, world, spec, rank_samples(sizes, world) if len(sizes) % world == 0 else sizes, event,
              sizes=list(sizes), salt=f"{seed}:{index}")
    for name, entry in SPACE.items():
        if isinstance(entry, Drawn) and entry.draw is not None:
            d.opts[name] = entry.draw(d)
    if refusal:
        REFUSALS[refusal].apply(d)
    pair, pair_rng = pair_of(seed, index)
    partner = None
    if pair:
        PAIRS[pair].prepare(d.opts)
        partner = PAIRS[pair].partner(pair_rng, d.opts)
    target = rng.randrange(world) if event.endswith("-rank") else None
    return Case(seed=seed, index=index, world=world, data=spec, options=tuple(d.opts.items()),
                steps_per_epoch=d.steps_per_epoch, expected_steps=d.expected_steps, max_steps_note=d.note,
                event=event, target_rank=target, anchor=rng.choices(("start", "train", "end"), weights=(3, 5, 2))[0],
                fraction=round(rng.random(), 3), refusal=refusal, pair=pair,
                partner=tuple(partner.items()) if partner else ())


def pair_of(seed: int, index: int) -> tuple[str | None, random.Random]:
    """The pair axis of a no-event case (or None), and the stream that draws its partner."""
    rng = random.Random(f"hpctrain-chaos:{seed}:{index}:pair")
    if event_of(seed, index) != "none" or refusal_of(seed, index) or rng.random() >= PAIR_FRACTION:
        return None, rng
    return rng.choice(sorted(PAIRS)), rng
