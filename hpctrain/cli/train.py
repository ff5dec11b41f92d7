"""`hpctrain train`: one data-parallel training run on however many ranks started it."""

from __future__ import annotations

import json
import sys
from dataclasses import fields
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ..base.config import TrainConfig, read_toml
from ..base.errors import ConfigError
from .common import handle_errors, is_rank0


def _load_toml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"--config {str(path)!r} not found")
    try:
        data = read_toml(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:  # TOMLDecodeError is a ValueError
        raise ConfigError(f"--config {str(path)!r} is not valid TOML ({exc})") from exc
    valid = {f.name for f in fields(TrainConfig)} - {"extra"}
    unknown = sorted(k.replace("-", "_") for k in data if k.replace("-", "_") not in valid)
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(unknown)} in {str(path)!r}; valid keys are the train flags: {', '.join(sorted(valid))}")
    return {k.replace("-", "_"): v for k, v in data.items()}


def build_config(ctx: typer.Context, values: dict[str, Any], config: Path | None) -> TrainConfig:
    """Flags win over the config file; the file wins over defaults."""
    merged = dict(values)
    if config is not None:
        for key, value in _load_toml(config).items():
            source = ctx.get_parameter_source(key)
            if source is None or source.name != "COMMANDLINE":
                merged[key] = value
    for required in ("data", "run_dir"):
        if merged.get(required) in (None, ""):
            raise ConfigError(f"--{required.replace('_', '-')} is required (or set {required} in --config)")
    try:
        return TrainConfig(**merged)
    except TypeError as exc:
        raise ConfigError(f"bad value in --config: {exc}") from exc


@handle_errors
def train(
    ctx: typer.Context,
    data: Annotated[Optional[Path], typer.Option(help="Directory written by `hpctrain shard`.")] = None,
    run_dir: Annotated[Optional[Path], typer.Option(help="Run directory: metrics, checkpoints, logs, model.")] = None,
    model: Annotated[str, typer.Option(help="mlp, mlp:H1,H2[:dropout=P], cnn, module:factory or file.py:factory.")] = "mlp",
    epochs: Annotated[int, typer.Option(help="Passes over the training data.")] = 10,
    max_steps: Annotated[int, typer.Option(help="Stop after this many steps in total (0: no limit).")] = 0,
    batch_size: Annotated[int, typer.Option(help="Samples per rank per step (global batch = this x ranks).")] = 32,
    lr: Annotated[float, typer.Option(help="Learning rate.")] = 0.05,
    optimizer: Annotated[str, typer.Option(help="sgd, adam or adamw.")] = "sgd",
    momentum: Annotated[float, typer.Option(help="SGD momentum.")] = 0.9,
    weight_decay: Annotated[float, typer.Option(help="Weight decay.")] = 0.0,
    seed: Annotated[int, typer.Option(help="Seed of initialization, shuffling and dropout.")] = 0,
    schedule: Annotated[str, typer.Option(help="Learning-rate schedule: constant, cosine or step.")] = "constant",
    clip_grad: Annotated[float, typer.Option(help="Clip the global gradient norm (0: off).")] = 0.0,
    shuffle: Annotated[bool, typer.Option("--shuffle/--no-shuffle", help="Shuffle every epoch.")] = True,
    init_weights: Annotated[Optional[Path], typer.Option(help="Start from this state_dict (.pt).")] = None,
    checkpoint_every: Annotated[str, typer.Option(help="Checkpoint every N steps; 0: at the end and on signals only; auto: Young/Daly interval from the measured checkpoint cost.")] = "auto",
    mtbf_hours: Annotated[float, typer.Option(help="Mean time between failures assumed by --checkpoint-every auto.")] = 24.0,
    keep: Annotated[int, typer.Option(help="Complete checkpoints to keep (>= 2).")] = 2,
    resume: Annotated[str, typer.Option(help="auto, never, or a checkpoint directory.")] = "auto",
    bucket_mb: Annotated[float, typer.Option(help="Gradient bucket size in MiB.")] = 25.0,
    compress: Annotated[str, typer.Option(help="Allreduce wire format: none, fp16 or bf16.")] = "none",
    overlap: Annotated[Optional[bool], typer.Option("--overlap/--no-overlap", help="Overlap the allreduce with backward (default: when a spare CPU or a GPU allows).", show_default=False)] = None,
    accumulate: Annotated[int, typer.Option(help="Micro-batches per optimizer step (sync on the last only).")] = 1,
    hierarchical: Annotated[bool, typer.Option("--hierarchical", help="Node-local reduce, leaders allreduce, node-local broadcast.")] = False,
    deterministic: Annotated[bool, typer.Option("--deterministic", help="Sum gradients in rank order: same bits every run.")] = False,
    audit_samples: Annotated[bool, typer.Option("--audit-samples", help="Write RUN/samples/rank-N.txt.")] = False,
    log_every: Annotated[int, typer.Option(help="Log metrics every N steps.")] = 10,
    tensorboard: Annotated[bool, typer.Option("--tensorboard", help="Also write TensorBoard events to RUN/tensorboard.")] = False,
    collective_timeout: Annotated[float, typer.Option(help="Abort when a collective waits longer than this (s; 0: never).")] = 300.0,
    checkpoint_timeout: Annotated[float, typer.Option(help="Abort when a checkpoint write, waiting for every rank's part, takes longer than this (s; 0: never).")] = 1800.0,
    config: Annotated[Optional[Path], typer.Option(help="TOML file with the same keys as these flags (flags win).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Train a model data-parallel on the ranks that started this command (one rank with no launcher).

    Example: hpctrain launch -n 2 -- train --data data/ --run-dir runs/a --epochs 20
    """
    values = dict(locals())
    for name in ("ctx", "config", "json_out"):
        values.pop(name)
    values["json"] = json_out
    cfg = build_config(ctx, values, config)
    from ..base.stop import FLAG
    from ..control.trainer import train as run

    FLAG.exit_budget = cfg.collective_timeout  # for what is left after the run: MPI_Finalize waits for every rank
    summary = run(cfg)
    if is_rank0():
        if json_out:
            print(json.dumps(summary))
        else:
            keys = ("world_size", "epochs", "steps", "global_batch_size", "train_loss", "val_loss", "val_accuracy",
                    "samples_per_s", "ranks_in_sync", "param_sha256")
            for key in keys:
                value = summary.get(key)
                print(f"{key:>18}: {value:.4f}" if isinstance(value, float) else f"{key:>18}: {value}")
            print(f"{'run_dir':>18}: {cfg.run_dir}", file=sys.stdout)
