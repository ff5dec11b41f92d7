"""--stage-to on 2 real MPI ranks: the same parameters as without staging, each rank's own files copied and
removed (or kept, and re-used), and a full disk, a corrupt copy or a stop during staging ending every rank alike."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest

from conftest import hpctrain, mpirun, summary
from hpctrain.data.shardformat import load_manifest

pytestmark = pytest.mark.mpi
ARGS = ["--epochs", "2", "--batch-size", "32", "--seed", "7", "--log-every", "5", "--checkpoint-every", "0"]


@pytest.fixture(scope="module")
def digits4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("digits4") / "data"
    hpctrain(["shard", "digits", str(out), "--shards", "4"])
    return out


def train(data: Path, run: Path, *extra: str, check: bool = True):
    return mpirun(2, ["train", "--data", str(data), "--run-dir", str(run), *ARGS, *extra], check=check)


def staged_files(local: Path) -> dict[str, list[str]]:
    """{rank directory: its files, relative} of every run's copies under DIR."""
    return {rank.name: sorted(p.relative_to(rank).as_posix() for p in rank.rglob("*") if p.is_file())
            for rank in sorted(local.glob("hpctrain-*/rank-*"))}


def test_staged_run_is_bit_identical_and_removes_its_copies(digits4: Path, tmp_path: Path) -> None:
    train(digits4, tmp_path / "plain")
    plain = summary(tmp_path / "plain")
    assert plain["staged_bytes"] == 0 and plain["staging_s"] is None

    local = tmp_path / "local"
    local.mkdir()
    train(digits4, tmp_path / "staged", "--stage-to", str(local))
    staged = summary(tmp_path / "staged")
    assert staged["param_sha256"] == plain["param_sha256"] and staged["ranks_in_sync"]
    shardset = load_manifest(digits4)
    everything = sum(f.path.stat().st_size for files in shardset.splits.values() for f in files)
    assert staged["staged_bytes"] == everything  # 2 ranks x (2 train + 2 val files): every file once
    assert 0 < staged["staging_s"] < 60
    assert list(local.iterdir()) == []  # removed at the end, the run's directory too
    for rank in (0, 1):
        log = (tmp_path / "staged" / "logs" / f"rank-{rank:04d}.log").read_text()
        assert "staged 4 shard files" in log and f"rank-{rank:05d} in " in log


