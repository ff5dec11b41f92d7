"""Checkpoints: the policy (when, where, how many) and the atomic, verifiable on-disk format.

A checkpoint is a directory `RUN/checkpoints/step-NNNNNNN/` holding
    model.pt     the model's state_dict (the user's own keys), written once: parameters are equal on all ranks
    train.pt     optimizer, LR schedule and the trainer's counters
    ranks.pt     per-rank state gathered from every rank (RNG states, data cursor, audit position)
    meta.json    step, epoch, world size, resolved config, data fingerprint, sha256 of every file above
    COMPLETE     the completion marker, written last
It is written under a temporary name, every file fsynced, then renamed into place, so a directory named
`step-*` is complete or does not exist. A checkpoint counts only with its marker and matching checksums;
`latest()` falls back to the previous one when the newest is damaged. `keep` (>= 2) old checkpoints
survive; older ones are pruned only after a newer one is complete.

Saving is asynchronous: at the step boundary the state is copied to host memory (the only stall), and a
background thread on rank 0 serializes and writes it while training goes on; the next save first waits
for the previous one. Loading reads on rank 0 and broadcasts, so a job opens each file once (kinder to a
parallel filesystem's metadata servers than every rank opening it).

Only the trainer and the library API use this module; it knows nothing about MPI beyond the `Comm`
object it is given.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from .errors import CheckpointError

MARKER = "COMPLETE"
FILES = ("model.pt", "train.pt", "ranks.pt")


def step_dir_name(step: int) -> str:
    return f"step-{step:07d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def to_host(obj: Any) -> Any:
    """A deep copy of a state tree with every tensor cloned to CPU memory (the snapshot at the step boundary)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_host(v) for v in obj)
    return obj


class _HashingWriter(io.RawIOBase):
    """A write-only file that hashes what passes through: torch.save streams into it, no second copy."""

    def __init__(self, fh: Any):
        self.fh = fh
        self.sha = hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.sha.update(data)
        return self.fh.write(data)


def _save_hashed(path: Path, obj: Any) -> str:
    """torch.save `obj` to `path`, fsynced; return the sha256 of the bytes written."""
    import torch

    with open(path, "wb") as fh:
        writer = _HashingWriter(fh)
        torch.save(obj, writer)
        fh.flush()
        os.fsync(fh.fileno())
    return writer.sha.hexdigest()


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint directories of a run, newest first (complete or not)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]), reverse=True)


def check(path: Path) -> dict[str, Any]:
    """The meta of a complete, intact checkpoint; raise CheckpointError saying what is wrong otherwise."""
    path = Path(path)
    if not (path / MARKER).is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} has no {MARKER} marker (it was never finished)")
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {str(path)!r} has an unreadable meta.json ({exc})") from exc
    for name, digest in meta.get("sha256", {}).items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {str(path)!r} lacks {name}")
        if hashlib.sha256(file.read_bytes()).hexdigest() != digest:
            raise CheckpointError(f"checkpoint {str(path)!r}: {name} does not match its checksum (corrupt or truncated)")
    if set(meta.get("sha256", {})) != set(FILES):
        raise CheckpointError(f"checkpoint {str(path)!r} lists files {sorted(meta.get('sha256', {}))}, expected {list(FILES)}")
    return meta


def latest(run_dir: Path, warn: Any = None) -> Path | None:
    """The newest complete, intact checkpoint of a run, warning about each damaged one skipped."""
    for path in list_checkpoints(run_dir):
        try:
            check(path)
            return path
        except CheckpointError as exc:
            if warn is not None:
                warn(f"skipping damaged checkpoint: {exc}; falling back to an older one")
    return None


def load_files(path: Path) -> dict[str, Any]:
    """Read a checkpoint's state (weights_only: no code runs from the file)."""
    import torch

    meta = check(path)
    state = {"meta": meta}
    for name in FILES:
        with open(Path(path) / name, "rb") as fh:
            state[name[:-3]] = torch.load(fh, map_location="cpu", weights_only=True)
    return state


