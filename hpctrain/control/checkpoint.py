"""Checkpoints: the policy (when, where, how many) and the atomic, verifiable on-disk format.

A checkpoint is a directory `RUN/checkpoints/step-NNNNNNN/` holding
    part-RRRRR.bin  the tensors of the model and optimizer state, split over the ranks that wrote them
    state.pt        the model's state_dict (the user's own keys) and the train state (optimizer, LR schedule,
                    counters), each tensor replaced by a reference into a part file
    ranks.pt        per-rank state gathered from every rank (RNG states, data cursor, audit position)
    meta.json       step, epoch, world size, resolved config, data fingerprint, sha256 of every file above
    COMPLETE        the completion marker, written last
Model and optimizer state are equal on every rank (data parallel), so each tensor is written once, by one
rank: the tensors are dealt to the ranks largest first, each to the rank with the fewest bytes so far (as
torch.distributed.checkpoint deduplicates replicated tensors). W ranks write about 1/W of the bytes each,
in parallel: on a parallel filesystem the write bandwidth grows with the nodes, and the CPU a save takes
from training is shared instead of landing on rank 0. A part file is raw tensor bytes behind a JSON header
(no pickle); the small trees go through torch.save and load with weights_only=True.

It is written under a temporary name, every file fsynced, then renamed into place, so a directory named
`step-*` is complete or does not exist. A checkpoint counts only with its marker and matching checksums;
`latest()` falls back to the previous one when the newest is damaged. `keep` (>= 2) old checkpoints
survive; older ones are pruned only after a newer one is complete.

Saving is asynchronous: at the step boundary each rank copies its share of the state to host memory (the
only stall; into buffers kept from the previous save, see `Staging`), and a background thread per rank
writes it while training goes on. The ranks learn that every part is on disk from the one small allreduce
they already do per step; rank 0 then gathers the checksums and completes the checkpoint (meta, marker,
rename). The next save first waits for the previous one. Loading reads on rank 0 and broadcasts, so a job
opens each file once (kinder to a parallel filesystem's metadata servers than every rank opening it).

Only the trainer and the library API use this module; it knows nothing about MPI beyond the `Comm`
object it is given, and runs no collective outside the trainer's thread.
"""

from __future__ import annotations

import hashlib
import heapq
import io
import json
import math
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ..base.durable import fsync_dir, sha256_file
from ..base.errors import CheckpointError, HpctrainError

MARKER = "COMPLETE"
STATE = "state.pt"
RANKS = "ranks.pt"
PART_MAGIC = b"HPCTPRT1"
_ALIGN = 64
_REF = "__hpctrain_tensor__"


def step_dir_name(step: int) -> str:
    return f"step-{step:07d}"


def part_name(rank: int) -> str:
    return f"part-{rank:05d}.bin"


def expected_files(parts: int) -> set[str]:
    return {STATE, RANKS, *(part_name(r) for r in range(parts))}



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


