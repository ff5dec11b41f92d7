"""Files on disk that the shard writer and the checkpoint writer share: durable renames, whole-file sha256."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


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
