"""A model cut into pipeline stages and split over tensor-parallel ranks: what one rank holds.

`model_limits(model)` says what a model allows (how many blocks, and for the GPT its heads and vocabulary);
`build_stage(model, groups)` takes the whole model (every rank builds it from the same seed, or rank 0's
weights broadcast) and keeps this rank's part: its pipeline stage's blocks, split over its tensor-parallel
group. Two kinds of model are a sequence of blocks:
- the built-in GPT: stage p holds blocks [l_p, l_{p+1}) of `shard_bounds(layers, P)`; the first also holds the
  token and position embeddings, the last the final LayerNorm and the head. With P > 1 the tied
  embedding/head is held twice, by the first stage (the embedding) and the last (the head), and its
  gradient is summed over the two (`Stage.tied`). Tensor parallel over T ranks as in `tensor`.
- an `nn.Sequential`, or a module with a `pipeline_blocks()` method returning the modules whose composition
  is its forward: stage p holds blocks [b_p, b_{p+1}) of `shard_bounds(blocks, P)`. A parameter used by two
  stages (tied weights) is refused; such a model cannot be split by tensor parallelism.

A stage's parameter and buffer names are the whole model's (`full_key` maps the few that are not), and
`pieces(key, shape)` says where this rank's share of a tensor sits in the whole one: what builds the whole
model back at the end (model.pt) and what a checkpoint of any layout is read and written with.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..base.errors import ConfigError
from .groups import Groups
from ..comm.buckets import shard_bounds
from .layout import ModelLimits
from .tensor import (TensorParallelBlock, VocabEmbedding, VocabHead, tensor_pieces, vocab_argmax,
                     vocab_cross_entropy)

Piece = tuple[int, int, int, int]  # (dim, start in the whole tensor, start in this rank's, length)


def model_limits(model: Any, name: str) -> ModelLimits:
    """What `model` (named `name` in messages) allows: its blocks, and for the GPT its heads and vocabulary."""
    from ..compute.gpt import GPT

    if isinstance(model, GPT):
        return ModelLimits(name, model.layers, heads=model.heads, vocab=model.vocab_size)
    return ModelLimits(name, len(_blocks(model)) if _blocks(model) is not None else None)


def _blocks(model: Any) -> list[tuple[str, nn.Module]] | None:
    """(qualified name, module) of each block of a sequence-of-blocks model, in order (None: not one)."""
    if isinstance(model, nn.Sequential):
        return list(model.named_children())
    declared = getattr(model, "pipeline_blocks", None)
    if not callable(declared):
        return None
    names = {id(m): n for n, m in model.named_modules()}
    blocks = list(declared())
    missing = [type(b).__name__ for b in blocks if id(b) not in names]
    if missing:
        raise ConfigError(f"pipeline_blocks() of the model returned modules that are not its submodules "
                          f"({', '.join(missing[:3])}): return the model's own blocks, in order")
    return [(names[id(b)], b) for b in blocks]


class Stage(nn.Module):
    """This rank's part of the model: `first`/`last` stage, forward on its input, the loss on the last."""

    first: bool
    last: bool
    tied: list[nn.Parameter]  # parameters also held by another stage (their gradient is summed over `tie`)
    whole: dict[str, tuple[tuple[int, ...], torch.dtype]]  # every tensor of the whole model: shape, dtype
    aliases: dict[str, str]  # whole-model names that are another name's tensor (a tied head: its embedding)
    keys: list[str]  # the whole model's state_dict names, in its order
    param_keys: list[str]  # the whole model's parameter names, in its parameters() order

    def full_key(self, key: str) -> str:
        """The whole model's name of this stage's parameter or buffer `key`."""
        return key

    def pieces(self, key: str, shape: tuple[int, ...]) -> list[Piece]:
        """Where this rank's tensor `key` sits in the whole one of `shape` ([]: it holds it whole)."""
        return []

    def copy(self, key: str) -> bool:
        """Whether `key` is this stage's copy of a tensor another stage holds too (and writes)."""
        return False

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The summed loss of the last stage's output against the targets."""
        out, y = _flat(out, y)
        return nn.functional.cross_entropy(out.float(), y, reduction="sum")

    def predict(self, out: torch.Tensor) -> torch.Tensor:
        """The predicted class of every row (token) of the last stage's output."""
        return out.reshape(-1, out.shape[-1]).argmax(dim=1)


def _flat(out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if out.dim() > 2:  # a language model: (batch, tokens, vocabulary), one target per token
        return out.reshape(-1, out.shape[-1]), y.reshape(-1)
    return out, y


class GPTStage(Stage):
    """Stage p of P of the built-in GPT, tensor-parallel over `tensor` (see the module docstring)."""

    def __init__(self, gpt: Any, groups: Groups):
        super().__init__()
        tp = groups.tensor
        self.first, self.last, self.tp, self.heads = groups.first, groups.last, tp, gpt.heads
        lo, hi = shard_bounds(gpt.layers, groups.layout.pipe)[groups.p]
        self.vocab_lo, vocab_hi = shard_bounds(gpt.vocab_size, tp.size)[tp.rank]
        self.tied = []
        if self.first:
            self.tok_emb = VocabEmbedding(gpt.tok_emb.weight[self.vocab_lo:vocab_hi], self.vocab_lo, tp)
            self.pos_emb, self.drop = gpt.pos_emb, gpt.drop
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] if tp.size == 1 else TensorParallelBlock(gpt.blocks[i], tp)
                                     for i in range(lo, hi)})
        if self.last:
            self.ln_f = gpt.ln_f
            weight = (self.tok_emb.weight if self.first
                      else nn.Parameter(gpt.tok_emb.weight.detach()[self.vocab_lo:vocab_hi].clone()))
            self.head = VocabHead(weight, self.vocab_lo, tp)
        if groups.layout.pipe > 1 and (self.first or self.last):
            self.tied = [self.tok_emb.weight if self.first else self.head.weight]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.drop(self.tok_emb(x) + self.pos_emb.weight[:x.shape[-1]])
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x

    def full_key(self, key: str) -> str:
        return "tok_emb.weight" if key == "head.weight" else key

    def copy(self, key: str) -> bool:
        return key == "head.weight" and not self.first  # the last stage's copy of the tied embedding

    def pieces(self, key: str, shape: tuple[int, ...]) -> list[Piece]:
        return tensor_pieces(key, shape, self.tp, heads=self.heads)

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out, y = _flat(out, y)
        return vocab_cross_entropy(out, y, self.vocab_lo, self.tp)

    def predict(self, out: torch.Tensor) -> torch.Tensor:
        return vocab_argmax(out.reshape(-1, out.shape[-1]), self.vocab_lo, self.tp)


