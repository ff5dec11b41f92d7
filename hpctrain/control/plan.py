"""A memory plan before the job: the bytes each rank will hold at a ZeRO stage and world size (`hpctrain plan`,
and the line `train` logs at start-up and checks its measured peak against).

Per rank, the largest one, counted as the run holds them between two steps (what `hpctrain bench train` and
`train`'s summary measure), from the model's real buckets (built on the meta device: no memory):
- parameters: 4 bytes x P at stages 0-2, this rank's slices at stage 3 (plus, during a step, `gathered`: the
  units it gathers, the root unit and the two largest others, one being prefetched, and the gradients of the
  unit being reduced, whole until they are summed);
- gradients: 4P at stage 0; 4P plus the reduced slice at stage 1; the reduced slice and the one buffer a
  bucket is packed into while it is sent at stage 2; the reduced slice at stage 3 (a unit's gradients are
  packed into its gathered parameter memory);
- optimizer state: per element of what the rank steps (all at stage 0, its slices at 1-3) 8 bytes for Adam and
  AdamW, 4 for SGD with momentum, and Adam's 4-byte step per parameter slice;
- activations: what autograd saves for backward in one forward of a micro-batch (measured on the meta device;
  under bf16/fp16 half of it, plus the 16-bit copies of the weights autocast saves);
- data (a run on a shard set): the reader's window buffers and the labels and ids it loads whole
  (`data.reader.planned_bytes`: one window when a rank's part of the data set fits in one, else up to four);
- start-up: every rank builds the whole model (4P) before it is sharded, so a run's peak is at least that.
The peak a process reaches adds its runtime (Python, torch, MPI: measured in this process) to the larger of
start-up and a step (which holds the data buffers too).
"""

from __future__ import annotations

import math
import resource
from dataclasses import dataclass, field
from typing import Any

from ..base.errors import ConfigError
from ..comm import strategy_class
from ..comm.buckets import Cut, shard_bounds, trainable_in_backward_order

GRAD_OWN_BYTES = 1 << 18  # as GradSync.OWN_BYTES: a gradient this large is a bucket alone
STATE_BYTES = {"adam": 8, "adamw": 8, "sgd": 4}  # optimizer state per element (SGD: its momentum buffer)


@dataclass(frozen=True, slots=True)
class Plan:
    """Bytes per rank (the largest rank) of one ZeRO stage on `world` ranks."""

    stage: int
    world: int
    params: int
    grads: int
    optimizer: int
    gathered: int
    activations: int
    startup: int
    runtime: int
    extra: dict[str, Any] = field(default_factory=dict)
    data: int = 0

    @property
    def state(self) -> int:
        """Parameters, gradients and optimizer state: what ZeRO shards."""
        return self.params + self.grads + self.optimizer

    @property
    def peak(self) -> int:
        return self.runtime + max(self.startup, self.state + self.gathered + self.activations + self.data)


def as_dict(p: Plan) -> dict[str, int]:
    """The plan's figures (bytes per rank), for summary.json and `hpctrain plan --json`."""
    return {"stage": p.stage, "world": p.world, "params": p.params, "grads": p.grads, "optimizer": p.optimizer,
            "gathered": p.gathered, "activations": p.activations, "data": p.data, "state": p.state,
            "startup": p.startup, "runtime": p.runtime, "peak": p.peak}


