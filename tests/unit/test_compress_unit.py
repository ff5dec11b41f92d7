"""Compressor state across a checkpoint: it comes back where the gradients are.

A checkpoint's tensors are loaded on the CPU (`map_location="cpu"`); a run on a GPU used to keep its restored
error feedback there, and its first compressed step after every resume failed with a device mismatch. No GPU
is here: the model is put on torch's "meta" device to stand for "not the CPU the checkpoint loaded on"."""

from __future__ import annotations

import pytest
import torch

from hpctrain.comm import GradSync, world


@pytest.mark.parametrize("spec", ["powersgd:2", "topk:0.1"])
def test_restored_compressor_state_moves_to_the_gradients_device(spec: str) -> None:
    model = torch.nn.Linear(8, 4, device="meta")
    sync = GradSync(model.parameters(), world(), overlap=False, compress=spec)
    flat = sync.buckets[0].flat
    state = {"errors": {"0": torch.ones(flat.shape)}}
    if spec.startswith("powersgd"):
        state["qs"] = {"0": torch.ones(8 * 2)}
    sync.load_compressor_state(state)
    restored = sync.compressor_state()
    tensors = [*restored["errors"].values(), *restored.get("qs", {}).values()]
    assert tensors and all(t.device == flat.device for t in tensors), [t.device for t in tensors]
    assert list(restored["errors"]) == [0]  # bucket indices as ints, whatever the checkpoint's keys
    sync.close()


@pytest.mark.parametrize("spec", ["powersgd:2", "topk:0.1"])
def test_state_saved_for_other_buckets_is_not_loaded_and_says_so(spec: str) -> None:
    """Error feedback is per bucket: restored into buckets cut otherwise (another --bucket-mb, or a version of
    hpctrain that cut them otherwise), the first compressed step used to fail on a shape mismatch."""
    model = torch.nn.Linear(8, 4)
    sync = GradSync(model.parameters(), world(), overlap=False, compress=spec)
    state = {"errors": {"0": torch.ones(7)}}
    if spec.startswith("powersgd"):
        state["qs"] = {"0": torch.ones(8 * 2)}
    unfit = sync.load_compressor_state(state)
    assert unfit and "bucket 0 holds 36 elements, its saved error 7" in unfit and "--bucket-mb" in unfit
    assert sync.compressor_state()["errors"] == {}  # afresh
    fits = {"errors": {"0": torch.ones(36)}, **({"qs": {"0": torch.ones(16)}} if "qs" in state else {})}
    assert sync.load_compressor_state(fits) is None and list(sync.compressor_state()["errors"]) == [0]
    sync.close()