class CheckpointManager:
    """Owns the checkpoint policy of one run. The trainer calls `save(step, ...)` at every step boundary."""

    def __init__(self, run_dir: Path, comm: Any, *, every: int | str = 0, keep: int = 2, asynchronous: bool = True,
                 mtbf_hours: float = 24.0, log: Any = None):
        if keep < 2:
            raise CheckpointError(f"keep {keep} must be at least 2")
        self.root = Path(run_dir) / "checkpoints"
        self.comm = comm
        self.every = every
        self.keep = keep
        self.asynchronous = asynchronous
        self.log = log
        self.last_saved: int | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.stall_seconds = 0.0
        self.write_seconds = 0.0
        self.saves = 0
        self.mtbf_s = mtbf_hours * 3600.0
        self._last_time = time.monotonic()

    def interval_seconds(self) -> float:
        """Young/Daly: the checkpoint interval that minimizes expected lost work, sqrt(2 x cost x MTBF).

        The cost is the measured stall plus the background write (conservative: the write mostly overlaps
        training); before any save is measured, one second is assumed.
        """
        cost = (self.stall_seconds + self.write_seconds) / self.saves if self.saves else 1.0
        return math.sqrt(2.0 * max(cost, 1e-3) * self.mtbf_s)

    def due(self, step: int) -> bool:
        """Whether a periodic checkpoint is due at `step`; with `auto`, only rank 0's answer counts (the
        trainer agrees on it collectively, since clocks differ between ranks)."""
        if step <= 0 or step == self.last_saved:
            return False
        if self.every == "auto":
            return time.monotonic() - self._last_time >= self.interval_seconds()
        return bool(self.every) and step % int(self.every) == 0

    def save(self, step: int, state: Any, *, stop_requested: bool = False, final: bool = False) -> bool:
        """The trainer calls this at every step boundary, on every rank; returns True when the run must stop.

        One small allreduce agrees whether any rank was asked to stop (a signal) and whether a checkpoint
        is due (rank 0's answer: with `auto` the policy reads a clock, and clocks differ). A checkpoint is
        then written when due, on a stop (synchronously) and at the last step (synchronously). `state` is
        a dict with model_state, train_state, rank_state and meta, or a callable returning one (called only
        when a checkpoint is written).
        """
        stopping, due = self.comm.allreduce_array([stop_requested, self.comm.rank == 0 and self.due(step)], op="max")
        if stopping or due or final:
            self._save(step, **(state() if callable(state) else state), wait=bool(stopping or final))
        return bool(stopping)

    def _save(self, step: int, *, model_state: dict, train_state: dict, rank_state: dict, meta: dict,
              wait: bool = False) -> None:
        if step == self.last_saved:
            if wait:
                self.wait()
            return
        start = time.perf_counter()
        ranks = self.comm.gather(to_host(rank_state), root=0)
        if self.comm.rank == 0:
            self._join()
            snapshot = (to_host(model_state), to_host(train_state), ranks, dict(meta, step=step))
            if self.asynchronous and not wait:
                self._thread = threading.Thread(target=self._write_guarded, args=(step, *snapshot),
                                                name="hpctrain-checkpoint", daemon=True)
                self._thread.start()
            else:
                self._write(step, *snapshot)
        self.last_saved = step
        self.saves += 1
        self._last_time = time.monotonic()
        self.stall_seconds += time.perf_counter() - start
        if wait:
            self.wait()

    def wait(self) -> None:
        """Block until the last save is on disk (collective), raising its error if it failed."""
        if self.comm.rank == 0:
            self._join()
        failed = self.comm.bcast(repr(self._error) if self._error is not None else None, root=0)
        if failed:
            raise CheckpointError(f"writing a checkpoint failed: {failed}")

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _write_guarded(self, *args: Any) -> None:
        try:
            self._write(*args)
        except BaseException as exc:  # noqa: BLE001 - reported by wait()
            self._error = exc
            if self.log:
                self.log(f"checkpoint write failed: {exc}")

    def _write(self, step: int, model_state: dict, train_state: dict, ranks: list, meta: dict) -> None:
        start = time.perf_counter()
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / step_dir_name(step)
        tmp = self.root / f".tmp-{step_dir_name(step)}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        digests = {}
        for name, obj in (("model.pt", model_state), ("train.pt", train_state), ("ranks.pt", ranks)):
            digests[name] = _save_hashed(tmp / name, obj)
        _write_bytes(tmp / "meta.json", json.dumps(dict(meta, sha256=digests), indent=2, default=str).encode())
        _write_bytes(tmp / MARKER, b"")
        _fsync_dir(tmp)
        if final.exists():  # a stale one from an earlier, diverged attempt at the same step
            _discard(final)
        tmp.rename(final)
        _fsync_dir(self.root)
        self._prune()
        self.write_seconds += time.perf_counter() - start

    def _prune(self) -> None:
        complete = 0
        for path in list_checkpoints(self.root.parent):
            if (path / MARKER).is_file():
                complete += 1
                if complete > self.keep:
                    _discard(path)
        for junk in [*self.root.glob(".tmp-step-*"), *self.root.glob(".trash-*")]:
            if not junk.name.endswith(f"-{os.getpid()}"):
                shutil.rmtree(junk, ignore_errors=True)


def _discard(path: Path) -> None:
    """Remove a checkpoint directory: first renamed out of the listing (atomic), then deleted, so a crash
    half-way through the deletion never leaves a listed checkpoint with files missing."""
    trash = path.with_name(f".trash-{path.name}-{os.getpid()}-{time.monotonic_ns()}")
    path.rename(trash)
    shutil.rmtree(trash, ignore_errors=True)
