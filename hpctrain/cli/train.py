"""`hpctrain train`: one data-parallel training run on however many ranks started it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ..base.config import TRAIN_RENAMED, TRAIN_SECTIONS, section_panels, TrainConfig, flatten_sections, read_toml
from ..base.sections import TRAIN_FLAT, train_options
from ..base.errors import ConfigError
from .common import handle_errors, is_rank0, usage_error
from .options import config_parameters, given, take_renamed, with_signature


def _load_toml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"--config {str(path)!r} not found")
    try:
        raw = read_toml(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:  # TOMLDecodeError is a ValueError
        raise ConfigError(f"--config {str(path)!r} is not valid TOML ({exc})") from exc
    data = TrainConfig.upgrade(flatten_sections(raw, TRAIN_SECTIONS))
    unknown = sorted(k for k in data if k not in TRAIN_FLAT)
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(unknown)} in {str(path)!r}; valid keys are the train flags "
                          f"(`hpctrain train --help`), in the sections {', '.join(f'[{s}]' for s in TRAIN_SECTIONS)}")
    flat = sorted(k for k in raw if k.replace("-", "_") not in TRAIN_SECTIONS)
    if flat and is_rank0():
        print(f"note: --config {path}: {', '.join(flat)} outside a [section] still read; `hpctrain train --help` "
              "shows each key's section", file=sys.stderr)
    return data


def build_config(ctx: typer.Context, values: dict[str, Any], config: Path | None) -> TrainConfig:
    """Flags win over the config file; the file wins over defaults."""
    merged = dict(values)
    if config is not None:
        for key, value in _load_toml(config).items():
            if not given(ctx, key):
                merged[key] = value
    for required in ("data", "run_dir"):
        if merged.get(required) in (None, ""):
            raise ConfigError(f"--{required.replace('_', '-')} is required (or set {required} in --config)")
    try:
        return TrainConfig.from_flat(merged)
    except TypeError as exc:
        raise ConfigError(f"bad value in --config: {exc}") from exc


def config_from_args(args: list[str]) -> TrainConfig | None:
    """`hpctrain train ARGS` parsed and checked as the ranks would, in this process and with no MPI: the
    config, or None when ARGS ask for --help (printed here). A usage error (an unknown flag, a bad value)
    raises ConfigError with its one line, so a launcher prints it once instead of once per rank."""
    import typer.main

    from .helpformat import App

    solo = App()
    solo.command()(train)
    command = typer.main.get_command(solo)  # an app of one command is that command
    try:
        ctx = command.make_context("hpctrain train", list(args))
    except Exception as exc:  # click's UsageError and Exit, whichever click Typer ships (duck-typed)
        if getattr(exc, "exit_code", None) == 0:
            return None
        message = usage_error(exc, "hpctrain train")
        if message is None:
            raise
        raise ConfigError(message) from None
    values = dict(ctx.params)
    config = values.pop("config", None)
    take_renamed(ctx, values, TRAIN_RENAMED)
    return build_config(ctx, values, config)


@handle_errors
def train(
    ctx: typer.Context,
    config: Annotated[Optional[Path], typer.Option(help="TOML file with the same keys as these flags (flags win).")] = None,
    **values: Any,
) -> None:
    """Train a model data-parallel on the ranks that started this command (one rank with no launcher).

    The options come in sections; a --config TOML file takes the same keys under [section] headings (flags win),
    and RUN/config.toml is written that way. A stopped run continues when the same command runs again.

    Example: hpctrain launch -n 2 -- train --data data/ --run-dir runs/a --epochs 20
    """
    take_renamed(ctx, values, TRAIN_RENAMED)
    cfg = build_config(ctx, values, config)
    from ..base.hostmem import tune_host_memory
    from ..base.stop import FLAG, edge_budget

    tune_host_memory()  # before torch's first allocation, which the trainer's import is the start of
    from ..control.trainer import train as run

    FLAG.exit_budget = edge_budget(cfg.watchdog.collective_timeout)  # what is left after the run: MPI_Finalize waits for every rank
    summary = run(cfg)
    if is_rank0():
        if cfg.logging.json:
            print(json.dumps(summary))
        else:
            keys = ("world_size", "epochs", "steps", "global_batch_size", "train_loss", "val_loss", "val_accuracy",
                    "samples_per_s", "ranks_in_sync", "param_sha256")
            if "tokens_per_s" in summary:  # a language model: its own figures where a classifier has accuracy
                keys = ("world_size", "epochs", "steps", "global_batch_size", "seq_len", "train_loss", "val_loss",
                        "val_bits_per_byte", "val_perplexity", "tokens_per_s", "mfu", "ranks_in_sync", "param_sha256")
            for key in keys:
                value = summary.get(key)
                print(f"{key:>18}: {value:.4f}" if isinstance(value, float) else f"{key:>18}: {value}")
            print(f"{'run_dir':>18}: {cfg.run.run_dir}", file=sys.stdout)
            if "straggler" in summary:  # --trace
                print(f"{'timeline':>18}: {cfg.run.run_dir / summary['trace']['file']} (open it in ui.perfetto.dev)")
                print(f"{'straggler':>18}: {summary['straggler']['verdict']}")


with_signature(train, config_parameters(train_options(), skip=("progress", "extra"), required=("data", "run_dir"),
                                        panels=section_panels(TRAIN_SECTIONS),
                                        renamed=TRAIN_RENAMED))
