"""The on-disk format of a checkpoint: which files a checkpoint directory holds, the part files, the named tensor
references in the trees, the split of the writing over the ranks, and the hashing done while writing.

A checkpoint directory holds `part-RRRRR.bin` (one per rank that wrote), `state.pt`, `ranks.pt`, `meta.json`
and the `COMPLETE` marker, which holds the sha256 of meta.json (empty in checkpoints of earlier versions; see
`manager` for what each file holds and when a directory counts).

Format 2 (meta.json `"format": 2`): every tensor has a name (its path in the state trees: `model/fc.weight`,
`train/optimizer/state/3/exp_avg`, `rank0001/rng/torch`), its whole shape and dtype, and is stored as pieces,
each an n-d box of it (offsets and lengths per dimension) that one rank wrote contiguously into its part file;
the trees refer to tensors by name, and state.pt holds the index of every piece (`build_index`), so a reader
reads any box of any tensor by byte ranges (`boxes`). State that is equal on every rank (a replicated
model, a plain optimizer) is written once, whole: the tensors are dealt to the ranks largest first, each to the
rank with the fewest bytes so far (as torch.distributed.checkpoint deduplicates replicated tensors), so W ranks
write about 1/W of the bytes each, in parallel. Sharded state (ZeRO's slices of parameters and optimizer
state) is written by the rank that owns it, as boxes of the whole tensors: a run saved on W ranks at any stage
is read by W' ranks at any stage, each reading what it will own. A part file is raw tensor bytes behind a JSON
header (no pickle); the small trees go through torch.save and load with weights_only=True. Every file is hashed
while it is written (no second pass over the bytes) and fsynced.

Format 3 (meta.json `"format": 3`) is format 2 on disk, with one promise more: the model's buffers (BatchNorm's
running statistics, any `register_buffer`) are rank 0's, written by rank 0 alone, and every rank held them equal
(the gradient engine broadcasts them every step, `comm/buffers.py`). In a checkpoint of format 2 written by
several ranks each rank had kept its own buffers and the dealing above wrote each one from whichever rank it fell
to: one rank's running mean beside another's variance. Such a checkpoint still resumes (every rank loads the
same values) and the resume says so in one line (`state.restore`).

Format 1 (checkpoints of earlier versions: numbered whole tensors, a sharded optimizer's slices as per-rank
trees) is still read (`read_part`), whole, by rank 0.
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
FORMAT = 3
NAMED_FORMATS = (2, 3)  # the formats whose tensors are named pieces (read alike)
PART_MAGIC = b"HPCTPRT2"  # format 2: named pieces
PART_MAGIC_1 = b"HPCTPRT1"  # format 1: numbered whole tensors (read only)
_ALIGN = 64
REF = "__hpctrain_tensor__"


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


def split_tensors(tree: Any, first: int = 0) -> tuple[Any, list[Any]]:
    """(the tree with each tensor replaced by a numbered reference, from `first` on, the tensors in that order)."""
    import torch

    tensors: list[Any] = []

    def walk(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
            return {REF: first + len(tensors) - 1}
        if isinstance(obj, dict):
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(walk(v) for v in obj)
        return obj

    return walk(tree), tensors


def split_named(tree: Any, prefix: str) -> tuple[Any, dict[str, Any]]:
    """(the tree with each tensor replaced by a reference to its name, {name: tensor}); a tensor's name is its
    path in the tree under `prefix` (`model/fc.weight`), and a reference already in the tree stays as it is."""
    import torch

    tensors: dict[str, Any] = {}

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            tensors[path] = obj
            return {REF: path}
        if isinstance(obj, dict):
            if len(obj) == 1 and REF in obj:
                return obj
            return {k: walk(v, f"{path}/{k}" if path else str(k)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(walk(v, f"{path}/{i}" if path else str(i)) for i, v in enumerate(obj))
        return obj

    return walk(tree, prefix), tensors


def join_tensors(tree: Any, tensors: dict[int, Any], where: str) -> Any:
    """The inverse of split_tensors."""
    if isinstance(tree, dict):
        if len(tree) == 1 and REF in tree:
            if tree[REF] not in tensors:
                raise CheckpointError(f"checkpoint {where!r} refers to tensor {brief(tree[REF], 20)}, which no part "
                                      "file holds")
            return tensors[tree[REF]]
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


def piece(name: str, tensor: Any, shape: Any = None, start: Any = None) -> dict[str, Any]:
    """A part-file entry for `tensor` as the box at `start` (default: the origin) of tensor `name` of whole
    `shape` (default: the tensor's own: a whole tensor)."""
    size = list(tensor.shape)
    return {"name": name, "dtype": str(tensor.dtype).removeprefix("torch."),
            "shape": list(shape) if shape is not None else size,
            "start": list(start) if start is not None else [0] * len(size), "size": size,
            "nbytes": tensor.numel() * tensor.element_size()}


def part_header(entries: list[dict[str, Any]]) -> tuple[bytes, int]:
    """(the JSON header of a part file holding `entries` in order, the file offset its data starts at); sets
    each entry's "offset" (from the data's start, 64-byte aligned). A pure function: a rank knows where each of
    its pieces will lie before it writes them."""
    offset = 0
    for entry in entries:
        entry["offset"] = offset
        offset = _padded(offset + entry["nbytes"])
    head = json.dumps({"byteorder": sys.byteorder, "pieces": entries}).encode()
    head += b" " * (_padded(16 + len(head)) - 16 - len(head))
    return head, 16 + len(head)


def write_part(path: Path, head: bytes, entries: list[dict[str, Any]], tensors: list[Any]) -> str:
    """Write a part file: 8 bytes magic, 8 bytes header length (little endian), the header (`part_header`), then
    each tensor's bytes (contiguous, C order) at its entry's offset; fsynced. Returns the sha256."""
    import torch

    sha = hashlib.sha256()
    with open(path, "wb") as fh:
        written = 0
        for chunk in (PART_MAGIC, len(head).to_bytes(8, "little"), head):
            sha.update(chunk)
            fh.write(chunk)
        for entry, t in zip(entries, tensors):
            if written < entry["offset"]:
                pad = b"\0" * (entry["offset"] - written)
                sha.update(pad)
                fh.write(pad)
                written = entry["offset"]
            if entry["nbytes"]:
                view = memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())
                sha.update(view)
                fh.write(view)
                written += entry["nbytes"]
        fh.flush()
        os.fsync(fh.fileno())
    return sha.hexdigest()


