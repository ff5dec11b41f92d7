"""The checkpoint modules' in-process parts: staging buffers, the part-file format, the split of the writing
over ranks, and a save/load round trip (one process, no MPI: the multi-rank tests are in tests/mpi)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from hpctrain.checkpoint import manager as ckpt
from hpctrain.checkpoint import boxes as ckptboxes
from hpctrain.checkpoint import format as ckptformat
from hpctrain.checkpoint import writer as ckptwriter
from hpctrain.comm import Comm
from hpctrain.base.durable import sha256_file
from hpctrain.base.errors import CheckpointError


def test_staging_reuses_buffers_and_snapshots_are_independent_of_training() -> None:
    staging = ckptwriter.Staging()
    w = torch.randn(64, 32)
    first = staging.snapshot({0: w, 1: w.t(), 2: torch.zeros(3)})
    assert torch.equal(first[0], w) and torch.equal(first[1], w.t())  # a non-contiguous source copies by value
    ptr = first[0].data_ptr()
    w.add_(1.0)  # training goes on: the snapshot must not move
    assert not torch.equal(first[0], w)
    second = staging.snapshot({0: w, 2: torch.zeros(4, dtype=torch.float64)})
    assert second[0].data_ptr() == ptr  # the same host buffer, no new allocation
    assert torch.equal(second[0], w)
    assert second[2].shape == (4,) and second[2].dtype == torch.float64  # shape and dtype changed: a new buffer
    assert set(staging.buffers) == {0, 2}  # a tensor no longer written frees its buffer


def _write_whole(directory: Path, tensors: dict[str, torch.Tensor]) -> ckptboxes.Reader:
    """Write `tensors` whole into part 0 of `directory` and return a reader over it."""
    entries = [ckptformat.piece(name, t) for name, t in tensors.items()]
    head, base = ckptformat.part_header(entries)
    digest = ckptformat.write_part(directory / ckptformat.part_name(0), head, entries, list(tensors.values()))
    assert digest == sha256_file(directory / ckptformat.part_name(0))
    assert ckptformat.read_header(directory / ckptformat.part_name(0)) == (base, entries)
    return ckptboxes.Reader(directory, ckptformat.build_index([(0, base, entries)]))


def test_part_file_round_trip_every_dtype_and_shape(tmp_path: Path) -> None:
    tensors = {"a": torch.randn(5, 7), "b/c": torch.arange(11, dtype=torch.int64), "d": torch.tensor(2.5),
               "e": torch.randn(3).to(torch.bfloat16), "f": torch.zeros(0, 4), "g": torch.tensor([True, False, True]),
               "h": torch.randn(2, 3, dtype=torch.complex128)}
    reader = _write_whole(tmp_path, tensors)
    for name, t in tensors.items():
        back = reader.read(name)
        assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)
    assert reader.bytes_read == sum(t.numel() * t.element_size() for t in tensors.values())


def test_any_box_and_any_flat_range_reads_only_its_bytes_from_pieces_of_several_parts(tmp_path: Path) -> None:
    """A tensor written as the flat slices of three ranks (ZeRO's cut: boxes of rows and parts of rows) reads
    back by any box (a tensor-parallel cut) and any flat range, and the reader copies out only those bytes."""
    whole = torch.arange(5 * 6 * 7, dtype=torch.float32).reshape(5, 6, 7)
    parts = []
    for rank, (lo, hi) in enumerate([(0, 71), (71, 150), (150, 210)]):
        entries, tensors, at = [], [], lo
        for start, size in ckptboxes.flat_boxes(whole.shape, lo, hi):
            n = math.prod(size)
            tensors.append(whole.reshape(-1)[at:at + n].view(size))
            entries.append(ckptformat.piece("w", tensors[-1], whole.shape, start))
            at += n
        assert at == hi and len(entries) <= 5  # at most 2 x (dims - 1) + 1 boxes
        head, base = ckptformat.part_header(entries)
        ckptformat.write_part(tmp_path / ckptformat.part_name(rank), head, entries, tensors)
        parts.append((rank, base, entries))
    reader = ckptboxes.Reader(tmp_path, ckptformat.build_index(parts))
    assert torch.equal(reader.read("w"), whole)
    for box in [((1, 2, 3), (3, 4, 2)), ((0, 0, 5), (5, 6, 2)), ((4, 5, 6), (1, 1, 1))]:
        before = reader.bytes_read
        got = reader.read("w", box)
        assert torch.equal(got, whole[tuple(slice(s, s + n) for s, n in zip(*box))])
        assert reader.bytes_read - before == got.numel() * 4
    for lo, hi in [(0, 210), (5, 6), (40, 133), (69, 151)]:
        before = reader.bytes_read
        assert torch.equal(reader.read_flat("w", lo, hi), whole.reshape(-1)[lo:hi])
        assert reader.bytes_read - before == (hi - lo) * 4
    with pytest.raises(CheckpointError, match="no tensor 'v'"):
        reader.read("v")


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's maps (Linux)")
def test_a_read_leaves_no_part_file_mapped(tmp_path: Path) -> None:
    """The pages of a part file's memory map count in the process's resident memory while the map is open: a
    reader that kept its maps until close() held every byte a resume read twice (the 70 M MLP at ZeRO 3 resumed
    on 2 ranks: 400 MiB per rank above the peak of its steps). Each read closes the maps it opened."""
    tensors = {"w": torch.randn(64, 256), "v": torch.randn(1000)}
    reader = _write_whole(tmp_path, tensors)
    part = str(tmp_path / ckptformat.part_name(0))

    def mapped() -> bool:
        return any(line.rstrip().endswith(part) for line in Path("/proc/self/maps").read_text().splitlines())

    out = torch.empty(500)
    assert torch.equal(reader.read("w"), tensors["w"]) and not mapped()
    assert torch.equal(reader.read_flat("v", 100, 600, out=out), tensors["v"][100:600]) and not mapped()
    assert torch.equal(reader.read("w", ((3, 5), (7, 9))), tensors["w"][3:10, 5:14]) and not mapped()


def test_a_read_goes_into_a_tensor_outside_host_memory(tmp_path: Path) -> None:
    """A resume at ZeRO 3 on a GPU reads each slice straight into the rank's CUDA tensor: the direct copy into a
    tensor's bytes (through .numpy()) is for host memory only, and a GPU's tensor takes a host copy instead
    (found by benchmarks/gpu_check.sh, resume-zero3: "can't convert cuda:0 device type tensor to numpy"). No GPU
    here: the meta device stands in for it, being no more convertible to numpy than CUDA memory is; with a GPU
    the CUDA tensor itself is read into and compared."""
    tensors = {"w": torch.randn(64, 256), "v": torch.randn(1000)}
    reader = _write_whole(tmp_path, tensors)
    out = torch.empty(500, device="meta")
    assert reader.read_flat("v", 100, 600, out=out) is out  # raised TypeError before
    assert reader.read("w", ((3, 5), (7, 9)), out=torch.empty(7, 9, device="meta")).shape == (7, 9)
    if torch.cuda.is_available():
        gpu = torch.empty(500, device="cuda")
        assert torch.equal(reader.read_flat("v", 100, 600, out=gpu).cpu(), tensors["v"][100:600])


@pytest.mark.skipif(sys.byteorder != "little", reason="the header records the byte order")
def test_part_file_bytes_are_pinned(tmp_path: Path) -> None:
    """The part-file layout is a file format: checkpoints written by earlier versions must still load, so a part
    file of format 1 (tests/golden/part-format1.bin, as first released) reads back as it was written, and the
    bytes written for the same pieces in format 2 never change."""
    old = ckptformat.read_part(Path(__file__).parents[1] / "golden" / "part-format1.bin")
    tensors = {0: torch.arange(6, dtype=torch.float32).reshape(2, 3), 2: torch.tensor([1, -2, 3], dtype=torch.int64),
               5: torch.tensor([0.5, -1.5]).to(torch.bfloat16), 7: torch.zeros(0, 3), 9: torch.tensor(True)}
    assert all(torch.equal(old[key], t) and old[key].dtype == t.dtype for key, t in tensors.items())
    entries = [ckptformat.piece(f"t/{key}", t) for key, t in tensors.items()]
    head, _ = ckptformat.part_header(entries)
    digest = ckptformat.write_part(tmp_path / "p.bin", head, entries, list(tensors.values()))
    assert digest == "764141b8f9a564f67a014c1e4c791c3f36cc569a1af0b1a75442c85bbffa9ea2"


def test_part_file_damage_is_a_clear_error(tmp_path: Path) -> None:
    reader = _write_whole(tmp_path, {"w": torch.randn(1000)})
    part = tmp_path / ckptformat.part_name(0)
    data = part.read_bytes()
    part.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        ckptboxes.Reader(tmp_path, reader.index).read("w")
    part.write_bytes(b"NOTAPART" + data[8:])
    with pytest.raises(CheckpointError, match="magic"):
        ckptformat.read_header(part)
    reader.index["w"]["dtype"] = "Tensor "
    with pytest.raises(CheckpointError, match="unknown dtype"):
        reader.read("w")


def test_writers_share_the_bytes_evenly_and_agree_without_talking() -> None:
    tensors = [torch.empty(n) for n in (4_000_000, 1_600_000, 4_000_000, 2048, 1_600_000, 10, 2048, 10)]
    owner = ckptformat.assign_writers(tensors, 2)
    assert owner == ckptformat.assign_writers(tensors, 2)
    load = [sum(t.numel() for t, o in zip(tensors, owner) if o == r) for r in range(2)]
    assert abs(load[0] - load[1]) <= 2048 * 2  # two of the big four each, then the small ones balance
    assert ckptformat.assign_writers(tensors, 1) == [0] * len(tensors)
    assert sorted(set(ckptformat.assign_writers(tensors, 16))) == list(range(8))  # more ranks than tensors: one each


def test_save_then_load_round_trip_with_reused_buffers(tmp_path: Path) -> None:
    mgr = ckpt.CheckpointManager(tmp_path, Comm(None), every=1, keep=2)
    w = torch.randn(16, 16)
    opt = torch.optim.Adam([torch.nn.Parameter(torch.randn(16))], lr=0.1)
    opt.param_groups[0]["params"][0].grad = torch.ones(16)
    opt.step()
    for step in (1, 2, 3):
        w.add_(1.0)
        expected = w.clone()
        mgr.save(step, {"model_state": {"w": w}, "train_state": {"optimizer": opt.state_dict(), "step": step},
                        "rank_state": {"r": 0}, "meta": {"step": step}})
        w.add_(100.0)  # changed while the background write may still run; the checkpoint keeps step's value
    mgr.wait()
    names = sorted(p.name for p in ckpt.list_checkpoints(tmp_path))
    assert names == ["step-0000002", "step-0000003"]
    loaded = ckpt.load_files(ckpt.latest(tmp_path))
    assert torch.equal(loaded["model"]["w"], expected)
    assert loaded["train"]["step"] == 3 and loaded["ranks"] == [{"r": 0}]
    assert torch.equal(loaded["train"]["optimizer"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert sorted(loaded["meta"]["sha256"]) == ["part-00000.bin", "ranks.pt", "state.pt"]
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_a_failed_write_is_reported_and_leaves_nothing_listed(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").write_text("not a directory")  # every write fails
    mgr = ckpt.CheckpointManager(tmp_path, Comm(None), every=1, keep=2)
    state = {"model_state": {"w": torch.ones(3)}, "train_state": {}, "rank_state": {}, "meta": {}}
    mgr.save(1, state)  # asynchronous: the failure surfaces at the next wait
    with pytest.raises(CheckpointError, match="writing a checkpoint failed.*rank 0"):
        mgr.save(2, state, final=True)
    assert ckpt.list_checkpoints(tmp_path) == []


def test_a_meta_json_that_lies_about_its_parts_is_refused(tmp_path: Path) -> None:
    mgr = ckpt.CheckpointManager(tmp_path, Comm(None), every=1, keep=2)
    mgr.save(1, {"model_state": {"w": torch.ones(3)}, "train_state": {}, "rank_state": {}, "meta": {}}, final=True)
    path = ckpt.latest(tmp_path)
    meta_file = path / "meta.json"
    meta = json.loads(meta_file.read_text())
    for parts in (10**9, 0, 2):
        meta_file.write_text(json.dumps(dict(meta, parts=parts)))
        with pytest.raises(CheckpointError, match="part files|lists files"):
            ckpt.verify(path)


def test_parts_another_node_wrote_must_be_visible_before_the_marker(tmp_path: Path) -> None:
    (tmp_path / "part-00000.bin").write_bytes(b"x" * 10)
    ckptwriter._await_parts(tmp_path, {"part-00000.bin": 10}, patience=0.0)  # present and whole: no wait
    with pytest.raises(CheckpointError, match="part-00001.bin.*every node shares"):
        ckptwriter._await_parts(tmp_path, {"part-00000.bin": 10, "part-00001.bin": 5}, patience=0.3)
    with pytest.raises(CheckpointError, match="size differs"):
        ckptwriter._await_parts(tmp_path, {"part-00000.bin": 11}, patience=0.0)


def test_load_files_has_its_documented_name_and_the_old_one_still_works_with_a_warning() -> None:
    import importlib

    import hpctrain.checkpoint

    assert hpctrain.checkpoint.load_files is ckpt.load_files
    sys.modules.pop("hpctrain.control.checkpoint", None)  # a first import, as a user's script makes it
    with pytest.warns(DeprecationWarning, match="hpctrain.checkpoint.load_files"):
        old = importlib.import_module("hpctrain.control.checkpoint")
    assert old.load_files is ckpt.load_files and old.CheckpointManager is ckpt.CheckpointManager
