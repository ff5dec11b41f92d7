"""A run's position in its data (data/position.py), the one `hpctrain train` and the library both keep: a batch
counts once it is handed out, a checkpoint's position resumes at the next batch, and on another world size the
rest of the epoch is every sample not yet trained on, once."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hpctrain.base.config import ShardConfig
from hpctrain.data.position import Cursor, Position
from hpctrain.data.reader import ShardReader
from hpctrain.data.shardformat import load_manifest
from hpctrain.data.sharding import shard


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("p") / "d"
    shard(ShardConfig(source="synthetic:203:4:3", out=out, shards=4, val_fraction=0), show_progress=False)
    return out


def cursors(data: Path, world: int, position: Position | None = None) -> list[Cursor]:
    shardset = load_manifest(data)
    return [Cursor(ShardReader(shardset, "train", rank=r, world=world, batch_size=8, seed=5), position)
            for r in range(world)]


def test_a_batch_counts_when_handed_out_and_the_last_one_starts_the_next_epoch(data: Path) -> None:
    """Before: the library counted a batch only when the next was asked for, so a checkpoint written after
    training on batch k resumed at batch k again."""
    (cursor,) = cursors(data, 1)
    batches = cursor.batches()
    next(batches)
    assert cursor.position == Position(0, 1) and cursor.meta(1)["segments"] == [(1, 1, 8)]
    for _ in range(cursor.steps - 2):
        next(batches)
    next(batches)  # the epoch's last batch, still being trained on
    assert cursor.epoch == 0 and cursor.position == Position(1)
    assert list(batches) == [] and (cursor.epoch, cursor.step) == (1, 0)
    cursor.close()


def test_the_rest_of_an_epoch_on_another_world_size_is_every_sample_not_yet_trained_on(data: Path) -> None:
    first = cursors(data, 2)
    seen = []
    for cursor in first:
        batches = cursor.batches()
        seen += [next(batches).index for _ in range(3)]
        batches.close()
    meta = {"world_size": 2, **first[0].meta(2)}
    for world in (1, 4):
        rest = cursors(data, world, Position.from_meta(meta, world, 8))
        assert all(c.position == Position(0, 0, [(2, 3, 8)]) for c in rest)
        ids = np.concatenate(seen + [b.index for c in rest for b in c.batches()])
        assert len(ids) == 203 and len(np.unique(ids)) == 203, world
        assert all(c.epoch == 1 and c.prior == [] for c in rest)
        for c in rest:
            c.close()
    for c in first:
        c.close()


def test_steps_to_counts_the_rest_of_the_epoch_then_whole_ones(data: Path) -> None:
    (whole,), (mid,) = cursors(data, 1), cursors(data, 1, Position(1, 2))
    assert mid.steps_to(3) == whole.steps - 2 + whole.steps and mid.steps_to(1) == 0
    whole.close()
    mid.close()
