"""`ShardedOptimizer`: a torch optimizer that steps only the parameter slices this rank owns (ZeRO 1-3),
and the conversions of its state to and from torch's own `state_dict` format.

The wrapped optimizer itself steps the slices: its param groups are re-pointed at `ZeroSync.segments` (as
DeepSpeed's ZeRO does), so its state (momentum, Adam's moments) exists only for the owned slices, 1/W of it
per rank, while its param-group dicts stay the ones the user and any LR scheduler attached to it hold: a
change of lr, momentum, betas or weight decay applies at the next step, whoever makes it. This is exact only
for elementwise optimizers, whose update of an element reads nothing but that element's gradient and state;
others (LBFGS, Adafactor, anything that looks at a whole tensor) are refused.

State. `layout_state()` is the replicated part (param groups by the index of each parameter in the wrapped
optimizer, and each parameter's shape), `owned_state()` this rank's slices of the state; a checkpoint writes
them as boxes of whole tensors and `load_owned()` reads back the slices this rank owns now, on any world size
and stage (checkpoint/state.py). `state_dict()` gathers torch's ordinary optimizer state_dict of the whole
model (`full_state` joins any number of ranks' `shard_state()`s) and `load_state_dict()` slices such a dict.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

from ..base.errors import CheckpointError, ConfigError

ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop")
"""torch.optim classes whose update is elementwise, so that stepping slices equals stepping tensors."""


_OWNERS: "weakref.WeakKeyDictionary[Any, weakref.ref[ShardedOptimizer]]" = weakref.WeakKeyDictionary()


def sharded_owner(optimizer: Any) -> "ShardedOptimizer | None":
    """The ShardedOptimizer that the torch optimizer `optimizer` was given to, or None. Its own state is then
    this rank's slices only: save, load or broadcast the state through the ShardedOptimizer."""
    try:
        ref = _OWNERS.get(optimizer)
    except TypeError:  # not weakly referenceable: never given to a ShardedOptimizer
        return None
    return ref() if ref is not None else None


