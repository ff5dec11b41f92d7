"""ZeRO stage 3 of the gradient engine: the parameters are sharded too, gathered by module only while in use.

Units, as FSDP2's per-module units: every element of the model's `nn.Sequential`, `nn.ModuleList` and
`nn.ModuleDict` containers (an element that is itself a container is split further) is a unit, and the rest
of the model's parameters (embeddings, a head, a final norm: what the model's own forward touches) form the
root unit. A parameter that more than one unit uses, or that a module outside its unit registers (a weight
tied across units), belongs to the root unit, so it is whole wherever it is used. Each unit's trainable
parameters are one bucket: units in reverse registration order (backward order), the root last.

Each rank keeps only its slice of every bucket (`bucket.owned`; the optimizer steps it in place). The bucket's
flat parameter memory (`bucket.param_flat`, of which every parameter is a view) holds no bytes until needed:
- before a unit's forward (a forward pre-hook) its slices are allgathered into that memory, and the next unit
  in forward order is prefetched on the communication thread (with overlap; without, gathers run inline);
- after its forward (a forward hook) the memory is released (its storage resized to nothing: autograd's
  saved views of it stay valid and see the bytes again once it is gathered again), except for the root and
  the last unit of the forward, which backward needs first. A released unit's parameters keep their shapes
  but hold no bytes: each is a NaN expanded to its shape (a write is refused by torch), never a view of the
  empty memory, whose read would be out of bounds, and any read of it by torch (outside the unit's forward
  and backward: GPT-2's `F.linear(x, self.transformer.wte.weight)` in the model's own forward) raises one line
  naming the parameter and its unit (released.py) instead of computing on NaN;
- before its backward (a hook on the unit's outputs' gradients) the unit is gathered again and the previous
  unit prefetched; once backward has accumulated every gradient of the unit, they are packed into that same
  gathered memory (nothing reads the parameters again this step), reduce-scattered into this rank's slice
  as at stage 2, and the memory is released.
So a rank holds 1/W of the parameters, gradients and optimizer state, plus the units in use (two, or three
while one is prefetched) and the root unit during forward and backward. Its slices of the gradients hold
memory only from their unit's reduction to the optimizer's step, so a unit's backward, the step's peak (the
unit's parameters and gradient whole), holds only the slices reduced before it; before the backward of a unit
too large for glibc to keep, the freed memory the process kept is handed back (`_before_backward`).
Staged (GPU memory, an MPI that is not CUDA-aware) the gathers go through each bucket's pinned host memory,
which keeps the gathered parameters until they change: the gather before a unit's backward is then a copy
back to the device, not a collective.
The forward order is recorded in the first forward; every rank runs the same modules in the same order, so
every rank issues the same gathers. Every decision to gather or release is taken in program order, on the
thread that runs forward and backward, never by the communication thread (which only runs the collectives
in the order they were submitted): a unit is released when its reduction is submitted (`launching`), and the
reduction frees its memory after it. So a forward that runs during backward (activation checkpointing's
recomputation, reentrant or not) gathers what it needs, prefetches the unit backward needs next (not the next
in forward order) and keeps its unit for the backward that follows, identically on every rank, whatever the
communication thread is doing.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Iterator

from ..base.errors import CommError
from ..base.hostmem import MMAP_THRESHOLD, give_back_freed_memory
from ..base.errors import ConfigError
from .buckets import Bucket, Cut, Engine, Footprint, flatten_params, pack, sharded_bucket
from .released import mark_gathered, mark_released, name_parameters
from .units import group_by_unit
from .zero import Sharded, allreduce_into_shard, reduce_into_shard, staging, unpacked

def _tensors(obj: Any) -> Iterator[Any]:
    """The tensors in a module's output (a tensor, or tuples, lists and dicts of them)."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def _release_memory(tensor: Any) -> None:
    """Give back `tensor`'s memory (its storage resized to nothing; views of it stay valid and see memory again
    after `_hold`). A storage whose size is pinned (handed out through `Tensor.numpy()`) keeps its memory."""
    try:
        tensor.untyped_storage().resize_(0)
    except RuntimeError:
        pass


def _hold(tensor: Any, zero: bool) -> None:
    """Give `tensor` memory again if it was given back (by `_release_memory` or `ShardedParams._release`),
    zeroed with `zero`."""
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0 and tensor.numel():
        storage.resize_(tensor.numel() * tensor.element_size())
        if zero:
            tensor.zero_()


