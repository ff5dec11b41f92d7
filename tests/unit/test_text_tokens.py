"""Text -> tokens -> packed rows -> language-model shards: the text sources, the tokenizers, packing and the
shard writer, on real files in tmp_path."""

from __future__ import annotations

import dataclasses
import json
import tracemalloc
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpctrain.base.durable import sha256_file
from hpctrain.base.errors import ConfigError, DataError
from hpctrain.data.shardformat import load_manifest, verify
from hpctrain.data.text import is_val, open_documents, pieces_of, split_documents
from hpctrain.data.tokens import (BYTES_SHA256, EOT_TEXT, BytesTokenizer, Packer, PackStats, load_tokenizer, pack,
                                  token_dtype, tokenize, train_bpe)
from hpctrain.base.config import ShardConfig
from hpctrain.data.tokenshards import write_token_shards

TEXTS = ["héllo wörld, ünïcode ✓ and 😀\n", "second document\nwith two lines", "x", "Ω" * 50 + " end"]


def read_docs(spec: str, **kwargs: object) -> list[bytes]:
    return [b"".join(doc) for doc in open_documents(spec, **kwargs)]


def write_corpus(folder: Path, texts: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, t in enumerate(texts):
        (folder / f"doc-{i:04d}.txt").write_text(t, encoding="utf-8")
    return folder


# ---------------------------------------------------------------------------------------------------
# tokenizers and packing
# ---------------------------------------------------------------------------------------------------

def test_bytes_tokenizer_round_trip() -> None:
    tok = BytesTokenizer()
    assert (tok.vocab_size, tok.eot_id, tok.sha256) == (257, 256, BYTES_SHA256)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids.dtype == np.uint16 and ids.max() < 256
        np.testing.assert_array_equal(ids, np.frombuffer(text.encode(), np.uint8))
        assert tok.decode(ids) == text
        assert np.array_equal(tok.encode(text.encode()), ids)
    both = np.concatenate([tok.encode("a"), [tok.eot_id], tok.encode("b")])
    assert tok.decode(both) == f"a{EOT_TEXT}b"
    with pytest.raises(DataError, match="id 300 .* 0..256"):
        tok.decode([300])


def test_token_dtype() -> None:
    assert token_dtype(257) == np.uint16 and token_dtype(1 << 16) == np.uint16
    assert token_dtype((1 << 16) + 1) == np.uint32
    with pytest.raises(ConfigError):
        token_dtype(0)


def test_pack_is_exact() -> None:
    """Every token in order, EOT after each document, rows of seq_len + 1 sharing one token, tail dropped."""
    rng = np.random.default_rng(0)
    docs = [bytes(rng.integers(97, 123, n, dtype=np.uint8)) for n in rng.integers(0, 40, 60)]
    tok = BytesTokenizer()
    stream = np.concatenate([np.append(tok.encode(d), tok.eot_id) for d in docs]).astype(np.uint16)
    seq_len, stats = 7, PackStats()
    blocks = list(pack(tokenize([[d] for d in docs], tok), seq_len, block_rows=5, stats=stats))
    assert all(len(b) == 5 for b in blocks[:-1]) and 0 < len(blocks[-1]) <= 5
    rows = np.concatenate(blocks)
    assert rows.dtype == np.uint16 and rows.shape[1] == seq_len + 1
    n = (len(stream) - 1) // seq_len
    assert len(rows) == n == stats.rows and stats.tokens == len(stream)
    for r in range(n):
        np.testing.assert_array_equal(rows[r], stream[r * seq_len:r * seq_len + seq_len + 1])
    assert stats.dropped_tokens == len(stream) - (n * seq_len + 1)
    assert (rows == tok.eot_id).sum() - (rows[1:, 0] == tok.eot_id).sum() == (stream[:n * seq_len + 1] == 256).sum()


def test_pack_short_stream_and_big_pieces() -> None:
    stats = PackStats()
    assert list(pack([np.arange(5, dtype=np.uint16)], 8, stats=stats)) == []
    assert (stats.rows, stats.dropped_tokens) == (0, 5)
    ids = np.arange(10_000, dtype=np.uint32) % 60_000  # one piece much bigger than a block
    rows = np.concatenate(list(pack([ids], 9, dtype=np.uint32, block_rows=4)))
    assert rows.dtype == np.uint32
    np.testing.assert_array_equal(rows[:, :-1].ravel(), ids[:len(rows) * 9])


def test_packer_and_reader_memory_stay_bounded(tmp_path: Path) -> None:
    """A 48 MiB one-line file (one document), read in 1 MiB pieces and packed in 256 KiB blocks: Python's
    peak allocation stays a few MiB, far from the size of the text."""
    path = tmp_path / "big.txt"
    line = ("the quick brown fox jumps over the lazy dog, " * 1000).encode()
    with open(path, "wb") as fh:
        for _ in range((48 << 20) // len(line)):
            fh.write(line)
    size = path.stat().st_size
    packer = Packer(127, np.dtype(np.uint16), 1024)
    tracemalloc.start()
    try:
        rows = 0
        for ids in tokenize(open_documents(f"text:{path}", piece_bytes=1 << 20), BytesTokenizer()):
            for block in packer.add(ids):
                assert block.shape == (1024, 128)
                rows += len(block)
        last = packer.finish()
        rows += 0 if last is None else len(last)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert packer.stats.tokens == size + 1 and rows == packer.stats.rows == size // 127
    assert peak < 12 << 20, f"peak {peak / 2**20:.1f} MiB for {size / 2**20:.0f} MiB of text"


# ---------------------------------------------------------------------------------------------------
# sources
# ---------------------------------------------------------------------------------------------------

def test_pieces_cut_at_newlines_spaces_and_characters(tmp_path: Path) -> None:
    text = ("Ω😀é" * 300 + "\n" + "word " * 200 + "ünï" * 500).encode()
    for piece_bytes in (16, 64, 1000):
        pieces = list(pieces_of(text, piece_bytes))
        assert b"".join(pieces) == text and all(len(p) <= piece_bytes for p in pieces)
        for p in pieces:
            p.decode("utf-8")
        path = tmp_path / f"t{piece_bytes}.txt"
        path.write_bytes(text)
        pieces = list(next(open_documents(f"text:{path}", piece_bytes=piece_bytes)))
        assert b"".join(pieces) == text and all(len(p) <= 2 * piece_bytes for p in pieces)
    assert list(pieces_of(b"a" * 10 + b"\n" + b"b c" * 5, 16)) == [b"a" * 10 + b"\n", b"b c" * 5]
    assert list(pieces_of(b"a" * 12 + b" bbb" * 3, 16)) == [b"a" * 12 + b" bbb", b" bbb" * 2]
    assert list(pieces_of(b"a" * 20, 16)) == [b"a" * 16, b"a" * 4]
    assert list(pieces_of(("a" * 15 + "éa").encode(), 16)) == \
        [b"a" * 15, "éa".encode()]


def test_directory_walk_is_sorted_and_globbed(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / ".git").mkdir()
    for rel, text in {"b.txt": "B", "a.txt": "A", "sub/c.txt": "C", "notes.md": "M", ".hidden.txt": "H",
                      ".git/x.txt": "G", "empty.txt": ""}.items():
        (root / rel).write_text(text)
    assert read_docs(f"text:{root}") == [b"A", b"B", b"C"]
    assert read_docs(f"text:{root}", glob="*.txt") == [b"A", b"B"]
    assert read_docs(f"text:{root}", glob="**/*.md") == [b"M"]
    assert read_docs(f"text:{root / 'sub' / 'c.txt'}") == [b"C"]
    with pytest.raises(DataError, match="no files"):
        open_documents(f"text:{root}", glob="*.rst")
    with pytest.raises(DataError, match="does not exist"):
        open_documents(f"text:{root / 'missing'}")
    (root / "latin.txt").write_bytes("caf\xe9 ok".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin\.txt: not UTF-8 at byte 3"):
        read_docs(f"text:{root}")


def test_jsonl_field_and_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text('{"body": "first", "id": 1}\n\n{"body": "zwëite"}\n{"body": null}\n{"body": "third"}\n')
    assert read_docs(str(path), field="body") == [b"first", "zwëite".encode(), b"third"]
    with pytest.raises(DataError, match=r"docs\.jsonl:1: no field 'text' \(the line has 'body', 'id'\).*--text-field"):
        read_docs(str(path))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": "broken\n')
    docs = open_documents(f"jsonl:{bad}")
    assert b"".join(next(docs)) == b"ok"
    with pytest.raises(DataError, match=r"bad\.jsonl:2: not valid JSON"):
        next(docs)
    (tmp_path / "list.jsonl").write_text('["text"]\n')
    with pytest.raises(DataError, match=r"list\.jsonl:1: .*JSON object"):
        read_docs(str(tmp_path / "list.jsonl"))


def test_parquet_column(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    folder = tmp_path / "pq"
    folder.mkdir()
    pq.write_table(pa.table({"id": [1, 2, 3], "content": ["alpha", None, "gämma"]}), folder / "b.parquet",
                   row_group_size=2)
    pq.write_table(pa.table({"id": [4], "content": ["zero"]}), folder / "a.parquet")
    assert read_docs(f"parquet:{folder / 'b.parquet'}", field="content") == [b"alpha", "gämma".encode()]
    assert read_docs(f"parquet:{folder}", field="content") == [b"zero", b"alpha", "gämma".encode()]
    with pytest.raises(DataError, match=r"no column 'text' \(its columns: id, content\)"):
        open_documents(f"parquet:{folder}")
    with pytest.raises(DataError, match="not strings"):
        open_documents(f"parquet:{folder}", field="id")


def test_split_is_even_and_deterministic() -> None:
    flags = [is_val(i, 0.25) for i in range(12)]
    assert [i for i, v in enumerate(flags) if v] == [3, 7, 11]
    assert sum(is_val(i, 0.01) for i in range(1000)) == 10 and not is_val(0, 0.5)
    assert not any(is_val(i, 0.0) for i in range(100))
    splits = [s for s, _ in split_documents([[b"x"]] * 10, 0.2)]
    assert splits.count("val") == 2 and splits == [s for s, _ in split_documents([[b"y"]] * 10, 0.2)]
    with pytest.raises(ConfigError, match="--val-fraction"):
        is_val(0, 1.0)


# ---------------------------------------------------------------------------------------------------
# BPE
# ---------------------------------------------------------------------------------------------------

def test_train_bpe_round_trip(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    corpus = write_corpus(tmp_path / "c", [f"the cat {i} sat on the mat; ünïcode ✓ {i * 7}\n" * 5 for i in range(40)])
    tok = train_bpe(open_documents(f"text:{corpus}"), 400, tmp_path / "tokenizer.json")
    assert tok.sha256 == sha256_file(tmp_path / "tokenizer.json")
    assert tok.tokenizer.token_to_id(EOT_TEXT) == tok.eot_id and 257 <= tok.vocab_size <= 400
    for text in ["the cat sat on the mat", "ünïcode ✓ 😀 never seen", "  spaces\n\nand lines "]:
        ids = tok.encode(text)
        assert ids.dtype == np.uint16 and tok.decode(ids) == text
    assert len(tok.encode("the cat sat on the mat")) < len("the cat sat on the mat") // 2
    long = "".join(f"the cat {i} sat on the mat\n" for i in range(3000)).encode()  # encoded in parts, cut at newlines
    np.testing.assert_array_equal(tok.encode_batch([b"x", long])[1], tok.encode(long))
    again = load_tokenizer(tmp_path / "tokenizer.json")
    assert (again.vocab_size, again.eot_id, again.sha256) == (tok.vocab_size, tok.eot_id, tok.sha256)
    with pytest.raises(ConfigError, match="257"):
        train_bpe([], 100, tmp_path / "small.json")


def test_tokenizer_without_eot_gets_one(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    raw = tokenizers.Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.train_from_iterator(["hello world"] * 10, trainers.BpeTrainer(vocab_size=270, show_progress=False,
                                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    raw.save(str(tmp_path / "noeot.json"))
    tok = load_tokenizer(tmp_path / "noeot.json")
    assert tok.eot_id == tok.vocab_size - 1 and EOT_TEXT in tok.name
    with pytest.raises(ConfigError, match="neither `bytes` nor a tokenizer.json"):
        load_tokenizer(tmp_path / "missing.json")


# ---------------------------------------------------------------------------------------------------
# the shard writer
# ---------------------------------------------------------------------------------------------------

def read_split(out: Path, split: str) -> np.ndarray:
    rows, ids = [], []
    for f in load_manifest(out).splits[split]:
        with h5py.File(f.path, "r") as h5:
            assert h5["x"].fletcher32 and h5["index"].fletcher32 and "y" not in h5
            rows.append(h5["x"][()])
            ids.append(h5["index"][()])
    index = np.concatenate(ids)
    assert np.array_equal(np.sort(index), np.arange(len(index)))
    return np.concatenate(rows)[np.argsort(index)]


def test_write_token_shards(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    texts = [" ".join(["wörd"] * int(n)) + "\n" for n in rng.integers(1, 200, 50)]
    corpus = write_corpus(tmp_path / "corpus", texts)
    cfg = ShardConfig(source=f"text:{corpus}", out=tmp_path / "out", seq_len=16, shards=3, val_fraction=0.1,
                           chunk_rows=4)
    manifest = write_token_shards(cfg)
    out = cfg.out
    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert manifest["task"] == "lm" and manifest["vocab_size"] == manifest["num_classes"] == 257
    assert manifest["seq_len"] == 16 and manifest["x"] == {"dtype": "uint16", "shape": [17]}
    assert manifest["tokenizer"]["name"] == "bytes" and manifest["tokenizer"]["sha256"] == BYTES_SHA256
    shardset = load_manifest(out)
    assert shardset.x_shape == (17,) and shardset.num_classes == 257
    tok = BytesTokenizer()
    for split in ("train", "val"):
        body = manifest["splits"][split]
        mine = [t.encode() for i, t in enumerate(texts) if is_val(i, 0.1) == (split == "val")]
        assert body["documents"] == len(mine) and body["text_bytes"] == sum(map(len, mine))
        assert body["tokens"] == body["text_bytes"] + len(mine)
        sizes = [e["samples"] for e in body["shards"]]
        assert max(sizes) - min(sizes) <= 1 and sum(sizes) == body["samples"]
        for e in body["shards"]:
            assert sha256_file(out / e["file"]) == e["sha256"]
        expected = np.concatenate(list(pack(tokenize([[d] for d in mine], tok), 16)))
        np.testing.assert_array_equal(read_split(out, split), expected)
        assert body["target_tokens"] == len(expected) * 16
        assert body["dropped_tokens"] == body["tokens"] - (len(expected) * 16 + 1)
    assert verify(out) == []  # the row check finds nothing wrong with rows packed right
    with pytest.raises(ConfigError, match="already exists"):
        write_token_shards(cfg)
    again = write_token_shards(dataclasses.replace(cfg, force=True))
    assert again["splits"] == manifest["splits"]


def test_write_token_shards_jsonl_bpe_and_failures(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"line {i} of the corpus, with ünïcode\n" * 20}) + "\n"
                            for i in range(30)))
    tok = train_bpe(open_documents(str(path)), 300, tmp_path / "tok.json")
    cfg = ShardConfig(source=str(path), out=tmp_path / "lm", tokenizer=str(tmp_path / "tok.json"), seq_len=8,
                           shards=2, val_fraction=0.0)
    manifest = write_token_shards(cfg)
    assert set(manifest["splits"]) == {"train"} and manifest["tokenizer"]["sha256"] == tok.sha256
    assert manifest["eot_id"] == tok.eot_id and manifest["vocab_size"] == tok.vocab_size
    rows = read_split(cfg.out, "train")
    assert tok.decode(rows[:, :-1].ravel()).startswith("line 0 of the corpus")
    assert verify(cfg.out) == []  # a subword tokenizer: the row check holds too
    # a bad line late in the file: an error naming it, and nothing written
    with open(path, "a") as fh:
        fh.write('{"txt": "oops"}\n')
    bad = ShardConfig(source=str(path), out=tmp_path / "deep" / "lm2", seq_len=8, shards=2)
    with pytest.raises(DataError, match=r"docs\.jsonl:31: no field 'text'"):
        write_token_shards(bad)
    assert not (tmp_path / "deep").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    with pytest.raises(DataError, match="fewer than --shards 64"):
        write_token_shards(ShardConfig(source=f"text:{write_corpus(tmp_path / 'c', ['tiny text'] * 3)}",
                                            out=tmp_path / "few", seq_len=2, shards=64, val_fraction=0.0))
    with pytest.raises(ConfigError, match="not text"):
        write_token_shards(ShardConfig(source="digits", out=tmp_path / "x"))
    assert not (tmp_path / "x").exists()
