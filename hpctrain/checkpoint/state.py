"""What a checkpoint holds of a training loop, and how it is put back: the one path that `hpctrain train`
(control/resume.py) and the library's `Checkpointer` (api.py) both take.

`capture` names every tensor by its path (`model/<state_dict key>`, `train/optimizer/state/<index>/<key>`,
`train/scheduler/...`, `rankRRRRR/...`). What every rank holds alike goes into the trees, written once; what
ZeRO shards is written by each rank as boxes of the whole tensors (`pieces`): at stages 1-3 the slices of the
parameters and of the optimizer state this rank owns. `restore` reads, through the checkpoint's reader, only
what this rank holds under its own world size and stage: at stage 3 its slices of the parameters, at stages
1-3 its slices of the optimizer state, at stages 0-2 the whole parameters (every rank holds them); so a run
saved at any stage on W ranks resumes at any stage on any W'. The model's buffers are rank 0's, written by rank 0
alone (every rank holds rank 0's: `comm/buffers.py`).
"""

from __future__ import annotations

import math
from typing import Any, Callable

from ..base.errors import CheckpointError
from ..comm import ShardedOptimizer, world
from .boxes import flat_boxes, is_ref
from .format import FORMAT, REF
from .loader import Loaded

OPTIM = "train/optimizer/state"  # the name prefix of optimizer state: OPTIM/<parameter index>/<key>


def flat_pieces(name: str, shape: tuple[int, ...], lo: int, hi: int, flat: Any) -> list[tuple[str, Any, Any, Any]]:
    """Elements [lo, hi) of tensor `name` (whole `shape`), held in the 1-d `flat`, as pieces: one per box."""
    out, at = [], 0
    for start, size in flat_boxes(shape, lo, hi):
        n = math.prod(size)
        out.append((name, flat[at:at + n].view(size), tuple(shape), start))
        at += n
    return out


