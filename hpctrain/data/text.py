"""Text documents for language-model shards: the text SOURCE forms, streamed in pieces, and the
deterministic train/val split of documents.

A document is an iterable of UTF-8 `bytes` pieces of at most about `piece_bytes` each (4 MiB by default),
so a 1 GB file is never in memory whole. A piece that is not a document's last ends after a newline when
there is one in its second half, else before a space there, else at a UTF-8 character boundary: every
piece decodes on its own, and a subword tokenizer (whose pre-tokenizer splits at newlines and before
spaces) rarely sees a cut inside a word. Every piece is checked to be UTF-8.

The forms (`TEXT_FORMS`):
- `text:PATH`: PATH a file (one document) or a directory whose files matching `glob` (default `**/*.txt`),
  walked in sorted order of their relative paths, are one document each; hidden files and folders are skipped.
- `FILE.jsonl` or `jsonl:PATH` (a file, or a directory of `**/*.jsonl`): one JSON object per line, the
  document in its field `field` (default `text`); blank lines are skipped.
- `FILE.parquet` or `parquet:PATH` (a file, or a directory of `**/*.parquet`; needs pyarrow): one document
  per row of the string column `field` (default `text`), read in record batches.

Empty documents (an empty file, an empty or null text) are skipped: they count nowhere, not even in the
document numbering of the split.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Iterator

from ..base.errors import ConfigError, DataError

TEXT_FORMS = "text:PATH (a file or a directory), FILE.jsonl or jsonl:PATH, parquet:PATH"
PIECE_BYTES = 4 << 20  # the largest piece of a document handed on at once
DEFAULT_GLOB = {"text": "**/*.txt", "jsonl": "**/*.jsonl", "parquet": "**/*.parquet"}
PARQUET_BATCH_ROWS = 256  # rows of a Parquet file converted to Python strings at a time

Document = Iterable[bytes]


def text_form(spec: str) -> str | None:
    """`text`, `jsonl` or `parquet` for a text SOURCE, None for anything else. A plain FILE.parquet is a
    table of features and labels (`sources`); its text column is read as `parquet:FILE`."""
    for form in DEFAULT_GLOB:
        if spec.startswith(form + ":"):
            return form
    return "jsonl" if Path(spec).suffix.lower() == ".jsonl" else None


def open_documents(spec: str, *, glob: str | None = None, field: str = "text",
                   piece_bytes: int = PIECE_BYTES) -> Iterator[Document]:
    """The documents of the text SOURCE `spec`, in order. The files are found and checked now (a missing
    path, a glob that matches nothing, a Parquet file without the column raise DataError here); the
    documents are read as they are asked for. Consume each document before asking for the next."""
    form = text_form(spec)
    if form is None:
        raise DataError(f"unknown text SOURCE {spec!r}: use one of {TEXT_FORMS}")
    if piece_bytes < 16:
        raise ConfigError(f"piece_bytes {piece_bytes!r} must be at least 16 (default {PIECE_BYTES})")
    path = Path(spec[len(form) + 1:] if spec.startswith(form + ":") else spec)
    files = list_files(path, glob or DEFAULT_GLOB[form], spec)
    if form == "text":
        return _text_documents(files, piece_bytes)
    if form == "jsonl":
        return _jsonl_documents(files, field, piece_bytes)
    return _parquet_documents(files, field, piece_bytes)


def list_files(path: Path, pattern: str, spec: str) -> list[Path]:
    """`path` itself when it is a file, else the files below it that match `pattern`, sorted by their path
    relative to it, hidden ones (any part starting with '.') left out."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DataError(f"SOURCE {spec!r}: {str(path)!r} does not exist; check the path")
    found = sorted((p.relative_to(path).as_posix(), p) for p in path.glob(pattern) if p.is_file())
    files = [p for rel, p in found if not any(part.startswith(".") for part in rel.split("/"))]
    if not files:
        raise DataError(f"SOURCE {spec!r}: no files in {str(path)!r} match {pattern!r}; pass another --glob "
                        "(e.g. '**/*.md') or check the directory")
    return files


