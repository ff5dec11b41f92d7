"""The on-disk format of a checkpoint: which files a checkpoint directory holds, the part files, the tensor
references in the trees, the split of the writing over the ranks, and the hashing done while writing.

A checkpoint directory holds `part-RRRRR.bin` (one per rank that wrote), `state.pt`, `ranks.pt`, `meta.json`
and the `COMPLETE` marker, which holds the sha256 of meta.json (empty in checkpoints of earlier versions; see
`checkpoint` for what each file holds and when a directory counts).
Model and optimizer state are equal on every rank (data parallel), so each tensor is written once, by one
rank: the tensors are dealt to the ranks largest first, each to the rank with the fewest bytes so far (as
torch.distributed.checkpoint deduplicates replicated tensors). W ranks write about 1/W of the bytes each,
in parallel: on a parallel filesystem the write bandwidth grows with the nodes, and the CPU a save takes
from training is shared instead of landing on rank 0. State that differs between ranks (the slices of a
sharded optimizer) is written by the rank that holds it, numbered after the shared tensors. A part file is
raw tensor bytes behind a JSON header (no pickle); the small trees go through torch.save and load with
weights_only=True. Every file is hashed while it is written (no second pass over the bytes) and fsynced.
"""

from __future__ import annotations

import hashlib
import heapq
import io
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from ..base.errors import CheckpointError, brief, describe

MARKER = "COMPLETE"
STATE = "state.pt"
RANKS = "ranks.pt"
PART_MAGIC = b"HPCTPRT1"
_ALIGN = 64
_REF = "__hpctrain_tensor__"


def part_name(rank: int) -> str:
    return f"part-{rank:05d}.bin"


def expected_files(parts: int) -> set[str]:
    return {STATE, RANKS, *(part_name(r) for r in range(parts))}


def decode_json(raw: bytes) -> Any:
    """Parse JSON bytes; on damage raise ValueError saying where, in a few words (never quoting the bytes:
    a UnicodeDecodeError's repr holds the whole file)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not valid UTF-8 JSON at byte {exc.start} ({exc.reason})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid UTF-8 JSON at byte {len(text[:exc.pos].encode())} ({exc.msg})") from None


def meta_digest(raw: bytes) -> str:
    """What the marker holds: the sha256 of meta.json's bytes (meta.json lists the other files' digests)."""
    return hashlib.sha256(raw).hexdigest()


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


def split_tensors(tree: Any, first: int = 0) -> tuple[Any, list[Any]]:
    """(the tree with each tensor replaced by a numbered reference, from `first` on, the tensors in that order)."""
    import torch

    tensors: list[Any] = []

    def walk(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
            return {_REF: first + len(tensors) - 1}
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
                raise CheckpointError(f"checkpoint {where!r} refers to tensor {brief(tree[_REF], 20)}, which no part "
                                      "file holds")
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
            header = decode_json(fh.read(size))
        except ValueError as exc:
            raise bad(f"its header is {exc}") from None
        if not isinstance(header, dict) or header.get("byteorder") != sys.byteorder:
            order = header.get("byteorder") if isinstance(header, dict) else None
            raise bad(f"written on a {brief(order, 20)}-endian machine, this one is {sys.byteorder}-endian")
        try:
            return _read_tensors(fh, header.get("tensors", []), 16 + size, total, bad)
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise bad(f"a tensor entry of its header is broken ({describe(exc)})") from None


def _read_tensors(fh: Any, entries: list[dict], base: int, total: int, bad: Any) -> dict[int, Any]:
    import torch

    out = {}
    for entry in entries:
        dtype = getattr(torch, str(entry["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise bad(f"unknown dtype {brief(entry['dtype'], 40)}")
        t = torch.empty([int(d) for d in entry["shape"]], dtype=dtype)
        nbytes = t.numel() * t.element_size()
        if nbytes != entry["nbytes"] or base + entry["offset"] + nbytes > total:
            raise bad(f"tensor {brief(entry['id'], 20)} does not fit its declared size")
        if nbytes:
            fh.seek(base + entry["offset"])
            if fh.readinto(memoryview(t.reshape(-1).view(torch.uint8).numpy())) != nbytes:
                raise bad(f"tensor {brief(entry['id'], 20)} is truncated")
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


def save_hashed(path: Path, obj: Any) -> str:
    """torch.save `obj` to `path`, fsynced; return the sha256 of the bytes written."""
    import torch

    with open(path, "wb") as fh:
        writer = _HashingWriter(fh)
        torch.save(obj, writer)
        fh.flush()
        os.fsync(fh.fileno())
    return writer.sha.hexdigest()


def write_bytes(path: Path, data: bytes) -> None:
    """Write a small file (meta.json, the marker), fsynced."""
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def discard(path: Path) -> None:
    """Remove a checkpoint directory: first renamed out of the listing (atomic), then deleted, so a crash
    half-way through the deletion never leaves a listed checkpoint with files missing."""
    trash = path.with_name(f".trash-{path.name}-{os.getpid()}-{time.monotonic_ns()}")
    path.rename(trash)
    shutil.rmtree(trash, ignore_errors=True)
