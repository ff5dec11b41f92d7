"""ModelFile writes, one tensor at a time, the file torch.save writes (model.pt's format stays torch.save's)."""

from __future__ import annotations

import zipfile

import pytest
import torch

from hpctrain.base.durable import replacing
from hpctrain.checkpoint import modelfile
from hpctrain.checkpoint.modelfile import ModelFile


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(30, 40), torch.nn.BatchNorm1d(40), torch.nn.Linear(40, 40),
                                torch.nn.Linear(40, 40, bias=False))
    model[3].weight = model[2].weight  # tied: one storage under two keys
    state = model.state_dict(keep_vars=True)
    state["permuted"] = torch.randn(3, 5).t()  # dense, not contiguous: torch.save keeps its strides
    state["strided"] = torch.randn(6, 6)[::2, ::3]  # not dense: copied contiguous
    state["empty"] = torch.empty(0, 4)
    return state


def _copies(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    copies: dict[int, torch.Tensor] = {}
    return {k: copies.setdefault(id(t), t.detach().to("cpu", copy=True)) for k, t in state.items()}


@pytest.mark.parametrize("chunk", [1 << 24, 1000], ids=["whole-tensors", "tensors-in-chunks"])
def test_streamed_file_is_torch_saves_byte_for_byte_but_its_serialization_id(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(modelfile, "CHUNK_BYTES", chunk)
    state = _state()
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    with replacing(tmp_path / "a" / "model.pt") as tmp:  # as the trainer wrote it before: its archive's name
        torch.save(_copies(state), tmp)
    out = ModelFile(tmp_path / "b" / "model.pt", state.items())
    for key, tensor in state.items():
        out.write(key, tensor)
    out.close()

    want, got = (zipfile.ZipFile(tmp_path / d / "model.pt") for d in ("a", "b"))
    assert got.testzip() is None  # every record's CRC-32 is right
    assert [i.filename for i in got.infolist()] == [i.filename for i in want.infolist()]
    for a, b in zip(want.infolist(), got.infolist()):
        if not a.filename.endswith("serialization_id"):
            assert (a.header_offset, a.CRC, want.read(a)) == (b.header_offset, b.CRC, got.read(b)), a.filename
    loaded = torch.load(tmp_path / "b" / "model.pt")
    assert all(torch.equal(loaded[k], v.detach()) and loaded[k].stride() == _copies(state)[k].stride()
               for k, v in state.items())
    assert loaded["3.weight"].untyped_storage().data_ptr() == loaded["2.weight"].untyped_storage().data_ptr()


def test_a_failed_write_is_raised_by_close_and_leaves_no_file(tmp_path):
    state = _state()
    out = ModelFile(tmp_path / "missing" / "model.pt", state.items())  # no such folder: the write fails
    for key, tensor in state.items():
        out.write(key, tensor)  # the collective goes on: nothing raised here
    with pytest.raises((OSError, RuntimeError)):  # torch's archive writer raises RuntimeError
        out.close()
    assert not (tmp_path / "missing").exists()
