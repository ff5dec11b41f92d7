"""What a language-model run adds to the trainer: the model built from the data's vocabulary and sequence
length, the targets per row, and the figures of `train`'s metrics that only a token stream has.

A run is a language model when its data is (`ShardSet.task == "lm"`, written by `hpctrain shard text:...`):
each row of seq_len + 1 tokens gives seq_len next-token targets, so the loss and the mean gradient are per
target token, `tokens_per_s` is rows per second times seq_len, and

- MFU (model FLOPs utilization) = tokens_per_s x training FLOPs per token / the peak FLOP/s of every rank's
  device together. FLOPs per token come from the model (`compute.gpt.flops_per_token`: 6 N + 12 L d T for
  the built-in GPT; 6 N for a user's model, whose attention hpctrain cannot see); the peak is measured at
  start-up by each rank with a matmul in the run's precision (all ranks at once, as they will train, and
  without a time budget: on a loaded node it takes what it takes) and summed. Both inputs are in
  summary.json.
- bits per byte of the validation text = val_loss (nats per token) x the split's tokens / its text bytes
  / ln 2, from the manifest's counts: comparable across tokenizers, unlike the loss per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..comm.wire import torch_dtype
from ..compute.models import build_model
from ..data.shardformat import ShardSet
from .watchdog import waiting, working


def build(spec: str, shardset: ShardSet) -> Any:
    """The model of `spec` (--model) for this data: a classifier of its samples, or a language model of its
    tokens."""
    if shardset.task != "lm":
        return build_model(spec, shardset.x_shape, shardset.num_classes)
    from ..compute.gpt import build_lm

    return build_lm(spec, shardset.seq_len, shardset.num_classes)


@dataclass(frozen=True, slots=True)
class Rates:
    """How a run's sample counts become its token figures (targets 1 and no flops for a classifier)."""

    targets: int = 1  # targets per sample: seq_len for token rows
    flops_per_token: float = 0.0
    peak_flops: float = 0.0  # every rank's measured peak, summed
    tokens_per_byte: float = 0.0  # of the validation text

    def extra(self, samples_per_s: float) -> dict[str, float]:
        """tokens_per_s and mfu of a logged window (nothing for a classifier)."""
        if self.targets == 1 and not self.flops_per_token:
            return {}
        tokens = samples_per_s * self.targets
        return {"tokens_per_s": tokens, "mfu": tokens * self.flops_per_token / self.peak_flops if self.peak_flops else 0.0}

    def summary(self, samples_per_s: float, last_val: dict[str, float]) -> dict[str, Any]:
        """A language model's figures for summary.json: tokens/s, MFU and both of its inputs, perplexity, bits
        per byte (nothing for a classifier)."""
        if self.targets == 1:
            return {}
        return {**self.extra(samples_per_s), "flops_per_token": self.flops_per_token, "peak_flops": self.peak_flops,
                "seq_len": self.targets, **{k: last_val.get(k) for k in ("val_perplexity", "val_bits_per_byte")}}

    def validation(self, val: dict[str, float]) -> dict[str, float]:
        """Perplexity and bits per byte beside a language model's val_loss."""
        if self.targets == 1 or "val_loss" not in val:
            return {}
        out = {"val_perplexity": math.exp(min(val["val_loss"], 700.0))}
        if self.tokens_per_byte:
            out["val_bits_per_byte"] = val["val_loss"] * self.tokens_per_byte / math.log(2)
        return out


def rates(precision: str, shardset: ShardSet, model: Any, comm: Any, device: Any, *,
          flops: float | None = None, watchdog: Any = None) -> Rates:
    """The Rates of this run (`precision`: --precision); for a language model every rank measures its peak
    matmul FLOP/s now (collective; `watchdog` names its waits). `flops`: the whole model's FLOPs per token,
    where `model` is a part of it (a pipeline stage)."""
    if shardset.task != "lm":
        return Rates()
    fpt, peak = flops_and_peak(model, shardset.seq_len, comm, device, precision, watchdog=watchdog)
    fpt = flops if flops is not None else fpt
    val = shardset.manifest.get("splits", {}).get("val", {})
    per_byte = val.get("tokens", 0) / val["text_bytes"] if val.get("text_bytes") else 0.0
    return Rates(targets=shardset.seq_len, flops_per_token=fpt, peak_flops=peak, tokens_per_byte=per_byte)


def flops_and_peak(model: Any, seq_len: int, comm: Any, device: Any, precision: str,
                   watchdog: Any = None) -> tuple[float, float]:
    """(training FLOPs per token of `model`, the peak FLOP/s of every rank's device in `precision`, summed):
    the two inputs of MFU. Every rank measures at once, as they will train (collective).

    Measuring is each rank's own work, and a loaded node slows it as much as the load likes: it is no wait
    on the other ranks (the watchdog sees the rank computing), and the sum after it, which waits for the
    slowest measurement, has no budget. A rank that dies meanwhile is still found: its heartbeat goes silent."""
    from ..compute.gpt import GPT, measure_peak_flops, model_flops_per_token

    if isinstance(model, GPT):
        fpt = model_flops_per_token(model, seq_len)
    else:  # a user's model: 6 N, its attention unseen
        fpt = 6 * sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    with waiting(watchdog, "start-up: the ranks meet to measure their peak FLOP/s together (language models)"):
        comm.barrier()
    with working(watchdog):  # inside a caller's wait too (a bench's start-up): this rank's own work, unwatched
        mine = measure_peak_flops(device, dtype=torch_dtype(precision), seconds=0.3)
    with waiting(watchdog, "start-up: summing the ranks' peak FLOP/s (no budget: a slow measurement is load, not a "
                 "hang)", budget=0):
        peak = float(comm.allreduce_array([mine])[0])
    return float(fpt), peak
