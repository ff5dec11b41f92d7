"""Language models: a small decoder-only transformer (`GPT`), its spec, its FLOP count, and the device's peak.

`GPT` is GPT-2's architecture read top to bottom, nothing more: token plus learned position embeddings,
`layers` pre-norm blocks (LayerNorm -> causal self-attention -> residual; LayerNorm -> 4x GELU MLP ->
residual), a final LayerNorm and an output head whose weight IS the token embedding (tied: one tensor, so
one gradient and one allreduce). Attention is `scaled_dot_product_attention(is_causal=True)`, which picks a
fused kernel where the device has one. Weights are initialized as GPT-2's: normal(0, 0.02), and the two
projections that write into the residual stream scaled by 1/sqrt(2 * layers), so the stream's variance
does not grow with depth.

A language model maps int64 tokens (B, T), T <= seq_len, to logits (B, T, vocab_size). Specs (`build_lm`):
`gpt` or `gpt:layers=L,dim=D,heads=H,dropout=P` (any of the keys, any order), `module.path:factory` or
`path/to/file.py:factory` with `factory(seq_len, vocab_size) -> nn.Module`.

`flops_per_token` is the training cost per token that model FLOPs utilization (MFU) divides by time, and
`measure_peak_flops` the denominator: what this device's matmuls reach, measured, not read off a data sheet.
Unlike `models`, this module imports torch when imported (its classes are torch modules): the CLI imports it
only inside the commands that need it.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..base.errors import ConfigError
from .models import load_factory

GPT_DEFAULTS: dict[str, Any] = {"layers": 2, "dim": 128, "heads": 4, "dropout": 0.0}
GPT_EXAMPLE = "gpt:layers=6,dim=384,heads=6,dropout=0.1"
LM_SPECS = ("gpt", "gpt:layers=L,dim=D,heads=H,dropout=P", "module.path:factory", "path/to/file.py:factory")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees positions <= t only."""

    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(dim, 3 * dim)  # q, k and v of every head in one matmul
        self.proj = nn.Linear(dim, dim)  # writes into the residual stream
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        # (B, T, 3 * C) -> three (B, heads, T, C / heads)
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class Block(nn.Module):
    """One pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, dropout)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.proj = nn.Linear(4 * dim, dim)  # writes into the residual stream
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.proj(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    """A decoder-only transformer: int64 tokens (B, T), T <= seq_len -> logits (B, T, vocab_size)."""

    def __init__(self, vocab_size: int, seq_len: int, layers: int = 2, dim: int = 128, heads: int = 4,
                 dropout: float = 0.0):
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("seq_len", seq_len), ("layers", layers), ("dim", dim),
                            ("heads", heads)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"GPT {name} {value!r} must be a whole number of at least 1, e.g. {GPT_EXAMPLE}")
        if dim % heads:
            raise ConfigError(f"GPT dim {dim} is not divisible by heads {heads}: each head takes dim / heads "
                              f"channels, e.g. {GPT_EXAMPLE}")
        if not 0 <= dropout < 1:
            raise ConfigError(f"GPT dropout {dropout!r} must be in [0, 1), e.g. {GPT_EXAMPLE}")
        self.vocab_size, self.seq_len, self.layers, self.dim, self.heads = vocab_size, seq_len, layers, dim, heads
        self.tok_emb = nn.Embedding(vocab_size, dim)
        self.pos_emb = nn.Embedding(seq_len, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: the same Parameter, not a copy
        self.apply(self._init)
        for block in self.blocks:
            for proj in (block.attn.proj, block.proj):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[-1]
        if t > self.seq_len:
            raise ValueError(f"GPT got {t} tokens per row, more than its seq_len {self.seq_len}: crop the context")
        x = self.drop(self.tok_emb(tokens) + self.pos_emb.weight[:t])
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def num_params(self, *, positions: bool = False) -> int:
        """Parameters, the tied embedding/head counted once; without the position embeddings unless
        `positions` (they cost no matmul, so `flops_per_token` leaves them out)."""
        n = sum(p.numel() for p in self.parameters())  # parameters() yields a shared tensor once
        return n if positions else n - self.pos_emb.weight.numel()


def parse_gpt_spec(spec: str) -> dict[str, Any]:
    """The GPT keyword arguments of `gpt` or `gpt:layers=L,dim=D,heads=H,dropout=P` (any subset, any order;
    the rest default to layers=2, dim=128, heads=4, dropout=0). Raises ConfigError quoting the spec."""
    head, sep, rest = spec.partition(":")
    if head != "gpt":
        raise ConfigError(f"model {spec!r} is not a gpt spec: write gpt or e.g. {GPT_EXAMPLE}")
    opts = dict(GPT_DEFAULTS)
    seen: set[str] = set()
    for part in rest.split(",") if sep else []:
        key, eq, value = (s.strip() for s in part.partition("="))
        if key not in GPT_DEFAULTS or not eq:
            raise ConfigError(f"unknown option {part!r} in model {spec!r}: gpt takes "
                              f"{', '.join(f'{k}=' for k in GPT_DEFAULTS)} e.g. {GPT_EXAMPLE}")
        if key in seen:
            raise ConfigError(f"{key} is given twice in model {spec!r}: give each once, e.g. {GPT_EXAMPLE}")
        seen.add(key)
        if key == "dropout":
            try:
                opts[key] = float(value)
            except ValueError:
                raise ConfigError(f"dropout {value!r} in model {spec!r} must be a number in [0, 1), "
                                  f"e.g. {GPT_EXAMPLE}") from None
            if not 0 <= opts[key] < 1:
                raise ConfigError(f"dropout {value!r} in model {spec!r} must be in [0, 1), e.g. {GPT_EXAMPLE}")
        elif not value.isdigit() or int(value) < 1:
            raise ConfigError(f"{key} {value!r} in model {spec!r} must be a whole number of at least 1, "
                              f"e.g. {GPT_EXAMPLE}")
        else:
            opts[key] = int(value)
    if opts["dim"] % opts["heads"]:
        raise ConfigError(f"dim {opts['dim']} in model {spec!r} is not divisible by heads {opts['heads']}: "
                          f"each head takes dim / heads channels, e.g. {GPT_EXAMPLE}")
    return opts


def build_lm(spec: str, seq_len: int, vocab_size: int) -> nn.Module:
    """The language model for `spec` (see the module docstring); raises ConfigError for an unknown or broken
    spec. A factory is called as `factory(seq_len, vocab_size)` and must return an nn.Module."""
    if spec == "gpt" or spec.startswith("gpt:"):
        return GPT(vocab_size, seq_len, **parse_gpt_spec(spec))
    if spec.split(":")[0] in ("mlp", "cnn"):
        raise ConfigError(f"--model {spec} is a classifier, and this data is token shards (a language model's): "
                          "token shards need `--model gpt` (or gpt:layers=L,dim=D,heads=H) or a factory "
                          "module.path:factory / path/to/file.py:factory")
    if ":" not in spec:
        raise ConfigError(f"unknown language model {spec!r}: use one of {', '.join(LM_SPECS)}")
    model = load_factory(spec, known="gpt, gpt:layers=L,dim=D,heads=H,dropout=P",
                         signature="(seq_len, vocab_size)")(int(seq_len), int(vocab_size))
    if not isinstance(model, nn.Module):
        raise ConfigError(f"the factory of --model {spec!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def flops_per_token(n_params: int, layers: int, dim: int, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward) of a decoder-only transformer:

        6 * N + 12 * layers * dim * seq_len

    N is the parameter count without the position embeddings (a lookup, no matmul); a tied embedding/head
    counts once, as the head's matmul. 6 * N: every weight does one multiply-add (2 FLOPs) per token in the
    forward pass and two in the backward pass (gradients of the input and of the weight). 12 * layers * dim *
    seq_len: attention's own matmuls, QK^T and AV, 2 * 2 * seq_len * dim per token and layer forward, times 3
    with backward; counted over the whole context, as if not causal, by convention, so MFU figures compare
    across codebases. Source: PaLM (Chowdhery et al., 2022, appendix B, "6N + 12LHQT" with H * Q = dim),
    as nanoGPT's `estimate_mfu` uses it; Kaplan et al. (2020, section 2.1) derive the 6N term."""
    return 6 * int(n_params) + 12 * int(layers) * int(dim) * int(seq_len)


