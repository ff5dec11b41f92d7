"""The asynchronous checkpoint writer: the step-boundary snapshot, the background write of each rank's part,
and rank 0's completion of the checkpoint.

At the step boundary each rank copies its share of the state to host memory (the only stall; into buffers
kept from the previous save, see `Staging`), and a background thread per rank writes it while training goes
on. The ranks learn that every part is on disk from the one small allreduce they already do per step (the
policy in `manager` runs it); rank 0 then gathers the checksums and completes the checkpoint (meta,
marker, rename). The next save first waits for the previous one.

It knows nothing about MPI beyond the `Comm` object it is given, and runs no collective outside the
trainer's thread: only `AsyncWriter.finish` is collective, and the policy calls it there.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ..base.durable import NO_SPACE, free_bytes, fsync_dir, human_bytes
from ..base.errors import CheckpointError, HpctrainError, describe
from ..trace.spans import TRACER
from .format import (MARKER, RANKS, STATE, build_index, discard, meta_digest, part_name, save_hashed, write_bytes,
                     write_part)


class Staging:
    """Host buffers for the step-boundary snapshot, kept from one save to the next.

    A fresh clone of every tensor pays the page faults of new memory at every save, several times the cost of a copy into
    buffers already mapped; GPU tensors land in pinned
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


class AsyncWriter:
    """Writes one checkpoint at a time in the background, on every rank. A job (built by the policy) holds
    `step`, `tmp` (the temporary directory), `final` (the directory it is renamed to), `head` and `entries`
    (this rank's part header and pieces) and `parts` (their tensors, a snapshot); on rank 0 also `skeleton`,
    `ranks` (what every rank sent: its state tree, layout digest and pieces) and `meta`. `on_complete` runs in rank 0's completer after
    each rename (the policy prunes old checkpoints there)."""

    def __init__(self, comm: Any, *, log: Any = None, on_complete: Callable[[], None] | None = None):
        self.comm = comm
        self.log = log
        self.on_complete = on_complete or (lambda: None)
        self.staging = Staging()
        self.job: dict[str, Any] | None = None  # a save whose parts are being written (same on every rank)
        self.error: BaseException | None = None  # rank 0: the first failure, reported by the policy's wait()
        self.write_seconds = 0.0  # wall time of this rank's writes (in the background, overlapping training)
        self.write_cpu_seconds = 0.0  # CPU time this rank's writes took from training
        self._thread: threading.Thread | None = None  # this rank's writer, or rank 0's completer
        self._own: dict[str, Any] = {"digests": {}, "sizes": {}, "error": None}  # this rank's last write

    def writing(self) -> bool:
        """Whether this rank is still writing its part of the pending save."""
        return self.job is not None and self._thread is not None and self._thread.is_alive()

    def start(self, job: dict[str, Any]) -> None:
        """Write this rank's part of `job` in a background thread (the previous job must be finished)."""
        self.job = job
        self._own = {"digests": {}, "sizes": {}, "error": None}
        self._thread = threading.Thread(target=self._write_guarded, args=(job,), name="hpctrain-checkpoint",
                                        daemon=True)
        self._thread.start()

    def _write_guarded(self, job: dict[str, Any]) -> None:
        """This rank's part (and on rank 0 the trees and the gathered rank states), in the background."""
        start, cpu = time.perf_counter(), time.thread_time()
        tmp, name = job["tmp"], job["tmp"].name  # the file (or directory) being written, for the error
        need = sum(t.numel() * t.element_size() for t in job["parts"])
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            name = part_name(self.comm.rank)
            digests = {name: write_part(tmp / name, job["head"], job["entries"], job["parts"])}
            sizes = {name: (tmp / name).stat().st_size}
            if self.comm.rank == 0:
                if len({r["layout"] for r in job["ranks"]}) > 1:
                    raise CheckpointError("the ranks hold model or optimizer state of different dtypes or shapes; a "
                                          "checkpoint needs the same model and optimizer on every rank")
                index = build_index([(r, *got["pieces"]) for r, got in enumerate(job["ranks"])])
                for name, tree in ((STATE, {**job["skeleton"], "index": index}),
                                   (RANKS, [r["state"] for r in job["ranks"]])):
                    digests[name] = save_hashed(tmp / name, tree)
            self._own = {"digests": digests, "sizes": sizes, "error": None, "need": need}
        except BaseException as exc:  # noqa: BLE001 - gathered by rank 0, reported by wait()
            failure = _failure(exc, tmp)
            self._own = {"digests": {}, "sizes": {}, "error": failure, "file": name, "need": need}
            if self.log:
                self.log(f"checkpoint write failed on rank {self.comm.rank}, writing {name}: {failure['why']}")
        finally:
            self.write_seconds += time.perf_counter() - start
            self.write_cpu_seconds += time.thread_time() - cpu
            TRACER.span("checkpoint write", start, time.perf_counter(), step=job["step"])

    def finish(self) -> None:
        """Every rank's part is written (or failed): rank 0 gathers the checksums and completes the
        checkpoint in the background (meta, marker, rename). Collective."""
        job, self.job = self.job, None
        assert job is not None
        self.join()
        results = self.comm.gather(self._own, root=0)
        if self.comm.rank != 0:
            return
        failed = [(r, res) for r, res in enumerate(results) if res["error"]]
        if failed:
            self._fail(_part_failure(job, failed, need=sum(res.get("need", 0) for res in results)))
            shutil.rmtree(job["tmp"], ignore_errors=True)
            return
        digests = {k: v for res in results for k, v in res["digests"].items()}
        sizes = {k: v for res in results for k, v in res["sizes"].items()}
        self._thread = threading.Thread(target=self._complete, args=(job, digests, sizes), name="hpctrain-checkpoint",
                                        daemon=True)
        self._thread.start()

    def _complete(self, job: dict[str, Any], digests: dict[str, str], sizes: dict[str, int]) -> None:
        tmp, final = job["tmp"], job["final"]
        meta = json.dumps(dict(job["meta"], sha256=digests), indent=2, default=str).encode()
        name = "meta.json"
        try:
            _await_parts(tmp, sizes)
            write_bytes(tmp / name, meta)
            name = MARKER
            write_bytes(tmp / MARKER, meta_digest(meta).encode())  # the marker vouches for meta.json
            fsync_dir(tmp)
            name = final.name
            if final.exists():  # a stale one from an earlier, diverged attempt at the same step
                discard(final)
            tmp.rename(final)
            fsync_dir(final.parent)
            self.on_complete()
        except BaseException as exc:  # noqa: BLE001 - reported by wait()
            failure = _failure(exc, tmp)
            self._fail(_part_failure(job, [(0, dict(error=failure, file=name))], need=len(meta)))
            shutil.rmtree(tmp, ignore_errors=True)

    def _fail(self, exc: CheckpointError) -> None:
        if self.error is None:
            self.error = exc
        if self.log:
            self.log(str(exc))

    def join(self) -> None:
        """Wait for this rank's writer (or rank 0's completer) to end."""
        # No timeout here: a write to a slow filesystem may rightly take long. The trainer's watchdog gives
        # every such wait its checkpoint budget (on_write) and ends the job past it.
        if self._thread is not None:
            self._thread.join()
            self._thread = None


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


