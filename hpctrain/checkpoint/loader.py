"""Opening a checkpoint for a resume: rank 0 reads the small files (meta.json, state.pt's trees and the index
of the pieces, ranks.pt) and broadcasts them; then every rank reads, through its own `boxes.Reader`, only
the byte ranges of what it will hold (`state.restore` asks for them): never the whole state on any rank.

A checkpoint of format 1 (written by earlier versions) is read whole by rank 0 and broadcast, as then, and
served from memory by the same reader interface (a sharded optimizer's slices joined into whole tensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..base.errors import CheckpointError, HpctrainError
from ..comm import full_state
from .boxes import MemoryReader, Reader
from .format import NAMED_FORMATS, split_named
from .manager import load_broadcast, read_trees, verify


@dataclass(slots=True)
class Loaded:
    """An opened checkpoint: its meta, the trees (tensors as references to names) and a reader of the names."""

    path: Path
    meta: dict[str, Any]
    model: dict[str, Any]
    train: dict[str, Any]
    ranks: list[Any]
    reader: Reader


def open_checkpoint(path: Path, comm: Any, *, verified: bool = False) -> Loaded:
    """Open the checkpoint at `path` on every rank of `comm` (collective): rank 0 verifies it (unless
    `verified`: it just did) and reads its small files, every rank gets them; no tensor is read yet."""
    path = Path(path)
    small, error = None, None
    if comm.rank == 0:
        try:
            meta = verify(path, hash_files=not verified)
            small = (meta, *read_trees(path)) if meta.get("format") in NAMED_FORMATS else None
        except HpctrainError as exc:
            error = exc
    comm.agree(error if comm.rank == 0 else None)
    small = comm.bcast(small)
    if small is None:  # format 1
        return _format1(path, load_broadcast(path, comm, verified=True))
    meta, tree, ranks = small
    return Loaded(path, meta, tree["model"], tree["train"], ranks, Reader(path, tree["index"]))


def _format1(path: Path, state: dict[str, Any]) -> Loaded:
    """A checkpoint of format 1, read whole, as format 2's trees over a reader of the tensors in memory."""
    if state["meta"].get("layout_free"):
        raise CheckpointError(f"checkpoint {str(path)!r} is a split run's of format 1, written by a development "
                            "version between issues 30 and 29 that no release had: resume it with that version, or "
                            "start a new --run-dir")
    train = dict(state["train"])
    owns = [r.get("own") or {} for r in state["ranks"]]
    if "zero" in train["optimizer"]:  # a sharded optimizer: its layout here, each rank's slices in its own state
        train["optimizer"] = full_state(train["optimizer"], [own.get("optimizer") for own in owns])
    model, tensors = split_named(state["model"], "model")
    train, more = split_named(train, "train")
    tensors.update(more)
    ranks = []
    for r, (rank_state, own) in enumerate(zip(state["ranks"], owns)):
        rank_state = {k: v for k, v in rank_state.items() if k != "own"}
        if own.get("compress") is not None:
            rank_state["compress"] = own["compress"]
        tree, more = split_named(rank_state, f"rank{r:05d}")
        ranks.append(tree)
        tensors.update(more)
    return Loaded(path, state["meta"], model, train, ranks, MemoryReader(path, tensors))
