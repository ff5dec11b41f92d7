"""Tensor parallelism for the built-in GPT (Megatron-LM's scheme, over an MPI communicator of T ranks).

Each transformer block keeps its LayerNorms whole (replicated) and splits its four matmuls:
- column-parallel in: the attention's fused q/k/v projection by heads (rank t computes heads
  [t H/T, (t+1) H/T) for q, k and v), the MLP's first layer by hidden units (4 dim / T each);
- row-parallel out: the attention's output projection and the MLP's second layer take this rank's share of
  their input and produce a partial sum, summed over the group; their bias is added once, after the sum.
Two custom autograd operators carry the communication: `to_group` (Megatron's f) is the identity forward and
sums the input gradient over the group backward; `from_group` (g) sums the activation over the group forward
and is the identity backward. So a block costs one allreduce of activations (batch x tokens x dim) per
attention and one per MLP, forward, and the same two backward.

The tied token embedding / output head is split by vocabulary: rank t holds rows [v_t, v_{t+1}) (`shard_bounds`:
shares within one row of each other, so a vocabulary that T does not divide, like the 257 ids of the byte
tokenizer, still splits). The embedding looks up the ids in its rows, zeroes the others and sums over the
group; the head produces this rank's logits only, and `vocab_cross_entropy` computes the loss from them with
two small allreduces per batch (the row maxima, then the sums of exponentials with the target's logit),
never gathering the (tokens x vocabulary) logits. Positions, LayerNorms and the row-parallel biases are
replicated: their gradients are the same on every rank of the group by construction (each is computed from
replicated inputs and the group-summed output gradient), so they stay identical without communication
(the end of a run checks it).

With T = 1 every operator is the identity and every share the whole tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..comm import Comm
from ..comm.p2p import allreduce_
from ..comm.buckets import shard_bounds


class _ToGroup(torch.autograd.Function):
    """f: identity forward; the input gradient summed over the group backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return allreduce_(ctx.comm, grad.contiguous().clone(), label="backward sum"), None


class _FromGroup(torch.autograd.Function):
    """g: the activation summed over the group forward; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        return allreduce_(comm, x.contiguous().clone(), label="forward sum")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def to_group(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return x if comm.size == 1 else _ToGroup.apply(x, comm)


def from_group(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return x if comm.size == 1 else _FromGroup.apply(x, comm)


class _VocabCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from this rank's slice [lo, lo + V_t) of the logits."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, lo: int, comm: Comm) -> torch.Tensor:
        rowmax = allreduce_(comm, logits.max(dim=1).values.contiguous(), "max", "loss max")
        shifted = logits - rowmax.unsqueeze(1)
        exp = shifted.exp()
        local = target - lo
        inside = (local >= 0) & (local < logits.shape[1])
        local = local.clamp(0, logits.shape[1] - 1)
        picked = shifted.gather(1, local.unsqueeze(1)).squeeze(1) * inside
        sums = allreduce_(comm, torch.stack([exp.sum(dim=1), picked]).contiguous(), label="loss sums")
        loss = sums[0].log() - sums[1]
        ctx.save_for_backward(exp.div_(sums[0].unsqueeze(1)), local, inside)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local, inside = ctx.saved_tensors
        out = softmax.clone()
        rows = torch.arange(out.shape[0], device=out.device)
        out[rows, local] -= inside.to(out.dtype)
        return out.mul_(grad.unsqueeze(1)), None, None, None


def vocab_cross_entropy(logits: torch.Tensor, target: torch.Tensor, lo: int, comm: Comm) -> torch.Tensor:
    """The summed cross-entropy of `target` ids (N,) given this rank's logits (N, V_t) for ids [lo, lo + V_t)."""
    if comm.size == 1:
        return F.cross_entropy(logits.float(), target, reduction="sum")
    return _VocabCrossEntropy.apply(logits.float(), target, lo, comm).sum()


def vocab_argmax(logits: torch.Tensor, lo: int, comm: Comm) -> torch.Tensor:
    """The id of the largest logit of each row over the whole vocabulary (the lowest on a tie, as argmax)."""
    if comm.size == 1:
        return logits.argmax(dim=1)
    best, where = logits.float().max(dim=1)
    top = allreduce_(comm, best.contiguous().clone(), "max", "argmax")
    ids = torch.where(best == top, where + lo, torch.full_like(where, 1 << 62)).double()
    return (-allreduce_(comm, (-ids).contiguous(), "max", "argmax")).long()  # the smallest id that reaches the top