def _cut(data: bytes, start: int, stop: int) -> int:
    """Where a piece of data[start:stop] ends when the document goes on past `stop`: after the last newline
    in the second half, else before the last space there, else at the last UTF-8 character boundary."""
    half = start + (stop - start) // 2
    at = data.rfind(b"\n", half, stop)
    if at >= 0:
        return at + 1
    at = data.rfind(b" ", half, min(stop + 1, len(data)))  # a space just past stop: cut before it, at stop
    if at > half:
        return at
    if stop < len(data) and data[stop] & 0xC0 != 0x80:  # the next byte starts a character
        return stop
    for at in range(stop - 1, max(start, stop - 5), -1):
        lead = data[at]
        if lead & 0xC0 != 0x80:  # not a continuation byte: the last character starts here; is it whole?
            length = 1 if lead < 0x80 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
            return stop if at + length == stop else at
    return stop  # no character start in the last bytes: not UTF-8, which the check of the piece reports


def _checked(piece: bytes, where: str, offset: int) -> bytes:
    """`piece`, once it is known to be UTF-8 (DataError naming the byte offset when it is not)."""
    try:
        piece.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{where}: not UTF-8 at byte {offset + exc.start} ({exc.reason}); convert it to UTF-8 "
                        "(e.g. `iconv -f LATIN1 -t UTF-8`) or leave it out") from None
    return piece


def pieces_of(data: bytes, piece_bytes: int = PIECE_BYTES) -> Iterator[bytes]:
    """The UTF-8 text `data` cut into pieces of at most `piece_bytes` (see the module docstring)."""
    start = 0
    while len(data) - start > piece_bytes:
        end = _cut(data, start, start + piece_bytes)
        yield data[start:end]
        start = end
    yield data[start:] if start else data


def _file_pieces(path: Path, piece_bytes: int) -> Iterator[bytes]:
    """The pieces of one text file, read `piece_bytes` at a time."""
    offset, carry = 0, b""
    try:
        with open(path, "rb") as fh:
            while True:
                block = fh.read(piece_bytes)
                data = carry + block if carry else block
                if not block:
                    if data:
                        yield _checked(data, str(path), offset)
                    return
                end = _cut(data, 0, len(data))
                piece, carry = data[:end], data[end:]
                yield _checked(piece, str(path), offset)
                offset += len(piece)
    except OSError as exc:
        raise DataError(f"cannot read {str(path)!r} ({exc}); check the file and its permissions") from exc


def _text_documents(files: list[Path], piece_bytes: int) -> Iterator[Document]:
    for path in files:
        if path.stat().st_size:
            yield _file_pieces(path, piece_bytes)


def _jsonl_documents(files: list[Path], field: str, piece_bytes: int) -> Iterator[Document]:
    for path in files:
        try:
            fh = open(path, "rb")
        except OSError as exc:
            raise DataError(f"cannot read {str(path)!r} ({exc}); check the file and its permissions") from exc
        with fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                text = _jsonl_text(line, field, f"{path}:{lineno}")
                if text:
                    yield pieces_of(text, piece_bytes)


def _jsonl_text(line: bytes, field: str, where: str) -> bytes:
    """The UTF-8 bytes of the text in field `field` of one JSONL line."""
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise DataError(f"{where}: not valid JSON ({exc}); fix or delete that line") from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: a line must hold a JSON object with a {field!r} field, found "
                        f"{type(record).__name__}; fix or delete that line")
    if field not in record:
        names = ", ".join(map(repr, list(record)[:10])) or "none"
        raise DataError(f"{where}: no field {field!r} (the line has {names}); name the field that holds the text "
                        "with --text-field")
    text = record[field]
    if text is None:
        return b""
    if not isinstance(text, str):
        raise DataError(f"{where}: field {field!r} holds {type(text).__name__}, not a string; name the field "
                        "that holds the text with --text-field")
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DataError(f"{where}: field {field!r} holds an unpaired surrogate ({exc.reason}); fix that line") from None


