"""The buckets of the gradient engine (`gradsync.GradSync`), their one owner: which parameters share one
collective, the memory it runs on, and (ZeRO) which slice of each bucket each rank owns.

Autograd owns the gradients (`GradSync.zero()` drops them, as torch's `zero_grad()` does): a gradient of at
least `GradSync.OWN_BYTES` is a bucket alone, reduced in the memory autograd handed over; a run of small ones
is packed into one flat buffer allocated once, and their `.grad`s become its views (`bind_bucket`), or (stages
2 and 3) packed into one reused buffer only while it is sent (`pack`). With ZeRO every bucket is cut into one
contiguous slice per rank (`shard_bounds`), and the parameters become views into the bucket's flat parameter
memory (`flatten_params`); `plan_segments` says, as a pure function, which parts of which parameters a rank owns.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Protocol

from ..base.errors import ConfigError


def trainable_in_backward_order(params: Iterable[Any]) -> list[Any]:
    """The distinct trainable parameters, last layers first; they must share one dtype and one device."""
    unique: dict[int, Any] = {}
    for p in params:
        if p.requires_grad and id(p) not in unique:
            unique[id(p)] = p
    ordered = list(unique.values())[::-1]  # backward visits the last layers first
    if not ordered:
        raise ConfigError("the model has no trainable parameters")
    dtypes = {p.dtype for p in ordered}
    devices = {p.device for p in ordered}
    if len(dtypes) > 1 or len(devices) > 1:
        raise ConfigError(
            f"all trainable parameters must share one dtype and device (found {sorted(map(str, dtypes))} "
            f"on {sorted(map(str, devices))}); cast the model with .to() first"
        )
    return ordered


def assign_buckets(ordered: list[Any], bucket_mb: float, alone_bytes: int | None = None,
                   alone: Iterable[Any] = (), *, adjacent: bool = True) -> list[list[Any]]:
    """Cut the parameters, in order, into runs of at most `bucket_mb` MiB; a larger parameter is a run alone,
    and so is one of at least `alone_bytes` (when given), and each of `alone`. Without `adjacent`, the
    parameters that are not alone are packed as if those that are were not between them (each run then takes
    the place of its first parameter): for buckets that are all summed at once, after backward, where fewer
    collectives cost less (a small allreduce's cost is mostly its latency, and a model's biases are small) and no run has
    to be ready before the next."""
    size_of = ordered[0].element_size()
    limit = max(1, int(bucket_mb * 2**20) // size_of)
    limit_alone = limit if alone_bytes is None else min(limit, max(1, alone_bytes // size_of))
    single = {id(p) for p in alone}
    if not adjacent:
        small = [p for p in ordered if p.numel() < limit_alone and id(p) not in single]
        runs = {id(run[0]): run for run in (assign_buckets(small, bucket_mb) if small else [])}
        packed = {id(p) for p in small}
        return [runs[id(p)] if id(p) in packed else [p] for p in ordered if id(p) not in packed or id(p) in runs]
    groups: list[list[Any]] = [[]]
    size, last_alone = 0, False
    for p in ordered:
        is_alone = p.numel() >= limit_alone or id(p) in single
        if groups[-1] and (size + p.numel() > limit or is_alone or last_alone):
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += p.numel()
        last_alone = is_alone
    return groups


class Bucket:
    """A run of parameters that share one collective, in backward order, and the memory of their gradients
    (`flat`: stages 0 and 1) and, with ZeRO, of their parameters and this rank's slice [lo, hi)."""

    __slots__ = ("index", "flat", "params", "ready", "host", "wire", "done", "views", "own", "param_flat",
                 "counts", "lo", "hi", "shard", "owned", "unit", "host_shard")

    def __init__(self, index: int, flat: Any, params: list[Any]):
        self.index = index
        self.flat = flat
        self.params = params
        self.views: list[Any] = []  # a packed bucket's slices, one per parameter (owned gradients)
        self.own = False  # one parameter reduced from its own gradient's memory: `flat` is bound per step
        self.ready: set[int] = set()
        self.host: Any = None  # pinned host staging buffer for device tensors on a non-CUDA-aware MPI
        self.wire: Any = None  # 16-bit wire buffer when compressing
        self.done = threading.Event()
        # ZeRO: the flat parameter memory (whole at stages 1-2; at stage 3 gathered only while in use), each
        # rank's element count, this rank's [lo, hi), its reduced gradient slice and its parameter slice
        self.param_flat: Any = None
        self.counts: list[int] = []
        self.lo = self.hi = 0
        self.shard: Any = None
        self.owned: Any = None
        self.unit: Any = None  # stage 3: the modules whose forward uses these parameters (zero3.Unit)
        self.host_shard: Any = None  # ZeRO, staged: pinned host memory of this rank's slice (beside `host`)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


