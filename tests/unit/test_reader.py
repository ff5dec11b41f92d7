"""The per-rank reader: exactly once per epoch, equal step counts, deterministic order, exact resume."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hpctrain.base.config import ShardConfig
from hpctrain.data.reader import ShardReader
from hpctrain.base.errors import ConfigError
from hpctrain.data.shardformat import load_manifest
from hpctrain.data.sharding import shard


@pytest.fixture(scope="module")
def uneven(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("u") / "d"
    # 4 train shards of 9, 10, 10, 10 samples
    shard(ShardConfig(source="synthetic:39:5:3", out=out, shards=4, val_fraction=0), show_progress=False)
    return out


@pytest.fixture(scope="module")
def bigger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("b") / "d"
    shard(ShardConfig(source="synthetic:5003:4:3", out=out, shards=4, val_fraction=0), show_progress=False)
    return out


def epoch_ids(data: Path, world: int, epoch: int, **kw) -> list[np.ndarray]:
    shardset = load_manifest(data)
    ids = []
    for rank in range(world):
        r = ShardReader(shardset, "train", rank=rank, world=world, **kw)
        ids.append(np.concatenate([b.index for b in r.epoch(epoch)]))
        r.close()
    return ids


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("shuffle", [True, False])
def test_every_sample_once_per_epoch(bigger: Path, world: int, shuffle: bool) -> None:
    for epoch in (0, 1):
        ids = np.concatenate(epoch_ids(bigger, world, epoch, batch_size=64, shuffle=shuffle, seed=3, block_rows=100,
                                       window_rows=700))
        assert len(ids) == 5003 and len(np.unique(ids)) == 5003


def test_equal_steps_on_uneven_shards(uneven: Path) -> None:
    shardset = load_manifest(uneven)
    readers = [ShardReader(shardset, "train", rank=r, world=2, batch_size=4) for r in range(2)]
    assert list(readers[0].counts) == [19, 20]
    assert readers[0].steps_per_epoch == readers[1].steps_per_epoch == 5
    sizes = [[len(b.y) for b in r.epoch(0)] for r in readers]
    assert sizes == [[4, 4, 4, 4, 3], [4, 4, 4, 4, 4]]
    assert list(readers[1].step_sizes(4)) == [3, 4]


def test_shuffle_is_a_function_of_seed_epoch_rank_world(bigger: Path) -> None:
    a = epoch_ids(bigger, 2, 0, batch_size=32, seed=1)
    assert all(np.array_equal(x, y) for x, y in zip(a, epoch_ids(bigger, 2, 0, batch_size=32, seed=1)))
    assert not np.array_equal(a[0], epoch_ids(bigger, 2, 1, batch_size=32, seed=1)[0])
    assert not np.array_equal(a[0], epoch_ids(bigger, 2, 0, batch_size=32, seed=2)[0])


def test_no_shuffle_walks_shards_in_file_order(bigger: Path) -> None:
    shardset = load_manifest(bigger)
    import h5py

    expected = np.concatenate([h5py.File(f.path, "r")["index"][()] for f in shardset.rank_shards("train", 1, 2)])
    got = np.concatenate([b.index for b in ShardReader(shardset, "train", rank=1, world=2, batch_size=50,
                                                       shuffle=False).epoch(0)])
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("shuffle", [True, False])
def test_resume_mid_epoch_replays_the_rest(bigger: Path, shuffle: bool) -> None:
    shardset = load_manifest(bigger)
    r = ShardReader(shardset, "train", rank=0, world=2, batch_size=64, shuffle=shuffle, block_rows=128, window_rows=512)
    full = [b.index for b in r.epoch(2)]
    tail = [b.index for b in r.epoch(2, start_step=7)]
    assert len(tail) == len(full) - 7
    assert all(np.array_equal(a, b) for a, b in zip(full[7:], tail))
    np.testing.assert_array_equal(np.sort(np.concatenate(full[:7])), np.sort(r.consumed(2, 7)))  # the same samples


def test_world_must_divide_shards(uneven: Path) -> None:
    with pytest.raises(ConfigError, match="ranks cannot share them evenly"):
        ShardReader(load_manifest(uneven), "train", rank=0, world=3, batch_size=4)


def test_corrupt_chunk_names_file_and_chunk(tmp_path: Path) -> None:
    from hpctrain.base.errors import DataError

    out = tmp_path / "d"
    shard(ShardConfig(source="synthetic:4000:16:3", out=out, shards=1, val_fraction=0, chunk_rows=500),
          show_progress=False)
    path = out / "train" / "shard-00000-of-00001.h5"
    import h5py

    with h5py.File(path, "r") as h5:
        offset = h5["x"].id.get_chunk_info(3).byte_offset  # the 4th chunk of x
    with open(path, "r+b") as fh:
        fh.seek(offset + 100)
        fh.write(b"\xff" * 16)
    reader = ShardReader(load_manifest(out), "train", rank=0, world=1, batch_size=256, shuffle=False, prefetch=0)
    with pytest.raises(DataError, match=r"chunk 3 of .x.. of shard .*shard-00000-of-00001.h5") as err:
        for _ in reader.epoch(0):
            pass
    assert "hpctrain verify" in str(err.value)


def test_forked_reader_opens_its_own_handles(bigger: Path) -> None:
    import os

    r = ShardReader(load_manifest(bigger), "train", rank=0, world=1, batch_size=100, shuffle=False, prefetch=0)
    first = next(iter(r.epoch(0))).index
    pid = os.fork()
    if pid == 0:  # the child reads through fresh handles and reports by exit code
        ok = np.array_equal(next(iter(r.epoch(0))).index, first) and all(h.id.valid for h in r._handles.values())
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert np.array_equal(next(iter(r.epoch(0))).index, first)


@pytest.mark.parametrize("shuffle", [True, False])
def test_elastic_rest_of_epoch_on_another_world_size(bigger: Path, shuffle: bool) -> None:
    from hpctrain.data.reader import epoch_remainder

    shardset = load_manifest(bigger)
    kw = dict(batch_size=64, shuffle=shuffle, seed=5)
    # 4 ranks train 9 steps of epoch 3, then 2 ranks 5 steps, then 1 rank finishes the epoch
    done = epoch_remainder(shardset, "train", [(4, 9), (2, 5)], epoch=3, **kw)
    assert len(done) == 4 * 9 * 64 + 2 * 5 * 64 and len(np.unique(done)) == len(done)
    rest = ShardReader(shardset, "train", rank=0, world=1, exclude=done, segment=2, **kw)
    tail = np.concatenate([b.index for b in rest.epoch(3)])
    everything = np.concatenate([done, tail])
    assert len(everything) == 5003 and len(np.unique(everything)) == 5003
    # a resume inside the remainder on the same world size replays it exactly
    again = ShardReader(shardset, "train", rank=0, world=1, exclude=done, segment=2, **kw)
    part = [b.index for b in again.epoch(3, start_step=3)]
    np.testing.assert_array_equal(np.concatenate(part), tail[3 * 64:])


def test_window_buffers_are_reused_once_free_never_while_a_batch_may_still_come_from_them(bigger: Path) -> None:
    shardset = load_manifest(bigger)
    one = ShardReader(shardset, "train", rank=0, world=1, batch_size=64, seed=1)  # one window holds all 5003 rows
    for epoch in range(4):
        assert sorted(np.concatenate([b.index for b in one.epoch(epoch)])) == list(range(5003))
    assert len(one._pool) == 1  # every epoch read into the first epoch's buffer (fresh memory costs more than a read)
    one.close()
    many = ShardReader(shardset, "train", rank=0, world=1, batch_size=64, seed=1, block_rows=100, window_rows=700)
    for epoch in range(3):  # eight windows an epoch, read ahead while batches straddle two: none overwritten early
        batches = list(many.epoch(epoch))
        assert sorted(np.concatenate([b.index for b in batches])) == list(range(5003))
        x = np.concatenate([b.x for b in batches])
        assert np.array_equal(x, shardset_x(bigger)[np.concatenate([b.index for b in batches])])
    assert 2 <= len(many._pool) <= 5
    many.close()


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_split_one_window_holds_is_read_once_and_every_epoch_gives_a_fresh_reads_batches(bigger: Path,
                                                                                           shuffle: bool) -> None:
    """When one window holds the rank's whole split, later epochs gather from the rows read at the first (held)
    instead of re-reading them in another block order; every batch is still the one a fresh read gives, row for row
    (the sums of a step, and so exact resume, depend on the order inside a batch)."""
    shardset = load_manifest(bigger)
    kw = dict(rank=1, world=2, batch_size=48, seed=5, shuffle=shuffle, block_rows=100)  # 26 blocks, one window
    held = ShardReader(shardset, "train", **kw)
    reads = []
    read = held._read
    held._read = lambda blocks, **k: reads.append(len(blocks)) or read(blocks, **k)
    for epoch, start in ((0, 0), (1, 0), (2, 5), (3, 0)):
        fresh = ShardReader(shardset, "train", **kw)
        for a, b in zip(held.epoch(epoch, start), fresh.epoch(epoch, start), strict=True):
            for name in ("index", "x", "y"):
                np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        fresh.close()
    assert reads == [26]  # the first epoch read the rank's 26 blocks; no epoch after it read again
    held.close()


def shardset_x(data: Path) -> np.ndarray:
    """Every sample's features by global id, read straight from the shard files (normalized as the reader does)."""
    import h5py

    shardset = load_manifest(data)
    rows = {}
    for f in shardset.rank_shards("train", 0, 1):
        with h5py.File(f.path, "r", locking=False) as h5:
            for i, x in zip(h5["index"][()], h5["x"][()]):
                rows[int(i)] = x
    x = np.stack([rows[i] for i in range(len(rows))])
    return shardset.normalize_on_read(x)
