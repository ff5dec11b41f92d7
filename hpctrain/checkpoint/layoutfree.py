"""Checkpoints of runs split over ranks (--tp/--pp), in the one checkpoint format: each rank's share of a tensor
is a box of the whole tensor, and a resume reads only the boxes it will hold.

A split rank holds shares of the whole model's tensors: for a tensor-parallel split, pieces along one dimension
(`parallel.stages`: (dim, offset in the whole tensor, offset in the share, length)); a pipeline stage holds
its blocks' tensors whole. Each piece is one box of the format (`boxes`): start `offset` and size `length`
along its dimension, the whole extent along the others. So a split run writes what a data-parallel run writes:
the model's tensors by their whole-model names (`model/<key>`; the tied head refers to the embedding's name),
the optimizer state by the whole model's parameter index (`train/optimizer/state/<index>/<key>`), the trees
alike on every rank. The ranks of the first replica that hold a share write it (a tensor every tensor-parallel
rank holds whole: tensor rank 0; the tied embedding/head: the first stage).

Any run reads any of them: a data-parallel run (any ZeRO stage) reads a split run's checkpoint through
`state.restore` as if a data-parallel run had written it, and a split run reads any checkpoint here
(`restore`): for each tensor of its stage, the boxes of its pieces. meta.json records the layout (D, T, P).
"""

from __future__ import annotations

from typing import Any

from ..base.errors import CheckpointError
from ..comm import ShardedOptimizer
from ..parallel.stages import Piece, shares
from .boxes import is_ref
from .format import REF
from .loader import Loaded
from .state import OPTIM


def boxes(name: str, share: Any, shape: tuple[int, ...], pieces: list[Piece]) -> list[tuple[str, Any, Any, Any]]:
    """This rank's `share` of tensor `name` (whole `shape`) as checkpoint pieces (name, tensor, shape, start):
    one box per piece, or the whole tensor."""
    if not pieces:
        return [(name, share, shape, (0,) * len(shape))]
    out = []
    for dim, start, at, length in pieces:
        begin = [0] * len(shape)
        begin[dim] = start
        out.append((name, share.narrow(dim, at, length).contiguous(), shape, tuple(begin)))
    return out


def read_share(reader: Any, name: str, shape: tuple[int, ...], pieces: list[Piece]) -> Any:
    """This rank's share of tensor `name` (whole `shape`), read by the boxes of its `pieces` only."""
    import torch

    if not pieces:
        return reader.read(name)
    parts = []
    for dim, start, _, length in pieces:
        begin, size = [0] * len(shape), list(shape)
        begin[dim], size[dim] = start, length
        parts.append(reader.read(name, (tuple(begin), tuple(size))))
    return torch.cat(parts, dim=pieces[0][0])


def capture(run: Any, *, rank_state: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """What `CheckpointManager.save` writes of a split run at this step boundary (a collective: a ZeRO optimizer
    gathers its state over the data-parallel group, and the ranks agree on the non-tensor optimizer values)."""
    import torch

    stage, g = run.model, run.par.groups
    saved = run.optimizer.state_dict()
    index = {key: i for i, key in enumerate(stage.param_keys)}  # the whole model's optimizer order
    local = {key: saved["state"].get(i) for i, (key, _) in enumerate(stage.named_parameters())}
    pieces: list[Any] = []
    values: dict[int, dict[str, Any]] = {}
    for key, full, tensor, share_pieces, writes in shares(stage, g.t):
        if not writes or g.d != 0:
            continue
        shape = tuple(stage.whole[full][0])
        pieces += boxes(f"model/{full}", tensor.detach(), shape, share_pieces)
        for name, value in (local.get(key) or {}).items():
            where = f"{OPTIM}/{index[full]}/{name}"
            if torch.is_tensor(value) and tuple(value.shape) == tuple(tensor.shape) and value.dim():
                pieces += boxes(where, value, shape, share_pieces)
            elif torch.is_tensor(value):
                pieces.append((where, value, tuple(value.shape), (0,) * value.dim()))
            elif value is not None:
                values.setdefault(index[full], {})[name] = value
    merged: dict[int, dict[str, Any]] = {}
    for part in run.comm.allgather(values):  # every rank writes the same trees
        for i, entries in part.items():
            merged.setdefault(i, {}).update(entries)
    groups = [{k: v for k, v in group.items() if k != "params"} for group in saved["param_groups"]][:1]
    groups[0]["params"] = list(range(len(stage.param_keys)))
    model = {key: {REF: f"model/{stage.aliases.get(key, key)}"} for key in stage.keys}
    optimizer = {"layout_free": True, "param_groups": groups, "values": merged,
                 "shapes": [list(stage.whole[k][0]) for k in stage.param_keys]}
    train = {"optimizer": optimizer, "scheduler": run.scheduler.state_dict()}
    if run.scaler is not None:
        train["scaler"] = run.scaler.state_dict()
    compressor = run.sync.compressor_state()
    if compressor is not None:
        rank_state = {**rank_state, "compress": compressor}
    return dict(model_state=model, train_state=train, rank_state=rank_state, meta={**meta, "layout_free": True},
                pieces=pieces)


def _name(loaded: Loaded, full: str) -> str:
    ref = loaded.model.get(full)
    if not is_ref(ref):
        raise CheckpointError(f"checkpoint {str(loaded.path)!r} holds no tensor {full!r} of the model: resume with "
                              "the model the run was written with")
    return ref[REF]


def restore(loaded: Loaded, stage: Any, optimizer: Any) -> None:
    """Load this rank's shares of the checkpoint's model and optimizer state (written by any layout, any ZeRO
    stage) into its `stage` and `optimizer`, reading only their boxes."""
    import torch

    reader = loaded.reader
    state = {}
    for key in stage.state_dict():
        name = _name(loaded, stage.full_key(key))
        state[key] = read_share(reader, name, reader.shape(name), stage.pieces(key, reader.shape(name)))
    stage.load_state_dict(state)
    index = {key: i for i, key in enumerate(stage.param_keys)}
    saved = loaded.train["optimizer"]
    values = {int(i): dict(v) for i, v in saved.get("values", {}).items()}
    for i, entries in saved.get("state", {}).items():  # a plain optimizer's values that are not tensors
        values.setdefault(int(i), {}).update({k: v for k, v in entries.items() if not is_ref(v)})
    local: dict[int, dict[str, Any]] = {}
    for i, (key, param) in enumerate(stage.named_parameters()):
        full = stage.full_key(key)
        shape = reader.shape(_name(loaded, full))
        pieces = stage.pieces(key, shape)
        got: dict[str, Any] = {}
        for name in reader.names(f"{OPTIM}/{index[full]}/"):
            saved_shape = reader.shape(name)
            got[name.rsplit("/", 1)[1]] = (read_share(reader, name, shape, pieces) if saved_shape == shape and shape
                                           else reader.read(name))
        got.update(values.get(index[full], {}))
        if got:
            local[i] = got
    settings = {k: v for k, v in saved["param_groups"][0].items() if k != "params"}
    if isinstance(optimizer, ShardedOptimizer):  # ZeRO 1/2 over the data-parallel group: its slices of each share
        def fetch(i: int, start: int, stop: int) -> dict[str, Any] | None:
            entries = local.get(i)
            return {k: (v.reshape(-1)[start:stop].clone() if torch.is_tensor(v) and v.dim() else v)
                    for k, v in entries.items()} if entries else None

        optimizer.load_owned([{**settings, "params": []}], fetch)
        return
    n = len(list(stage.parameters()))
    optimizer.load_state_dict({"state": local, "param_groups": [{**settings, "params": list(range(n))}]})
