"""`hvd.DistributedOptimizer`: the user's torch optimizer, its gradients averaged over the ranks.

Each gradient is submitted by name for an in-place allreduce the moment backward has accumulated it (a
post-accumulate-grad hook), so communication overlaps the rest of backward; the negotiation thread fuses
the gradients that became ready together into one buffer. `step()` (or `synchronize()`) waits for them; a
parameter that got no gradient on this rank this step is reduced as zeros, so ranks whose graphs differ
still match. The optimizer object itself becomes the distributed one (its class is swapped for a subclass of
its own class), so its state, `param_groups` and `isinstance` checks stay as they were.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterable, Iterator

import torch

from .basics import ProcessSet, global_process_set, size
from .compression import Compression
from .handles import Adasum, Average, Sum, synchronize as wait_handle
from .mpi_ops import allreduce_async_, sparse_allreduce_async


class _Distributed:
    """Methods mixed in front of the user's optimizer class."""

    def _hvd_setup(self, named_parameters: Any, compression: Any, backward_passes_per_step: int, op: int,
                   gradient_predivide_factor: float, sparse_as_dense: bool, process_set: ProcessSet) -> None:
        self._compression = compression
        self._parameter_names = _names(self.param_groups, named_parameters)
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {p: backward_passes_per_step for p in self._parameter_names}
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._handles: dict[Any, Any] = {}
        self._hooks: list[Any] = []
        self._requires_update: set[Any] = set()
        self._synchronized = False
        self._should_synchronize = True
        if process_set.included() and size() > 1:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.requires_grad:
                        self._requires_update.add(p)
                        self._hooks.append(p.register_post_accumulate_grad_hook(self._hvd_ready))

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def _hvd_ready(self, p: Any) -> None:
        if self._handles.get(p, (None,))[0] is not None and self._allreduce_delay[p] <= 0:
            raise AssertionError("Gradients were computed more than backward_passes_per_step times before call to "
                                 "step(). Increase backward_passes_per_step to accumulate gradients locally.")
        self._allreduce_delay[p] -= 1
        self._handles[p] = self._hvd_submit(p) if self._allreduce_delay[p] == 0 else (None, None)

    def _hvd_submit(self, p: Any) -> tuple[Any, Any]:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        name = self._parameter_names.get(p)
        tensor = p.grad
        if tensor.is_sparse:
            if not self.sparse_as_dense:
                return sparse_allreduce_async(tensor, name=f"allreduce.{name}", op=self.op,
                                              process_set=self.process_set), "sparse"
            tensor = tensor.to_dense()
        compressed, ctx = self._compression.compress(tensor)
        pre, post = ((1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor) if self.op == Average
                     else (1.0, 1.0))
        handle = allreduce_async_(compressed, name=name, op=self.op, prescale_factor=pre, postscale_factor=post,
                                  process_set=self.process_set)
        return handle, (compressed, ctx)

    def synchronize(self) -> None:
        """Wait for every gradient's allreduce (submitting those backward did not produce, as zeros)."""
        if not self.process_set.included() or size() == 1:
            self._synchronized = True
            return
        for p in self._requires_update:
            if self._handles.get(p, (None,))[0] is None:
                self._handles[p] = self._hvd_submit(p)
        for p, (handle, ctx) in self._handles.items():
            self._allreduce_delay[p] = self.backward_passes_per_step
            if ctx == "sparse":
                reduced = handle()
                p.grad.zero_().add_(reduced)
                continue
            output = wait_handle(handle)
            compressed, state = ctx
            if p.grad.is_sparse:
                p.grad.zero_().add_(self._compression.decompress(output, state).to_sparse())
            elif compressed is not p.grad:
                p.grad.copy_(self._compression.decompress(output, state))
        self._handles.clear()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """`step()` inside it does not synchronize (after an explicit `synchronize()`, e.g. to clip)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                              "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in "
                              "your code.")
            self.synchronize()
        self._synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if any(h is not None for h, _ in self._handles.values()):
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as it can cause "
                                 "a race condition.")
        return super().zero_grad(set_to_none)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._handles = {}
        self._synchronized = False
        self._should_synchronize = True
        self.set_backward_passes_per_step(self.backward_passes_per_step)
        super().load_state_dict(*args, **kwargs)


def _names(param_groups: list[dict[str, Any]], named_parameters: Iterable[Any] | None) -> dict[Any, str]:
    """Each parameter's name (what the ranks match its gradient by), checked as Horovod checks it."""
    if named_parameters is not None:
        named = list(named_parameters)
    else:
        named = [(f"allreduce.noname.{i}.{j}", v) for i, group in enumerate(param_groups)
                 for j, v in enumerate(group["params"])]
    if any(not isinstance(p, tuple) for p in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced by "
                         "model.named_parameters().")
    seen: set[str] = set()
    dups = sorted({k for k, _ in named if k in seen or seen.add(k)})
    if dups:
        raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(dups)}")
    named_ids = {id(v) for _, v in named}
    unnamed = [id(v) for group in param_groups for v in group["params"] if id(v) not in named_ids]
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters were not named. "
                         f"Python object ids: {', '.join(map(str, unnamed))}")
    return {v: k for k, v in sorted(named, key=lambda kv: kv[0])}


def DistributedOptimizer(optimizer: Any, named_parameters: Any = None, compression: Any = Compression.none,
                         backward_passes_per_step: int = 1, op: int = Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups: Any = None, sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set) -> Any:
    """Make `optimizer` average its gradients over the ranks of `process_set` (Horovod's signature).

    `num_groups` and `groups` are accepted and need nothing: the ranks fuse whatever is ready together.
    `op=hvd.Adasum` is refused (see docs/horovod.md)."""
    if op == Adasum:
        raise NotImplementedError("DistributedOptimizer(op=hvd.Adasum) is not supported by hpctrain.horovod; use "
                                  "hvd.Average (the default) or hvd.Sum")
    if op not in (Average, Sum):
        raise ValueError(f"DistributedOptimizer op {op!r}: use hvd.Average or hvd.Sum")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if groups is not None and not (isinstance(groups, list) or int(groups) > 0):
        raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
    base = type(optimizer)
    if not isinstance(optimizer, _Distributed):
        optimizer.__class__ = type(base.__name__, (_Distributed, base), {"__module__": base.__module__})
    optimizer._hvd_setup(named_parameters, compression, backward_passes_per_step, op, gradient_predivide_factor,
                         sparse_as_dense, process_set)
    return optimizer
