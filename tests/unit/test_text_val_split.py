"""`shard text` with a --val-fraction that gives no validation split (#54 item 10): 5 documents at 0.05 wrote
train alone and said nothing. Now a source of two documents or more whose fraction puts none in val is
refused in one line naming a fraction that does; a one-document source (the split is by document) is said to
have no val split; a val split too short for one row is refused like a train split is."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from hpctrain.base.config import ShardConfig
from hpctrain.base.errors import ConfigError, DataError
from hpctrain.cli.main import app
from hpctrain.data.tokenshards import write_token_shards

runner = CliRunner()


def _corpus(root: Path, sizes: list[int]) -> Path:
    root.mkdir()
    for i, words in enumerate(sizes):
        (root / f"d{i}.txt").write_text(f"hello world {i} " * words)
    return root


def test_a_fraction_that_puts_no_document_in_val_is_refused_naming_one_that_does(tmp_path: Path) -> None:
    corpus = _corpus(tmp_path / "docs", [200] * 5)
    with pytest.raises(ConfigError) as info:
        write_token_shards(ShardConfig(source=f"text:{corpus}", out=tmp_path / "out", seq_len=16, shards=1,
                                       val_fraction=0.05))
    message = str(info.value)
    assert "--val-fraction 0.05" in message and "5 documents" in message and "--val-fraction 0.2" in message
    assert "--val-fraction 0" in message
    assert not (tmp_path / "out").exists()  # nothing left behind
    manifest = write_token_shards(ShardConfig(source=f"text:{corpus}", out=tmp_path / "ok", seq_len=16, shards=1,
                                              val_fraction=0.2))
    assert manifest["splits"]["val"]["documents"] == 1


def test_the_command_refuses_it_in_one_line_with_exit_2(tmp_path: Path) -> None:
    corpus = _corpus(tmp_path / "docs", [200] * 5)
    result = runner.invoke(app, ["shard", f"text:{corpus}", str(tmp_path / "out"), "--seq-len", "16", "--shards", "1",
                                 "--val-fraction", "0.05"])
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1 and "--val-fraction 0.05" in result.output


def test_one_document_is_said_to_have_no_val_split(tmp_path: Path) -> None:
    corpus = _corpus(tmp_path / "docs", [200])
    result = runner.invoke(app, ["shard", f"text:{corpus}", str(tmp_path / "out"), "--seq-len", "16", "--shards", "1",
                                 "--val-fraction", "0.2"])
    assert result.exit_code == 0, result.output
    assert "no val split" in result.output and "one document" in result.output, result.output


def test_a_val_split_too_short_for_one_row_is_refused(tmp_path: Path) -> None:
    corpus = _corpus(tmp_path / "docs", [200, 1, 200])  # d1, the val document at 0.5, is 14 bytes
    with pytest.raises(DataError, match="val split"):
        write_token_shards(ShardConfig(source=f"text:{corpus}", out=tmp_path / "out", seq_len=16, shards=1,
                                       val_fraction=0.5))
