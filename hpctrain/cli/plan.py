"""`hpctrain plan`: the memory each rank will hold, per ZeRO stage, before the job runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import handle_errors


@handle_errors
def plan(
    model: Annotated[str, typer.Option(help="Model spec, as train's --model: mlp:H1,H2,..., cnn, gpt:layers=L,dim=D,"
                                       "heads=H, module.path:factory or file.py:factory.")] = "mlp",
    world: Annotated[int, typer.Option(help="Ranks of the job.", min=1)] = 1,
    zero: Annotated[Optional[int], typer.Option(help="The ZeRO stage you plan (0-3); all four are shown.",
                                                min=0, max=3)] = None,
    optimizer: Annotated[str, typer.Option(help="sgd (with momentum), adam or adamw.")] = "adam",
    precision: Annotated[str, typer.Option(help="fp32, bf16 or fp16 (autocast: weights stay fp32).")] = "fp32",
    batch_size: Annotated[int, typer.Option(help="Samples (token rows) per rank per micro-batch.", min=1)] = 64,
    seq_len: Annotated[Optional[int], typer.Option(help="Tokens per row: a language model (gpt specs are one; "
                                                   "default 128 for them).", min=1)] = None,
    data: Annotated[Optional[Path], typer.Option(help="Sharded data (hpctrain shard): its sample shape, classes, "
                                                 "vocabulary and seq_len instead of the defaults below, and what "
                                                 "its reader holds per rank in the peak.")] = None,
    input_dim: Annotated[int, typer.Option(help="Features per sample of a classifier (without --data).", min=1)] = 784,
    classes: Annotated[int, typer.Option(help="Classes of a classifier; a language model's vocabulary "
                                         "(without --data: 10, or 257 for a language model).", min=0)] = 0,
    bucket_mb: Annotated[float, typer.Option(help="As train's --bucket-mb.")] = 25.0,
    memory: Annotated[Optional[str], typer.Option(help="Memory per rank, e.g. 80GiB: say which stages fit on "
                                                  "--world ranks, and the fewest ranks each stage fits on.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object instead of the table.")] = False,
) -> None:
    """Bytes per rank of parameters, gradients, optimizer state, gathered parameters (ZeRO 3) and activations at
    each ZeRO stage, from the model's real buckets (built on the meta device: no memory), and the peak a rank
    reaches with its runtime. `train` logs the same plan at start-up and warns when its peak departs from it.

    Example: hpctrain plan --model gpt:layers=24,dim=1024,heads=16 --world 4 --optimizer adam --precision bf16 --batch-size 8 --seq-len 1024 --memory 24GiB
    """
    from ..control.plan import table

    result = table(model, world=world, zero=zero, optimizer=optimizer, precision=precision, batch_size=batch_size,
                   seq_len=seq_len, data=data, input_dim=input_dim, classes=classes, bucket_mb=bucket_mb,
                   memory=memory)
    print(json.dumps(result["json"]) if as_json else result["text"])
