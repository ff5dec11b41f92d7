"""The documentation: the site builds strictly, the reference holds every option, `--help` reads at 80 columns,
the README stays a front door, and the config's sections cover every field once."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from hpctrain.base.config import (SHARD_SECTIONS, TRAIN_SECTIONS, ShardConfig, TrainConfig, flatten_sections,
                                  read_train_toml, write_toml)
from hpctrain.base.errors import ConfigError
from hpctrain.base.sections import TRAIN_FLAT
from hpctrain.cli.reference import cli_reference, commands, config_reference

ROOT = Path(__file__).resolve().parents[2]
MKDOCS = Path(sys.executable).with_name("mkdocs")


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """`mkdocs build --strict`: a broken link, an anchor that is not there, a page left out of the nav or a
    docstring mkdocstrings cannot read fails the build."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([str(MKDOCS), "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    cli = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    assert "--collective-timeout" in cli and "hpctrain bench train" in cli
    assert "DistributedOptimizer" in (tmp_path / "site" / "reference" / "api" / "index.html").read_text()


def test_every_option_of_every_command_is_in_the_generated_reference() -> None:
    reference = cli_reference()
    missing = []
    for name, command in commands():
        assert f"## `{name}`" in reference
        for param in command.params:
            if getattr(param, "hidden", False):
                continue
            for opt in [*getattr(param, "opts", []), *getattr(param, "secondary_opts", [])]:
                if opt.startswith("-") and opt not in reference:
                    missing.append(f"{name} {opt}")
    assert not missing, missing
    config = config_reference()
    for name in [*TRAIN_FLAT, *(f.name for f in fields(ShardConfig))]:
        assert f"| `{name}` |" in config, name


@pytest.mark.parametrize("names,sections", [(list(TRAIN_FLAT), TRAIN_SECTIONS),
                                           ([f.name for f in fields(ShardConfig)], SHARD_SECTIONS)], ids=["train", "shard"])
def test_every_config_field_is_in_exactly_one_section(names: list[str], sections: dict[str, tuple[str, ...]]) -> None:
    listed = [name for names in sections.values() for name in names]
    assert len(listed) == len(set(listed)), "a field in two sections"
    assert sorted(listed) == sorted(names)


def test_a_config_file_reads_in_sections_and_flat_and_refuses_a_key_in_the_wrong_one() -> None:
    sectioned = "[optimizer]\nlr = 0.2\nclip-grad = 1.0\n[run]\nepochs = 3\n[communication]\ncompress = 'bf16'\n"
    assert read_train_toml(sectioned) == {"lr": 0.2, "clip_grad": 1.0, "epochs": 3, "grad_compression": "bf16"}
    assert read_train_toml("lr = 0.2\nepochs = 3\n") == {"lr": 0.2, "epochs": 3}  # the flat keys still read
    with pytest.raises(ConfigError, match=r"key 'lr' is in section \[data\]; it belongs in \[optimizer\]"):
        read_train_toml("[data]\nlr = 0.2\n")
    with pytest.raises(ConfigError, match="given twice"):
        flatten_sections({"lr": 0.1, "optimizer": {"lr": 0.2}}, TRAIN_SECTIONS)
    cfg = TrainConfig.flat(data=Path("d"), run_dir=Path("r"), lr=0.3, zero=1)
    text = write_toml(cfg.to_sections())
    assert "[optimizer]" in text and "[zero]" in text and "\nlr = 0.3" in text
    assert TrainConfig.flat(**read_train_toml(text)).to_dict() == cfg.to_dict()  # RUN/config.toml round-trips


def _help_columns(text: str) -> list[int]:
    """For each panel of a `--help` rendering, the width left to the help text: the panel's inner width minus
    the column where the help text starts (the flags column's right edge)."""
    widths = []
    panel: list[str] = []
    for line in text.splitlines():
        if line.startswith("╭"):
            panel = []
        elif line.startswith("│"):
            panel.append(line[1:-1])
        elif line.startswith("╰") and panel:
            starts = []
            for row in panel:
                m = re.match(r"( ?\S+(?: \S+)*)(\s{2,})\S", row)
                if m and row.startswith(" -"):
                    starts.append(m.end() - 1)
            if starts:
                widths.append(len(panel[0]) - max(starts))
    return widths


def test_help_of_every_command_reads_at_80_columns() -> None:
    env = {**os.environ, "COLUMNS": "80", "TERM": "dumb"}
    narrow = {}
    for name, _ in commands():
        argv = [sys.executable, "-m", "hpctrain", *name.split()[1:], "--help"]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
        assert proc.returncode == 0, (name, proc.stderr[-2000:])
        assert max(len(line) for line in proc.stdout.splitlines()) <= 80, name
        widths = _help_columns(proc.stdout)
        if widths and min(widths) < 40:
            narrow[name] = min(widths)
    assert not narrow, f"help text squeezed under 40 columns at COLUMNS=80: {narrow}"


def test_train_help_groups_its_options_by_section() -> None:
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "train", "--help"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "COLUMNS": "100"})
    titles = re.findall(r"╭─ (.+?) ─", proc.stdout)
    assert titles[:4] == ["Run", "Data", "Model", "Optimizer and schedule"], titles
    assert "Memory (ZeRO)" in titles and "Watchdog" in titles and titles[-1] == "Options"
    assert "[default: 32]" in proc.stdout  # defaults are shown (not eaten as rich markup)


def test_the_readme_is_a_front_door() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    assert readme.startswith("# hpctrain\n\n```\nmake demo") and "make test" in readme.splitlines()[4]
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / link).is_file(), link


def test_version_and_info() -> None:
    from hpctrain import __version__

    out = subprocess.run([sys.executable, "-m", "hpctrain", "--version"], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == f"hpctrain {__version__}"
    info = subprocess.run([sys.executable, "-m", "hpctrain", "info"], capture_output=True, text=True, timeout=60)
    assert info.returncode == 0, info.stderr
    for word in ("torch", "MPI", "mpi4py", "HDF5", "h5py", "tokenizers", "mpirun"):
        assert word in info.stdout, word