class BlocksStage(Stage):
    """Stage p of P of a sequence of blocks (an nn.Sequential, or a model's pipeline_blocks())."""

    def __init__(self, model: Any, groups: Groups):
        super().__init__()
        named = _blocks(model)
        if named is None:
            raise ConfigError("this model is not a sequence of blocks: return an nn.Sequential from the factory or "
                              "give the model a pipeline_blocks() method")
        P = groups.layout.pipe
        _refuse_shared(named, P)
        self.first, self.last, self.tied = groups.first, groups.last, []
        lo, hi = shard_bounds(len(named), P)[groups.p]
        self.names = [name for name, _ in named[lo:hi]]
        self.blocks = nn.ModuleList(module for _, module in named[lo:hi])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def full_key(self, key: str) -> str:
        _, index, rest = key.split(".", 2)
        return f"{self.names[int(index)]}.{rest}"


def _refuse_shared(named: list[tuple[str, nn.Module]], stages: int) -> None:
    """Refused in one line: a parameter used by blocks of two stages (this pipeline cannot split it), and a
    stage with nothing to train (blocks without parameters, e.g. a Flatten alone)."""
    seen: dict[int, int] = {}
    for p, (lo, hi) in enumerate(shard_bounds(len(named), stages)):
        trainable = False
        for name, module in named[lo:hi]:
            for pname, param in module.named_parameters():
                trainable = trainable or param.requires_grad
                if seen.setdefault(id(param), p) != p:
                    raise ConfigError(f"--pp {stages}: parameter {name}.{pname} is used by stages {seen[id(param)]} "
                                      f"and {p} (tied weights); only the built-in gpt's tied embedding/head can span "
                                      "stages: use fewer stages or untie it")
        if not trainable:
            blocks = ", ".join(type(m).__name__ for _, m in named[lo:hi])
            raise ConfigError(f"--pp {stages}: stage {p} would hold only {blocks}, with no parameter to train: use "
                              "fewer stages, or blocks that each hold a layer with weights")


def build_stage(model: Any, groups: Groups) -> Stage:
    """This rank's stage of `model` (the whole model, the same on every rank) in the layout of `groups`."""
    from ..compute.gpt import GPT

    whole, aliases, first_name = {}, {}, {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in first_name:
            aliases[key] = first_name[id(tensor)]
            continue
        first_name[id(tensor)] = key
        whole[key] = (tuple(tensor.shape), tensor.dtype)
    if isinstance(model, GPT):
        stage: Stage = GPTStage(model, groups)
    elif groups.layout.tensor > 1:
        raise ConfigError("--tp: only the built-in gpt declares how to split across tensor-parallel ranks")
    else:
        stage = BlocksStage(model, groups)
    stage.whole, stage.aliases = whole, aliases
    stage.keys = list(model.state_dict().keys())
    stage.param_keys = [k for k, _ in model.named_parameters()]
    return stage


def take(whole: torch.Tensor, pieces: list[Piece]) -> torch.Tensor:
    """This rank's share of `whole` (a new tensor)."""
    if not pieces:
        return whole.clone()
    return torch.cat([whole.narrow(dim, start, length) for dim, start, _, length in pieces], dim=pieces[0][0])


def put(whole: torch.Tensor, share: torch.Tensor, pieces: list[Piece]) -> None:
    """Write this rank's `share` into its place in `whole`."""
    if not pieces:
        whole.copy_(share)
        return
    for dim, start, at, length in pieces:
        whole.narrow(dim, start, length).copy_(share.narrow(dim, at, length))


def shares(stage: Stage, tp_rank: int) -> list[tuple[str, str, torch.Tensor, list[Piece], bool]]:
    """Every tensor of this rank's stage in whole-model terms: (its stage name, its whole-model name, the
    tensor, its pieces, whether this rank writes it into a whole model of its replica). A rank writes its own
    share of a split tensor; a tensor held whole by every tensor-parallel rank is written by tensor rank 0;
    the tied embedding/head by the first stage, which holds it as the embedding. Each whole-model name once."""
    out, seen = [], set()
    for key, tensor in stage.state_dict(keep_vars=True).items():
        full = stage.full_key(key)
        if full in seen:
            continue
        seen.add(full)
        pieces = stage.pieces(key, tuple(stage.whole[full][0]))
        writes = (bool(pieces) or tp_rank == 0) and not stage.copy(key)
        out.append((key, full, tensor, pieces, writes))
    return out
