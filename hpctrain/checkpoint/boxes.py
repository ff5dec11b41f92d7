"""Reading a checkpoint by boxes: every tensor is named, with its whole shape and dtype, and stored as pieces,
each an n-d box (offsets and lengths per dimension) that one rank wrote contiguously into its part file. A
reader asks for any box of any tensor and reads only the bytes of the pieces that overlap it, through
`np.memmap` of the part files; never the whole state.

What a layout owns maps onto boxes: a whole tensor is one box; a ZeRO slice of a flat bucket covers a flat
range of each of its parameters, which is at most 2 x (dims - 1) + 1 boxes (`flat_boxes`: a partial first
row, whole rows, a partial last row, recursively); a tensor-parallel slice is one box. The index (which
pieces of which tensor lie where) is gathered by rank 0 when it writes and stored in state.pt
(`format.index_entry`); the format is in docs/reference/formats.md.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from ..base.errors import CheckpointError
from .format import REF, part_name

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (start, size), one entry per dimension


def flat_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[Box]:
    """Elements [lo, hi) of the C-order flattening of `shape` as boxes, in order; each box is a contiguous run
    of the flattening, so the boxes' elements concatenated are the range."""
    shape = tuple(shape)
    if hi <= lo:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    out: list[Box] = []
    if lo % inner:  # a partial first row
        row, end = lo // inner, min(hi, (lo // inner + 1) * inner)
        out += [((row, *s), (1, *z)) for s, z in flat_boxes(shape[1:], lo - row * inner, end - row * inner)]
        lo = end
    whole_end = hi // inner * inner
    if lo < whole_end:  # whole rows
        out.append(((lo // inner, *(0,) * (len(shape) - 1)), ((whole_end - lo) // inner, *shape[1:])))
        lo = whole_end
    if lo < hi:  # a partial last row
        row = lo // inner
        out += [((row, *s), (1, *z)) for s, z in flat_boxes(shape[1:], 0, hi - row * inner)]
    return out


def intersect(a: Box, b: Box) -> Box | None:
    """The box both `a` and `b` cover, or None."""
    start, size = [], []
    for a0, an, b0, bn in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(a0, b0), min(a0 + an, b0 + bn)
        if hi <= lo:
            return None
        start.append(lo)
        size.append(hi - lo)
    return tuple(start), tuple(size)


def is_ref(obj: Any) -> bool:
    return isinstance(obj, dict) and len(obj) == 1 and REF in obj


class Reader:
    """Boxes of the tensors of the checkpoint in `directory`, by the index its state.pt holds. `bytes_read`
    counts the tensor bytes this reader copied out of the part files (what a test asks a resume to keep to
    what the rank owns)."""

    def __init__(self, directory: Path, index: dict[str, dict[str, Any]]):
        self.directory = Path(directory)
        self.index = index
        self.bytes_read = 0

    def names(self, prefix: str = "") -> list[str]:
        return [name for name in self.index if name.startswith(prefix)]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)["shape"])

    def read(self, name: str, box: Box | None = None, out: Any = None) -> Any:
        """The `box` (default: all) of tensor `name`, into `out` (allocated when None; shaped like the box)."""
        import torch

        entry = self._entry(name)
        dtype = getattr(torch, str(entry["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointError(f"checkpoint {str(self.directory)!r}: tensor {name!r} has an unknown dtype "
                                  f"{str(entry['dtype'])[:40]!r}")
        box = box or ((0,) * len(entry["shape"]), tuple(entry["shape"]))
        if out is None:
            out = torch.empty(box[1], dtype=dtype)
        covered, maps = 0, {}  # the part files' maps, unmapped when this call returns (see _piece)
        for part, start, size, offset in entry["pieces"]:
            common = intersect(box, (tuple(start), tuple(size)))
            if common is None:
                continue
            src = self._piece(maps, part, offset, size, out.element_size())
            local = tuple(slice(c - s, c - s + n) for c, s, n in zip(common[0], start, common[1]))
            dst = tuple(slice(c - b, c - b + n) for c, b, n in zip(common[0], box[0], common[1]))
            self.bytes_read += _copy_out(src[local], out[dst])
            covered += math.prod(common[1])
        if covered != math.prod(box[1]):
            raise CheckpointError(f"checkpoint {str(self.directory)!r} holds {covered} of the {math.prod(box[1])} "
                                  f"elements of {name!r} asked for (box {box}): a rank's part is missing")
        return out

    def read_flat(self, name: str, lo: int, hi: int, out: Any = None) -> Any:
        """Elements [lo, hi) of the flattening of tensor `name`, as a 1-d tensor (into `out` when given)."""
        import torch

        entry = self._entry(name)
        if out is None:
            out = torch.empty(hi - lo, dtype=getattr(torch, entry["dtype"]))
        at = 0
        for box in flat_boxes(tuple(entry["shape"]), lo, hi):
            n = math.prod(box[1])
            self.read(name, box, out[at:at + n].view(box[1]))
            at += n
        return out

    def resolve(self, tree: Any) -> Any:
        """`tree` with every tensor reference replaced by the whole tensor."""
        if is_ref(tree):
            return self.read(tree[REF])
        if isinstance(tree, dict):
            return {k: self.resolve(v) for k, v in tree.items()}
        if isinstance(tree, (list, tuple)):
            return type(tree)(self.resolve(v) for v in tree)
        return tree

    def close(self) -> None:
        """Nothing to release: every map is closed by the call that opened it."""

    def _entry(self, name: str) -> dict[str, Any]:
        entry = self.index.get(name)
        if entry is None:
            raise CheckpointError(f"checkpoint {str(self.directory)!r} holds no tensor {name!r}")
        return entry

    def _piece(self, maps: dict[int, Any], part: int, offset: int, size: list[int], itemsize: int) -> Any:
        """The piece's bytes as an array shaped (*size, itemsize) over a memory map of its part file. The maps
        live in `maps`, one call of `read` long: the pages a map has touched count in the process's resident
        memory while it is open, so a reader that kept them would hold every byte it read twice (a resume of
        the 70 M MLP at ZeRO 3 on 2 ranks peaked at 1.34 GiB per rank, above the 1.14 GiB of its steps)."""
        raw = maps.get(part)
        if raw is None:
            raw = maps[part] = np.memmap(self.directory / part_name(part), dtype=np.uint8, mode="r")
        n = math.prod(size) * itemsize
        if offset + n > raw.size:
            raise CheckpointError(f"checkpoint part {part_name(part)!r} in {str(self.directory)!r} is shorter than "
                                  "its index says: truncated")
        return raw[offset:offset + n].reshape(*size, itemsize)


def _copy_out(src: Any, dst: Any) -> int:
    """Copy `src` (uint8, shaped (*dst.shape, itemsize), over a part file's map) into the tensor `dst`, with no
    copy in between when `dst` is in host memory with contiguous rows; returns the bytes copied."""
    import torch

    if dst.device.type == "cpu" and dst.dim() and dst.stride(-1) == 1 and not dst.requires_grad:
        np.copyto(dst.view(torch.uint8).numpy(), src.reshape(src.shape[:-2] + (-1,)))
    else:  # a scalar, strided rows or a GPU's memory: through a host copy of its own (the map is read-only)
        dst.copy_(torch.from_numpy(np.array(src, copy=True)).view(dst.dtype).reshape(dst.shape))
    return src.nbytes


class MemoryReader(Reader):
    """The same boxes over whole tensors already in memory (a checkpoint of format 1, read whole)."""

    def __init__(self, directory: Path, tensors: dict[str, Any]):
        super().__init__(directory, {name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                                            "pieces": []} for name, t in tensors.items()})
        self.tensors = tensors

    def read(self, name: str, box: Box | None = None, out: Any = None) -> Any:
        whole = self.tensors.get(name)
        if whole is None:
            self._entry(name)
        box = box or ((0,) * whole.dim(), tuple(whole.shape))
        part = whole[tuple(slice(s, s + n) for s, n in zip(*box))]
        self.bytes_read += part.numel() * part.element_size()
        if out is None:
            return part.clone()
        return out.copy_(part)