def build_index(parts: list[tuple[int, int, list[dict[str, Any]]]]) -> dict[str, dict[str, Any]]:
    """The index state.pt holds: {name: {"shape", "dtype", "pieces": [[part, start, size, file offset], ...]}}
    from every part's (number, data offset, entries). A box written by several ranks (a scalar every owner of a
    slice holds, such as Adam's step) is listed once; ranks that disagree on a tensor's shape or dtype are a
    CheckpointError."""
    index: dict[str, dict[str, Any]] = {}
    for part, base, entries in parts:
        for e in entries:
            entry = index.setdefault(e["name"], {"shape": e["shape"], "dtype": e["dtype"], "pieces": []})
            if entry["shape"] != e["shape"] or entry["dtype"] != e["dtype"]:
                raise CheckpointError(f"the ranks hold tensor {e['name']!r} with different shapes or dtypes "
                                      f"({entry['shape']} {entry['dtype']}, {e['shape']} {e['dtype']}); a checkpoint "
                                      "needs the same model and optimizer on every rank")
            if all(p[1] != e["start"] or p[2] != e["size"] for p in entry["pieces"]):
                entry["pieces"].append([part, e["start"], e["size"], base + e["offset"]])
    return index


def _bad_part(path: Path) -> Any:
    return lambda why: CheckpointError(f"checkpoint part {str(path)!r} is malformed: {why}")


def _open_header(fh: Any, path: Path, magic: bytes) -> tuple[int, dict[str, Any], int]:
    """(header length, header, file size) of the part file open in `fh`, checked: magic, length, JSON, byte order."""
    bad = _bad_part(path)
    if fh.read(8) != magic:
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
    return size, header, total


def read_header(path: Path) -> tuple[int, list[dict[str, Any]]]:
    """(the file offset a part file's data starts at, its piece entries) of a part file of format 2."""
    with open(path, "rb") as fh:
        size, header, _ = _open_header(fh, path, PART_MAGIC)
    return 16 + size, header.get("pieces", [])


def read_part(path: Path) -> dict[int, Any]:
    """The tensors of a part file of format 1, each read into its own memory (no pickle, nothing executed)."""
    bad = _bad_part(path)
    with open(path, "rb") as fh:
        size, header, total = _open_header(fh, path, PART_MAGIC_1)
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
