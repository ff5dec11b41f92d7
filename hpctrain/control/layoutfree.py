"""Checkpoints of runs split over ranks (--tp/--pp), written layout-free, and resumed on any layout.

A split run writes no replicated model: each tensor of the whole model is written by the ranks of the first
replica that hold a share of it, each its own share as pieces (boxes: a dimension, the share's offset in
the whole tensor, its length), with the optimizer state of that share beside it, in the rank's own part of
the checkpoint (the format's per-rank tensors, as ZeRO's slices are). A tensor every tensor-parallel rank
holds whole is written by tensor rank 0; the tied embedding/head by the first stage. meta.json records the
layout, and every whole tensor's shape and dtype (`whole`) and its aliases (the tied head).

Reading (`saved_whole`) turns a checkpoint of any kind, a split run's or a data-parallel one's (ZeRO slices
included), into whole tensors by name: the model, and each parameter's optimizer state. `restore` then
gives this rank its share: a split run takes its pieces of each tensor, a data-parallel run the whole
tensors. So a run saved at (D, T, P) resumes at any (D', T', P'), or with plain data parallelism, and back.
The checkpoint is read on rank 0 and broadcast whole, as every checkpoint is (control/checkpoint.py); a
reader of boxes that reads only a rank's own bytes is what issue #29's format adds.
"""

from __future__ import annotations

from typing import Any

from ..base.errors import CheckpointError
from ..comm import full_state, load_entries
from ..parallel.stages import put, shares, take


def _dtype(name: str) -> Any:
    import torch

    return getattr(torch, name.removeprefix("torch."))


def split_state(run: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """A split run's (model's and optimizer's part of the train state, this rank's own tensors, meta entries)
    for a checkpoint (a collective: a ZeRO optimizer gathers its state over the data-parallel group)."""
    stage, g = run.model, run.par.groups
    saved = run.optimizer.state_dict()
    by_key = {key: saved["state"].get(i) for i, (key, _) in enumerate(stage.named_parameters())}
    model, optimizer = {}, {}
    if g.d == 0:
        for key, full, tensor, pieces, writes in shares(stage, g.t):
            if writes:
                model[full] = [pieces, tensor.detach()]
                if by_key.get(key):
                    optimizer[full] = [pieces, by_key[key]]
    groups = [{k: v for k, v in group.items() if k != "params"} for group in saved["param_groups"]]
    lay = run.par.layout
    meta = {"layout": [lay.data, lay.tensor, lay.pipe], "layout_free": True, "aliases": dict(stage.aliases),
            "whole": {k: [list(shape), str(dtype)] for k, (shape, dtype) in stage.whole.items()}}
    return {"param_groups": groups}, {"model": model, "optimizer": optimizer}, meta


def saved_whole(state: dict[str, Any], param_keys: list[str]) -> tuple[dict, dict, list[dict]]:
    """(the whole model's tensors by name, each parameter's optimizer state by name, the optimizer's param
    group settings) of a checkpoint of any kind; `param_keys`: the whole model's parameter names in its
    optimizer's order (what a data-parallel checkpoint's optimizer state is indexed by)."""
    meta = state["meta"]
    if not meta.get("layout_free"):
        saved = state["train"]["optimizer"]
        if "zero" in saved:
            saved = full_state(saved, [(r.get("own") or {}).get("optimizer") for r in state["ranks"]])
        optimizer = {param_keys[int(i)]: entries for i, entries in saved["state"].items()}
        return dict(state["model"]), optimizer, saved["param_groups"]
    import torch

    whole = {k: torch.empty(shape, dtype=_dtype(dtype)) for k, (shape, dtype) in meta["whole"].items()}
    covered = dict.fromkeys(whole, 0)
    optimizer: dict[str, dict[str, Any]] = {}
    for rank in state["ranks"]:
        own = rank.get("own") or {}
        for full, (pieces, tensor) in own.get("model", {}).items():
            put(whole[full], tensor, pieces)
            covered[full] += tensor.numel()
        for full, (pieces, entries) in own.get("optimizer", {}).items():
            into = optimizer.setdefault(full, {})
            for name, value in entries.items():
                if torch.is_tensor(value) and value.dim():
                    put(into.setdefault(name, torch.empty(whole[full].shape, dtype=value.dtype)), value, pieces)
                else:
                    into.setdefault(name, value)
    short = [k for k, n in covered.items() if n != whole[k].numel()]
    if short:
        raise CheckpointError(f"the layout-free checkpoint lacks pieces of {len(short)} tensor(s) (e.g. {short[0]!r}): "
                              "a rank's part is missing; resume from an earlier checkpoint")
    for alias, target in meta.get("aliases", {}).items():
        whole[alias] = whole[target]
    return whole, optimizer, state["train"]["optimizer"]["param_groups"]


def restore(run: Any, state: dict[str, Any]) -> None:
    """Load the checkpoint's model and optimizer state into this rank's model (its stage, or the whole model),
    whatever layout wrote it."""
    import torch

    model, optimizer = run.model, run.optimizer
    stage = None if run.par.plain else model
    param_keys = list(stage.param_keys) if stage is not None else [k for k, _ in model.named_parameters()]
    whole, saved_opt, groups = saved_whole(state, param_keys)
    named = list(model.named_parameters())
    local: dict[int, dict[str, Any]] = {}
    if stage is None:
        model.load_state_dict({k: whole[k] for k in model.state_dict()})
        for i, (key, _) in enumerate(named):
            if saved_opt.get(key):
                local[i] = dict(saved_opt[key])
    else:
        stage.load_state_dict({k: take(whole[stage.full_key(k)], stage.pieces(k, tuple(whole[stage.full_key(k)].shape)))
                               for k in stage.state_dict()})
        for i, (key, _) in enumerate(named):
            entries = saved_opt.get(stage.full_key(key))
            if entries:
                shape = tuple(whole[stage.full_key(key)].shape)
                pieces = stage.pieces(key, shape)
                local[i] = {name: take(v, pieces) if torch.is_tensor(v) and tuple(v.shape) == shape else v
                            for name, v in entries.items()}
    model.to(run.device)
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": list(range(len(named)))}
              for group in groups[:1]]
    load_entries(optimizer, {"state": local, "param_groups": groups}, [])