def model_flops_per_token(model: GPT, seq_len: int | None = None) -> int:
    """`flops_per_token` of a GPT instance, over `seq_len` tokens of context (default: its own seq_len)."""
    return flops_per_token(model.num_params(), model.layers, model.dim, model.seq_len if seq_len is None else seq_len)


def measure_peak_flops(device: str | torch.device = "cpu", *, dtype: torch.dtype = torch.float32,
                       seconds: float = 0.5) -> float:
    """The matmul FLOP/s this device reaches, measured: the MFU denominator.

    Square matmuls of `dtype`, their size doubled from n = 128 while one takes under 5 ms, up to n = 1024 on a
    CPU and 8192 on a GPU (big enough to run at the device's matmul rate; a dtype the device computes slowly,
    fp16 on most CPUs, stops small instead of taking seconds per matmul); one warm-up, then timed repeats for
    about `seconds` (at least 3); the median of 2 * n^3 / time. Measure once per run: it takes the device for
    that long."""
    device = torch.device(device)
    largest = 1024 if device.type == "cpu" else 8192
    gen = torch.Generator().manual_seed(0)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed() -> float:
        sync()
        start = time.perf_counter()
        torch.mm(a, b)
        sync()
        return time.perf_counter() - start

    n = 128
    while True:
        a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
        b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
        timed()  # warm-up: kernel selection, thread pool start, caches
        if n >= largest or timed() >= 0.005:
            break
        n *= 2
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 100):
        times.append(timed())
    return 2 * n**3 / statistics.median(times)