class ColumnLinear(nn.Module):
    """Rows `rows` (a list of [start, stop) ranges of the output features) of a linear layer; input whole."""

    def __init__(self, full: nn.Linear, rows: list[tuple[int, int]], comm: Comm):
        super().__init__()
        self.comm = comm
        self.weight = nn.Parameter(torch.cat([full.weight.detach()[a:b] for a, b in rows]).clone())
        self.bias = nn.Parameter(torch.cat([full.bias.detach()[a:b] for a, b in rows]).clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(to_group(x, self.comm), self.weight, self.bias)


class RowLinear(nn.Module):
    """Input features [lo, hi) of a linear layer; the partial products summed over the group, then the bias."""

    def __init__(self, full: nn.Linear, lo: int, hi: int, comm: Comm):
        super().__init__()
        self.comm = comm
        self.weight = nn.Parameter(full.weight.detach()[:, lo:hi].clone())
        self.bias = nn.Parameter(full.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return from_group(F.linear(x, self.weight), self.comm) + self.bias


class TensorParallelAttention(nn.Module):
    """A CausalSelfAttention's heads [h0, h1) on this rank."""

    def __init__(self, full: Any, comm: Comm):
        super().__init__()
        dim, heads = full.qkv.in_features, full.heads
        hd = dim // heads
        h0, h1 = shard_bounds(heads, comm.size)[comm.rank]
        self.heads, self.dropout = h1 - h0, full.dropout
        self.qkv = ColumnLinear(full.qkv, [(j * dim + h0 * hd, j * dim + h1 * hd) for j in range(3)], comm)
        self.proj = RowLinear(full.proj, h0 * hd, h1 * hd, comm)
        self.resid_drop = full.resid_drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, -1)))


class TensorParallelBlock(nn.Module):
    """A GPT Block with its attention and MLP split over the group; LayerNorms whole. Parameter names are the
    Block's own (ln1.weight, attn.qkv.weight, fc.bias, ...)."""

    def __init__(self, full: Any, comm: Comm):
        super().__init__()
        hidden = full.fc.out_features
        lo, hi = shard_bounds(hidden, comm.size)[comm.rank]
        self.ln1, self.ln2, self.drop = full.ln1, full.ln2, full.drop
        self.attn = TensorParallelAttention(full.attn, comm)
        self.fc = ColumnLinear(full.fc, [(lo, hi)], comm)
        self.proj = RowLinear(full.proj, lo, hi, comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.proj(F.gelu(self.fc(self.ln2(x)))))


class VocabEmbedding(nn.Module):
    """Rows [lo, hi) of a token embedding: ids outside look up zeros; the sum over the group is the lookup."""

    def __init__(self, weight: torch.Tensor, lo: int, comm: Comm):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.lo, self.comm = lo, comm

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.comm.size == 1:
            return F.embedding(tokens, self.weight)
        local = tokens - self.lo
        outside = (local < 0) | (local >= self.weight.shape[0])
        found = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return from_group(found.masked_fill(outside.unsqueeze(-1), 0.0), self.comm)


class VocabHead(nn.Module):
    """The output head over rows [lo, hi) of the vocabulary: this rank's logits only."""

    def __init__(self, weight: nn.Parameter, lo: int, comm: Comm):
        super().__init__()
        self.weight = weight
        self.lo, self.comm = lo, comm

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(to_group(h, self.comm), self.weight)


def tensor_pieces(key: str, shape: tuple[int, ...], comm: Comm, *, heads: int) -> list[tuple[int, int, int, int]]:
    """Where this rank's tensor `key` (a GPT state_dict name) sits in the whole tensor: a list of pieces
    (dim, start in the whole tensor, start in this rank's tensor, length), one box each along dimension dim;
    [] for a tensor every rank holds whole. `shape` is the whole tensor's."""
    t, size = comm.rank, comm.size
    if size == 1:
        return []
    name = key.rsplit(".", 1)[0]
    if key in ("tok_emb.weight", "head.weight"):
        lo, hi = shard_bounds(shape[0], size)[t]
        return [(0, lo, 0, hi - lo)]
    if name.endswith("attn.qkv"):
        dim = shape[0] // 3
        h0, h1 = shard_bounds(heads, size)[t]
        hd = dim // heads
        width = (h1 - h0) * hd
        return [(0, j * dim + h0 * hd, j * width, width) for j in range(3)]
    if name.endswith("attn.proj") and key.endswith("weight"):
        dim = shape[1]
        h0, h1 = shard_bounds(heads, size)[t]
        return [(1, h0 * (dim // heads), 0, (h1 - h0) * (dim // heads))]
    if name.endswith(".fc"):
        lo, hi = shard_bounds(shape[0], size)[t]
        return [(0, lo, 0, hi - lo)]
    if name.endswith(".proj") and key.endswith("weight"):  # the MLP's second layer: its input features
        lo, hi = shard_bounds(shape[1], size)[t]
        return [(1, lo, 0, hi - lo)]
    return []
