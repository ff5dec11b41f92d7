"""Files on disk: atomic replacement, durable renames, whole-file sha256 (shards, checkpoints, run files), and
what a failed write says (which file, why, and on a full disk the free and needed bytes)."""

from __future__ import annotations

import errno
import hashlib
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .errors import StorageError

NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


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


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on the filesystem of `path` (or of its nearest existing
    parent); None when that cannot be asked."""
    for where in (Path(path).absolute(), *Path(path).absolute().parents):
        if where.is_dir():
            try:
                st = os.statvfs(where)
            except OSError:
                return None
            return st.f_bavail * st.f_frsize
    return None


def human_bytes(n: int | None) -> str:
    """`n` bytes for a person: 512 B, 3.0 MiB."""
    if n is None:
        return "unknown"
    if n < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        size /= 1024
        if size < 1024:
            break
    else:
        unit, size = "TiB", size / 1024
    return f"{size:.1f} {unit}"


def write_failure(exc: OSError, path: Path, *, needed: int | None = None) -> StorageError:
    """The one-line error for a failed write of `path`: why, and on a full disk (or quota) how many bytes are
    free on its filesystem and, when known, how many the write needed."""
    text = f"cannot write {path}: {exc.strerror or type(exc).__name__}"
    no_space = exc.errno in NO_SPACE
    if no_space:
        text += f" ({human_bytes(free_bytes(Path(path).parent))} free"
        text += f", {human_bytes(needed)} needed)" if needed else ")"
    error = StorageError(text)
    error.no_space = no_space
    return error


class WriteFaults:
    """The first failed write of a run file that could not be raised where it happened: a log line or a metrics
    record is written by one rank alone, mid-step, while the others go on into the next collective, so
    raising there would end this rank alone. The checkpoint policy reads it at the next step boundary and
    stops every rank together. One per process (`FAULTS`); a run clears it when it opens its logs."""

    def __init__(self) -> None:
        self.first: StorageError | None = None

    def record(self, error: StorageError) -> bool:
        """Keep `error` if it is the first; True when it was."""
        if self.first is not None:
            return False
        self.first = error
        return True

    def clear(self) -> None:
        self.first = None


FAULTS = WriteFaults()
