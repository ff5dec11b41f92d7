"""Checkpoints: the policy (when, where, how many, what counts as complete) and the public save and load
entry points. The file format is in `format`, the background writing in `writer`.

A checkpoint is a directory `RUN/checkpoints/step-NNNNNNN/` holding
    part-RRRRR.bin  the tensors of the model and optimizer state as pieces (boxes of named tensors), split over
                    the ranks that wrote them: each replicated tensor once, whole, and each rank's own slices
                    (what ZeRO shards) and its own state (RNG, error feedback)
    state.pt        the model's state_dict (the user's own keys) and the train state (optimizer, LR schedule,
                    counters), each tensor replaced by a reference to its name, and the index of every piece
    ranks.pt        per-rank state gathered from every rank (RNG states, data cursor, audit position), each
                    tensor a reference to its name
    meta.json       step, epoch, world size, format, resolved config, data fingerprint, sha256 of every file above
    COMPLETE        the completion marker, written last; it holds the sha256 of meta.json (checkpoints written
                    before it did have an empty one, and still load)

It is written under a temporary name, every file fsynced, then renamed into place, so a directory named
`step-*` is complete or does not exist. A checkpoint counts only with its marker and matching checksums;
`latest()` falls back to the previous one when the newest is damaged. `keep` (>= 2) old checkpoints
survive; older ones are pruned only after a newer one is complete.

Saving is asynchronous (`writer`): each rank writes its share in the background, and rank 0 completes
the checkpoint once every part is on disk. Loading (`loader`): rank 0 reads and broadcasts the small files,
and every rank reads from the part files only the byte ranges of what it will hold (`boxes`).

Only the trainer and the library API use this module; it knows nothing about MPI beyond the `Comm`
object it is given, and runs no collective outside the trainer's thread.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from ..base.durable import FAULTS, human_bytes, sha256_file
from ..base.errors import CheckpointError, HpctrainError, StorageError, brief, describe
from ..trace.spans import TRACER
from .boxes import Reader
from .format import (FORMAT, MARKER, NAMED_FORMATS, RANKS, STATE, assign_writers, decode_json, discard,
                     expected_files, join_tensors, layout_digest, meta_digest, part_header, part_name, piece,
                     read_part, split_named, split_tensors)
from .writer import AsyncWriter


def step_dir_name(step: int) -> str:
    return f"step-{step:07d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint directories of a run, newest first (complete or not)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]), reverse=True)


def verify(path: Path, *, hash_files: bool = True) -> dict[str, Any]:
    """The meta of a complete, intact checkpoint; raise CheckpointError saying in one short line what is wrong
    otherwise (which file, and how: never the file's bytes).

    `hash_files=False` checks the marker, meta.json and the file list but not the other files' checksums (for
    a caller that verified this checkpoint moments ago)."""
    path = Path(path)
    where = f"checkpoint {str(path)!r}"
    if not (path / MARKER).is_file():
        raise CheckpointError(f"{where} has no {MARKER} marker (it was never finished)")
    name = MARKER
    try:
        marker = (path / MARKER).read_bytes().strip()
        name = "meta.json"
        raw = (path / name).read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{where}: cannot read {name} ({describe(exc)})") from None
    try:
        meta = decode_json(raw)
    except ValueError as exc:
        raise CheckpointError(f"{where}: meta.json is {exc}") from None
    try:
        parts = int(meta["parts"])
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise CheckpointError(f"{where}: meta.json has no valid 'parts' ({describe(exc)})") from None
    listed = meta.get("sha256", {})
    if not isinstance(listed, dict) or not 1 <= parts <= len(listed):
        count = len(listed) if isinstance(listed, dict) else 0
        raise CheckpointError(f"{where}: meta.json says {parts} part files but lists {count} files")
    if set(listed) != expected_files(parts):
        raise CheckpointError(f"{where}: meta.json lists files {brief(sorted(listed), 120)}, expected "
                              f"{brief(sorted(expected_files(parts)), 120)}")
    if marker and marker != meta_digest(raw).encode():  # an empty marker: written before markers held the digest
        raise CheckpointError(f"{where}: meta.json sha256 mismatch (not the one recorded in {MARKER}): corrupt")
    for name, digest in listed.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{where} lacks {name}")
        if hash_files and sha256_file(file) != digest:
            raise CheckpointError(f"{where}: {name} sha256 mismatch (corrupt or truncated)")
    return meta


def latest(run_dir: Path, warn: Any = None) -> Path | None:
    """The newest complete, intact checkpoint of a run, warning in one line about each damaged one skipped
    (what is wrong with it, and which checkpoint is used instead)."""
    skipped: list[str] = []
    found = None
    for path in list_checkpoints(run_dir):
        try:
            verify(path)
            found = path
            break
        except CheckpointError as exc:
            skipped.append(str(exc))
    if warn is not None:
        instead = f"using {found.name} instead" if found else "no intact checkpoint is left: starting afresh"
        for text in skipped:
            warn(f"skipping damaged checkpoint: {text}; {instead}")
    return found


def last_complete(run_dir: Path) -> Path | None:
    """The newest checkpoint with its marker, meta.json and files in place (not hashing their bytes: for
    saying where a failed run can continue from)."""
    for path in list_checkpoints(run_dir):
        try:
            verify(path, hash_files=False)
            return path
        except CheckpointError:
            continue
    return None


def size_of(path: Path) -> int:
    """The bytes of a checkpoint's files."""
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())