def capture(model: Any, optimizer: Any, sync: Any, *, scheduler: Any = None, scaler: Any = None,
            rank_state: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """What `CheckpointManager.save` writes of this step boundary (`sync`: the gradient engine, or None)."""
    model_tree, pieces = _model_entries(model, sync)
    opt_tree, opt_pieces = _optimizer_entries(optimizer)
    train = {"optimizer": opt_tree, "scheduler": scheduler.state_dict() if scheduler is not None else None}
    if scaler is not None:
        train["scaler"] = scaler.state_dict()
    compressor = sync.compressor_state() if sync is not None else None  # error feedback: this rank's own
    if compressor is not None:
        rank_state = {**rank_state, "compress": compressor}
    return dict(model_state=model_tree, train_state=train, rank_state=rank_state, meta=meta,
                pieces=pieces + opt_pieces)


def _model_entries(model: Any, sync: Any) -> tuple[dict[str, Any], list[Any]]:
    """The model's tree (a reference for each buffer, and at stages 1-3 for each trainable parameter; tied ones
    to the first key), and this rank's pieces: its owned slices of the parameters, and on rank 0 the buffers.

    Rank 0 writes the buffers alone: they are the one state forward changes, each rank its own, until the
    engine's broadcast makes them rank 0's (`comm/buffers.py`); dealt to the ranks as replicated state is,
    a checkpoint taken where they differ would pair one rank's running mean with another's variance."""
    import torch

    rank = sync.comm.rank if sync is not None else world().rank
    first: dict[int, str] = {}
    tree: dict[str, Any] = {}
    pieces = []
    for key, value in model.state_dict(keep_vars=True).items():
        if not torch.is_tensor(value):  # a module's extra state
            tree[key] = value
        elif (sync is not None and sync.strategy.owns(value)) or not isinstance(value, torch.nn.Parameter):
            name = f"model/{first.setdefault(id(value), key)}"
            tree[key] = {REF: name}
            if not isinstance(value, torch.nn.Parameter) and rank == 0 and first[id(value)] == key:
                pieces.append((name, value.detach(), tuple(value.shape), (0,) * value.dim()))
        else:  # parameters every rank holds whole and equal (all at stage 0; frozen ones at 1-3)
            tree[key] = value.detach()
    if sync is None or not sync.strategy.sharded:
        return tree, pieces
    for seg in sync.segments:
        pieces += flat_pieces(f"model/{first[id(seg.param)]}", tuple(seg.param.shape), seg.start, seg.stop,
                              seg.tensor.detach())
    return tree, pieces


def _optimizer_entries(optimizer: Any) -> tuple[dict[str, Any], list[Any]]:
    """A plain optimizer's state_dict; or a sharded one's layout (param groups, shapes) and this rank's pieces
    of its state (a scalar such as Adam's step written whole by every rank that holds a slice)."""
    import torch

    if not isinstance(optimizer, ShardedOptimizer):
        return optimizer.state_dict(), []
    layout = optimizer.layout_state()
    layout["values"] = {}
    pieces: list[Any] = []
    for index, start, stop, state in optimizer.owned_state():
        for key, value in state.items():
            name = f"{OPTIM}/{index}/{key}"
            if torch.is_tensor(value) and value.dim():
                pieces += flat_pieces(name, tuple(layout["shapes"][index]), start, stop, value.reshape(-1))
            elif torch.is_tensor(value):
                pieces.append((name, value, (), ()))
            elif value is not None:
                layout["values"].setdefault(index, {})[key] = value
    return layout, pieces


def restore(loaded: Loaded, model: Any, optimizer: Any, sync: Any, *, scheduler: Any = None,
            scaler: Any = None, warn: Callable[[str], Any] | None = None) -> None:
    """Load the checkpoint into `model`, `optimizer` (plain or sharded), `scheduler` and `scaler`, reading only
    what this rank holds (`sync`: the gradient engine, or None for a plain model). `warn` gets each line the
    user should read about the state loaded (an older checkpoint's buffers)."""
    _load_model(loaded, model, sync)
    _load_optimizer(loaded, optimizer)
    restore_schedule(loaded, scheduler, scaler)
    for line in mixed_buffers(loaded, model) if warn is not None else []:
        warn(line)


def mixed_buffers(loaded: Loaded, model: Any) -> list[str]:
    """The line for a checkpoint written by several ranks before format 3, whose model buffers another rank
    than rank 0 wrote some of: ranks kept their own buffers then, so these mix ranks' values (one rank's running
    mean beside another's variance). They are loaded as they are, the same on every rank, and are rank 0's from
    the next step on: the run goes on, but not as the one that wrote them would have."""
    import torch

    version, ranks = int(loaded.meta.get("format", 1)), int(loaded.meta.get("world_size", 1))
    if version >= FORMAT or ranks < 2:
        return []
    params = {id(p) for p in model.parameters()}
    keys = [k for k, v in model.state_dict(keep_vars=True).items() if torch.is_tensor(v) and id(v) not in params
            and k in loaded.model]
    if version >= 2:  # the index says which rank wrote each
        keys = [k for k in keys if is_ref(loaded.model[k])
                and any(p[0] != 0 for p in loaded.reader.index.get(loaded.model[k][REF], {}).get("pieces", []))]
    if not keys:
        return []
    named = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
    who = "ranks other than rank 0 wrote" if version >= 2 else "any of its ranks may have written"
    return [f"checkpoint {str(loaded.path)!r} (format {version}, {ranks} ranks) holds buffers that {who} ({named}): "
            "before format 3 each rank kept its own buffers, so these mix ranks' values; every rank loads them as "
            "they are and holds rank 0's from the next step on"]


def restore_schedule(loaded: Loaded, scheduler: Any, scaler: Any) -> None:
    """Load the checkpoint's LR schedule and fp16 loss scale (either may be None: not restored)."""
    reader = loaded.reader
    if scheduler is not None and loaded.train.get("scheduler") is not None:
        scheduler.load_state_dict(reader.resolve(loaded.train["scheduler"]))
    if scaler is not None and "scaler" in loaded.train:
        scaler.load_state_dict(reader.resolve(loaded.train["scaler"]))


def rank_state(loaded: Loaded, rank: int) -> dict[str, Any]:
    """What rank `rank` saved of its own (RNG streams, data position, error feedback), read whole."""
    return loaded.reader.resolve(loaded.ranks[rank])


def _load_model(loaded: Loaded, model: Any, sync: Any) -> None:
    reader, tree = loaded.reader, loaded.model
    if sync is None or sync.strategy.holds_whole_model:
        model.load_state_dict({k: reader.resolve(v) for k, v in tree.items()})
        return
    keys: dict[int, str] = {}
    sharded = set()
    for key, value in model.state_dict(keep_vars=True).items():
        if sync.owns(value):
            keys.setdefault(id(value), key)
            sharded.add(key)
    for seg in sync.segments:  # this rank's slices of the parameters, straight into its memory
        key = keys[id(seg.param)]
        ref = tree.get(key)
        if not is_ref(ref) or reader.shape(ref[REF]) != tuple(seg.param.shape):
            raise CheckpointError(f"checkpoint {str(loaded.path)!r} holds no parameter {key!r} of shape "
                                  f"{tuple(seg.param.shape)}: resume with the model the run was written with")
        reader.read_flat(ref[REF], seg.start, seg.stop, out=seg.tensor.detach())
    sync.params_written()
    rest = {k: reader.resolve(v) for k, v in tree.items() if k not in sharded}
    missing, unexpected = model.load_state_dict(rest, strict=False)
    if unexpected or set(missing) - sharded:
        raise CheckpointError(f"checkpoint {str(loaded.path)!r} does not fit the model: missing keys "
                              f"{sorted(set(missing) - sharded)[:3]}, unexpected {unexpected[:3]}")


def _load_optimizer(loaded: Loaded, optimizer: Any) -> None:
    """Torch's optimizer state from the names under OPTIM (every stage writes them there) and the saved
    param groups: whole for a plain optimizer, this rank's slices for a sharded one."""
    reader, saved = loaded.reader, loaded.train["optimizer"]
    names: dict[int, dict[str, str]] = {}
    for name in reader.names(OPTIM + "/"):
        index, key = name[len(OPTIM) + 1:].split("/", 1)
        names.setdefault(int(index), {})[key] = name
    values: dict[int, dict[str, Any]] = {int(i): dict(v) for i, v in saved.get("values", {}).items()}
    for index, state in saved.get("state", {}).items():  # a plain optimizer's values that are not tensors
        values.setdefault(int(index), {}).update({k: v for k, v in state.items() if not is_ref(v)})
    if isinstance(optimizer, ShardedOptimizer):
        def fetch(index: int, start: int, stop: int) -> dict[str, Any] | None:
            got = {key: reader.read_flat(name, start, stop) if reader.shape(name) else reader.read(name)
                   for key, name in names.get(index, {}).items()}
            got.update(values.get(index, {}))
            return got or None

        optimizer.load_owned(saved["param_groups"], fetch)
        return
    state = {index: {key: reader.read(name) for key, name in keys.items()} for index, keys in names.items()}
    for index, extra in values.items():
        state.setdefault(index, {}).update(extra)
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})
