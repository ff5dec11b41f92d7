"""`hvd.elastic`: Horovod's elastic API on a fixed-size MPI job, mapped onto checkpoints and requeue.

An MPI job cannot add or lose ranks while it runs, so what Horovod's elastic mode does by re-forming the ring
is done here by the batch system: `commit()` keeps the state in memory and, when `HPCTRAIN_ELASTIC_DIR` is set
(or `dir=` is given), writes it atomically to `<dir>/elastic_state.pt` from rank 0; `hvd.elastic.run` loads
the last committed state when it starts (a requeued Slurm job from `hpctrain submit` resumes there) and
broadcasts it from rank 0. A failed rank ends the job (it is not replaced in place); `check_host_updates()`
never finds new hosts.
"""

from __future__ import annotations

import copy
import functools
import os
from pathlib import Path
from typing import Any, Callable

import torch

from .basics import rank
from .functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters


class State:
    """What `hvd.elastic.run` keeps across a restart: commit() to save, restore() to go back, sync() to
    broadcast rank 0's copy."""

    def __init__(self, dir: str | None = None, **kwargs: Any):
        self._dir = dir or os.environ.get("HPCTRAIN_ELASTIC_DIR")
        self._reset_callbacks: list[Callable[[], None]] = []
        self._values = dict(kwargs)
        for key, value in kwargs.items():
            setattr(self, key, value)
        self._saved: dict[str, Any] = {}

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def check_host_updates(self) -> None:
        """A fixed-size MPI job never gains or loses hosts while it runs."""

    def commit(self) -> None:
        self.save()
        if self._dir and rank() == 0:
            path = Path(self._dir) / "elastic_state.pt"
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            torch.save(self._saved, tmp)
            os.replace(tmp, path)

    def load_committed(self) -> bool:
        """Load the state the last run committed to disk (rank 0); True if there was one."""
        path = Path(self._dir) / "elastic_state.pt" if self._dir else None
        found = bool(path is not None and rank() == 0 and path.exists())
        if found:
            self._saved = torch.load(path, weights_only=True)
            self.restore()
        return found

    def save(self) -> None:
        self._saved = {"values": {k: copy.deepcopy(getattr(self, k)) for k in self._values}}

    def restore(self) -> None:
        for key, value in self._saved.get("values", {}).items():
            setattr(self, key, copy.deepcopy(value))

    def sync(self) -> None:
        values = broadcast_object({k: getattr(self, k) for k in self._values}, 0, name="elastic.state")
        for key, value in values.items():
            setattr(self, key, value)


ObjectState = State


class TorchState(State):
    """A model and an optimizer (and any other values, as keyword arguments) that survive a restart."""

    def __init__(self, model: Any = None, optimizer: Any = None, **kwargs: Any):
        self.model, self.optimizer = model, optimizer
        super().__init__(**kwargs)

    def save(self) -> None:
        super().save()
        if self.model is not None:
            self._saved["model"] = copy.deepcopy(self.model.state_dict())
        if self.optimizer is not None:
            self._saved["optimizer"] = copy.deepcopy(self.optimizer.state_dict())

    def restore(self) -> None:
        super().restore()
        if self.model is not None and "model" in self._saved:
            self.model.load_state_dict(self._saved["model"])
        if self.optimizer is not None and "optimizer" in self._saved:
            self.optimizer.load_state_dict(self._saved["optimizer"])

    def sync(self) -> None:
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        super().sync()


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a training function taking a State first: it starts from the last committed state (if any)
    and rank 0's copy of it."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        state.load_committed()
        state.sync()
        return func(state, *args, **kwargs)

    return wrapper
