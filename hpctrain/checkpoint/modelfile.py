"""The whole model's file (RUN/model.pt), written one tensor at a time.

`torch.save` wants the whole state_dict in memory at once. At ZeRO stage 3 that is the one moment of a run when a
rank holds the whole model, so the end of the run would peak above its training (issue 54, item 12). `ModelFile`
writes the file `torch.save` writes, without ever holding more than one tensor of it:

1. `torch.save` of placeholders (uninitialised memory that is never touched, so it is never resident), under
   `torch.serialization.skip_data`, lays out the archive: the pickle (keys, shapes, strides, dtypes, which keys
   share a tensor) and a reserved space for each tensor's bytes;
2. each tensor's bytes are written into its space as the caller hands it over (at stage 3, while its unit is
   gathered), and the CRC-32 of each, which `skip_data` leaves 0, is set in the archive's two headers at the end.

The result is `torch.save`'s file byte for byte, but for the archive's random serialization id
(tests/unit/test_modelfile.py compares them).
"""

from __future__ import annotations

import contextlib
import os
import struct
import zlib
import zipfile
from pathlib import Path
from typing import Any, Iterable, Iterator

from ..base.durable import replacing
from ..base.errors import HpctrainError


def _layout(tensor: Any) -> tuple[int, ...]:
    """The strides of `tensor.to("cpu", copy=True)`: its own where it is dense and non-overlapping (torch's
    preserve_format), else contiguous ones."""
    size, stride = tuple(tensor.size()), tuple(tensor.stride())
    expect = 1
    for st, sz in sorted((st, sz) for sz, st in zip(size, stride) if sz != 1):
        if st != expect:
            break
        expect *= sz
    else:
        return stride
    out, acc = [], 1
    for sz in reversed(size):
        out.append(acc)
        acc *= max(sz, 1)
    return tuple(reversed(out))


CHUNK_BYTES = 1 << 24
"""The most bytes of a tensor copied at once to hash or write it: far below a large layer's size."""


def byte_chunks(tensor: Any) -> Iterator[Any]:
    """The bytes of the contiguous `tensor`, in order, as numpy copies of at most CHUNK_BYTES on the host: hashing
    or writing a tensor never holds a copy of it whole (nor pins a ZeRO 3 parameter's storage, as
    Tensor.numpy() of the tensor itself would)."""
    import torch

    flat = tensor.detach().reshape(-1)
    if not flat.numel():
        return
    data = flat.view(torch.uint8)
    for start in range(0, data.numel(), CHUNK_BYTES):
        yield data[start:start + CHUNK_BYTES].to("cpu", copy=True).numpy()


