"""Node-local staging: each rank's own shard files copied to a fast local directory and read from there.

`hpctrain train --stage-to DIR|auto` (and `ShardLoader(stage_to=...)`): before the first step, every rank copies
the train and val files the manifest assigns to it on the current world size (rank r of W: shards r, r+W, ...)
into

    DIR/hpctrain-<dataset fingerprint[:12]>-<run[:8]>/rank-NNNNN/{manifest.json, train/..., val/...}

(the files at their paths in the manifest, so the directory says what it holds), checks each copy's sha256
against the manifest, and reads the copies from then on; the parallel filesystem is read once, in large
sequential pieces. The ranks of a node copy at the same time, each its own files; the free space of DIR is
checked first, for all the ranks of the node that stage there. The directory is named for the dataset and
the run (two runs of one dataset on a node never share or remove each other's copies) and removed at the end
(on an error and on a stop too), unless kept; a later run of the same run finds kept copies and re-uses
those that still verify. A stop signal during staging ends it at the next 4 MiB piece.

A copy reads, hashes and writes 4 MiB pieces through one buffer, so the sha256 checked is that of the very
bytes written, and each byte passes through user memory once. Reading the copy back to hash it would only
re-read the page cache just written (checking this code, not the disk); a kernel copy (sendfile) plus such a
read-back took 25% more CPU, and hashing on a second thread more still (the piece leaves the core's cache).
The read is sequential, so the kernel's readahead overlaps it with the hash and the write.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..base.durable import sha256_file
from ..base.errors import ConfigError, DataError, HpctrainError
from ..base.rankenv import RankEnv
from ..base.stop import FLAG, STOP_EXIT
from ..trace.spans import TRACER
from .shardformat import MANIFEST, ShardFile, ShardSet

PIECE = 4 << 20  # bytes per read, hash and write: the piece is still in the core's cache for the hash and
# the write (32 MiB measured 35% more CPU); a stop is noticed between two pieces


class StagingStopped(HpctrainError):
    """A stop signal (SIGTERM/SIGUSR2) came while the shards were being staged: no step was trained since the
    last checkpoint, so there is nothing new to save; the copies are removed and the run ends with exit 3."""

    exit_code = STOP_EXIT
    label = ""  # a stop, not a failure: the CLI prints "stopped by ..." without "error: "


@dataclass(frozen=True, slots=True)
class Planned:
    """One file of the plan: the manifest's entry, where its copy goes, and its size in bytes."""

    source: ShardFile
    copy: Path
    size: int


@dataclass(frozen=True, slots=True)
class StagePlan:
    """What one rank stages: its files (in the manifest's split order) and where their copies go."""

    dir: Path  # DIR, as resolved
    root: Path  # this rank's directory under DIR
    files: tuple[Planned, ...]
    manifest: Path  # the original manifest.json

    @property
    def size(self) -> int:
        return sum(p.size for p in self.files)


@dataclass(frozen=True, slots=True)
class Staged:
    """What staging did (all zero/None: no staging), for the log and summary.json."""

    root: Path | None = None
    files: int = 0
    bytes: int = 0  # this rank's staged bytes (copied now, or kept from an earlier run and re-used)
    copied: int = 0  # of which copied now
    seconds: float = 0.0  # this rank's staging time, checks and copies
    total_bytes: int = 0  # every rank's staged bytes
    max_seconds: float | None = None  # the slowest rank's staging time: how long the run waited for staging


def resolve_dir(stage_to: str, env: RankEnv) -> Path:
    """DIR of --stage-to: as given, or for `auto` $SLURM_TMPDIR, else $TMPDIR (ConfigError when neither is
    set); it must be an existing, writable directory."""
    if stage_to == "auto":
        name, value = next(((n, v) for n, v in (("SLURM_TMPDIR", env.slurm_tmpdir), ("TMPDIR", env.tmpdir)) if v),
                           (None, None))
        if value is None:
            raise ConfigError(f"--stage-to auto: neither $SLURM_TMPDIR nor $TMPDIR is set on {socket.gethostname()}; "
                              "name a node-local directory instead, e.g. --stage-to /tmp or --stage-to /dev/shm")
        what = f"--stage-to auto (${name})"
    else:
        value, what = stage_to, "--stage-to"
    path = Path(value).expanduser().absolute()
    if not path.is_dir():
        raise ConfigError(f"{what} {str(path)!r} is not a directory on {socket.gethostname()}: create it (on "
                          "node-local disk, e.g. under /tmp or /dev/shm) or choose another")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {str(path)!r} is not writable: choose a directory you can write to")
    return path


