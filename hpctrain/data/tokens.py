"""Tokenizers and packing for language-model shards: text pieces -> token ids -> rows of seq_len + 1 tokens.

Two tokenizers share one small protocol (`Tokenizer`): `bytes`, with nothing to train or store (ids 0..255
are the UTF-8 bytes of the text, 256 is the end of a document), and a Hugging Face `tokenizers` file
(tokenizer.json), which `train_bpe` can make from the documents themselves.

`tokenize` turns documents into token arrays, each document followed by one EOT id. `Packer` (and the
generator `pack` around it) joins them into one stream and cuts it into rows of seq_len + 1 tokens, row r
being stream[r * seq_len : r * seq_len + seq_len + 1]: consecutive rows share one token, so a model that
reads row[:-1] and predicts row[1:] predicts every token of the stream but the first exactly once. The
tail that fills no whole row is dropped and counted. Memory is one block of rows, whatever the input.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Protocol

import numpy as np

from ..base.durable import replacing, sha256_file
from ..base.errors import ConfigError, DataError
from .text import pieces_of

EOT_TEXT = "<|endoftext|>"
BYTES_VOCAB = 257  # ids 0..255: the UTF-8 bytes; 256: end of text
BYTES_SHA256 = hashlib.sha256(b"hpctrain bytes tokenizer 1: ids 0..255 are UTF-8 bytes, 256 ends a document").hexdigest()
BLOCK_BYTES = 4 << 20  # default size of one block of packed rows
ENCODE_BATCH_BYTES = 1 << 20  # text handed to the tokenizer in one call (tokenizers encodes a batch in parallel)
ENCODE_PART_BYTES = 16 << 10  # the longest text tokenizers is given to encode at once


class Tokenizer(Protocol):
    """What packing needs of a tokenizer. `sha256` identifies it in the manifest (its file's hash)."""

    name: str
    vocab_size: int  # every id is below it
    eot_id: int  # the id that follows every document
    sha256: str

    def encode(self, text: str | bytes) -> np.ndarray:
        """The ids of `text` (str, or UTF-8 bytes), as `token_dtype(vocab_size)`, without any EOT."""
        ...

    def encode_batch(self, texts: list[bytes]) -> list[np.ndarray]:
        """`encode` of each of `texts`, maybe in parallel."""
        ...

    def decode(self, ids: Any) -> str:
        """The text of `ids`."""
        ...


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65,536, ids 0..65,535), else uint32."""
    if not 1 <= vocab_size <= 1 << 32:
        raise ConfigError(f"vocab_size {vocab_size!r} must be between 1 and 2**32")
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


@dataclass(frozen=True, slots=True)
class BytesTokenizer:
    """ids 0..255 are the bytes of the UTF-8 text, 256 (`eot_id`) ends a document: vocab_size 257. Nothing to
    train or store; its `sha256` is a constant naming this scheme. Exact for any text."""

    name: str = "bytes"
    vocab_size: int = BYTES_VOCAB
    eot_id: int = BYTES_VOCAB - 1
    sha256: str = BYTES_SHA256

    def encode(self, text: str | bytes) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else text
        return np.frombuffer(data, np.uint8).astype(np.uint16)

    def encode_batch(self, texts: list[bytes]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Any) -> str:
        """The text; an EOT becomes "<|endoftext|>", bytes that are not UTF-8 become U+FFFD."""
        ids = np.asarray(ids).ravel()
        if ids.size and (ids.min() < 0 or ids.max() >= BYTES_VOCAB):
            raise DataError(f"id {int(ids.max() if ids.max() >= BYTES_VOCAB else ids.min())} is not a bytes "
                            f"token: ids are 0..{BYTES_VOCAB - 1}")
        cuts = np.flatnonzero(ids == self.eot_id)
        parts = np.split(ids, cuts)
        texts = [bytes(p[p != self.eot_id].astype(np.uint8)).decode("utf-8", errors="replace") for p in parts]
        return EOT_TEXT.join(texts)


@dataclass(frozen=True, slots=True)
class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer read from its tokenizer.json. EOT is its "<|endoftext|>" token;
    a file without one gets it added as a special token with the next free id (so vocab_size grows by one;
    `sha256` stays that of the file, and the addition is the same every time)."""

    tokenizer: Any
    path: Path
    name: str
    vocab_size: int
    eot_id: int
    sha256: str

    def encode(self, text: str | bytes) -> np.ndarray:
        text = text.decode("utf-8") if isinstance(text, bytes) else text
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, token_dtype(self.vocab_size))

    def encode_batch(self, texts: list[bytes]) -> list[np.ndarray]:
        """Each text cut further into parts of at most ENCODE_PART_BYTES (at newlines where it can, see
        `text.pieces_of`): tokenizers encodes the parts of a batch in parallel, one long text on one thread,
        and holds offsets and strings per token of the text it is given."""
        dtype = token_dtype(self.vocab_size)
        parts = [list(pieces_of(t, ENCODE_PART_BYTES)) for t in texts]
        flat = [p.decode("utf-8") for ps in parts for p in ps]
        ids = iter(np.asarray(e.ids, dtype) for e in self.tokenizer.encode_batch(flat, add_special_tokens=False))
        out = []
        for ps in parts:
            chunk = [next(ids) for _ in ps]
            out.append(chunk[0] if len(chunk) == 1 else np.concatenate(chunk))
        return out

    def decode(self, ids: Any) -> str:
        return self.tokenizer.decode(np.asarray(ids).ravel().tolist(), skip_special_tokens=False)