def owned_bucket(index: int, group: list[Any], dtype: Any, device: Any) -> Bucket:
    """A bucket over gradients autograd owns: one parameter is reduced from its own `.grad` (bound each step),
    several are packed into a flat buffer allocated here once (their `.grad`s become its views when packed)."""
    import torch

    if len(group) == 1:
        bucket = Bucket(index, None, group)
        bucket.own = True
        return bucket
    bucket = Bucket(index, torch.zeros(sum(p.numel() for p in group), dtype=dtype, device=device), group)
    offset = 0
    for p in group:
        bucket.views.append(bucket.flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    return bucket


def bind_bucket(bucket: Bucket) -> None:
    """Point an owned bucket at this step's gradients: its parameter's own `.grad` (zeros when backward gave it
    none, made contiguous if it is not), or the small gradients copied into the flat buffer (zeros for one that
    got none), each `.grad` then a view into it. Idempotent within a step."""
    import torch

    if bucket.own:
        p = bucket.params[0]
        if p.grad is None:
            p.grad = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
        elif not p.grad.is_contiguous():
            p.grad = p.grad.contiguous()
        bucket.flat = p.grad.view(-1)
        return
    for p, view in zip(bucket.params, bucket.views):
        grad = p.grad
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
        else:
            continue
        p.grad = view


class Engine(Protocol):
    """What a stage's strategy sees of the gradient engine (`gradsync.GradSync`): the buckets and where they
    live, how a bucket goes on the wire (the collectives, the wire format, the scaling of this step's sum), and
    the engine's submission of collectives (in program order, on the communication thread with overlap)."""

    OWN_BYTES: int  # a gradient this large is a bucket alone, reduced from its own memory
    comm: Any  # world.Comm
    colls: Any  # collectives.Collectives
    buckets: list[Bucket]
    segments: list[Any]  # the optimizer's leaves over this rank's slices (zero.Segment); none at stage 0
    dtype: Any
    device: Any
    overlap: bool
    staging: bool  # device memory goes to MPI through pinned host buffers
    deterministic: bool
    compress: str  # the wire format: none, fp16 or bf16
    compressor: Any  # PowerSGD or top-k (compress.py), or None
    reduce: str  # ZeRO's reducer
    prescale: float
    postscale: float
    loss_scale: float | None
    wire_round: int

    @property
    def threaded(self) -> bool: ...

    def count_wire(self, numel: int, element_size: int) -> None: ...

    def gather(self, bucket: Bucket, full: Any, shard: Any = None) -> None: ...

    def submit(self, task: Callable[[], None], done: threading.Event) -> None: ...

    def await_done(self, done: threading.Event) -> None: ...

    def bucket_of(self, param: Any) -> Bucket: ...

    def owns(self, tensor: Any) -> bool: ...


@dataclass(frozen=True, slots=True)
class Cut:
    """A model's trainable parameters as a stage cuts them into buckets, seen from rank 0 (which holds the
    largest slices): what the memory plan (control/plan.py) asks a stage's `footprint` of. Counts of elements."""

    total: int  # of the model
    owned: int  # in rank 0's slices of the buckets
    packed: int  # in the largest bucket of several parameters
    numels: list[int]  # of each bucket
    root: list[bool]  # whether each bucket is the model's root unit (stage 3's units)
    params: int  # trainable parameters
    owned_params: int  # parameters rank 0 holds a slice of, counted per bucket
    world: int


@dataclass(frozen=True, slots=True)
class Footprint:
    """Elements a rank holds between two steps at a stage (`gathered`: what it holds whole during a step on top),
    and the number of tensors its optimizer steps."""

    params: int
    grads: int
    state: int  # elements the optimizer keeps state for
    pieces: int  # tensors the optimizer steps (Adam keeps a step count per tensor)
    gathered: int = 0


class Strategy:
    """What a ZeRO stage does at the moments of a step (gradsync.GradSync calls them), and what it answers to the
    trainer, the plan, the checkpoint and the API, so that they never branch on the stage's number (the
    registry `strategies.STRATEGIES` maps it to a class). A stage defines `build`, `reduce` (after backward: a
    bucket's gradients are ready), `after_step`, `grad_tensors` and `grad_bytes`; the moments below do nothing
    unless it needs them (stage 3 does). This class answers as stage 0 does: every rank holds everything."""

    stage = 0
    eager = False  # reduce each bucket inline as soon as backward has filled it, even without overlap
    COLLECTIVE = "allreduce"  # what the flight recorder calls a bucket's sum
    sharded = False  # the optimizer state is sharded: the optimizer steps this rank's slices (`ShardedOptimizer`)
    holds_whole_model = True  # every rank holds every parameter between steps
    gathers_in_forward = False  # a forward is a collective: every rank runs one for every batch, empty ones too
    packs = False  # a bucket's gradients are packed into one buffer to be sent (the reducer probe asks)
    watches_accumulation = False  # backward's gradient-ready hooks matter even with no reduction to launch

    def __init__(self, engine: Engine, module: Any = None):
        self.engine, self.module = engine, module  # the model (stage 3 shards it by module)

    @classmethod
    def refuse(cls, compress: str, hierarchical: bool, reduce: str, module: Any, alone: list[Any]) -> None:
        """What does not compose with this stage, refused in one line before anything is built."""

    @classmethod
    def plan_groups(cls, model: Any, ordered: list[Any], bucket_mb: float, own_bytes: int) -> list[tuple[list[Any], Any]]:
        """The memory plan's buckets of `ordered` (trainable parameters, backward order), each with its module
        (None: buckets are not cut by module)."""
        return [(group, None) for group in assign_buckets(ordered, bucket_mb, own_bytes)]

    @classmethod
    def footprint(cls, cut: Cut) -> Footprint:
        """What a rank holds of a model cut as `cut` (the memory plan's per-stage formulas)."""
        return Footprint(params=cut.total, grads=cut.total, state=cut.total, pieces=cut.params)

    def start(self) -> None:
        """The engine is built: hook the model (stage 3's forward hooks)."""

    def launching(self, bucket: Bucket) -> None:
        """`bucket`'s reduction is about to be submitted: in program order, the same on every rank (what a
        stage decides here, it decides alike everywhere; the communication thread only runs the reduction)."""

    def accumulated(self, param: Any) -> None:
        """Backward accumulated `param`'s gradient with the reduction off (a micro-batch of an accumulation)."""

    def settle(self) -> None:
        """Every bucket of the step is reduced."""

    def params_written(self) -> None:
        """The parameters were written outside a step (loaded from a checkpoint)."""

    def close(self) -> None:
        """Remove what `start` hooked."""

    def owns(self, tensor: Any) -> bool:
        """Whether a checkpoint holds `tensor` in slices, each rank writing its own: a parameter this stage shards."""
        return False

    def reduced(self, param: Any) -> Any:
        """The memory that holds `param`'s summed gradient after `wait()`: its `.grad`."""
        return param.grad

    def state_items(self, model: Any) -> Iterator[tuple[str, Any]]:
        """(key, parameter or buffer) of `model.state_dict(keep_vars=True)`, whole while it is handed out."""
        yield from model.state_dict(keep_vars=True).items()

    def param_bytes(self) -> int:
        """Bytes of parameter memory this rank holds now."""
        return sum(p.numel() * p.element_size() for b in self.engine.buckets for p in b.params)

    def optimizer(self, optimizer: Any) -> Any:
        """What steps the parameters: `optimizer` itself, which steps the whole model."""
        return optimizer


def shard_bounds(n: int, world: int) -> list[tuple[int, int]]:
    """[lo, hi) of each rank's slice of `n` elements: contiguous, in rank order, sizes within one element."""
    base, extra = divmod(n, world)
    bounds, lo = [], 0
    for r in range(world):
        hi = lo + base + (r < extra)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def plan_segments(numels: list[list[int]], world: int, rank: int) -> list[tuple[int, int, int, int]]:
    """The parts of parameters that `rank` owns, given each bucket's parameter sizes in bucket order:
    (bucket, position of the parameter in its bucket, start, stop) with [start, stop) in the flattened
    parameter. A pure function: every rank (and a checkpoint reader) can compute any rank's plan."""
    out = []
    for b, sizes in enumerate(numels):
        lo, hi = shard_bounds(sum(sizes), world)[rank]
        offset = 0
        for i, n in enumerate(sizes):
            start, stop = max(lo, offset), min(hi, offset + n)
            if start < stop:
                out.append((b, i, start - offset, stop - offset))
            offset += n
    return out


def sharded_bucket(index: int, group: list[Any], comm_size: int, rank: int, dtype: Any, device: Any) -> Bucket:
    """A ZeRO bucket: its slices' bounds and this rank's zeroed gradient slice (no parameter memory yet)."""
    import torch

    bucket = Bucket(index, None, group)
    bounds = shard_bounds(bucket.numel, comm_size)
    bucket.counts = [hi - lo for lo, hi in bounds]
    bucket.lo, bucket.hi = bounds[rank]
    bucket.shard = torch.zeros(bucket.hi - bucket.lo, dtype=dtype, device=device)
    return bucket


def flatten_params(bucket: Bucket, dtype: Any, device: Any) -> Any:
    """Copy the bucket's parameters into one new flat buffer and make each parameter a view into it; returns it."""
    import torch

    flat = torch.empty(bucket.numel, dtype=dtype, device=device)
    offset = 0
    for p in bucket.params:
        k = p.numel()
        flat[offset:offset + k].copy_(p.detach().reshape(-1))
        p.data = flat[offset:offset + k].view_as(p)
        offset += k
    return flat


def pack(bucket: Bucket, buffer: Any) -> Any:
    """The bucket's gradients in one flat tensor (zeros for a parameter that got none), and the `.grad`s dropped:
    a bucket of one parameter gives that gradient's own memory, several are copied into `buffer` (at least as
    large as the bucket)."""
    import torch

    if len(bucket.params) == 1:
        p = bucket.params[0]
        grad = (p.grad.reshape(-1).contiguous() if p.grad is not None
                else torch.zeros(p.numel(), dtype=p.dtype, device=p.device))
        p.grad = None
        return grad
    packed, offset = buffer[:bucket.numel], 0
    for p in bucket.params:
        k = p.numel()
        if p.grad is None:
            packed[offset:offset + k].zero_()
        else:
            packed[offset:offset + k].copy_(p.grad.reshape(-1))
        p.grad = None
        offset += k
    return packed
