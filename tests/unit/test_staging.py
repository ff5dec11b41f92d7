"""Node-local staging (--stage-to): the directory, the plan, copies verified against the manifest's sha256,
the free-space check, stops, re-use of kept copies, removal, and the CLI's errors. Real shard files on tmp_path;
a world of one (`Comm(None)`). The same under mpirun -n 2 through the trainer: tests/mpi/test_staging_mpi.py."""

from __future__ import annotations

import contextlib
import hashlib
import shutil
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from hpctrain.base.config import ShardConfig, TrainConfig
from hpctrain.base.durable import sha256_file
from hpctrain.base.errors import ConfigError, DataError
from hpctrain.base.rankenv import RankEnv, read_env
from hpctrain.base.stop import STOP_EXIT
from hpctrain.cli.main import app
from hpctrain.comm import Comm
from hpctrain.data import staging
from hpctrain.data.reader import ShardReader
from hpctrain.data.shardformat import MANIFEST, load_manifest
from hpctrain.data.sharding import shard

runner = CliRunner()


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("stg") / "d"
    shard(ShardConfig(source="synthetic:3000:16:3", out=out, shards=4, val_fraction=0.25), show_progress=False)
    return out


@pytest.fixture
def dest(tmp_path: Path) -> Path:
    d = tmp_path / "local"
    d.mkdir()
    return d


def make_plan(data: Path, dest: Path, rank: int = 0, world: int = 2, owner: str = "run-a") -> staging.StagePlan:
    return staging.plan(load_manifest(data), str(dest), RankEnv(), rank, world, owner=owner)


def test_the_environment_names_the_scratch_directories() -> None:
    env = read_env({"SLURM_TMPDIR": "/scratch/job", "TMPDIR": "/tmp/x"})
    assert (env.slurm_tmpdir, env.tmpdir) == ("/scratch/job", "/tmp/x")


def test_auto_prefers_slurm_tmpdir_then_tmpdir(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    assert staging.resolve_dir("auto", RankEnv(slurm_tmpdir=str(a), tmpdir=str(b))) == a
    assert staging.resolve_dir("auto", RankEnv(tmpdir=str(b))) == b
    assert staging.resolve_dir(str(b), RankEnv(slurm_tmpdir=str(a))) == b


def test_auto_without_either_variable_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"neither \$SLURM_TMPDIR nor \$TMPDIR is set.*--stage-to /tmp"):
        staging.resolve_dir("auto", RankEnv())


@pytest.mark.parametrize("stage_to", ["auto", "{tmp}/missing"])
def test_a_directory_that_does_not_exist_is_refused(tmp_path: Path, stage_to: str) -> None:
    env = RankEnv(tmpdir=str(tmp_path / "gone"))
    needle = r"--stage-to auto \(\$TMPDIR\) '.*gone' is not a directory" if stage_to == "auto" else "missing' is not a directory"
    with pytest.raises(ConfigError, match=needle):
        staging.resolve_dir(stage_to.format(tmp=tmp_path), env)


def test_the_plan_holds_this_ranks_files_of_both_splits(data: Path, dest: Path) -> None:
    shardset = load_manifest(data)
    plan = make_plan(data, dest, rank=1, world=2)
    assert [p.source for p in plan.files] == shardset.splits["train"][1::2] + shardset.splits["val"][1::2]
    tag = hashlib.sha256(b"run-a").hexdigest()[:8]
    assert plan.root == dest / f"hpctrain-{shardset.fingerprint[:12]}-{tag}" / "rank-00001"
    assert [p.copy.relative_to(plan.root).as_posix() for p in plan.files] == [
        p.source.path.relative_to(data.resolve()).as_posix() for p in plan.files]
    assert plan.size == sum(p.source.path.stat().st_size for p in plan.files)
    # another run of the same data stages elsewhere (neither removes the other's copies); another world size
    # stages that world's assignment
    assert make_plan(data, dest, rank=1, owner="run-b").root != plan.root
    assert [p.source for p in make_plan(data, dest, rank=1, world=4).files] == [
        shardset.splits["train"][1], shardset.splits["val"][1]]