def _tokenizers_module() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise ConfigError("a tokenizer.json needs the Hugging Face tokenizers package, which is not installed: "
                          "pip install tokenizers (or use --tokenizer bytes)") from None
    return tokenizers


def load_tokenizer(spec: str | Path) -> BytesTokenizer | HFTokenizer:
    """`bytes`, or the path of a Hugging Face tokenizer.json."""
    if str(spec) == "bytes":
        return BytesTokenizer()
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(f"--tokenizer {str(spec)!r} is neither `bytes` nor a tokenizer.json file: check the path, "
                          "or train one with `hpctrain shard ... --train-tokenizer V`")
    tokenizers = _tokenizers_module()
    try:
        tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises its own Exception type for a bad file
        raise DataError(f"cannot read {str(path)!r} as a tokenizers JSON file ({exc}); give a tokenizer.json") from None
    name = f"tokenizers:{path.name}"
    if tok.token_to_id(EOT_TEXT) is None:
        tok.add_special_tokens([EOT_TEXT])
        name += f" +{EOT_TEXT}"
    vocab_size = max(tok.get_vocab(with_added_tokens=True).values()) + 1  # ids may have gaps: the largest counts
    return HFTokenizer(tok, path, name, vocab_size, tok.token_to_id(EOT_TEXT), sha256_file(path))


def train_bpe(documents: Iterable[Iterable[bytes]], vocab_size: int, out_path: Path | str, *,
              min_frequency: int = 2) -> HFTokenizer:
    """Train a byte-level BPE tokenizer (GPT-2's scheme: 256 byte symbols, merges learned from the text,
    "<|endoftext|>" as a special token) on the documents, streamed; save it atomically as `out_path`
    (a tokenizer.json) and return it. `vocab_size` counts the 256 bytes and EOT, so it is at least 257."""
    if not isinstance(vocab_size, int) or not 257 <= vocab_size <= 1 << 32:
        raise ConfigError(f"vocab_size {vocab_size!r} must be a whole number from 257 (the 256 bytes and EOT) "
                          "up, e.g. 32000")
    tokenizers = _tokenizers_module()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOT_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((piece.decode("utf-8") for doc in documents for piece in doc), trainer=trainer)
    out_path = Path(out_path)
    with replacing(out_path) as tmp:
        tok.save(str(tmp))
    return load_tokenizer(out_path)  # type: ignore[return-value]


def tokenize_tagged(documents: Iterable[tuple[Any, Iterable[bytes]]], tokenizer: Tokenizer,
                    batch_bytes: int = ENCODE_BATCH_BYTES) -> Iterator[tuple[Any, np.ndarray]]:
    """(tag, ids) for the pieces of each (tag, document), in order, each document followed by (tag, [EOT]).
    Pieces are encoded about `batch_bytes` at a time (one call to the tokenizer for many small documents)."""
    eot = np.array([tokenizer.eot_id], token_dtype(tokenizer.vocab_size))
    pending: list[tuple[Any, bytes | None]] = []  # None: the end of a document
    size = 0

    def flush() -> Iterator[tuple[Any, np.ndarray]]:
        encoded = iter(tokenizer.encode_batch([p for _, p in pending if p is not None]))
        for tag, piece in pending:
            yield tag, eot if piece is None else next(encoded)
        pending.clear()

    for tag, doc in documents:
        for piece in doc:
            pending.append((tag, piece))
            size += len(piece)
            if size >= batch_bytes:
                yield from flush()
                size = 0
        pending.append((tag, None))
    yield from flush()