def _failure(exc: BaseException, tmp: Path) -> dict[str, Any]:
    """What rank 0 needs to say why this rank's write failed, in a few words (picklable, gathered)."""
    storage = isinstance(exc, OSError)
    return {"why": str(exc) if isinstance(exc, HpctrainError) else describe(exc), "storage": storage,
            "no_space": storage and exc.errno in NO_SPACE, "free": free_bytes(tmp) if storage else None}


def _part_failure(job: dict[str, Any], failed: list[tuple[int, dict[str, Any]]], *, need: int) -> CheckpointError:
    """One line for a checkpoint that could not be written: which rank could not write which file where, why,
    and for a full disk the bytes free there and those the checkpoint needed. A failure of the filesystem
    (an OSError) is a failure during the work (exit 1); the rest keep CheckpointError's code."""
    rank, res = failed[0]
    why = res["error"]
    text = f"writing a checkpoint failed (step {job['step']}): rank {rank}"
    if why["storage"]:
        text += f" cannot write {res['file']} in {job['final'].parent}"
    text += f": {why['why']}"
    if why["no_space"]:
        text += f" ({human_bytes(why['free'])} free, {human_bytes(need)} needed)"
    if len(failed) > 1:
        text += f"; rank{'s' if len(failed) > 2 else ''} {', '.join(str(r) for r, _ in failed[1:])} too"
    error = CheckpointError(text)
    if why["storage"]:
        error.exit_code = 1
    error.no_space = why["no_space"]
    return error
