"""One source of truth per option: the config dataclasses hold name, default and help; `--help` shows them."""

from __future__ import annotations

import re
from dataclasses import MISSING, fields
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hpctrain.base.config import ShardConfig, TrainConfig
from hpctrain.tools.slurm.config import SubmitConfig
from hpctrain.cli.main import app
from hpctrain.base.sections import train_options
from hpctrain.cli.options import flag, option_fields

runner = CliRunner()


def help_text(command: str) -> str:
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "400", "NO_COLOR": "1", "TERM": "dumb"})
    assert result.exit_code == 0, result.output
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.output).split())


@pytest.mark.parametrize(("command", "source", "skip"), [
    ("train", train_options(), {"progress"}),
    ("shard", ShardConfig, {"source", "out"}),
    ("submit", SubmitConfig, {"job_name", "signal_delay_s", "binds", "container_python"}),
], ids=["train", "shard", "submit"])
def test_help_shows_every_field_with_its_dataclass_default_and_help(command: str, source: object, skip: set[str]) -> None:
    text = help_text(command)
    for name, _, f, doc in option_fields(source):
        if name in skip:
            continue
        assert flag(name) in text, f"{flag(name)} missing from `hpctrain {command} --help`"
        assert doc, f"{command}: the field of {flag(name)} has no docstring under it"
        assert " ".join(doc.split()[:6]) in text, f"help of {flag(name)} differs from the field's docstring"
        if f.default not in (MISSING, None, ()):
            default = f.default if not isinstance(f.default, bool) else (name.replace("_", "-") if f.default else
                                                                          "no-" + name.replace("_", "-"))
            assert f"[default: {default}]" in text, f"{flag(name)}: default {default!r} not shown"


def test_train_takes_its_defaults_from_the_dataclass(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}
    monkeypatch.setattr("hpctrain.control.trainer.train", lambda cfg: seen.setdefault("cfg", cfg) and {})
    result = runner.invoke(app, ["train", "--data", "d", "--run-dir", "r"])
    assert result.exit_code == 0, result.output
    assert seen["cfg"] == TrainConfig.flat(data=Path("d"), run_dir=Path("r"))


def test_the_old_spelling_of_a_renamed_option_still_works(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen = []
    monkeypatch.setattr("hpctrain.control.trainer.train", lambda cfg: seen.append(cfg) or {})
    result = runner.invoke(app, ["train", "--data", "d", "--run-dir", "r", "--compress", "fp16"])
    assert result.exit_code == 0, result.output
    assert seen[-1].communication.grad_compression == "fp16" and "--compress is now --grad-compression" in result.output
    result = runner.invoke(app, ["train", "--data", "d", "--run-dir", "r", "--compress", "fp16", "--grad-compression", "bf16"])
    assert seen[-1].communication.grad_compression == "bf16"  # the new spelling wins
    old = tmp_path / "old.toml"
    old.write_text('data = "d"\nrun_dir = "r"\ncompress = "bf16"\n')
    result = runner.invoke(app, ["train", "--config", str(old)])
    assert result.exit_code == 0 and seen[-1].communication.grad_compression == "bf16", result.output
    result = runner.invoke(app, ["train", "--data", "d", "--run-dir", "r", "--grad-compression", "int4"])
    assert result.exit_code == 2 and "--grad-compression 'int4'" in result.output and "none, fp16, bf16" in result.output


def test_shard_s_old_compression_flag_still_works(tmp_path: Path) -> None:
    result = runner.invoke(app, ["shard", "synthetic:64:5:3", str(tmp_path / "d"), "--shards", "2", "--compression", "lzf"])
    assert result.exit_code == 0, result.output
    assert "--compression is now --hdf5-compression" in result.output
    import json

    assert json.loads((tmp_path / "d" / "manifest.json").read_text())["compression"] == "lzf"
    result = runner.invoke(app, ["shard", "synthetic:64", str(tmp_path / "e"), "--hdf5-compression", "zstd"])
    assert result.exit_code == 2 and "--hdf5-compression 'zstd'" in result.output and not (tmp_path / "e").exists()


def test_submit_builds_its_config_from_the_dataclass(tmp_path: Path) -> None:
    result = runner.invoke(app, ["submit", "--dry-run", "--json", "--folder", str(tmp_path), "--env", "A=1", "--env",
                                 "B=2", "--nodes", "2", "--cpus-per-task", "2", "--", "train", "--data", "d"])
    assert result.exit_code == 0, result.output
    import json

    script = json.loads(result.output)["script"]
    assert "#SBATCH --nodes=2" in script.splitlines() and {"export A=1", "export B=2"} <= set(script.splitlines())
    result = runner.invoke(app, ["submit", "--dry-run", "--folder", str(tmp_path), "--env", "1A=x", "--", "hostname"])
    assert result.exit_code == 2 and "--env '1A=x'" in result.output


# options of `bench train` and `plan` spelled like a train flag but meaning something else there
NOT_TRAINING = {"--json": "prints the command's own result as JSON", "--trace": "bench train's DIR for a timeline"}


@pytest.mark.parametrize("command", ["bench train", "plan"])
def test_the_training_options_of_bench_train_and_plan_are_the_sections_fields(command: str) -> None:
    """Every option `bench train` and `plan` share with `train` is generated from the same section field: its
    help is the field's, and its values are the section's (`--grad-compression` takes all five kinds, and a
    bad one is refused by the section's check before anything starts)."""
    from hpctrain.cli.reference import commands

    by_name = dict(commands())
    shared = {flag(name): doc for name, _, _, doc in option_fields(train_options())}
    seen = []
    for param in by_name[f"hpctrain {command}"].params:
        for opt in [o for o in getattr(param, "opts", []) if o in shared and o not in NOT_TRAINING]:
            assert " ".join((param.help or "").split()) == shared[opt], f"{command} {opt}: not the section's help"
            seen.append(opt)
    assert "--model" in seen and "--batch-size" in seen and "--zero" in seen and "--optimizer" in seen
    if command == "bench train":
        assert {"--grad-compression", "--bucket-mb", "--tp", "--pp", "--collective-timeout"} <= set(seen)
        assert all(kind in shared["--grad-compression"] for kind in ("none", "fp16", "bf16", "powersgd", "topk"))
        result = runner.invoke(app, ["bench", "train", "-n", "1", "--grad-compression", "int4"])
        assert result.exit_code == 2 and "powersgd[:RANK]" in result.output and "topk" in result.output
        result = runner.invoke(app, ["bench", "train", "-n", "1", "--zero", "2", "--grad-compression", "topk"])
        assert result.exit_code == 2 and "does not combine with --zero 2" in result.output
    else:
        result = runner.invoke(app, ["plan", "--precision", "fp8"])
        assert result.exit_code == 2 and "choose one of fp32, bf16, fp16" in result.output