def _in_backward() -> bool:
    """Whether autograd is running a backward on this thread (a forward now is a recomputation of one)."""
    import torch

    return torch._C._current_graph_task_id() != -1


class Unit:
    """One bucket's modules and the state of its gathered parameters: released, pending (a gather submitted)
    or gathered."""

    __slots__ = ("bucket", "module", "root", "state", "event", "error", "accumulated", "lock", "views", "absent",
                 "on_host", "mapped")

    def __init__(self, bucket: Bucket, module: Any, root: bool):
        import torch

        self.bucket, self.module, self.root = bucket, module, root
        self.state = "gathered"
        self.views = [p.data for p in bucket.params]  # each parameter's view of `param_flat`: its data when gathered
        nan = torch.full((1,), float("nan"), dtype=bucket.param_flat.dtype, device=bucket.param_flat.device)
        self.absent = [nan.expand(p.shape) for p in bucket.params]  # ... and when released: no bytes (NaN)
        self.event = threading.Event()
        self.error: BaseException | None = None
        self.accumulated: set[int] = set()  # gradients accumulated in this backward without a reduction
        self.lock = threading.Lock()
        self.on_host = False  # staged: `bucket.host` holds the parameters as they are (gathered, not stepped since)
        # host memory larger than what glibc keeps for reuse (hostmem.py): its gathered parameters and its
        # gradient are mapped afresh every time
        flat = bucket.param_flat
        self.mapped = flat.device.type == "cpu" and bucket.numel * flat.element_size() > MMAP_THRESHOLD