def test_staged_copies_are_identical_and_read_the_same(data: Path, dest: Path) -> None:
    shardset = load_manifest(data)
    plan = make_plan(data, dest)
    assert staging.stage_files(plan) == (plan.size, plan.size)
    for p in plan.files:
        assert p.copy.read_bytes() == p.source.path.read_bytes()
    assert (plan.root / MANIFEST).read_bytes() == (data / MANIFEST).read_bytes()
    assert not list(plan.root.rglob(".*.part"))
    moved = staging.relocated(shardset, plan)
    assert moved.fingerprint == shardset.fingerprint
    assert [f.path for f in moved.rank_shards("train", 0, 2)] == [p.copy for p in plan.files[:2]]
    assert moved.rank_shards("train", 1, 2) == shardset.rank_shards("train", 1, 2)  # the other rank's: as they were
    for split in ("train", "val"):
        a, b = (ShardReader(s, split, rank=0, world=2, batch_size=64, seed=5) for s in (shardset, moved))
        for x, y in zip(a.epoch(1), b.epoch(1), strict=True):
            np.testing.assert_array_equal(x.x, y.x)
            np.testing.assert_array_equal(x.index, y.index)
        a.close(), b.close()


def test_a_copy_corrupted_on_the_way_is_detected(data: Path, dest: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A byte that arrives changed (a flaky read from the parallel filesystem) makes the copy's hash differ."""
    plan = make_plan(data, dest)
    read_piece = staging._read_piece

    def flipping(fh: object, buf: memoryview) -> int:
        n = read_piece(fh, buf)
        if n:
            buf[n // 2] ^= 0xFF
        return n

    monkeypatch.setattr(staging, "_read_piece", flipping)
    with pytest.raises(DataError, match=r"copy of .*shard-00000-of-00004.h5' staged to .*rank-00000/train/shard-00000-of-00004.h5' has sha256 .* the manifest says"):
        staging.stage_files(plan)
    assert not plan.files[0].copy.exists() and not list(plan.root.rglob(".*.part"))


def test_a_source_that_changed_since_shard_is_detected(data: Path, tmp_path: Path, dest: Path) -> None:
    changed = tmp_path / "changed"
    shutil.copytree(data, changed)
    victim = load_manifest(changed).splits["val"][0].path
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 1
    victim.write_bytes(raw)
    with pytest.raises(DataError, match="changed since `hpctrain shard` or the copy is corrupt"):
        staging.stage_files(make_plan(changed, dest))


@pytest.mark.parametrize("piece", [10_000, 1 << 20, 64 << 20])
def test_copies_of_any_piece_size_are_exact(data: Path, dest: Path, monkeypatch: pytest.MonkeyPatch, piece: int) -> None:
    """Many pieces, a few, or one: the bytes and the hash of the whole file."""
    monkeypatch.setattr(staging, "PIECE", piece)
    source = load_manifest(data).splits["train"][0]
    assert staging.copy_hashed(source.path, dest / "copy", lambda: False) == source.sha256
    assert (dest / "copy").read_bytes() == source.path.read_bytes()
    (dest / "empty").write_bytes(b"")
    assert staging.copy_hashed(dest / "empty", dest / "copy", lambda: False) == hashlib.sha256(b"").hexdigest()


def test_free_space_is_checked_first(data: Path, dest: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = make_plan(data, dest)
    assert staging.space_error(plan, Comm(None)) is None
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(staging.shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 100, 100))
    error = staging.space_error(plan, Comm(None))
    assert isinstance(error, DataError)
    assert f"--stage-to {str(dest)!r}" in str(error) and f"rank 0 needs {plan.size} bytes" in str(error)
    assert "only 100 bytes" in str(error)
    # copies kept from an earlier run need no new room
    staging.stage_files(plan)
    assert staging.space_error(plan, Comm(None)) is None


def test_a_stop_ends_staging_between_pieces(data: Path, dest: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staging, "PIECE", 4096)
    plan = make_plan(data, dest)
    calls = []

    def stopped() -> bool:
        calls.append(1)
        return len(calls) > 3  # during the first file (of many pieces)

    with pytest.raises(staging.StagingStopped, match="while staging the shards.*run the same command to continue") as info:
        staging.stage_files(plan, stopped)
    assert info.value.exit_code == STOP_EXIT
    assert len(calls) == 4 and not plan.files[0].copy.exists()
    staging.remove(plan)
    assert not plan.root.parent.exists()


def test_kept_copies_are_reused_when_they_verify(data: Path, dest: Path) -> None:
    plan = make_plan(data, dest)
    staging.stage_files(plan)
    stamps = [p.copy.stat().st_mtime_ns for p in plan.files]
    assert staging.stage_files(plan) == (plan.size, 0)
    assert [p.copy.stat().st_mtime_ns for p in plan.files] == stamps
    bad = plan.files[1].copy
    raw = bytearray(bad.read_bytes())
    raw[100] ^= 1
    bad.write_bytes(raw)
    assert staging.stage_files(plan) == (plan.size, plan.files[1].size)  # a copy that no longer verifies: copied again
    assert sha256_file(bad) == plan.files[1].source.sha256


def test_stage_removes_the_copies_when_the_run_ends(data: Path, dest: Path) -> None:
    shardset = load_manifest(data)
    plans = [make_plan(data, dest, rank=r) for r in (0, 1)]
    with contextlib.ExitStack() as stack:
        moved, staged = staging.stage(plans[0], shardset, Comm(None), keep=False, on_exit=stack.callback)
        staging.stage_files(plans[1])
        assert staged.files == 4 and staged.bytes == staged.copied == staged.total_bytes == plans[0].size
        assert staged.max_seconds == staged.seconds > 0
        assert all(p.copy.exists() for p in plans[0].files)
    assert not plans[0].root.exists() and plans[1].root.exists()  # only this rank's; the run's directory stays
    staging.remove(plans[1])
    assert list(dest.iterdir()) == []
    with contextlib.ExitStack() as stack:
        staging.stage(plans[0], shardset, Comm(None), keep=True, on_exit=stack.callback)
    assert all(p.copy.exists() for p in plans[0].files)


def test_a_copy_that_cannot_be_written_is_a_data_error(data: Path, dest: Path) -> None:
    plan = make_plan(data, dest)
    plan.root.parent.write_text("in the way")  # the run's directory under DIR cannot be made
    with contextlib.ExitStack() as stack, pytest.raises(DataError, match="staging to .* failed"):
        staging.stage(plan, load_manifest(data), Comm(None), keep=False, on_exit=stack.callback)


def test_config_checks() -> None:
    with pytest.raises(ConfigError, match="--stage-to '' must name a node-local directory"):
        TrainConfig.flat(data=Path("d"), run_dir=Path("r"), stage_to="")
    with pytest.raises(ConfigError, match="--keep-staged keeps the copies that --stage-to makes"):
        TrainConfig.flat(data=Path("d"), run_dir=Path("r"), keep_staged=True)
    assert TrainConfig.flat(data=Path("d"), run_dir=Path("r"), stage_to="auto", keep_staged=True).data.stage_to == "auto"


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--stage-to", "auto"], "--stage-to auto: neither $SLURM_TMPDIR nor $TMPDIR is set"),
        (["--stage-to", "{tmp}/nope"], "nope' is not a directory"),
        (["--stage-to", ""], "--stage-to '' must name a node-local directory"),
        (["--keep-staged"], "--keep-staged keeps the copies that --stage-to makes"),
    ],
)
def test_train_refuses_bad_staging_flags(data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         args: list[str], needle: str) -> None:
    monkeypatch.delenv("TMPDIR", raising=False)
    monkeypatch.delenv("SLURM_TMPDIR", raising=False)
    run = tmp_path / "run"
    args = [a.format(tmp=tmp_path) for a in args]
    result = runner.invoke(app, ["train", "--data", str(data), "--run-dir", str(run), *args])
    assert result.exit_code == 2, result.output
    assert needle in " ".join(result.output.split())
    assert "Traceback" not in result.output
    assert not run.exists()  # refused before anything is written