def runtime_bytes() -> int:
    """This process's peak resident memory so far (torch, MPI and Python loaded, no model yet)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def warm_runtime(optimizer: str) -> int:
    """The runtime a training process holds without its model: this process's peak resident memory once a tiny
    step (forward, backward, the optimizer as `train` makes it) has loaded the kernels a step runs (the fused
    Adam step alone maps about 70 MB of torch's code)."""
    import torch

    from ..base.sections import OptimizerConfig
    from .step import make_optimizer

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    torch.nn.functional.cross_entropy(model(torch.zeros(2, 8)), torch.zeros(2, dtype=torch.int64)).backward()
    make_optimizer(OptimizerConfig(name=optimizer), model.parameters()).step()
    return runtime_bytes()


def meta_model(build: Any) -> Any:
    """`build()` on the meta device: the model's shapes and modules, no memory."""
    import torch

    from ..base.errors import HpctrainError

    try:
        with torch.device("meta"):
            return build()
    except HpctrainError:
        raise
    except Exception as exc:  # noqa: BLE001 - a factory that computes with tensors cannot build there
        raise ConfigError(f"the model does not build on torch's meta device ({type(exc).__name__}: {exc}); the "
                          "plan builds it there to need no memory") from None


def saved_bytes(model: Any, example: Any, loss: Any) -> int:
    """Bytes autograd saves for backward in one forward of `example` through `model` (and `loss` of its output),
    the parameters themselves left out (works on the meta device)."""
    import torch

    params = {p.untyped_storage()._cdata for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: Any) -> Any:
        key = t.untyped_storage()._cdata
        if key not in params:
            saved[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss(model(example))
    return sum(saved.values())


def plan(model: Any, *, world: int, zero: int, optimizer: str, activations: int, precision: str = "fp32",
         bucket_mb: float = 25.0, momentum: float = 0.9, runtime: int | None = None, data: int = 0) -> Plan:
    """The plan of `model` (on any device, meta included) at ZeRO `zero` on `world` ranks; `activations` are
    the bytes autograd saves for one micro-batch in fp32 (`saved_bytes`), `data` what the readers hold."""
    if world < 1:
        raise ConfigError(f"plan: --world {world!r} must be at least 1")
    stage = strategy_class(zero)
    ordered = trainable_in_backward_order(model.parameters())
    size = ordered[0].element_size()
    total = sum(p.numel() for p in ordered)
    units = stage.plan_groups(model, ordered, bucket_mb, GRAD_OWN_BYTES)
    groups = [g for g, _ in units]
    numels = [sum(p.numel() for p in g) for g in groups]
    held = stage.footprint(Cut(
        total=total, owned=sum(shard_bounds(n, world)[0][1] for n in numels),  # rank 0: the largest slices
        packed=max((n for g, n in zip(groups, numels) if len(g) > 1), default=0),
        numels=numels, root=[module is model for _, module in units], params=len(ordered),
        owned_params=sum(len(_owned_params(g, world)) for g in groups), world=world))
    per_element = 0 if optimizer == "sgd" and not momentum else STATE_BYTES.get(optimizer, 8)
    steps = 4 * held.pieces if optimizer in ("adam", "adamw") else 0
    state = per_element * held.state + steps
    act = activations if precision == "fp32" else activations // 2 + 2 * total
    return Plan(zero, world, held.params * size, held.grads * size, state, held.gathered * size, act, total * size,
                runtime if runtime is not None else runtime_bytes(),
                {"parameters": total, "buckets": len(groups), "largest_bucket": max(numels) * size}, data)


def _owned_params(group: list[Any], world: int) -> list[int]:
    """The parameters of a bucket that rank 0's slice touches (one optimizer segment each)."""
    lo, hi = shard_bounds(sum(p.numel() for p in group), world)[0]
    out, offset = [], 0
    for i, p in enumerate(group):
        if max(lo, offset) < min(hi, offset + p.numel()):
            out.append(i)
        offset += p.numel()
    return out


def fits(plans: list[Plan], memory: int) -> list[Plan]:
    """Those of `plans` whose peak fits `memory` bytes per rank."""
    return [p for p in plans if p.peak <= memory]


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def parse_memory(text: str) -> int:
    """Bytes of `80GiB`, `512MiB`, `1.5TB`, `2G` (binary units; a bare number is bytes)."""
    t = text.strip().upper().replace("IB", "").removesuffix("B")
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    unit = t[-1] if t and t[-1] in units else ""
    try:
        value = float(t[:len(t) - len(unit)]) * units[unit]
    except ValueError:
        raise ConfigError(f"--memory {text!r}: write e.g. 80GiB, 512MiB or 24G") from None
    if value <= 0 or math.isinf(value):
        raise ConfigError(f"--memory {text!r} must be a positive size, e.g. 80GiB")
    return int(value)


def line(p: Plan) -> str:
    """One line of the plan, as `train` logs it."""
    return (f"memory plan, ZeRO stage {p.stage} on {p.world} ranks, per rank: parameters {human(p.params)}, "
            f"gradients {human(p.grads)}, optimizer {human(p.optimizer)}, gathered {human(p.gathered)}, "
            f"activations ~{human(p.activations)}, data {human(p.data)}, runtime {human(p.runtime)}; "
            f"peak ~{human(p.peak)}")


@dataclass(frozen=True, slots=True)
class Workload:
    """What the plan needs of a run beside the model: its optimizer, precision, micro-batch and buckets."""

    optimizer: str = "adam"
    precision: str = "fp32"
    batch_size: int = 64
    bucket_mb: float = 25.0
    momentum: float = 0.9


def spec_model(spec: str, *, lm: bool, input_shape: tuple[int, ...] = (784,), classes: int = 10,
               seq_len: int = 128, vocab: int = 257) -> tuple[Any, Any]:
    """(the model of `spec` on the meta device, a function of the micro-batch size giving the bytes autograd
    saves for it), as `train` builds the model: a language model (`lm`) of token rows of `seq_len` below
    `vocab`, or a classifier of `input_shape` features into `classes`."""
    import torch

    from ..compute.gpt import build_lm
    from ..compute.models import build_model

    if lm:
        model = meta_model(lambda: build_lm(spec, seq_len, vocab))
        shape, dtype, targets = (seq_len,), torch.int64, lambda b: torch.zeros(b * seq_len, dtype=torch.int64,
                                                                                device="meta")
    else:
        model = meta_model(lambda: build_model(spec, input_shape, classes))
        shape, dtype, targets = input_shape, torch.float32, lambda b: torch.zeros(b, dtype=torch.int64, device="meta")

    def activations(batch: int) -> int:
        example = torch.zeros((batch, *shape), dtype=dtype, device="meta")
        loss = torch.nn.CrossEntropyLoss(reduction="sum")
        return saved_bytes(model, example, lambda out: loss(out.reshape(-1, out.shape[-1]).float(), targets(batch)))

    return model, activations


def stages(model: Any, activations: int, world: int, work: Workload, runtime: int | None = None,
           data: int = 0) -> list[Plan]:
    """The plans of stages 0-3 on `world` ranks."""
    runtime = runtime if runtime is not None else runtime_bytes()
    return [plan(model, world=world, zero=z, optimizer=work.optimizer, activations=activations,
                 precision=work.precision, bucket_mb=work.bucket_mb, momentum=work.momentum, runtime=runtime,
                 data=data) for z in range(4)]


def smallest_worlds(model: Any, activations: int, work: Workload, memory: int, *, most: int = 4096,
                    data: Any = None) -> dict[int, int | None]:
    """The fewest ranks (a power of two up to `most`) on which each stage's peak fits `memory`; None: none.
    `data` (a function of the world size) gives the readers' bytes per rank."""
    runtime = runtime_bytes()
    out: dict[int, int | None] = {}
    for z in range(4):
        out[z] = next((w for w in (2**k for k in range(most.bit_length())) if plan(
            model, world=w, zero=z, optimizer=work.optimizer, activations=activations, precision=work.precision,
            bucket_mb=work.bucket_mb, momentum=work.momentum, runtime=runtime,
            data=data(w) if data is not None else 0).peak <= memory), None)
    return out


def table(spec: str, *, world: int, zero: int | None, optimizer: str, precision: str, batch_size: int,
          seq_len: int | None, data: Any, input_dim: int, classes: int, bucket_mb: float,
          memory: str | None) -> dict[str, Any]:
    """What `hpctrain plan` prints: {"text": the table and what fits, "json": the same as data}. The values are
    checked by the command, through the sections of a training config."""
    limit = parse_memory(memory) if memory is not None else None
    data_bytes = None
    if data is not None:
        from ..data.reader import planned_bytes
        from ..data.shardformat import load_manifest

        shards = load_manifest(data)
        data_bytes = lambda w: planned_bytes(shards, w)  # noqa: E731
        lm = shards.task == "lm"
        seq_len = shards.seq_len if lm else None
        model, activations = spec_model(spec, lm=lm, input_shape=tuple(shards.x_shape), classes=shards.num_classes,
                                        seq_len=seq_len or 1, vocab=shards.num_classes)
    else:
        lm = seq_len is not None or spec.partition(":")[0] == "gpt"
        seq_len = (seq_len or 128) if lm else None
        model, activations = spec_model(spec, lm=lm, input_shape=(input_dim,), classes=classes or 10,
                                        seq_len=seq_len or 1, vocab=classes or 257)
    work = Workload(optimizer, precision, batch_size, bucket_mb)
    try:
        act = activations(batch_size)
    except Exception as exc:  # noqa: BLE001 - the user's forward on the meta device
        raise ConfigError(f"--model {spec!r} does not run on torch's meta device ({type(exc).__name__}: {exc}); "
                          "the plan builds the model there to need no memory") from None
    plans = stages(model, act, world, work, runtime=warm_runtime(optimizer), data=data_bytes(world) if data_bytes else 0)
    total = plans[0].extra["parameters"]
    rows = [f"{spec} ({total / 1e6:,.1f} M parameters), {optimizer}, {precision}, micro-batch {batch_size}"
            f"{f' x {seq_len} tokens' if lm else ''}, {world} rank"
            f"{'s' if world > 1 else ''}; bytes per rank (the largest rank):",
            f"{'stage':>5}  {'params':>10}  {'grads':>10}  {'optimizer':>10}  {'gathered':>10}  {'activations':>11}"
            f"  {'p+g+o':>10}  {'peak':>10}"]
    for p in plans:
        mark = {zero: " <"}.get(p.stage, "")  # the stage asked for
        rows.append(f"{p.stage:>5}  {human(p.params):>10}  {human(p.grads):>10}  {human(p.optimizer):>10}  "
                    f"{human(p.gathered):>10}  {human(p.activations):>11}  {human(p.state):>10}  {human(p.peak):>10}{mark}")
    rows.append(f"peak = runtime {human(plans[0].runtime)} + the larger of start-up (the whole model, "
                f"{human(plans[0].startup)}, built on every rank before it is sharded) and a step"
                + (f" (with the data reader's {human(plans[0].data)}: its window buffers, labels and ids)"
                   if plans[0].data else ""))
    out: dict[str, Any] = {"model": spec, "parameters": total, "world": world, "optimizer": optimizer,
                           "precision": precision, "batch_size": batch_size,
                           "stages": [as_dict(p) for p in plans]}
    if limit is not None:
        good = [p.stage for p in fits(plans, limit)]
        fewest = smallest_worlds(model, act, work, limit, data=data_bytes)
        rows.append(f"--memory {memory}: on {world} rank{'s' if world > 1 else ''} "
                    + (f"stage{'s' if len(good) > 1 else ''} {', '.join(map(str, good))} fit{'' if len(good) > 1 else 's'}"
                       if good else "no stage fits"))
        rows += [f"  stage {z}: " + (f"fits on {w} rank{'s' if w > 1 else ''} or more" if w else
                                     "fits on no world size (its start-up or per-rank state alone is too large)")
                 for z, w in fewest.items()]
        out.update(memory=limit, fits=good, fewest_ranks=fewest)
    return {"text": "\n".join(rows), "json": out}


def for_run(spec: str, shardset: Any, *, world: int, zero: int, work: Workload, runtime: int) -> Plan | str:
    """The plan of a `train` run: its model on its data (a meta copy: the same buckets and units); or, when the
    model cannot be built or run on the meta device (a factory that computes with tensors), why not."""
    lm = shardset.task == "lm"
    try:
        model, activations = spec_model(spec, lm=lm, input_shape=tuple(shardset.x_shape),
                                        classes=shardset.num_classes, seq_len=shardset.seq_len if lm else 1,
                                        vocab=shardset.num_classes)
        act = activations(work.batch_size)
    except Exception as exc:  # noqa: BLE001 - any failure of the user's code on the meta device: no plan
        return f"no memory plan: model {spec!r} does not build and run on torch's meta device ({type(exc).__name__}: {exc})"
    from ..data.reader import planned_bytes

    return plan(model, world=world, zero=zero, optimizer=work.optimizer, activations=act, precision=work.precision,
                bucket_mb=work.bucket_mb, momentum=work.momentum, runtime=runtime, data=planned_bytes(shardset, world))


def measured(sync: Any, optimizer: Any, comm: Any, log: Any = None) -> dict[str, int]:
    """What the ranks hold now (between steps) and their peak RSS so far: the largest rank's of each
    (collective); `log` gets this rank's own."""
    state = getattr(optimizer, "state_bytes", None)
    opt = state() if state is not None else sum(v.numel() * v.element_size() for st in optimizer.state.values()
                                                for v in st.values() if hasattr(v, "numel"))
    mine = [sync.param_bytes(), sync.grad_bytes(), opt, runtime_bytes()]
    if log is not None:
        log("this rank holds params %d, grads %d, optimizer %d; its peak RSS %d", *mine)
    values = comm.allreduce_array(mine, op="max")
    return dict(zip(("params", "grads", "optimizer", "peak_rss"), (int(v) for v in values)))


def departure(p: Plan, got: dict[str, int], tolerance: float = 0.2) -> str | None:
    """The warning when the measured peak departs from the plan's by more than `tolerance`, else None."""
    off = got["peak_rss"] / max(1, p.peak) - 1.0
    if abs(off) <= tolerance:
        return None
    return (f"the peak RSS per rank, {human(got['peak_rss'])}, is {abs(off):.0%} {'above' if off > 0 else 'below'} "
            f"the memory plan's {human(p.peak)} (parameters {human(got['params'])}, gradients {human(got['grads'])}, "
            f"optimizer {human(got['optimizer'])} measured against {human(p.params)}, {human(p.grads)}, "
            f"{human(p.optimizer)} planned): what else does this process hold (data buffers, the model's own "
            "tensors, a user factory's)? hpctrain plan shows the parts")
