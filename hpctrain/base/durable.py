"""Files on disk: atomic replacement, durable renames, whole-file sha256 (shards, checkpoints, run files)."""

from __future__ import annotations

import hashlib
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """Write `path` whole or not at all: yield a temporary name beside it to write to, then rename it into
    place (atomic on POSIX), so a reader (a report viewer, a resumed run) never sees half a file. On an
    error the temporary file is removed and `path` is left as it was."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: Path, text: str) -> None:
    """Replace the text file `path` atomically (see `replacing`)."""
    with replacing(path) as tmp:
        tmp.write_text(text)


def fsync_dir(path: Path) -> None:
    """fsync a directory, so that the entries created or renamed in it survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path, block: int = 1 << 22) -> str:
    """The sha256 of a file, read in blocks (never whole into memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(block):
            digest.update(chunk)
    return digest.hexdigest()