def plan(shardset: ShardSet, stage_to: str, env: RankEnv, rank: int, world: int, *, owner: str,
         splits: tuple[str, ...] | None = None) -> StagePlan:
    """This rank's files on `world` ranks (of `splits`, default all) and where their copies go under DIR.
    `owner` names the run (its run directory): copies of one dataset for two runs go to two directories."""
    shardset.check_world(world)
    stage_dir = resolve_dir(stage_to, env)
    tag = hashlib.sha256(owner.encode()).hexdigest()[:8]
    root = stage_dir / f"hpctrain-{shardset.fingerprint[:12]}-{tag}" / f"rank-{rank:05d}"
    base = shardset.root.resolve()
    files = []
    for split in shardset.splits if splits is None else [s for s in shardset.splits if s in splits]:
        for f in shardset.rank_shards(split, rank, world):
            try:
                size = f.path.stat().st_size
            except OSError as exc:
                raise DataError(f"cannot stage {str(f.path)!r}: {exc.strerror}") from exc
            files.append(Planned(f, root / f.path.relative_to(base), size))  # inside the dataset: load_manifest checked
    return StagePlan(stage_dir, root, tuple(files), shardset.root / MANIFEST)


def _present(p: Planned) -> bool:
    try:
        return p.copy.stat().st_size == p.size
    except OSError:
        return False


def space_error(plan: StagePlan, comm: Any) -> DataError | None:
    """Whether DIR holds what every rank of this node that stages there still has to copy (one allgather;
    copies kept from an earlier run with the right size count as there). A DataError naming DIR, or None."""
    node, need = socket.gethostname(), sum(p.size for p in plan.files if not _present(p))
    try:
        device, free = os.stat(plan.dir).st_dev, shutil.disk_usage(plan.dir).free
    except OSError as exc:
        device, free = None, exc
    here = [n for h, d, n in comm.allgather((node, device, need)) if (h, d) == (node, device)]
    if isinstance(free, OSError):
        return DataError(f"--stage-to {str(plan.dir)!r}: cannot read its free space ({free.strerror})")
    total = sum(here)
    if total <= free:
        return None
    who = f"the {len(here)} ranks that stage there need" if len(here) > 1 else f"rank {comm.rank} needs"
    return DataError(f"--stage-to {str(plan.dir)!r} on {node}: {who} {total} bytes ({total / 1e9:.2f} GB) for their "
                     f"shard files, but only {free} bytes ({free / 1e9:.2f} GB) are free: free space there, choose a "
                     "larger node-local directory, or train without --stage-to")


def remove(plan: StagePlan) -> None:
    """Remove this rank's copies (its whole directory), and the run's directory under DIR once empty."""
    shutil.rmtree(plan.root, ignore_errors=True)
    try:
        plan.root.parent.rmdir()
    except OSError:  # another rank's copies are still there, or it is gone already
        pass


def _read_piece(fh: Any, buf: memoryview) -> int:
    """Fill `buf` from `fh` (less only at the end of the file); the bytes read."""
    got = 0
    while got < len(buf):
        n = fh.readinto(buf[got:])
        if not n:
            break
        got += n
    return got