def read_trees(path: Path) -> tuple[Any, Any]:
    """(state.pt's tree, ranks.pt's list) of a verified checkpoint (weights_only: no code runs from the files)."""
    import torch

    trees = []
    for name in (STATE, RANKS):
        try:
            with open(Path(path) / name, "rb") as fh:
                trees.append(torch.load(fh, map_location="cpu", weights_only=True))
        except Exception as exc:  # noqa: BLE001 - torch's and pickle's errors can run to pages
            raise CheckpointError(f"checkpoint {str(path)!r}: {name} cannot be loaded ({describe(exc)})") from None
    return trees[0], trees[1]


def load_files(path: Path, *, verified: bool = False) -> dict[str, Any]:
    """Read a whole checkpoint: {"meta", "model", "train", "ranks"} with every tensor whole (for tools and tests;
    a resume reads only its own boxes, `loader`). A sharded optimizer's state (--zero 1-3) is under
    train.optimizer.state as torch's optimizer state_dict has it. The checksums are checked first unless
    `verified` (the caller just did, e.g. through `latest`)."""
    path = Path(path)
    meta = verify(path, hash_files=not verified)
    tree, ranks = read_trees(path)
    if meta.get("format") not in NAMED_FORMATS:  # format 1: numbered tensors, all of them in the parts
        tensors: dict[int, Any] = {}
        for r in range(int(meta["parts"])):
            tensors.update(read_part(path / part_name(r)))
        tree, ranks = (join_tensors(t, tensors, str(path)) for t in (tree, ranks))
        return {"meta": meta, "model": tree["model"], "train": tree["train"], "ranks": ranks}
    reader = Reader(path, tree["index"])
    train = reader.resolve(tree["train"])
    optimizer = train.get("optimizer")
    if isinstance(optimizer, dict) and "state" not in optimizer:  # sharded: its state is in the index only
        prefix = "train/optimizer/state/"
        state: dict[int, dict[str, Any]] = {}
        for name in reader.names(prefix):
            index, key = name[len(prefix):].split("/", 1)
            state.setdefault(int(index), {})[key] = reader.read(name)
        optimizer["state"] = state
    out = {"meta": meta, "model": reader.resolve(tree["model"]), "train": train, "ranks": reader.resolve(ranks)}
    reader.close()
    return out