def split_tensors(tree: Any) -> tuple[Any, list[Any]]:
    """(the tree with each tensor replaced by a numbered reference, the tensors in that order)."""
    import torch

    tensors: list[Any] = []

    def walk(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
            return {_REF: len(tensors) - 1}
        if isinstance(obj, dict):
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(walk(v) for v in obj)
        return obj

    return walk(tree), tensors


def join_tensors(tree: Any, tensors: dict[int, Any], where: str) -> Any:
    """The inverse of split_tensors."""
    if isinstance(tree, dict):
        if len(tree) == 1 and _REF in tree:
            if tree[_REF] not in tensors:
                raise CheckpointError(f"checkpoint {where!r} refers to tensor {tree[_REF]}, which no part file holds")
            return tensors[tree[_REF]]
        return {k: join_tensors(v, tensors, where) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(join_tensors(v, tensors, where) for v in tree)
    return tree


def assign_writers(tensors: list[Any], world: int) -> list[int]:
    """The rank that writes each tensor: largest first, each to the rank with the fewest bytes so far.

    Every rank computes the same answer from its own (equal) state, with no communication."""
    owner = [0] * len(tensors)
    heap = [(0, r) for r in range(world)]
    for i in sorted(range(len(tensors)), key=lambda i: (-tensors[i].numel() * tensors[i].element_size(), i)):
        load, rank = heapq.heappop(heap)
        owner[i] = rank
        heapq.heappush(heap, (load + tensors[i].numel() * tensors[i].element_size(), rank))
    return owner


def layout_digest(tensors: list[Any]) -> str:
    """A fingerprint of the tensors' dtypes and shapes: ranks that disagree cannot share the writing."""
    return hashlib.sha256(json.dumps([(str(t.dtype), list(t.shape)) for t in tensors]).encode()).hexdigest()[:16]


class Staging:
    """Host buffers for the step-boundary snapshot, kept from one save to the next.

    A fresh clone of every tensor pays the page faults of new memory at every save (on this machine, 46 MB
    of MLP state: 34 ms cloned, 5.5 ms copied into buffers already mapped); GPU tensors land in pinned
    buffers. A buffer is reused only after the previous write finished (the manager waits for its writer
    first), and is reallocated when a tensor's shape or dtype changes.
    """

    def __init__(self) -> None:
        self.buffers: dict[Any, Any] = {}

    def snapshot(self, tensors: dict[Any, Any]) -> dict[Any, Any]:
        """Copies of `tensors` ({key: tensor}) in host buffers reused under the same keys."""
        import torch

        out, cuda = {}, False
        for key, obj in tensors.items():
            if obj.layout != torch.strided:
                raise CheckpointError(f"cannot checkpoint tensor {key!r}: layout {obj.layout} (only dense tensors)")
            buf = self.buffers.get(key)
            if buf is None or buf.shape != obj.shape or buf.dtype != obj.dtype:
                pin = obj.is_cuda and torch.cuda.is_available()
                buf = self.buffers[key] = torch.empty(obj.shape, dtype=obj.dtype, device="cpu", pin_memory=pin)
            buf.copy_(obj.detach(), non_blocking=obj.is_cuda)
            cuda = cuda or obj.is_cuda
            out[key] = buf
        if cuda:
            torch.cuda.synchronize()
        self.buffers = {key: self.buffers[key] for key in out}  # tensors this rank no longer writes
        return out


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def write_part(path: Path, tensors: dict[int, Any]) -> str:
    """Write {id: contiguous CPU tensor} as raw bytes behind a JSON header, fsynced; return the sha256.

    Layout: 8 bytes magic, 8 bytes header length (little endian), the header padded to 64 bytes, then each
    tensor's bytes at a 64-byte aligned offset from the end of the header."""
    import torch

    entries, offset = [], 0
    for i, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        entries.append({"id": int(i), "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                        "offset": offset, "nbytes": nbytes})
        offset = _padded(offset + nbytes)
    head = json.dumps({"byteorder": sys.byteorder, "tensors": entries}).encode()
    head += b" " * (_padded(16 + len(head)) - 16 - len(head))
    sha = hashlib.sha256()
    with open(path, "wb") as fh:
        written = 0
        for chunk in (PART_MAGIC, len(head).to_bytes(8, "little"), head):
            sha.update(chunk)
            fh.write(chunk)
        for entry, t in zip(entries, tensors.values()):
            if written < entry["offset"]:
                pad = b"\0" * (entry["offset"] - written)
                sha.update(pad)
                fh.write(pad)
                written = entry["offset"]
            if entry["nbytes"]:
                view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
                sha.update(view)
                fh.write(view)
                written += entry["nbytes"]
        fh.flush()
        os.fsync(fh.fileno())
    return sha.hexdigest()


def read_part(path: Path) -> dict[int, Any]:
    """The tensors of a part file, each read into its own memory (no pickle, nothing executed)."""
    import torch

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"checkpoint part {str(path)!r} is malformed: {why}")

    with open(path, "rb") as fh:
        if fh.read(8) != PART_MAGIC:
            raise bad("wrong magic bytes")
        size = int.from_bytes(fh.read(8), "little")
        total = os.fstat(fh.fileno()).st_size
        if size > total - 16:
            raise bad(f"header length {size} exceeds the file")
        try:
            header = json.loads(fh.read(size))
        except ValueError as exc:
            raise bad(f"unreadable header ({exc})") from exc
        if header.get("byteorder") != sys.byteorder:
            raise bad(f"written on a {header.get('byteorder')}-endian machine, this one is {sys.byteorder}-endian")
        base = 16 + size
        out = {}
        for entry in header.get("tensors", []):
            dtype = getattr(torch, str(entry["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise bad(f"unknown dtype {entry['dtype']!r}")
            t = torch.empty([int(d) for d in entry["shape"]], dtype=dtype)
            nbytes = t.numel() * t.element_size()
            if nbytes != entry["nbytes"] or base + entry["offset"] + nbytes > total:
                raise bad(f"tensor {entry['id']} does not fit its declared size")
            if nbytes:
                fh.seek(base + entry["offset"])
                if fh.readinto(memoryview(t.reshape(-1).view(torch.uint8).numpy())) != nbytes:
                    raise bad(f"tensor {entry['id']} is truncated")
            out[int(entry["id"])] = t
    return out


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


def check(path: Path, *, hash_files: bool = True) -> dict[str, Any]:
    """The meta of a complete, intact checkpoint; raise CheckpointError saying what is wrong otherwise.

    `hash_files=False` checks the marker, meta.json and the file list but not the checksums (for a caller
    that verified this checkpoint moments ago)."""
    path = Path(path)
    if not (path / MARKER).is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} has no {MARKER} marker (it was never finished)")
    try:
        meta = json.loads((path / "meta.json").read_text())
        parts = int(meta["parts"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {str(path)!r} has an unreadable meta.json ({exc!r})") from exc
    listed = meta.get("sha256", {})
    if not isinstance(listed, dict) or not 1 <= parts <= len(listed):
        raise CheckpointError(f"checkpoint {str(path)!r}: meta.json says {parts} part files but lists {len(listed)} files")
    if set(listed) != expected_files(parts):
        raise CheckpointError(f"checkpoint {str(path)!r} lists files {sorted(listed)}, expected {sorted(expected_files(parts))}")
    for name, digest in listed.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {str(path)!r} lacks {name}")
        if hash_files and sha256_file(file) != digest:
            raise CheckpointError(f"checkpoint {str(path)!r}: {name} does not match its checksum (corrupt or truncated)")
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


def load_files(path: Path, *, verified: bool = False) -> dict[str, Any]:
    """Read a checkpoint: {"meta", "model", "train", "ranks"} (weights_only: no code runs from the files).
    The checksums are checked first unless `verified` (the caller just did, e.g. through `latest`)."""
    import torch

    path = Path(path)
    meta = check(path, hash_files=not verified)
    tensors: dict[int, Any] = {}
    for r in range(int(meta["parts"])):
        tensors.update(read_part(path / part_name(r)))
    with open(path / STATE, "rb") as fh:
        tree = join_tensors(torch.load(fh, map_location="cpu", weights_only=True), tensors, str(path))
    with open(path / RANKS, "rb") as fh:
        ranks = torch.load(fh, map_location="cpu", weights_only=True)
    return {"meta": meta, "model": tree["model"], "train": tree["train"], "ranks": ranks}


def load_broadcast(path: Path, comm: Any, *, verified: bool = False) -> dict[str, Any]:
    """Rank 0 reads the checkpoint (verifying its checksums unless it just did) and broadcasts it: one
    reader per job, kinder to a parallel filesystem than W ranks reading every file. The trees go out
    pickled, the tensors' bytes by MPI_Bcast straight from their buffers (pickling them was 2.6x slower;
    `python benchmarks/checkpoint_load.py`)."""
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
        self._thread: threading.Thread | None = None  # this rank's writer, or rank 0's completer
        self._pending: dict[str, Any] | None = None  # a save whose parts are being written (same on every rank)
        self._own: dict[str, Any] = {"digests": {}, "sizes": {}, "error": None}  # this rank's last write
        self._error: BaseException | None = None  # rank 0: the first failure, reported by wait()
        self._staging = Staging()
        self.stall_seconds = 0.0  # all saves, including synchronous ones (stop, last step) that wait for the write
        self.async_stalls: list[float] = []  # the step-boundary stall of each asynchronous save
        self.write_seconds = 0.0  # wall time of this rank's writes (in the background, overlapping training)
        self.write_cpu_seconds = 0.0  # CPU time this rank's writes took from training
        self.saves = 0
        self.mtbf_s = mtbf_hours * 3600.0
        self._last_time = time.monotonic()

    def interval_seconds(self) -> float:
        """Young/Daly: the checkpoint interval that minimizes expected lost work, sqrt(2 x cost x MTBF).

        The cost is the measured stall plus the CPU time of the background write (what it takes from
        training when no core is idle); before any save is measured, one second is assumed.
        """
        cost = (self.stall_seconds + self.write_cpu_seconds) / self.saves if self.saves else 1.0
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

        One small allreduce agrees whether any rank was asked to stop (a signal), whether a checkpoint is
        due (rank 0's answer: with `auto` the policy reads a clock, and clocks differ) and whether any rank
        is still writing its part of the previous checkpoint; once none is, rank 0 completes it. A
        checkpoint is then written when due, on a stop (synchronously) and at the last step
        (synchronously). `state` is a dict with model_state, train_state, rank_state and meta, or a
        callable returning one (called only when a checkpoint is written).
        """
        writing = self._pending is not None and self._thread is not None and self._thread.is_alive()
        stopping, due, writing = self.comm.allreduce_array(
            [stop_requested, self.comm.rank == 0 and self.due(step), writing], op="max")
        if self._pending is not None and not writing:
            self.on_write()
            self._finish()
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
        self.on_write()
        if self._pending is not None:  # the previous save is still being written: it finishes first
            self._finish()
        self._join()
        skeleton, tensors = split_tensors({"model": model_state, "train": train_state})
        owner = assign_writers(tensors, self.comm.size)
        ranks = self.comm.gather({"state": to_host(rank_state), "layout": layout_digest(tensors)}, root=0)
        job: dict[str, Any] = {
            "step": step, "tmp": self.root / f".tmp-{step_dir_name(step)}-{self._token}",
            "parts": self._staging.snapshot({i: t for i, t in enumerate(tensors) if owner[i] == self.comm.rank})}
        if self.comm.rank == 0:
            job.update(skeleton=skeleton, ranks=ranks, meta=dict(meta, step=step, parts=self.comm.size))
        self._pending = job
        self._own = {"digests": {}, "sizes": {}, "error": None}
        self._thread = threading.Thread(target=self._write_guarded, args=(job,), name="hpctrain-checkpoint",
                                        daemon=True)
        self._thread.start()
        self.last_saved = step
        self.saves += 1
        self._last_time = time.monotonic()
        if wait or not self.asynchronous:
            self._finish()
            self._join()
        stall = time.perf_counter() - start
        self.stall_seconds += stall
        if self.asynchronous and not wait:
            self.async_stalls.append(stall)
        if wait:
            self.wait()

    def _write_guarded(self, job: dict[str, Any]) -> None:
        """This rank's part (and on rank 0 the trees and the gathered rank states), in the background."""
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            tmp = job["tmp"]
            tmp.mkdir(parents=True, exist_ok=True)
            name = part_name(self.comm.rank)
            digests = {name: write_part(tmp / name, job["parts"])}
            sizes = {name: (tmp / name).stat().st_size}
            if self.comm.rank == 0:
                if len({r["layout"] for r in job["ranks"]}) > 1:
                    raise CheckpointError("the ranks hold model or optimizer state of different dtypes or shapes; a "
                                          "checkpoint needs the same model and optimizer on every rank")
                digests[STATE] = _save_hashed(tmp / STATE, job["skeleton"])
                digests[RANKS] = _save_hashed(tmp / RANKS, [r["state"] for r in job["ranks"]])
            self._own = {"digests": digests, "sizes": sizes, "error": None}
        except BaseException as exc:  # noqa: BLE001 - gathered by rank 0, reported by wait()
            self._own = {"digests": {}, "sizes": {}, "error": f"rank {self.comm.rank}: {exc!r}"}
            if self.log:
                self.log(f"checkpoint write failed: {exc}")
        finally:
            self.write_seconds += time.perf_counter() - start
            self.write_cpu_seconds += time.thread_time() - cpu

    def _finish(self) -> None:
        """Every rank's part is written (or failed): rank 0 gathers the checksums and completes the
        checkpoint in the background (meta, marker, rename). Collective."""
        job, self._pending = self._pending, None
        assert job is not None
        self._join()
        results = self.comm.gather(self._own, root=0)
        if self.comm.rank != 0:
            return
        errors = [res["error"] for res in results if res["error"]]
        if errors:
            self._fail(CheckpointError(f"writing checkpoint step {job['step']} failed: {'; '.join(errors)}"))
            shutil.rmtree(job["tmp"], ignore_errors=True)
            return
        digests = {k: v for res in results for k, v in res["digests"].items()}
        sizes = {k: v for res in results for k, v in res["sizes"].items()}
        self._thread = threading.Thread(target=self._complete, args=(job, digests, sizes), name="hpctrain-checkpoint",
                                        daemon=True)
        self._thread.start()

    def _complete(self, job: dict[str, Any], digests: dict[str, str], sizes: dict[str, int]) -> None:
        try:
            tmp = job["tmp"]
            _await_parts(tmp, sizes)
            _write_bytes(tmp / "meta.json", json.dumps(dict(job["meta"], sha256=digests), indent=2, default=str).encode())
            _write_bytes(tmp / MARKER, b"")
            fsync_dir(tmp)
            final = self.root / step_dir_name(job["step"])
            if final.exists():  # a stale one from an earlier, diverged attempt at the same step
                _discard(final)
            tmp.rename(final)
            fsync_dir(self.root)
            self._prune()
        except BaseException as exc:  # noqa: BLE001 - reported by wait()
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        if self.log:
            self.log(f"checkpoint write failed: {exc}")

    def wait(self) -> None:
        """Block until the last save is on disk (collective), raising its error if it failed (on every rank)."""
        self.on_write()
        if self._pending is not None:
            self._finish()
        self._join()
        failed = self.comm.bcast(repr(self._error) if self._error is not None else None, root=0)
        if failed:
            error = CheckpointError(f"writing a checkpoint failed: {failed}")
            error.agreed = True  # rank 0 told every rank
            raise error

    def _join(self) -> None:
        # No timeout here: a write to a slow filesystem may rightly take long. The trainer's watchdog gives
        # every such wait its checkpoint budget (on_write) and ends the job past it.
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _prune(self) -> None:
        complete = 0
        for path in list_checkpoints(self.root.parent):
            if (path / MARKER).is_file():
                complete += 1
                if complete > self.keep:
                    _discard(path)
        for junk in [*self.root.glob(".tmp-step-*"), *self.root.glob(".trash-*")]:
            if not junk.name.endswith(f"-{self._token}") and not junk.name.endswith(f"-{os.getpid()}"):
                shutil.rmtree(junk, ignore_errors=True)


def _await_parts(tmp: Path, sizes: dict[str, int], patience: float = 10.0) -> None:
    """Every rank's part must be visible here, whole, before the checkpoint is marked complete. A network
    filesystem may show another node's new file a moment late; a RUN that is not shared by all nodes
    never shows it, and that would otherwise surface only at the next resume."""
    deadline = time.monotonic() + patience
    while True:
        missing = []
        for name, size in sorted(sizes.items()):
            try:
                if (tmp / name).stat().st_size != size:
                    missing.append(f"{name} (size differs)")
            except FileNotFoundError:
                missing.append(name)
        if not missing:
            return
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"rank 0 cannot see {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} in {str(tmp)!r}, "
                f"written by other ranks: put --run-dir on a filesystem that every node shares (not node-local /tmp)")
        time.sleep(0.2)


def _discard(path: Path) -> None:
    """Remove a checkpoint directory: first renamed out of the listing (atomic), then deleted, so a crash
    half-way through the deletion never leaves a listed checkpoint with files missing."""
    trash = path.with_name(f".trash-{path.name}-{os.getpid()}-{time.monotonic_ns()}")
    path.rename(trash)
    shutil.rmtree(trash, ignore_errors=True)
