"""`hpctrain generate`: text from a trained language model, in one process (no MPI).

Everything needed to rebuild the model is already beside the run: RUN/config.toml names the model spec and
the data directory, the data's manifest gives seq_len, vocab_size and the tokenizer (`bytes`, or the
tokenizer.json stored in the data directory, checked against the manifest's sha256), and RUN/model.pt holds
the weights (read with `weights_only=True`: no code in the file is run).

Sampling is the plain autoregressive loop: one forward pass per new token over the last seq_len tokens,
logits divided by the temperature, optionally cut to the top k, one draw from a `torch.Generator` seeded
with `seed` (the same seed, model and prompt give the same text). There is no KV cache: for the small models
this trains, recomputing the context costs less than the code a cache would add.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..base.config import read_train_toml
from ..base.durable import sha256_file
from ..base.errors import CheckpointError, ConfigError, DataError
from ..data.shardformat import inside, load_manifest
from ..data.tokens import BYTES_SHA256, load_tokenizer


def check_sampling(tokens: int, temperature: float, top_k: int | None) -> None:
    """Raise ConfigError for a sampling setting that cannot work, naming it and a value that does."""
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ConfigError(f"--tokens {tokens!r} must be a whole number of at least 1, e.g. --tokens 200")
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature <= 0:
        raise ConfigError(f"--temperature {temperature!r} must be a number above 0, e.g. --temperature 0.8 "
                          "(lower: more predictable text)")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ConfigError(f"--top-k {top_k!r} must be a whole number of at least 1, e.g. --top-k 40, or left out")


def read_run(run_dir: Path) -> tuple[str, Path]:
    """(model spec, data directory) of a run, from RUN/config.toml."""
    path = run_dir / "config.toml"
    if not path.is_file():
        raise ConfigError(f"{str(path)!r} not found: is {str(run_dir)!r} a run directory written by `hpctrain train`?")
    try:
        config = read_train_toml(path.read_text())
    except (OSError, ValueError, ConfigError) as exc:
        raise ConfigError(f"{str(path)!r} is not valid TOML ({exc}); it is written by `hpctrain train`") from exc
    if not isinstance(config.get("model"), str) or not isinstance(config.get("data"), str):
        raise ConfigError(f"{str(path)!r} has no `model` or no `data`; it is written by `hpctrain train`")
    data = Path(config["data"])
    if not data.is_dir():
        raise DataError(f"the run's data directory {str(data)!r} (`data` in {str(path)!r}) is not here: generate "
                        "reads its manifest for seq_len and the tokenizer; run from where you trained, or fix `data`")
    return config["model"], data


def lm_tokenizer(root: Path, manifest: dict[str, Any]) -> Any:
    """The tokenizer the data was made with: `bytes`, or its tokenizer.json inside the data directory (a path
    that leads out of it is refused), which must still hash to the manifest's sha256."""
    entry = manifest.get("tokenizer") or {}
    if entry.get("name") == "bytes":
        if entry.get("sha256") != BYTES_SHA256:
            raise DataError(f"the bytes tokenizer in {str(root / 'manifest.json')!r} is another version of it; "
                            "re-create the data with this hpctrain's `hpctrain shard`")
        return load_tokenizer("bytes")
    rel = entry.get("file")
    if not isinstance(rel, str) or not rel:
        raise DataError(f"{str(root / 'manifest.json')!r} names tokenizer {entry.get('name')!r} but no tokenizer "
                        f"file inside {str(root)!r}; re-create the data with `hpctrain shard`, which stores the "
                        "tokenizer beside the shards")
    path = inside(root, rel)  # as every path a manifest names: relative, and never out of the data directory
    if not path.is_file():
        raise DataError(f"tokenizer file {str(path)!r} named by {str(root / 'manifest.json')!r} is missing; "
                        "copy it back or re-create the data with `hpctrain shard`")
    if sha256_file(path) != entry.get("sha256"):
        raise DataError(f"tokenizer file {str(path)!r} is not the one the data was made with (its sha256 "
                        "differs from the manifest's); restore it or re-create the data with `hpctrain shard`")
    return load_tokenizer(path)


def load_lm(run_dir: Path) -> tuple[Any, Any, int]:
    """(model in eval mode on the CPU, tokenizer, seq_len) of a finished language-model run."""
    import torch

    from ..compute.gpt import build_lm

    weights = run_dir / "model.pt"
    if not run_dir.is_dir():
        raise ConfigError(f"run directory {str(run_dir)!r} does not exist")
    if not weights.is_file():
        raise CheckpointError(f"{str(weights)!r} not found: train first (`hpctrain train --data DATA --run-dir "
                              f"{run_dir} --model gpt`); model.pt is written when training finishes")
    spec, data = read_run(run_dir)
    shardset = load_manifest(data)
    if shardset.task != "lm":
        raise ConfigError(f"run {str(run_dir)!r} is not a language model: its data {str(data)!r} holds samples "
                          f"and labels (task {shardset.task!r}), not tokens; generate needs a run trained on text "
                          "shards (`hpctrain shard text:FILE DATA`)")
    seq_len, vocab_size = shardset.seq_len, shardset.num_classes
    tokenizer = lm_tokenizer(shardset.root, shardset.manifest)
    model = build_lm(spec, seq_len, vocab_size)
    try:
        state = torch.load(weights, map_location="cpu", weights_only=True)
        model.load_state_dict(state)
    except Exception as exc:  # torch raises RuntimeError, pickle and zip errors alike
        raise CheckpointError(f"{str(weights)!r} does not load into --model {spec!r} with seq_len {seq_len} and "
                              f"vocab_size {vocab_size} ({type(exc).__name__}: {str(exc).splitlines()[0]}); was "
                              "config.toml edited after training?") from None
    return model.eval(), tokenizer, seq_len


def sample(model: Any, ids: Any, tokens: int, seq_len: int, *, temperature: float = 0.8, top_k: int | None = None,
           generator: Any = None) -> Any:
    """`tokens` new ids after the 1-D int64 tensor `ids`, drawn one at a time from the model's next-token
    distribution (context cropped to the last seq_len ids, logits / temperature, only the top_k kept)."""
    import torch

    seq = ids.reshape(1, -1)
    with torch.inference_mode():
        for _ in range(tokens):
            logits = model(seq[:, -seq_len:])[:, -1, :].float() / temperature
            if top_k is not None and top_k < logits.shape[-1]:
                kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
            seq = torch.cat([seq, nxt], dim=1)
    return seq[0, ids.numel():]


def generate(run_dir: Path | str, prompt: str, *, tokens: int = 200, temperature: float = 0.8,
             top_k: int | None = None, seed: int = 0) -> str:
    """The prompt followed by `tokens` tokens the run's model writes after it. An empty prompt starts a new
    document (the context is one end-of-text token). Raises ConfigError, DataError or CheckpointError."""
    import torch

    check_sampling(tokens, temperature, top_k)
    model, tokenizer, seq_len = load_lm(Path(run_dir))
    ids = torch.as_tensor(tokenizer.encode(prompt).astype("int64")) if prompt else torch.tensor([tokenizer.eot_id])
    generator = torch.Generator().manual_seed(int(seed))
    new = sample(model, ids, tokens, seq_len, temperature=temperature, top_k=top_k, generator=generator)
    return prompt + tokenizer.decode(new.numpy())