class ModelFile:
    """`torch.save(state_dict, path)` one tensor at a time (see the module docstring). `items` gives the
    state_dict's (key, tensor) in order, for their metadata only (a ZeRO 3 parameter may be released); then
    `write(key, tensor)` for each key in the same order with its values, then `close()`, which puts the file in
    place (whole or not at all: `replacing`).

    A failure to write (a full disk) is kept and raised by `close()`: the writes run inside a collective (every
    rank gathers each unit), which the writing rank must not leave half way."""

    def __init__(self, path: Path, items: Iterable[tuple[str, Any]]):
        import torch

        self._stack = contextlib.ExitStack()
        self.error: OSError | RuntimeError | None = None  # torch's archive writer raises RuntimeError
        self._file: Any = None
        placeholders: dict[str, Any] = {}
        by_id: dict[int, Any] = {}  # a tensor under two keys (tied weights) is one storage, as torch.save keeps it
        self._record: dict[str, str] = {}  # key -> the archive's record of its storage
        for key, tensor in items:
            if id(tensor) not in by_id:
                by_id[id(tensor)] = torch.empty_strided(tuple(tensor.size()), _layout(tensor), dtype=tensor.dtype)
                self._record[key] = f"data/{len(by_id) - 1}"  # torch.save numbers storages as it first meets them
            placeholders[key] = by_id[id(tensor)]
        self._nbytes = {self._record[k]: placeholders[k].untyped_storage().nbytes() for k in self._record}
        self._crc: dict[str, int] = {}
        try:
            self.path = self._stack.enter_context(replacing(Path(path)))
            self._lay_out(placeholders)
        except (OSError, RuntimeError) as exc:
            self.error = exc

    def _lay_out(self, placeholders: dict[str, Any]) -> None:
        import torch
        from torch.serialization import skip_data

        with skip_data():
            torch.save(placeholders, self.path)
        reader = torch._C.PyTorchFileReader(str(self.path))
        self._offset = {name: reader.get_record_offset(name) for name in self._nbytes}
        del reader
        self._file = self._stack.enter_context(open(self.path, "r+b"))

    def write(self, key: str, tensor: Any) -> None:
        """Write `key`'s values (a tensor under a key seen before is written once, under its first key)."""
        import torch

        name = self._record.get(key)
        if name is None or self.error is not None:
            return
        data = tensor.detach()
        if not data.is_contiguous():  # torch.save keeps a dense tensor's layout: the bytes of such a copy
            data = torch.empty(0, dtype=torch.uint8).set_(data.to("cpu", copy=True).untyped_storage())
        if data.numel() * data.element_size() != self._nbytes[name]:
            raise HpctrainError(f"model.pt's {key!r} holds {data.numel() * data.element_size()} bytes where its "
                                f"placeholder held {self._nbytes[name]}; this is a bug, please report it")
        crc = 0
        try:
            self._file.seek(self._offset[name])
            for chunk in byte_chunks(data):
                self._file.write(chunk)
                crc = zlib.crc32(chunk, crc)
        except OSError as exc:
            self.error = exc
        self._crc[name] = crc

    def close(self) -> None:
        """Set each record's CRC-32 in its local header and in the central directory, flush the file to disk
        and put it in place; or raise the first error met writing it (the file is then removed)."""
        missing = [name for name in self._nbytes if name not in self._crc]
        if self.error is None and missing:
            raise HpctrainError(f"model.pt lacks the values of records {missing[:3]}; this is a bug, please report it")
        try:
            if self.error is not None:
                raise self.error
            self._set_crcs()
            self._file.flush()
            os.fsync(self._file.fileno())
        except BaseException as exc:
            self._stack.__exit__(type(exc), exc, exc.__traceback__)  # closes and removes the temporary file
            raise
        self._stack.close()

    def _set_crcs(self) -> None:
        from torch.serialization import get_crc32_options

        if not get_crc32_options():  # torch.save was told to leave them 0 (torch.serialization.config)
            return
        prefix_len, entries = self._entries()
        f = self._file
        for name, (local, central) in entries.items():
            crc = self._crc.get(name[prefix_len:])
            if crc is None:  # a record torch.save wrote whole (the pickle, the version)
                continue
            for at in (local + 14, central + 16):  # the CRC-32 field of a local header, of a central entry
                f.seek(at)
                f.write(struct.pack("<I", crc))

    def _entries(self) -> tuple[int, dict[str, tuple[int, int]]]:
        """(the length of the archive's folder prefix, {record name: (its local header's offset, its central
        directory entry's offset)})."""
        with zipfile.ZipFile(self.path) as archive:
            start = archive.start_dir
            infos = archive.infolist()
        prefix_len = infos[0].filename.index("/") + 1
        entries: dict[str, tuple[int, int]] = {}
        self._file.seek(start)
        blob = self._file.read()
        pos = 0
        for info in infos:
            if blob[pos:pos + 4] != b"PK\x01\x02":
                raise HpctrainError(f"model.pt's central directory is not where zipfile says ({start + pos}); this is a "
                                    "bug, please report it")
            name_len, extra_len, comment_len = struct.unpack("<HHH", blob[pos + 28:pos + 34])
            entries[info.filename] = (info.header_offset, start + pos)
            pos += 46 + name_len + extra_len + comment_len
        return prefix_len, entries