def load_broadcast(path: Path, comm: Any, *, verified: bool = False) -> dict[str, Any]:
    """Rank 0 reads the whole checkpoint (verifying its checksums unless it just did) and broadcasts it: how a
    checkpoint of format 1 is read. The trees go out pickled, the tensors' bytes by MPI_Bcast straight from
    their buffers (pickling them is slower: docs/performance.md)."""
    import torch

    state, error = None, None
    if comm.rank == 0:
        try:
            state = load_files(path, verified=verified)
        except HpctrainError as exc:
            error = exc
    comm.agree(error if comm.rank == 0 else None)
    if comm.size == 1:
        return state
    skeleton, tensors = split_tensors(state) if comm.rank == 0 else (None, [])
    skeleton, specs = comm.bcast((skeleton, [(t.dtype, tuple(t.shape)) for t in tensors]) if comm.rank == 0 else None)
    if comm.rank != 0:
        tensors = [torch.empty(shape, dtype=dtype) for dtype, shape in specs]
    comm.broadcast_tensors([t.reshape(-1).view(torch.uint8) for t in tensors if t.numel()])
    return join_tensors(skeleton, dict(enumerate(tensors)), str(path))


class CheckpointManager:
    """Owns the checkpoint policy of one run. The trainer calls `save(step, ...)` at every step boundary, on
    every rank (constructing it is collective too)."""

    def __init__(self, run_dir: Path, comm: Any, *, every: int | str = 0, keep: int = 2, asynchronous: bool = True,
                 mtbf_hours: float = 24.0, log: Any = None, on_write: Any = None):
        if keep < 2:
            raise CheckpointError(f"keep {keep} must be at least 2")
        self.root = Path(run_dir) / "checkpoints"
        self.comm = comm
        self.every = every
        self.keep = keep
        self.asynchronous = asynchronous
        self.log = log
        # called before each wait on the writing of parts (this rank's, then every rank's): the trainer
        # gives such waits the checkpoint budget of its watchdog instead of the collective one
        self.on_write = on_write or (lambda: None)
        self.last_saved: int | None = None
        # one name for this job's temporary directories, the same on every rank
        self._token = comm.bcast(f"{os.getpid()}-{time.time_ns() % 10**12}" if comm.rank == 0 else None)
        self._writer = AsyncWriter(comm, log=log, on_complete=self._prune)
        self.stall_seconds = 0.0  # all saves, including synchronous ones (stop, last step) that wait for the write
        self.async_stalls: list[float] = []  # the step-boundary stall of each asynchronous save
        self.saves = 0
        self.mtbf_s = mtbf_hours * 3600.0
        self._last_time = time.monotonic()

    @property
    def write_seconds(self) -> float:
        """Wall time of this rank's writes (in the background, overlapping training)."""
        return self._writer.write_seconds

    @property
    def write_cpu_seconds(self) -> float:
        """CPU time this rank's writes took from training."""
        return self._writer.write_cpu_seconds

    def interval_seconds(self) -> float:
        """Young/Daly: the checkpoint interval that minimizes expected lost work, sqrt(2 x cost x MTBF).

        The cost is the measured stall plus the CPU time of the background write (what it takes from
        training when no core is idle); before any save is measured, one second is assumed.
        """
        return math.sqrt(2.0 * max(self.save_cost(), 1e-3) * self.mtbf_s)

    def save_cost(self) -> float:
        """What one save costs training, measured: its stall plus its write's CPU time (1 s before any)."""
        return (self.stall_seconds + self.write_cpu_seconds) / self.saves if self.saves else 1.0

    def summary(self, auto: bool, run_s: float) -> dict[str, Any]:
        """summary.json's `checkpoint` entry; with `auto`, the interval and, in words, what it means here."""
        out: dict[str, Any] = {
            "saves": self.saves, "stall_s": self.stall_seconds, "write_s": self.write_seconds,
            "write_cpu_s": self.write_cpu_seconds,
            "async_stall_median_s": statistics.median(self.async_stalls) if self.async_stalls else None,
            "interval_s": self.interval_seconds() if auto else None}
        if auto:
            interval, cost = out["interval_s"], self.save_cost()
            what = (f"longer than this run's {run_s:.1f} s of training, so only the last step's checkpoint was "
                    "written" if interval > run_s else "checkpoints came that often, and one at the last step")
            out["interval_note"] = (f"--checkpoint-every auto: every {interval:.0f} s, the Young/Daly interval "
                                    f"sqrt(2 x {cost:.3f} s per save x --mtbf-hours {self.mtbf_s / 3600:g}); {what}")
        return out

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

        One small allreduce agrees whether any rank was asked to stop (a signal), whether a checkpoint is
        due (rank 0's answer: with `auto` the policy reads a clock, and clocks differ), whether any rank
        is still writing its part of the previous checkpoint (once none is, rank 0 completes it) and
        whether a write failed (a checkpoint, or a log or metrics file: `durable.FAULTS`); then every rank
        raises that failure together, saying where to continue from. A checkpoint is written when due, on
        a stop (synchronously) and at the last step (synchronously). `state` is a dict with model_state,
        train_state, rank_state and meta, or a callable returning one (called only when one is written).
        """
        writing = self._writer.writing()
        failed = FAULTS.first is not None or self._writer.error is not None
        stopping, due, writing, failed = self.comm.allreduce_array(
            [stop_requested, self.comm.rank == 0 and self.due(step), writing, failed], op="max")
        if failed:
            self._give_up()
        if self._writer.job is not None and not writing:
            self.on_write()
            self._writer.finish()
        if stopping or due or final:
            self._save(step, **(state() if callable(state) else state), wait=bool(stopping or final))
        return bool(stopping)

    def _save(self, step: int, *, model_state: dict, train_state: dict, rank_state: dict, meta: dict,
              pieces: list[tuple[str, Any, Any, Any]] = (), wait: bool = False) -> None:
        """Write a checkpoint of `model_state` and `train_state` (the same on every rank: each tensor written
        once, by the rank it is dealt to; a reference {REF: name} stands for a tensor of which the ranks write
        `pieces`), each rank's `rank_state`, and `pieces`: this rank's boxes (name, tensor, whole shape,
        start) of the tensors that are sharded. Collective."""
        if step == self.last_saved:
            if wait:
                self.wait()
            return
        start = time.perf_counter()
        self.on_write()
        if self._writer.job is not None:  # the previous save is still being written: it finishes first
            self._writer.finish()
        self._writer.join()
        skeleton, shared = split_named({"model": model_state, "train": train_state}, "")
        own, mine = split_named(rank_state, f"rank{self.comm.rank:05d}")
        owner = assign_writers(list(shared.values()), self.comm.size)
        mine = {**{n: t for (n, t), o in zip(shared.items(), owner) if o == self.comm.rank}, **mine}
        entries = [piece(name, t) for name, t in mine.items()]
        entries += [piece(name, t, shape, at) for name, t, shape, at in pieces]
        tensors = [*mine.values(), *(t for _, t, _, _ in pieces)]
        head, base = part_header(entries)
        ranks = self.comm.gather({"state": own, "layout": layout_digest(list(shared.values())),
                                  "pieces": (base, entries)}, root=0)
        # a save the run waits for (a stop, the last step) writes from the tensors themselves: no host copies
        host = dict(enumerate(tensors)) if wait and not any(t.is_cuda for t in tensors) else (
            self._writer.staging.snapshot(dict(enumerate(tensors))))
        job: dict[str, Any] = {
            "step": step, "tmp": self.root / f".tmp-{step_dir_name(step)}-{self._token}",
            "final": self.root / step_dir_name(step), "head": head, "entries": entries, "parts": list(host.values())}
        if self.comm.rank == 0:  # the writer checks the ranks agree and builds the index of the pieces
            job.update(skeleton={"format": FORMAT, **skeleton}, ranks=ranks,
                       meta=dict(meta, step=step, parts=self.comm.size, format=FORMAT))
        self._writer.start(job)
        self.last_saved = step
        self.saves += 1
        self._last_time = time.monotonic()
        if wait or not self.asynchronous:
            self._writer.finish()
            self._writer.join()
        stall = time.perf_counter() - start
        TRACER.span("checkpoint stall", start, start + stall, step=step)
        self.stall_seconds += stall
        if self.asynchronous and not wait:
            self.async_stalls.append(stall)
        if wait:
            self.wait()

    def wait(self) -> None:
        """Block until the last save is on disk (collective), raising its error if it failed (on every rank)."""
        self.on_write()
        if self._writer.job is not None:
            self._writer.finish()
        self._writer.join()
        if self.comm.bcast(self._writer.error is not None, root=0):
            self._raise_failure()

    def _give_up(self) -> None:
        """A write failed: finish the pending save (it may still succeed, and rank 0's completer must not be
        left running), then raise the failure on every rank together (collective)."""
        self.on_write()
        if self._writer.job is not None:
            self._writer.finish()
        self._writer.join()
        self._raise_failure()

    def _raise_failure(self) -> None:
        """Every rank raises the first failure (rank 0's failed checkpoint, else the lowest rank's failed
        write) as one line that ends with the last complete checkpoint and what to do (collective)."""
        mine: HpctrainError | None = self._writer.error if self.comm.rank == 0 else None
        if mine is None and FAULTS.first is not None:
            mine = type(FAULTS.first)(f"rank {self.comm.rank}: {FAULTS.first}")
            mine.no_space = FAULTS.first.no_space
        report = None if mine is None else (str(mine), mine.exit_code, getattr(mine, "no_space", False),
                                            isinstance(mine, CheckpointError))
        reports = self.comm.gather(report, root=0)
        verdict = None
        if self.comm.rank == 0:
            text, code, no_space, of_checkpoint = next((r for r in reports if r is not None),
                                                       ("a write of the run failed", 1, False, False))
            verdict = (f"{text}; {self._continue_hint(no_space, of_checkpoint)}", code, of_checkpoint)
        text, code, of_checkpoint = self.comm.bcast(verdict, root=0)
        error = (CheckpointError if of_checkpoint else StorageError)(text)
        error.exit_code, error.agreed = code, True  # every rank raises it now: nobody is left waiting
        raise error

    def _continue_hint(self, no_space: bool, of_checkpoint: bool) -> str:
        """Rank 0: the last complete checkpoint, and how to go on from it (with a full disk, how much room a
        checkpoint takes when the failed write was not one)."""
        last = last_complete(self.root.parent)
        fix = "free space" if no_space else "fix the cause"
        need = ""
        if no_space and last is not None and not of_checkpoint:
            need = f"a checkpoint of this run needs {human_bytes(size_of(last))}; "
        if last is None:
            return f"{need}no checkpoint was completed yet: {fix}, then run the same command to start again"
        return f"{need}last complete checkpoint: {last}: {fix}, then run the same command to continue"

    def _prune(self) -> None:
        """Rank 0, after a checkpoint is complete: keep the newest `keep` complete ones, and drop what crashed
        jobs left (temporary and half-deleted directories not of this job)."""
        complete = 0
        for path in list_checkpoints(self.root.parent):
            if (path / MARKER).is_file():
                complete += 1
                if complete > self.keep:
                    discard(path)
        for junk in [*self.root.glob(".tmp-step-*"), *self.root.glob(".trash-*")]:
            if not junk.name.endswith(f"-{self._token}") and not junk.name.endswith(f"-{os.getpid()}"):
                shutil.rmtree(junk, ignore_errors=True)
