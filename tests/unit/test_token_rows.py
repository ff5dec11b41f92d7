"""The rows stored in language-model shards are exactly the rows of the token stream, whatever the block
size, and `verify` catches stored rows that break the packing rule
(row r = stream[r * seq_len : r * seq_len + seq_len + 1])."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from typer.testing import CliRunner

from hpctrain.base.config import ShardConfig
from hpctrain.base.durable import sha256_file
from hpctrain.cli.main import app
from hpctrain.data.shardformat import load_manifest, verify
from hpctrain.data.tokens import pack
from hpctrain.data.tokenshards import write_token_shards

EOT = 256  # the bytes tokenizer's end of a document
ALNUM = b"abcdefghijklmnopqrstuvwxyz0123456789"
runner = CliRunner()


def stored_rows(out: Path, split: str = "train") -> np.ndarray:
    """Every stored row of `split`, in row order (by the `index` dataset)."""
    xs, ids = [], []
    for f in load_manifest(out).splits[split]:
        with h5py.File(f.path, "r") as h5:
            xs.append(h5["x"][()])
            ids.append(h5["index"][()])
    index = np.concatenate(ids)
    assert np.array_equal(np.sort(index), np.arange(len(index)))
    return np.concatenate(xs)[np.argsort(index)]


def expected_rows(text: bytes, seq_len: int) -> np.ndarray:
    """The rows of one document, computed from its bytes: the bytes then EOT, row r its tokens
    [r * seq_len, r * seq_len + seq_len], the tail short of a row dropped."""
    stream = np.append(np.frombuffer(text, np.uint8).astype(np.uint16), EOT)
    n = (len(stream) - 1) // seq_len
    return np.stack([stream[r * seq_len:r * seq_len + seq_len + 1] for r in range(n)])


def shard_text(tmp_path: Path, text: bytes, **options: object) -> Path:
    path = tmp_path / "doc.txt"
    path.write_bytes(text)
    out = tmp_path / "out"
    write_token_shards(ShardConfig(source=f"text:{path}", out=out, shards=1, val_fraction=0.0, **options))
    return out


def test_one_row_per_block_stores_every_row(tmp_path: Path) -> None:
    """The reported case: --shards 1 --chunk-rows 1 made every block one row, handed to the writer thread as a view
    of the packer's buffer, which was refilled before it was written (rows '67896', '|789|')."""
    out = shard_text(tmp_path, ALNUM, chunk_rows=1, seq_len=4)
    want = [list(b"abcde"), list(b"efghi"), list(b"ijklm"), list(b"mnopq"), list(b"qrstu"), list(b"uvwxy"),
            list(b"yz012"), list(b"23456"), [*b"6789", EOT]]
    assert stored_rows(out).tolist() == want
    np.testing.assert_array_equal(stored_rows(out), expected_rows(ALNUM, 4))
    assert verify(out) == []


def test_long_rows_with_default_chunking(tmp_path: Path) -> None:
    """A row of 512 KiB or more makes the default chunk one row, so one shard means one row per block."""
    rng = np.random.default_rng(3)
    text = bytes(rng.choice(np.frombuffer(ALNUM + b" \n", np.uint8), 3 << 20))
    seq_len = 1 << 18  # a row of (2**18 + 1) uint16 tokens: just over 512 KiB
    out = shard_text(tmp_path, text, seq_len=seq_len)
    assert json.loads((out / "manifest.json").read_text())["chunk_rows"] == 1
    want = expected_rows(text, seq_len)
    assert len(want) == 12
    np.testing.assert_array_equal(stored_rows(out), want)
    assert verify(out) == []


def test_one_row_blocks_own_their_memory() -> None:
    """The packer alone: blocks of one row that one call hands out are distinct rows, not one buffer seen many times."""
    ids = np.frombuffer(ALNUM, np.uint8).astype(np.uint16)
    blocks = list(pack([ids, np.array([EOT], np.uint16)], 4, block_rows=1))
    np.testing.assert_array_equal(np.concatenate(blocks), expected_rows(ALNUM, 4))


# ---------------------------------------------------------------------------------------------------
# verify on rows the writer got wrong (the sha256 in the manifest taken of the wrong rows, as it was)
# ---------------------------------------------------------------------------------------------------

def rewrite(out: Path, split: str, k: int, **datasets: np.ndarray) -> Path:
    """Overwrite datasets of shard k of `split` in place and re-hash it into the manifest, as a writer that
    stored those values would have."""
    m = json.loads((out / "manifest.json").read_text())
    entry = m["splits"][split]["shards"][k]
    path = out / entry["file"]
    with h5py.File(path, "r+") as h5:
        for name, values in datasets.items():
            h5[name][...] = values
    entry["sha256"] = sha256_file(path)
    (out / "manifest.json").write_text(json.dumps(m))
    return path


def test_verify_catches_the_rows_of_the_reported_bug(tmp_path: Path) -> None:
    out = shard_text(tmp_path, ALNUM, chunk_rows=1, seq_len=4)
    broken = np.array([[54, 55, 56, 57, 54]] * 5 + [[EOT, 55, 56, 57, EOT]] * 4, np.uint16)  # what it stored
    path = rewrite(out, "train", 0, x=broken)
    problems = verify(out)
    assert any(str(path) in p and "row 4" in p and "row 5" in p for p in problems), problems
    assert any("end-of-document" in p for p in problems), problems
    result = runner.invoke(app, ["verify", str(out)])
    assert result.exit_code == 1 and "row 4" in result.output
    assert verify(out, quick=True) == []  # sizes only: the rows are not read


@pytest.fixture
def two_shards(tmp_path: Path) -> Path:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(12):
        (corpus / f"d{i:02d}.txt").write_bytes(ALNUM[i:] + b" " + ALNUM[:i])
    out = tmp_path / "two"
    write_token_shards(ShardConfig(source=f"text:{corpus}", out=out, shards=2, chunk_rows=3, seq_len=5,
                                   val_fraction=0.25))
    assert verify(out) == []
    return out


def test_verify_catches_rows_that_do_not_join(two_shards: Path) -> None:
    """A row whose first token is not the previous row's last, across shards (shard 1 holds rows 3, 4, 5)."""
    with h5py.File(two_shards / "train" / "shard-00001-of-00002.h5", "r") as h5:
        x, index = h5["x"][()], h5["index"][()]
    assert index[0] == 3
    x[0, 0] = (x[0, 0] + 1) % 256
    rewrite(two_shards, "train", 1, x=x)
    problems = verify(two_shards)
    assert len(problems) == 1 and "row 2" in problems[0] and "row 3" in problems[0], problems


def test_verify_catches_bad_index_and_ids(two_shards: Path) -> None:
    with h5py.File(two_shards / "val" / "shard-00000-of-00002.h5", "r") as h5:
        x, index = h5["x"][()], h5["index"][()]
    rewrite(two_shards, "val", 0, index=np.where(np.arange(len(index)) == len(index) - 1, index[0], index))
    problems = verify(two_shards)
    assert len(problems) == 1 and "index" in problems[0] and "val" in problems[0], problems
    rewrite(two_shards, "val", 0, index=index)  # the index restored; now an id past the vocabulary
    x[0, 2] = 300
    rewrite(two_shards, "val", 0, x=x)
    problems = verify(two_shards)
    assert len(problems) == 1 and "300" in problems[0] and "257" in problems[0], problems
