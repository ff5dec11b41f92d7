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


def _serialize(obj: Any) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


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

    def __init__(self, run_dir: Path, comm: Any, *, every: int = 0, keep: int = 2, asynchronous: bool = True,
                 log: Any = None):
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

    def due(self, step: int) -> bool:
        return self.every > 0 and step > 0 and step % self.every == 0 and step != self.last_saved

    def save(self, step: int, *, model_state: dict, train_state: dict, rank_state: dict, meta: dict,
             force: bool = False, wait: bool = False) -> bool:
        """Write a checkpoint of `step` when due (or `force`); a collective: every rank must call it."""
        if not (force or self.due(step)) or step == self.last_saved:
            return False
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
        self.stall_seconds += time.perf_counter() - start
        if wait:
            self.wait()
        return True

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
            data = _serialize(obj)
            _write_bytes(tmp / name, data)
            digests[name] = hashlib.sha256(data).hexdigest()
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