class ShardedParams(Sharded):
    """The ZeRO stage 3 strategy of `engine` (a GradSync) over `module`."""

    stage = 3
    eager = True  # free each unit's gradients (and parameters) as soon as its backward is done
    holds_whole_model = False
    gathers_in_forward = True
    packs = True
    watches_accumulation = True  # a unit is released once an accumulation's micro-batch has its gradients

    def __init__(self, engine: Engine, module: Any):
        super().__init__(engine, module)
        self.units: list[Unit] = []
        self.order: list[Unit] = []  # units in the order of the first forward
        self.recording = True
        self._hooks: list[Any] = []
        self.gather_seconds = 0.0  # spent in the gathers (on the communication thread with overlap), summed
        self.wait_seconds = 0.0  # spent by forward and backward waiting for a unit's gather: what prefetch hides
        self._copies: Any = None  # staged: the CUDA stream that copies the owned slices to the host
        self._stepped: Any = None  # staged: a CUDA event recorded after the optimizer's step (on its stream)

    @classmethod
    def refuse(cls, compress: str, hierarchical: bool, reduce: str, module: Any, alone: list[Any]) -> None:
        super().refuse(compress, hierarchical, reduce, module, alone)
        if module is None:
            raise ConfigError("--zero 3 shards the parameters by module: give the model (module=model), not only "
                              "its parameters")
        if alone:
            raise ConfigError("--zero 3 keeps each module's parameters in one bucket, so no parameter can be reduced "
                              "alone (a pipeline's tied embedding/head asks for that): use --zero 2")

    @classmethod
    def plan_groups(cls, model: Any, ordered: list[Any], bucket_mb: float, own_bytes: int) -> list[tuple[list[Any], Any]]:
        """One bucket per unit, with its module (`group_by_unit`)."""
        return group_by_unit(model, ordered)

    @classmethod
    def footprint(cls, cut: Cut) -> Footprint:
        """The slices of parameters, gradients and optimizer state; during a step, on more than one rank, the
        root unit throughout, two others (one prefetched), and the gradients of the unit being reduced, whole
        until they are summed."""
        gathered = 0
        if cut.world > 1:
            root = sum(n for n, is_root in zip(cut.numels, cut.root) if is_root)
            others = sorted((n for n, is_root in zip(cut.numels, cut.root) if not is_root), reverse=True)
            gathered = root + sum(others[:2]) + max(cut.numels)
        return Footprint(params=cut.owned, grads=cut.owned, state=cut.owned, pieces=cut.owned_params,
                         gathered=gathered)

    def build(self, ordered: list[Any], bucket_mb: float, alone: list[Any]) -> list[Bucket]:
        """A bucket per unit: its parameters become views into the bucket's flat memory, this rank keeps a copy
        of its slice (`owned`), and the flat memory is released."""
        e = self.engine
        buckets = []
        for index, (group, module) in enumerate(group_by_unit(self.module, ordered)):
            bucket = sharded_bucket(index, group, e.comm.size, e.comm.rank, e.dtype, e.device)
            bucket.param_flat = flatten_params(bucket, e.dtype, e.device)
            # a world of one: the slice is the whole bucket, the same memory, never released
            bucket.owned = bucket.param_flat if e.comm.size == 1 else bucket.param_flat[bucket.lo:bucket.hi].clone()
            bucket.unit = Unit(bucket, module, module is self.module)
            self.units.append(bucket.unit)
            buckets.append(bucket)
            self._release(bucket.unit)  # before the next unit: never more than one unit whole beside the model
        return buckets

    def start(self) -> None:
        """Hook every unit's forward, and the model's (which holds the root unit, or none); name each unit's
        parameters for the error a read of a released one raises."""
        name_parameters(self.module, [(u.module, u.bucket.params, u.root) for u in self.units])
        root = next((u for u in self.units if u.root), None)
        self._hooks.append(self.module.register_forward_pre_hook(lambda m, a: self._before_forward(root)))
        self._hooks.append(self.module.register_forward_hook(lambda m, a, out: self._after_root(root, out)))
        for unit in self.units:
            if not unit.root:
                self._hooks.append(unit.module.register_forward_pre_hook(lambda m, a, u=unit: self._before_forward(u)))
                self._hooks.append(unit.module.register_forward_hook(lambda m, a, out, u=unit: self._after_forward(u, out)))

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    # -- before forward (and before backward) ----------------------------------------------------------
    def _before_forward(self, unit: Unit | None) -> None:
        if unit is None:  # the model holds no parameters outside its units
            return
        self.gather(unit)
        if self.recording:
            if unit not in self.order:
                self.order.append(unit)
        else:  # a forward during backward (a recomputation): backward needs the unit before next
            self.prefetch(unit, -1 if _in_backward() else +1)

    def _after_root(self, unit: Unit | None, output: Any) -> None:
        """The model's forward is done: its order is known from the first one on."""
        self.recording = False
        if unit is not None:
            self._after_forward(unit, output)

    def _after_forward(self, unit: Unit, output: Any) -> None:
        import torch

        outputs = [t for t in _tensors(output) if t.requires_grad] if torch.is_grad_enabled() else []
        for t in outputs:
            t.register_hook(lambda grad, u=unit: self._before_backward(u))
        if outputs and (unit.root or (not self.recording and unit is self.order[-1])):
            return  # backward needs it throughout (the root), or first (the last unit of the forward)
        if _in_backward():
            return  # recomputed for its backward, which follows: its reduction releases it
        self._release(unit)

    def _before_backward(self, unit: Unit) -> None:
        if unit.mapped:
            # The step's peak: the unit's parameters and its gradient, both whole, while its backward runs
            # (autograd computes a weight's gradient while the weight is alive). Neither comes from freed
            # memory the process kept (both are mapped afresh), so that memory is handed back first instead
            # of adding to the peak: a smaller unit's parameters and gradient, freed in the last step (the ZeRO
            # memory figures in docs/performance.md). Smaller units are left alone: their memory is
            # reused, not faulted in anew (hostmem.py).
            give_back_freed_memory()
        self.gather(unit)
        self.prefetch(unit, -1)

    def gather(self, unit: Unit) -> None:
        """Make `unit`'s parameters whole here: wait for its prefetch, or gather it now."""
        if unit.state == "gathered":
            return
        start = time.perf_counter()
        if unit.state == "released":
            self._submit(unit)
        if unit.state == "pending":
            self.engine.await_done(unit.event)
            unit.state = "gathered"
            for p, view in zip(unit.bucket.params, unit.views):
                mark_gathered(p)
                p.data = view
            self.wait_seconds += time.perf_counter() - start
            if unit.error is not None:
                error, unit.error = unit.error, None
                raise CommError(f"gathering the parameters of {type(unit.module).__name__} failed on rank "
                                f"{self.engine.comm.rank}: {error!r}") from error

    def prefetch(self, unit: Unit, step: int) -> None:
        """With overlap, start gathering the unit after `unit` (step +1) or before it (-1) in forward order."""
        if not self.engine.threaded or unit not in self.order:
            return
        at = self.order.index(unit) + step
        if 0 <= at < len(self.order) and self.order[at].state == "released":
            self._submit(self.order[at])

    def _submit(self, unit: Unit) -> None:
        unit.state = "pending"
        unit.event.clear()
        self.engine.submit(lambda: self._allgather(unit), unit.event)

    def _allgather(self, unit: Unit) -> None:
        """The allgather of `unit`'s slices into its flat memory (on the communication thread, or inline).

        Staged (device memory, an MPI that is not CUDA-aware), through the bucket's pinned host memory: this
        rank's slice goes to the host on a stream of its own that waits only for the optimizer's step, not
        behind the forward's kernels queued since (else a prefetch waits for the unit computing now, and so
        hides nothing), and the gathered parameters stay in the host memory
        until the bucket's gradients are summed through it or the step changes them: the gather before the
        unit's backward (and an accumulation's next micro-batch) copies them back without a collective."""
        bucket = unit.bucket
        start = time.perf_counter()
        try:
            storage = bucket.param_flat.untyped_storage()
            storage.resize_(bucket.numel * bucket.param_flat.element_size())
            full = bucket.param_flat
            if full.is_cuda and self.engine.staging:
                host, shard = staging(bucket, full.dtype)
                if not unit.on_host:
                    self._owned_to_host(bucket.owned, shard)
                    self.engine.gather(bucket, host, shard)
                    unit.on_host = True
                full.copy_(host)
            else:
                self.engine.gather(bucket, full, bucket.owned)
        except BaseException as exc:  # noqa: BLE001 - raised by gather() in the thread that needs the unit
            unit.error = exc
        finally:
            self.gather_seconds += time.perf_counter() - start

    def _owned_to_host(self, owned: Any, shard: Any) -> None:
        """Copy this rank's slice into `shard` (pinned host memory) once the step that wrote it is done, on the
        copy stream; before the first step, behind everything queued so far."""
        import torch

        if self._copies is None:
            self._copies = torch.cuda.Stream(owned.device)
        with torch.cuda.stream(self._copies):
            if self._stepped is not None:
                self._copies.wait_event(self._stepped)
            else:
                self._copies.wait_stream(torch.cuda.default_stream(owned.device))
            shard.copy_(owned, non_blocking=True)
        self._copies.synchronize()

    def _release(self, unit: Unit) -> None:
        """Give back `unit`'s flat parameter memory (its views keep their shapes and see no bytes)."""
        self._drop(unit)
        self._free(unit)

    def _drop(self, unit: Unit) -> None:
        """Mark `unit` released (in program order: whether it is gathered again is decided by this mark on
        every rank alike): its parameters read nothing from its flat memory any more, and refuse reads."""
        if self.engine.comm.size == 1:
            return
        for p, absent in zip(unit.bucket.params, unit.absent):
            p.data = absent
            mark_released(p)
        unit.state = "released"
        unit.accumulated.clear()

    def launching(self, bucket: Bucket) -> None:
        """`bucket`'s reduction is submitted (its unit's backward is done): its unit counts as released from
        now on, in program order, while the reduction, which packs the gradients into its memory, frees it."""
        self._drop(bucket.unit)

    def _free(self, unit: Unit) -> None:
        """Give back the memory of a dropped unit (after its reduction, on the communication thread with
        overlap: a gather the program submits later runs after it)."""
        if self.engine.comm.size == 1:
            return
        bucket = unit.bucket
        try:
            bucket.param_flat.untyped_storage().resize_(0)
        except RuntimeError:  # its memory was handed out through Tensor.numpy(), which pins a storage's size:
            # new memory for the parameters (autograd's saved views keep the old, with the same values, alive)
            flat = bucket.param_flat.new_empty(bucket.numel)
            offset = 0
            for at, p in enumerate(bucket.params):
                unit.views[at] = flat[offset:offset + p.numel()].view(p.shape)
                offset += p.numel()
            bucket.param_flat = flat
            flat.untyped_storage().resize_(0)

    # -- after backward --------------------------------------------------------------------------------
    def reduce(self, bucket: Bucket) -> None:
        """Pack the unit's gradients into its gathered parameter memory (its backward is done: nothing reads
        the parameters again this step, so no buffer of its own is needed), reduce-scatter them into this
        rank's slice, free the memory (the unit counts as released since this was submitted: `launching`).
        Summed unpacked (the allreduce reducer, a large gradient): the parameters' memory is freed first, so
        that a large gradient and the unit's parameters are never held beside the collective's own buffers."""
        flat = bucket.param_flat
        bucket.unit.on_host = False  # a staged sum goes through the host memory
        _hold(bucket.shard, zero=False)  # the reduction writes all of it
        if unpacked(self.engine, bucket):  # large gradients summed in their own memory, no packed copy:
            # the parameters are released first, and the small gradients packed into a buffer of their size
            self._free(bucket.unit)
            small = sum(p.numel() for p in bucket.params if p.numel() * p.element_size() < self.engine.OWN_BYTES)
            allreduce_into_shard(self.engine, bucket, flat.new_empty(small))
            return
        _hold(flat, zero=False)  # never gathered this step: memory to pack the gradients into
        buffer = flat if self.engine.comm.size > 1 else flat.new_empty(bucket.numel)
        reduce_into_shard(self.engine, pack(bucket, buffer), bucket)
        self._free(bucket.unit)

    def accumulated(self, param: Any) -> None:
        """Backward gave `param` its gradient with the reduction off (an accumulation's micro-batch): once the
        whole unit has its gradients, its parameters are released (the last micro-batch reduces them)."""
        unit = self.engine.bucket_of(param).unit
        unit.accumulated.add(id(param))
        if len(unit.accumulated) == len(unit.bucket.params) and unit.state == "gathered":
            self._release(unit)

    def settle(self) -> None:
        """After every reduction of a step: no unit stays gathered (one prefetched but never used, or a unit
        that got no gradient)."""
        for unit in self.units:
            _hold(unit.bucket.shard, zero=True)  # not reduced this step (its memory given back): zeros
            if unit.state == "pending":
                self.gather(unit)
            if unit.state == "gathered":
                self._release(unit)

    def state_items(self, model: Any) -> Iterator[tuple[str, Any]]:
        """(key, parameter or buffer) of `model.state_dict()` in order, each unit gathered while its keys are read and
        released after (the root's until the end): the whole model, never more than one unit of it at once
        beside the root. Collective: every rank iterates to the end."""
        held: Unit | None = None
        try:
            for key, value in model.state_dict(keep_vars=True).items():
                bucket = self.engine.bucket_of(value) if self.engine.owns(value) else None
                if bucket is not None and bucket.unit is not held:
                    if held is not None and not held.root:
                        self._release(held)
                    self.gather(bucket.unit)
                    held = bucket.unit
                yield key, value
        finally:
            self.settle()

    # -- after the optimizer step: the next forward gathers (staged, the step is marked) -----------------
    def after_step(self) -> None:
        """Each unit is gathered from the stepped slices when its forward comes; staged, the step is marked on
        its stream, for the copies of the slices to the host to wait for it alone."""
        self.params_written()
        if self.engine.comm.size > 1:  # the slices' gradients are used: their memory is held again by the next
            # reduction of each unit, so that a unit's backward holds only the gradients reduced before it
            for unit in self.units:
                _release_memory(unit.bucket.shard)
        if self.engine.staging and self.engine.comm.size > 1:  # staging: device memory on a CUDA rank
            import torch

            self._stepped = torch.cuda.Event()
            self._stepped.record(torch.cuda.current_stream(self.engine.device))

    def params_written(self) -> None:
        """This rank's slices were written (stepped, or loaded from a checkpoint): no unit's host copy of its
        parameters holds them any longer."""
        for unit in self.units:
            unit.on_host = False

    # -- what a step holds -------------------------------------------------------------------------------
    def grad_bytes(self) -> int:
        buckets = self.engine.buckets
        held = sum(b.shard.numel() * b.shard.element_size() for b in buckets)
        return held + sum(p.grad.numel() * p.grad.element_size() for b in buckets for p in b.params
                          if p.grad is not None)

    def param_bytes(self) -> int:
        """This rank's slices, and the flat memory of the units gathered now."""
        buckets = self.engine.buckets
        owned = sum(b.owned.numel() * b.owned.element_size() for b in buckets if b.owned is not b.param_flat)
        return owned + sum(b.param_flat.untyped_storage().nbytes() for b in buckets)