def _parquet_documents(files: list[Path], column: str, piece_bytes: int) -> Iterator[Document]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading {str(files[0])!r} needs pyarrow, which is not installed: pip install pyarrow") from None
    for path in files:  # every file's column checked now (its metadata only), read when reached
        _parquet_file(pq, pa, path, column).close()

    def documents() -> Iterator[Document]:
        for path in files:
            try:
                with _parquet_file(pq, pa, path, column) as pf:
                    for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[column]):
                        for text in batch.column(0).to_pylist():
                            if text:
                                yield pieces_of(text.encode("utf-8"), piece_bytes)
            except (OSError, pa.ArrowException) as exc:
                raise DataError(f"cannot read {str(path)!r} as Parquet ({exc}); check the file") from exc

    return documents()


def _parquet_file(pq: Any, pa: Any, path: Path, column: str) -> Any:
    """The open Parquet file, once it has the string column `column`."""
    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"cannot read {str(path)!r} as Parquet ({exc}); check the file") from exc
    schema = pf.schema_arrow
    if column not in schema.names:
        raise DataError(f"{str(path)!r} has no column {column!r} (its columns: {', '.join(schema.names)}); name "
                        "the column that holds the text with --text-field")
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or str(kind) == "string_view"):
        raise DataError(f"column {column!r} of {str(path)!r} holds {kind}, not strings; name the column that "
                        "holds the text with --text-field")
    return pf


# ---------------------------------------------------------------------------------------------------
# The train/val split
# ---------------------------------------------------------------------------------------------------

@lru_cache(maxsize=8)
def _ratio(val_fraction: float) -> tuple[int, int]:
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"--val-fraction {val_fraction!r} must be in [0, 1), e.g. --val-fraction 0.01")
    f = Fraction(val_fraction).limit_denominator(1_000_000)
    return f.numerator, f.denominator


def is_val(index: int, val_fraction: float) -> bool:
    """Whether document `index` (0, 1, 2, ... in source order) belongs to val: exactly when
    floor((index + 1) * f) > floor(index * f), f = val_fraction.

    So of the first n documents floor(n * f) are val, spread evenly (every 1/f-th document: a source sorted
    by topic or date gets a val split sampled across it), the first document is always train, and a
    document's split depends on its index alone: appending documents never moves earlier ones. No seed: the
    reader shuffles rows every epoch anyway. The unit is the document, so a source of one document (one big
    file) has no val split; give such text as several files or JSONL lines to get one."""
    p, q = _ratio(val_fraction)
    return (index + 1) * p // q > index * p // q


def split_documents(documents: Iterable[Document], val_fraction: float) -> Iterator[tuple[str, Document]]:
    """("train" or "val", document) for every document, split as `is_val` says."""
    _ratio(val_fraction)
    for index, doc in enumerate(documents):
        yield ("val" if is_val(index, val_fraction) else "train"), doc


def check_val_split(val_fraction: float, documents: int, val_documents: int) -> None:
    """Refuse a --val-fraction that put none of two or more documents in val (of n documents floor(n * f) are
    val, so a small source at a small fraction has none): training on without a val split, unsaid, is worse than
    a line naming a fraction that gives one. One document cannot be split at all: that is said, not refused."""
    if val_fraction <= 0 or val_documents or documents < 2:
        return
    enough = math.ceil(100 / documents) / 100  # floor(documents * enough) >= 1
    raise ConfigError(f"--val-fraction {val_fraction:g} of {documents} documents puts none in val (the split is by "
                      f"document: of n documents floor(n * {val_fraction:g}) are val): give --val-fraction {enough:g} "
                      "or more for one in val, or --val-fraction 0 for no val split")