class ShardedOptimizer:
    """`optimizer` (a torch.optim instance over the model's parameters, not stepped yet or with state that
    is re-sliced) stepping only this rank's slices, then allgathering the parameters. From here on its param
    groups hold this rank's slices of the parameters (`inner` is `optimizer`): step it through this object."""

    def __init__(self, optimizer: Any, sync: Any):
        kind = type(optimizer)
        if not kind.__module__.startswith("torch.optim") or kind.__name__ not in ELEMENTWISE:
            raise ConfigError(
                f"--zero {sync.stage} shards elementwise optimizers only ({', '.join(ELEMENTWISE)}), not "
                f"{kind.__module__}.{kind.__name__}: use one of those, or --zero 0")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.index = {id(p): i for i, p in enumerate(params)}
        self.shapes = [list(p.shape) for p in params]
        missing = [tuple(p.shape) for p in sync.params if id(p) not in self.index]
        if missing:
            raise ConfigError(f"the optimizer does not hold every trainable parameter of the model (missing shapes "
                              f"{missing[:3]}; an optimizer already sharded holds slices): give it model.parameters()")
        self.sync = sync
        mine: dict[int, list[Any]] = {}
        for seg in sync.segments:
            mine.setdefault(id(seg.param), []).append(seg)
        saved = optimizer.state_dict() if optimizer.state else None
        self.group_params = [[self.index[id(p)] for p in group["params"]] for group in optimizer.param_groups]
        self.segments = []  # in the order of the optimizer's parameters from now on
        for group in optimizer.param_groups:  # the same dicts: their hyperparameters stay the user's
            segs = [seg for p in group["params"] for seg in mine.get(id(p), [])]
            group["params"] = [s.tensor for s in segs]
            self.segments.extend(segs)
        optimizer.state.clear()  # it was keyed by whole parameters; re-sliced below
        self.inner = optimizer
        _OWNERS[optimizer] = weakref.ref(self)
        # each slice's gradient is a view into the reduced shard: re-attached before every step, so that a
        # zero_grad(set_to_none=True) on the optimizer itself cannot detach it
        self._grads = [s.tensor.grad for s in self.segments]
        if saved is not None:
            self.load_state_dict(saved)

    @property
    def state(self) -> Any:
        """The optimizer's state: this rank's slices only."""
        return self.inner.state

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.sync.zero()

    def step(self, closure: Any = None) -> None:
        """Step the owned slices, then allgather the parameters (collective)."""
        if closure is not None:
            raise ConfigError("a sharded optimizer (--zero 1-3) takes no closure: compute the loss before step()")
        for seg, grad in zip(self.segments, self._grads):
            seg.tensor.grad = grad
        self.sync.before_step()
        self.inner.step()
        self.sync.after_step()

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the global gradient norm to `max_norm` as torch.nn.utils.clip_grad_norm_ does; the norm is
        the sum of every rank's squared partial norm, gathered and added in rank order (the same bits on
        every rank). Returns the norm before clipping."""
        self.sync.before_step()  # after `synchronize()`: the `.grad`s as the caller left them are the gradient
        partial = sum(float(b.shard.double().square().sum()) for b in self.sync.buckets)
        total = math.sqrt(sum(self.sync.comm.allgather(partial)))
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for b in self.sync.buckets:
                b.shard.mul_(coef)
        return total

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        return sum(v.numel() * v.element_size() for st in self.inner.state.values() for v in st.values()
                   if hasattr(v, "numel"))

    # -- state ---------------------------------------------------------------------------------------
    def layout_state(self) -> dict[str, Any]:
        """The replicated part of a sharded checkpoint: the stage, the param groups (parameters by their index
        in the wrapped optimizer) and every parameter's shape."""
        groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": members}
                  for group, members in zip(self.inner.state_dict()["param_groups"], self.group_params)]
        return {"zero": self.sync.stage, "world_size": self.sync.comm.size, "param_groups": groups,
                "shapes": self.shapes}

    def shard_state(self) -> dict[str, Any]:
        """This rank's part of a sharded checkpoint: the owned (parameter, start, stop) and their state."""
        state = self.inner.state_dict()["state"]
        return {"segments": [[self.index[id(s.param)], s.start, s.stop] for s in self.segments],
                "state": [state.get(i) for i in range(len(self.segments))]}

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state_dict of the whole model, gathered from every rank (collective)."""
        shards = self.sync.comm.allgather(_to_cpu(self.shard_state()))
        return full_state(self.layout_state(), shards)

    def owned_state(self) -> list[tuple[int, int, int, dict[str, Any]]]:
        """This rank's optimizer state by slice: (parameter index, start, stop, {key: value}), a value being a
        tensor of stop - start elements or a scalar (Adam's step). What a checkpoint writes of it."""
        state = self.inner.state
        return [(self.index[id(s.param)], s.start, s.stop, dict(state.get(s.tensor, {}))) for s in self.segments]

    def load_owned(self, groups: list[dict[str, Any]], fetch: Any) -> None:
        """Load the state of this rank's slices: `groups` are torch's param_groups of the saved optimizer (its
        parameters by index), `fetch(index, start, stop)` gives {key: value} of elements [start, stop) of
        parameter `index` (a tensor of stop - start elements, or a scalar), or None for no state."""
        if len(groups) != len(self.inner.param_groups):
            raise CheckpointError(f"the checkpoint's optimizer has {len(groups)} param groups, this one "
                                  f"{len(self.inner.param_groups)}: build the optimizer as the run that wrote it did")
        inner_groups, state, at = [], {}, 0
        for group, live in zip(groups, self.inner.param_groups):
            n = len(live["params"])
            inner_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(range(at, at + n))})
            at += n
        for i, seg in enumerate(self.segments):
            saved = fetch(self.index[id(seg.param)], seg.start, seg.stop)
            if saved:
                state[i] = saved
        self.inner.load_state_dict({"state": state, "param_groups": inner_groups})

    def load_state_dict(self, full: dict[str, Any]) -> None:
        """Load torch's optimizer state_dict of the whole model (from a stage-0 run, or `full_state` of a
        sharded one): this rank keeps the slices it owns."""
        import torch

        def fetch(index: int, start: int, stop: int) -> dict[str, Any] | None:
            saved = full["state"].get(index)
            return {k: (v.reshape(-1)[start:stop] if v.dim() else v).clone() if torch.is_tensor(v) else v
                    for k, v in saved.items()} if saved else None  # own copies: never share a step counter

        self.load_owned(full["param_groups"], fetch)


def full_state(layout: dict[str, Any], shards: list[dict[str, Any]]) -> dict[str, Any]:
    """torch's optimizer state_dict of the whole model from a sharded checkpoint's layout and every rank's
    shard (any world size): each elementwise state tensor is reassembled from its slices."""
    import torch

    shapes = layout["shapes"]
    state: dict[int, dict[str, Any]] = {}
    covered: dict[tuple[int, str], int] = {}
    for shard in shards:
        for (index, start, stop), saved in zip(shard["segments"], shard["state"]):
            if not saved:
                continue
            whole = state.setdefault(int(index), {})
            for key, value in saved.items():
                if torch.is_tensor(value) and value.dim():
                    if key not in whole:
                        whole[key] = torch.zeros(math.prod(shapes[index]), dtype=value.dtype)
                    whole[key][start:stop] = value.reshape(-1).cpu()
                    covered[(index, key)] = covered.get((index, key), 0) + stop - start
                else:
                    whole.setdefault(key, value)
    for index, whole in state.items():
        for key, value in whole.items():
            if torch.is_tensor(value) and value.dim():
                if covered[(index, key)] != math.prod(shapes[index]):
                    raise CheckpointError(f"the sharded optimizer state {key!r} of parameter {index} covers "
                                          f"{covered[(index, key)]} of {math.prod(shapes[index])} elements: a rank's "
                                          "shard is missing from the checkpoint")
                whole[key] = value.view(shapes[index])
    return {"state": state, "param_groups": layout["param_groups"]}


def _to_cpu(tree: Any) -> Any:
    import torch

    if torch.is_tensor(tree):
        return tree.detach().cpu()
    if isinstance(tree, dict):
        return {k: _to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_to_cpu(v) for v in tree]
    return tree
