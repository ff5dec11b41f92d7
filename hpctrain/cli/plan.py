"""`hpctrain plan`: the memory each rank will hold, per ZeRO stage, before the job runs."""

from __future__ import annotations

import json
from typing import Annotated, Any, Optional

import typer

from ..base.config import TRAIN_SECTIONS, section_panels, sections_of
from ..base.sections import (CommConfig, ModelConfig, OptimizerConfig, PrecisionConfig, ZeroConfig, check_batch_size,
                             train_options)
from .common import handle_errors
from .options import config_parameters, with_signature

# the options `plan` shares with `train`: generated from the same sections' fields (name, help, check), with the
# plan's own defaults (--zero left out: every stage is shown; adam, the optimizer that holds the most)
TRAINING_OPTIONS = ("model", "data", "zero", "optimizer", "precision", "batch_size", "bucket_mb")


@handle_errors
def plan(
    world: Annotated[int, typer.Option(help="Ranks of the job.", min=1)] = 1,
    seq_len: Annotated[Optional[int], typer.Option(help="Tokens per row: a language model (gpt specs are one; "
                                                   "default 128 for them).", min=1)] = None,
    input_dim: Annotated[int, typer.Option(help="Features per sample of a classifier (without --data).", min=1)] = 784,
    classes: Annotated[int, typer.Option(help="Classes of a classifier; a language model's vocabulary "
                                         "(without --data: 10, or 257 for a language model).", min=0)] = 0,
    memory: Annotated[Optional[str], typer.Option(help="Memory per rank, e.g. 80GiB: say which stages fit on "
                                                  "--world ranks, and the fewest ranks each stage fits on.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object instead of the table.")] = False,
    **values: Any,
) -> None:
    """Bytes per rank of parameters, gradients, optimizer state, gathered parameters (ZeRO 3) and activations at
    each ZeRO stage, from the model's real buckets (built on the meta device: no memory), and the peak a rank
    reaches with its runtime. `train` logs the same plan at start-up and warns when its peak departs from it.
    With --data the plan takes the shards' sample shape, classes, vocabulary and seq_len instead of the
    defaults, and counts what a rank's reader holds; --zero marks the stage you plan (all four are shown).

    Example: hpctrain plan --model gpt:layers=24,dim=1024,heads=16 --world 4 --optimizer adam --precision bf16 --batch-size 8 --seq-len 1024 --memory 24GiB
    """
    from ..control.plan import table

    s = sections_of(values)  # each section checks its own values, as `train` does
    zero = ZeroConfig(**s["zero"]).stage if values["zero"] is not None else None
    optimizer, precision = OptimizerConfig(**s["optimizer"]).name, PrecisionConfig(**s["precision"]).compute
    bucket_mb, model = CommConfig(**s["communication"]).bucket_mb, ModelConfig(**s["model"]).spec
    check_batch_size(values["batch_size"])
    result = table(model, world=world, zero=zero, optimizer=optimizer, precision=precision,
                   batch_size=values["batch_size"], seq_len=seq_len, data=values["data"], input_dim=input_dim,
                   classes=classes, bucket_mb=bucket_mb, memory=memory)
    print(json.dumps(result["json"]) if as_json else result["text"])


with_signature(plan, config_parameters(train_options(TRAINING_OPTIONS), panels=section_panels(TRAIN_SECTIONS),
                                       defaults={"zero": None, "optimizer": "adam", "batch_size": 64, "data": None}))
