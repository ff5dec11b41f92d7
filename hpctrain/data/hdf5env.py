"""HDF5's file-locking setting, as the library will apply it.

HDF5 reads `HDF5_USE_FILE_LOCKING` itself at every file open and h5py has no call that reports it (a new file
access property list shows only the build default), so this module reads the variable, once, and says what it
means. Nothing else in hpctrain looks at it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

VARIABLE = "HDF5_USE_FILE_LOCKING"
# The values HDF5 understands (case-sensitive, as HDF5 compares them); anything else is ignored by HDF5.
_MEANINGS = {"FALSE": "off", "0": "off", "TRUE": "on", "1": "on", "BEST_EFFORT": "best-effort"}


@dataclass(frozen=True, slots=True)
class FileLocking:
    """How HDF5 locks files: `mode` is on, off or best-effort; `source` says where that comes from."""

    mode: str
    source: str
    raw: str | None = None
    valid: bool = True


def file_locking(default: tuple[bool, bool], environ: Mapping[str, str] | None = None) -> FileLocking:
    """The effective locking mode, given the library default `(use_locking, ignore_when_disabled)` (what h5py's
    `PropFAID.get_file_locking()` returns) and the environment (`os.environ` unless given)."""
    environ = os.environ if environ is None else environ
    raw = environ.get(VARIABLE)
    use, ignore = default
    built_in = "off" if not use else ("best-effort" if ignore else "on")
    if raw is None or raw == "":
        return FileLocking(mode=built_in, source="HDF5 default")
    if raw in _MEANINGS:
        return FileLocking(mode=_MEANINGS[raw], source=f"{VARIABLE}={raw}", raw=raw)
    return FileLocking(mode=built_in, source=f"HDF5 default ({VARIABLE}={raw!r} is ignored)", raw=raw, valid=False)


def reader_locking(environ: Mapping[str, str] | None = None) -> bool | None:
    """The `locking=` argument hpctrain's shard reader passes to h5py: off (shards are read-only and locks
    hang or fail on Lustre and NFS) unless the user set HDF5_USE_FILE_LOCKING, which HDF5 then applies."""
    environ = os.environ if environ is None else environ
    return None if environ.get(VARIABLE) else False