def tokenize(documents: Iterable[Iterable[bytes]], tokenizer: Tokenizer) -> Iterator[np.ndarray]:
    """The ids of the documents' pieces, in order, each document followed by [EOT]."""
    for _, ids in tokenize_tagged(((None, doc) for doc in documents), tokenizer):
        yield ids


@dataclass(slots=True)
class PackStats:
    """What a packer took in and gave out. `dropped_tokens`: the tail that filled no whole row."""

    tokens: int = 0
    rows: int = 0
    dropped_tokens: int = 0


@dataclass(slots=True)
class Packer:
    """Joins token arrays into one stream and cuts it into rows of seq_len + 1 tokens (see the module
    docstring), handed out in blocks of exactly `block_rows` rows by `add`, the last, shorter block by
    `finish`. Holds one block's worth of tokens, whatever it is fed; every block it hands out is a new array
    (never a view of that buffer), the caller's to keep or pass to another thread."""

    seq_len: int
    dtype: np.dtype = np.dtype(np.uint16)
    block_rows: int = 0
    """Rows per block (0: about 4 MiB of rows)."""
    stats: PackStats = field(default_factory=PackStats)
    _buf: np.ndarray = field(init=False, repr=False)
    _fill: int = field(init=False, default=0, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.seq_len, int) or self.seq_len < 1:
            raise ConfigError(f"--seq-len {self.seq_len!r} must be a whole number of at least 1, e.g. --seq-len 1024")
        self.dtype = np.dtype(self.dtype)
        row_bytes = (self.seq_len + 1) * self.dtype.itemsize
        self.block_rows = self.block_rows or max(1, BLOCK_BYTES // row_bytes)
        self._buf = np.empty(self.block_rows * self.seq_len + 1, self.dtype)

    def add(self, ids: np.ndarray) -> list[np.ndarray]:
        """Take `ids`; return the blocks they completed (often none)."""
        blocks = []
        n, pos = len(ids), 0
        self.stats.tokens += n
        while pos < n:
            take = min(n - pos, len(self._buf) - self._fill)
            self._buf[self._fill:self._fill + take] = ids[pos:pos + take]
            self._fill += take
            pos += take
            if self._fill == len(self._buf):
                blocks.append(self._rows(self.block_rows))
                self._buf[0] = self._buf[-1]  # the last token of this block's last row starts the next row
                self._fill = 1
        return blocks

    def _rows(self, rows: int) -> np.ndarray:
        """The first `rows` rows of the buffer, in memory of their own: the buffer is refilled at once, while
        the block may still wait for a writer thread. Always a copy (rows overlap by one token, so a block
        cannot be the buffer itself); `np.ascontiguousarray` would hand back a view for one row."""
        view = np.lib.stride_tricks.sliding_window_view(self._buf[:rows * self.seq_len + 1], self.seq_len + 1)
        self.stats.rows += rows
        return view[::self.seq_len].copy(order="C")

    def finish(self) -> np.ndarray | None:
        """The rows left (fewer than a block; None when there are none), the rest counted as dropped."""
        rows = (self._fill - 1) // self.seq_len if self._fill > 1 else 0
        block = self._rows(rows) if rows else None
        covered = self.stats.rows * self.seq_len + 1 if self.stats.rows else 0
        self.stats.dropped_tokens = self.stats.tokens - covered
        self._fill = 0
        return block


def pack(token_stream: Iterable[np.ndarray], seq_len: int, *, dtype: Any = np.uint16, block_rows: int = 0,
         stats: PackStats | None = None) -> Iterator[np.ndarray]:
    """Blocks of rows (block_rows, seq_len + 1) of `dtype` from a stream of token arrays (documents already
    ended by EOT, as `tokenize` gives them); the last block may be shorter. `stats`, when given, holds the
    counts once the generator is exhausted."""
    packer = Packer(seq_len, np.dtype(dtype), block_rows, stats if stats is not None else PackStats())
    for ids in token_stream:
        yield from packer.add(ids)
    last = packer.finish()
    if last is not None:
        yield last
