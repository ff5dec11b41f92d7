"""`hpctrain generate`: continue a prompt with a trained language model (one process, no MPI)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import handle_errors


@handle_errors
def generate(
    run: Annotated[Path, typer.Argument(help="Run directory of a finished language-model run (`hpctrain train "
                                        "--run-dir`, on text shards).", metavar="RUN", show_default=False)],
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="The text to continue (empty: start a new "
                                        "document).")] = "",
    tokens: Annotated[int, typer.Option("--tokens", "-n", help="How many tokens to generate.")] = 200,
    temperature: Annotated[float, typer.Option("--temperature", "-t", help="Divides the logits: below 1 more "
                                               "predictable text, above 1 more varied.")] = 0.8,
    top_k: Annotated[Optional[int], typer.Option("--top-k", help="Sample among the K likeliest tokens only "
                                                 "(default: all).", show_default=False)] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the sampling: the same seed gives the same "
                                      "text.")] = 0,
) -> None:
    """Print the prompt followed by the model's continuation.

    Reads RUN/config.toml, the data's manifest (seq_len, tokenizer) and RUN/model.pt; samples on the CPU.

    Example: hpctrain generate runs/tiny --prompt "Once upon a time" --tokens 300 --temperature 0.7 --top-k 40
    """
    from ..tools.generate import generate as run_generate

    print(run_generate(run, prompt, tokens=tokens, temperature=temperature, top_k=top_k, seed=seed), flush=True)
