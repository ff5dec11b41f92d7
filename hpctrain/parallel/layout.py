"""The layout of a hybrid-parallel run: W = D x T x P ranks, each with its place (d, t, p), and the layouts a
model and a dataset allow.

Ranks are numbered with the tensor-parallel index fastest, then the data-parallel one, then the pipeline
stage: rank = p * (D * T) + d * T + t. So the T ranks of a tensor-parallel group are neighbours in the rank
order that `srun` and `mpirun --map-by` give (on one node where T divides the ranks per node): their two
allreduces of activations per transformer layer, forward and backward, are the most frequent traffic. The
data-parallel groups come next (every gradient, once per step), and the pipeline stages span the longest
distance: they pass one activation per micro-batch to a neighbour, the least traffic of the three (as
Megatron-LM orders its groups).

`check_layout` is what start-up runs on every rank (a pure function: every rank reaches the same verdict):
it refuses a layout the world, the model or the data cannot take with one line that lists the layouts
that work.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..base.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Layout:
    """D data-parallel replicas, each a pipeline of P stages of T tensor-parallel ranks."""

    data: int
    tensor: int = 1
    pipe: int = 1

    @property
    def world(self) -> int:
        return self.data * self.tensor * self.pipe

    @property
    def plain(self) -> bool:
        """Pure data parallelism: no model split."""
        return self.tensor == 1 and self.pipe == 1

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(d, t, p) of `rank`."""
        p, rest = divmod(rank, self.data * self.tensor)
        d, t = divmod(rest, self.tensor)
        return d, t, p

    def rank(self, d: int, t: int, p: int) -> int:
        """The rank at (d, t, p)."""
        return p * self.data * self.tensor + d * self.tensor + t

    def __str__(self) -> str:
        return f"(D,T,P) = ({self.data},{self.tensor},{self.pipe})"


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What a model allows: how many stages at most (its blocks), and for tensor parallelism its heads and
    vocabulary (None: it does not declare how to split across tensor-parallel ranks)."""

    name: str
    blocks: int | None  # None: not a sequence of blocks (no pipeline)
    heads: int | None = None  # None: no tensor parallelism
    vocab: int | None = None

    def tensor_problem(self, t: int) -> str | None:
        """Why T = `t` does not fit the model (None: it does)."""
        if t == 1:
            return None
        if self.heads is None:
            return (f"model {self.name!r} does not declare how to split across tensor-parallel ranks (the built-in "
                    "gpt does)")
        if self.heads % t:
            return f"--tp {t} does not divide the model's {self.heads} attention heads"
        if self.vocab is not None and t > self.vocab:
            return f"--tp {t} is more than the vocabulary's {self.vocab} ids"
        return None

    def pipe_problem(self, p: int) -> str | None:
        """Why P = `p` does not fit the model (None: it does)."""
        if p == 1:
            return None
        if self.blocks is None:
            return (f"model {self.name!r} is not a sequence of blocks (an nn.Sequential, the built-in gpt, or a "
                    "module with pipeline_blocks())")
        if p > self.blocks:
            return f"--pp {p} is more stages than the model's {self.blocks} blocks"
        return None


def layouts_that_work(world: int, limits: ModelLimits, shards: int | None = None) -> list[Layout]:
    """Every (D, T, P) with D x T x P = `world` that the model (and `shards` per split, D dividing it) allows."""
    out = []
    for t in range(1, world + 1):
        for p in range(1, world // t + 1):
            if world % (t * p):
                continue
            d = world // (t * p)
            if limits.tensor_problem(t) or limits.pipe_problem(p) or (shards is not None and shards % d):
                continue
            out.append(Layout(d, t, p))
    return out


def check_layout(world: int, tp: int, pp: int, limits: ModelLimits, shards: int | None = None) -> Layout:
    """The layout of `world` ranks at --tp `tp` and --pp `pp`; raises ConfigError with the layouts that work."""
    problem = None
    if world % (tp * pp):
        problem = f"--tp {tp} x --pp {pp} = {tp * pp} does not divide the {world} ranks"
    problem = problem or limits.tensor_problem(tp) or limits.pipe_problem(pp)
    d = world // (tp * pp) if not world % (tp * pp) else 0
    if problem is None and shards is not None and shards % d:
        problem = (f"the data's {shards} shards per split cannot be shared evenly by D = {d} data-parallel ranks "
                   "(each replica reads shards d, d+D, ...)")
    if problem is None:
        return Layout(d, tp, pp)
    fits = layouts_that_work(world, limits, shards)
    listed = ", ".join(f"--tp {lay.tensor} --pp {lay.pipe} (D={lay.data})" for lay in fits[:12])
    more = f" and {len(fits) - 12} more" if len(fits) > 12 else ""
    raise ConfigError(f"{problem}: on {world} rank(s) with this model and data, use {listed}{more}" if fits else
                      f"{problem}, and no layout of {world} rank(s) fits this model and data: change the world size")