def test_kept_copies_are_each_ranks_own_and_the_next_run_reads_them(digits4: Path, tmp_path: Path) -> None:
    local, run, data = tmp_path / "local", tmp_path / "run", tmp_path / "data"
    local.mkdir()
    shutil.copytree(digits4, data)  # its files are changed below
    train(data, run, "--stage-to", str(local), "--keep-staged")
    first = summary(run)
    names = {split: [f.path.relative_to(data.resolve()).as_posix() for f in files]
             for split, files in load_manifest(data).splits.items()}
    assert staged_files(local) == {
        f"rank-{r:05d}": sorted(["manifest.json", *names["train"][r::2], *names["val"][r::2]]) for r in (0, 1)}

    # the originals change: a run that re-uses the verified copies never reads them, and trains the same
    for files in names.values():
        for name in files:
            raw = bytearray((data / name).read_bytes())
            raw[len(raw) // 2 : len(raw) // 2 + 64] = bytes(b ^ 0xFF for b in raw[len(raw) // 2 : len(raw) // 2 + 64])
            (data / name).write_bytes(raw)
    train(data, run, "--stage-to", str(local), "--keep-staged", "--resume", "never")
    again = summary(run)
    assert again["param_sha256"] == first["param_sha256"]
    assert "kept from an earlier run" in (run / "logs" / "rank-0001.log").read_text()

    # another run has no copies to re-use: it copies the changed originals, and every rank refuses them
    proc = train(data, tmp_path / "other", "--stage-to", str(local), check=False)
    assert proc.returncode == 2, proc.stderr
    assert "has sha256" in proc.stderr and "the manifest says" in proc.stderr
    assert sorted(staged_files(local)) == ["rank-00000", "rank-00001"]  # only the kept ones are left
    assert len(list(local.iterdir())) == 1


def test_a_resume_on_another_world_size_stages_that_worlds_files(digits4: Path, tmp_path: Path) -> None:
    local = tmp_path / "local"
    local.mkdir()
    for name, extra in (("plain", []), ("staged", ["--stage-to", str(local)])):
        run = tmp_path / name
        train(digits4, run, "--max-steps", "5", *extra)  # 2 ranks, checkpointed mid-epoch
        proc = hpctrain(["train", "--data", str(digits4), "--run-dir", str(run), *ARGS, *extra])  # the rest on 1 rank
        assert "config changed" not in proc.stderr, proc.stderr
    plain, staged = summary(tmp_path / "plain"), summary(tmp_path / "staged")
    assert staged["world_size"] == 1 and staged["resumed_from"] == 5
    assert staged["param_sha256"] == plain["param_sha256"]
    everything = sum(f.path.stat().st_size for files in load_manifest(digits4).splits.values() for f in files)
    assert staged["staged_bytes"] == everything
    log = (tmp_path / "staged" / "logs" / "rank-0000.log").read_text()
    assert log.index("staged 4 shard files") < log.index("staged 8 shard files")  # 2 ranks' share, then 1 rank's
    assert list(local.iterdir()) == []


SCRIPT = textwrap.dedent('''
    """argv: DATA RUN DIR MODE. Rank 1 alone meets a full disk (space), a copy corrupted on the way (corrupt)
    or a stop signal while it copies (stop); every rank writes how its run ended to RUN.rank-R.json."""
    import json, os, signal, sys
    from collections import namedtuple
    from pathlib import Path

    from hpctrain.base.config import TrainConfig
    from hpctrain.base.errors import HpctrainError
    from hpctrain.comm import world
    from hpctrain.control import trainer
    from hpctrain.data import staging

    data, run, local, mode = sys.argv[1:5]
    comm = world()
    if comm.rank == 1 and mode == "space":
        usage = namedtuple("usage", "total used free")
        staging.shutil.disk_usage = lambda path: usage(10**9, 10**9 - 1000, 1000)
    if comm.rank == 1 and mode == "corrupt":
        read_piece = staging._read_piece
        def flipping(fh, buf):  # a byte read wrong from the parallel filesystem
            n = read_piece(fh, buf)
            if n:
                buf[0] ^= 1
            return n
        staging._read_piece = flipping
    if comm.rank == 1 and mode == "stop":
        copy = staging.copy_hashed
        def stopped_meanwhile(source, target, stopped):
            os.kill(os.getpid(), signal.SIGTERM)  # as from a scheduler: the handler sets the stop flag
            return copy(source, target, stopped)
        staging.copy_hashed = stopped_meanwhile
    cfg = TrainConfig.flat(data=Path(data), run_dir=Path(run), epochs=1, stage_to=local, progress=False)
    try:
        trainer.train(cfg, comm=comm)
        result = {"rank": comm.rank, "code": 0}
    except HpctrainError as exc:
        result = {"rank": comm.rank, "code": exc.exit_code, "error": str(exc)}
    Path(f"{run}.rank-{comm.rank}.json").write_text(json.dumps(result))
''')


@pytest.mark.parametrize("mode, code, needle", [
    ("space", 2, "ranks that stage there need"),
    ("corrupt", 2, "has sha256"),
    ("stop", 3, "stopped by SIGTERM while staging the shards"),
])
def test_one_rank_failing_or_stopped_during_staging_ends_every_rank_alike(digits4: Path, tmp_path: Path, mode: str,
                                                                         code: int, needle: str) -> None:
    script, local = tmp_path / "staging_faults.py", tmp_path / "local"
    script.write_text(SCRIPT)
    local.mkdir()
    proc = mpirun(2, [str(script), str(digits4), str(tmp_path / "run"), str(local), mode], python_module=False,
                  timeout=120)
    results = [json.loads((tmp_path / f"run.rank-{r}.json").read_text()) for r in (0, 1)]
    assert [r["code"] for r in results] == [code, code], f"{results}\n{proc.stdout}\n{proc.stderr}"
    assert needle in results[1]["error"] and str(local) in results[1]["error"]
    assert results[0]["error"].startswith("rank 1: ") and needle in results[0]["error"]
    assert list(local.iterdir()) == []  # every rank's copies removed, the one that failed and the one that did not
    assert not (tmp_path / "run" / "checkpoints").exists() or not list((tmp_path / "run" / "checkpoints").iterdir())


API_SCRIPT = textwrap.dedent('''
    """argv: DATA DIR OUT. The library's loader with stage_to= gives the batches of the plain one, from the
    copies; every rank writes what it saw to OUT.rank-R.json."""
    import gc, json, sys
    from pathlib import Path

    import numpy as np
    import hpctrain

    data, local, out = sys.argv[1:4]
    ctx = hpctrain.init()
    plain = hpctrain.ShardLoader(data, batch_size=32, seed=3)
    staged = hpctrain.ShardLoader(data, batch_size=32, seed=3, stage_to=local)
    same = [np.array_equal(a[0].numpy(), b[0].numpy()) and np.array_equal(a[1].numpy(), b[1].numpy())
            for a, b in zip(plain, staged, strict=True)]
    files = [str(f.path) for f in staged.shardset.rank_shards("train", ctx.rank, ctx.world_size)]
    root, nbytes = staged.staged.root, staged.staged.bytes
    del staged
    gc.collect()
    Path(f"{out}.rank-{ctx.rank}.json").write_text(json.dumps(
        {"rank": ctx.rank, "batches": len(same), "same": all(same), "files": files, "bytes": nbytes,
         "gone": not root.exists()}))
''')


def test_the_library_loader_stages_too(digits4: Path, tmp_path: Path) -> None:
    script, local = tmp_path / "api_staging.py", tmp_path / "local"
    script.write_text(API_SCRIPT)
    local.mkdir()
    mpirun(2, [str(script), str(digits4), str(local), str(tmp_path / "out")], python_module=False, timeout=120)
    results = [json.loads((tmp_path / f"out.rank-{r}.json").read_text()) for r in (0, 1)]
    shardset = load_manifest(digits4)
    for r in results:
        assert r["batches"] > 0 and r["same"]
        assert len(r["files"]) == 2 and all(f.startswith(str(local)) for f in r["files"])
        assert r["bytes"] == sum(f.path.stat().st_size for f in shardset.splits["train"][r["rank"]::2])  # train only
        assert r["gone"]  # removed with the loader
    assert list(local.iterdir()) == []