def copy_hashed(source: Path, copy: Path, stopped: Callable[[], bool]) -> str:
    """Copy `source` to `copy` through one PIECE-sized buffer, hashing each piece between its read and its
    write; the sha256 of the bytes written. Raises StagingStopped when `stopped()` turns true between pieces."""
    digest, piece = hashlib.sha256(), memoryview(bytearray(PIECE))
    with open(source, "rb", buffering=0) as fin, open(copy, "wb", buffering=0) as fout:
        os.posix_fadvise(fin.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger readahead, as cp asks for
        while True:
            if stopped():
                raise StagingStopped(_stopped_text(copy))
            n = _read_piece(fin, piece)
            if n == 0:
                return digest.hexdigest()
            view = piece[:n]
            digest.update(view)
            while view:
                view = view[fout.write(view):]


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _stopped_text(where: Path) -> str:
    name = signal.Signals(FLAG.signum).name if FLAG.signum else "a stop request"
    return (f"stopped by {name} while staging the shards (at {str(where)!r}): no step was trained, nothing new to "
            "checkpoint; the copies are removed; run the same command to continue")


def stage_files(plan: StagePlan, stopped: Callable[[], bool] | None = None) -> tuple[int, int]:
    """Copy and verify this rank's files (a kept copy that verifies is re-used); (bytes staged, bytes copied).
    The copy of the manifest goes in first. A copy whose sha256 differs from the manifest is a DataError."""
    stopped = stopped or (lambda: FLAG.requested)
    plan.root.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(plan.manifest, plan.root / MANIFEST)
    copied = 0
    for p in plan.files:
        if stopped():
            raise StagingStopped(_stopped_text(p.copy))
        if _present(p) and sha256_file(p.copy) == p.source.sha256:
            continue
        p.copy.parent.mkdir(parents=True, exist_ok=True)
        part = p.copy.with_name(f".{p.copy.name}.part")
        try:
            got = copy_hashed(p.source.path, part, stopped)
        except OSError as exc:
            raise DataError(f"staging {str(p.source.path)!r} to {str(part)!r} failed: {exc}") from exc
        if got != p.source.sha256:
            part.unlink(missing_ok=True)
            raise DataError(f"the copy of {str(p.source.path)!r} staged to {str(p.copy)!r} has sha256 {got[:16]}..., "
                            f"the manifest says {p.source.sha256[:16]}...: the file changed since `hpctrain shard` or "
                            "the copy is corrupt; check the source with `hpctrain verify`")
        os.replace(part, p.copy)
        copied += p.size
    return plan.size, copied


def relocated(shardset: ShardSet, plan: StagePlan) -> ShardSet:
    """`shardset` with this rank's files read from their copies (the other ranks' entries unchanged: an
    elastic resume counts their samples from the originals)."""
    moved = {p.source.path: p.copy for p in plan.files}
    splits = {split: [dataclasses.replace(f, path=moved.get(f.path, f.path)) for f in files]
              for split, files in shardset.splits.items()}
    return dataclasses.replace(shardset, splits=splits)


def stage(plan: StagePlan, shardset: ShardSet, comm: Any, *, keep: bool, on_exit: Callable[..., Any],
          log: Callable[[str], None] | None = None, stopped: Callable[[], bool] | None = None) -> tuple[ShardSet, Staged]:
    """Every rank of `comm` together (after agreeing on `space_error`): copy and verify each rank's own files
    at the same time, and agree that all went well (else every rank raises); the shard set to read and what
    was staged. `on_exit(remove, plan)` is called before the first copy unless `keep` (e.g. an ExitStack's
    callback), so that the copies go however the run ends."""
    if not keep:
        on_exit(remove, plan)
    started = time.perf_counter()
    error, sizes = None, (0, 0)
    try:
        sizes = stage_files(plan, stopped)
    except HpctrainError as exc:
        error = exc
    except OSError as exc:  # the directory cannot be made, the manifest not copied: as a copy that fails
        error = DataError(f"staging to {str(plan.root)!r} failed: {exc}")
    seconds = time.perf_counter() - started
    TRACER.span("staging", started, started + seconds, bytes=sizes[0])
    comm.agree(error)
    everyone = comm.allgather((sizes[0], seconds))
    staged = Staged(plan.root, len(plan.files), sizes[0], sizes[1], seconds, sum(b for b, _ in everyone),
                    max(s for _, s in everyone))
    if log is not None:
        kept = f", {_size(staged.bytes - staged.copied)} kept from an earlier run" if staged.bytes > staged.copied else ""
        log(f"staged {staged.files} shard files, {_size(staged.bytes)} ({_size(staged.copied)} copied at "
            f"{staged.copied / max(seconds, 1e-9) / 1e6:.0f} MB/s{kept}), verified, to {plan.root} in {seconds:.2f} s; "
            f"all {comm.size} ranks: {_size(staged.total_bytes)}, the slowest in {staged.max_seconds:.2f} s")
    return relocated(shardset, plan), staged
