"""Faults a run survives must be reported in one short line: a damaged meta.json (every flipped byte is caught,
and the warning names the file, what is wrong and the checkpoint used instead), and a run file that cannot be
written (a full disk: /dev/full answers every write with ENOSPC) is recorded once, never as logging's
`--- Logging error ---` tracebacks."""

from __future__ import annotations

import errno
import itertools
import os
import re
import time
from pathlib import Path

import pytest
import torch

from hpctrain.base import durable
from hpctrain.base.errors import CheckpointError, StorageError
from hpctrain.comm import Comm
from hpctrain.checkpoint import manager as ckpt
from hpctrain.control import runlog

STATE = {"model_state": {"w": torch.ones(64)}, "train_state": {"lr": 0.1}, "rank_state": {"r": 0},
         "meta": {"epoch": 0, "config": {"model": "mlp:64", "lr": 0.05, "seed": 7}}}
DEV_FULL = Path("/dev/full")


def two_checkpoints(run: Path) -> tuple[Path, Path]:
    mgr = ckpt.CheckpointManager(run, Comm(None), every=1, keep=3)
    for step in (10, 20):
        mgr.save(step, STATE, final=True)
    newest, older = ckpt.list_checkpoints(run)
    return newest, older


def flip(path: Path, pos: int, mask: int) -> bytes:
    original = path.read_bytes()
    data = bytearray(original)
    data[pos] ^= mask
    path.write_bytes(bytes(data))
    return original


def test_every_flipped_byte_of_meta_json_is_caught_and_said_in_one_short_line(tmp_path: Path) -> None:
    newest, _ = two_checkpoints(tmp_path)
    meta = newest / "meta.json"
    size = meta.stat().st_size
    for pos in range(size):
        for mask in (0x80, 0x01):  # 0x80: no longer UTF-8; 0x01: another character, often still valid JSON
            original = flip(meta, pos, mask)
            try:
                with pytest.raises(CheckpointError) as caught:
                    ckpt.verify(newest, hash_files=False)
            finally:
                meta.write_bytes(original)
            text = str(caught.value)
            assert "meta.json" in text and len(text) < 300 and "\\x" not in text, (pos, mask, text)
    original = flip(meta, 10, 0x80)
    with pytest.raises(CheckpointError, match=r"meta\.json is not valid UTF-8 JSON at byte 10\b"):
        ckpt.verify(newest)


def test_the_fallback_warning_names_the_damaged_file_and_the_checkpoint_used(tmp_path: Path) -> None:
    newest, older = two_checkpoints(tmp_path)
    flip(newest / "meta.json", 40, 0x80)
    warnings: list[str] = []
    assert ckpt.latest(tmp_path, warn=warnings.append) == older
    assert len(warnings) == 1 and "\n" not in warnings[0] and len(warnings[0]) < 300, warnings
    assert newest.name in warnings[0] and "meta.json" in warnings[0] and "byte 40" in warnings[0]
    assert f"using {older.name}" in warnings[0]
    # a damaged part file is named too, and with nothing left the warning says the run starts afresh
    flip(older / "part-00000.bin", 100, 0x01)
    warnings.clear()
    assert ckpt.latest(tmp_path, warn=warnings.append) is None
    assert len(warnings) == 2 and "part-00000.bin" in warnings[1] and "sha256 mismatch" in warnings[1], warnings
    assert all(len(w) < 300 for w in warnings) and "no intact checkpoint is left" in warnings[1]


@pytest.mark.skipif(not DEV_FULL.exists(), reason="needs /dev/full (Linux) to fake a full disk")
def test_a_log_on_a_full_disk_is_recorded_once_and_never_prints_tracebacks(tmp_path: Path,
                                                                           capfd: pytest.CaptureFixture) -> None:
    (tmp_path / "logs").mkdir()
    os.symlink(DEV_FULL, tmp_path / "logs" / "rank-0000.log")
    log = runlog.setup_logging(tmp_path, 0)
    try:
        for i in range(5):
            log.error("line %d", i)
        fault = durable.FAULTS.first
        assert isinstance(fault, StorageError) and fault.exit_code == 1
        assert "rank-0000.log" in str(fault) and "No space left on device" in str(fault) and " free" in str(fault)
    finally:
        runlog.close_logging(log)
        durable.FAULTS.clear()
    err = capfd.readouterr().err
    assert "Logging error" not in err and "Traceback" not in err, err


@pytest.mark.skipif(not DEV_FULL.exists(), reason="needs /dev/full (Linux) to fake a full disk")
def test_a_run_file_that_cannot_be_written_is_recorded_not_raised_mid_step(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    os.symlink(DEV_FULL, path)
    durable.FAULTS.clear()
    try:
        fh = runlog.RunFile(path)
        fh.write("x" * 100 + "\n")
        fh.flush()  # ENOSPC here: recorded, not raised (the other ranks are on their way to the next collective)
        fh.write("more\n")
        fh.flush()
        fh.close()  # the failure is already recorded: closing says nothing more
        assert "metrics.jsonl" in str(durable.FAULTS.first) and "No space left" in str(durable.FAULTS.first)
    finally:
        durable.FAULTS.clear()
    fh = runlog.RunFile(path)
    fh.write("y\n")
    with pytest.raises(StorageError, match="metrics.jsonl.*No space left"):
        fh.close()  # a first failure at close, with nobody left to report it later: raised


def test_the_run_stops_at_the_next_step_boundary_after_a_write_fault(tmp_path: Path) -> None:
    mgr = ckpt.CheckpointManager(tmp_path, Comm(None), every=10, keep=2)
    mgr.save(10, STATE)
    mgr.wait()
    durable.FAULTS.clear()
    try:
        full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        durable.FAULTS.record(durable.write_failure(full, tmp_path / "metrics.jsonl"))
        with pytest.raises(StorageError) as caught:
            mgr.save(11, STATE)
    finally:
        durable.FAULTS.clear()
    text = str(caught.value)
    assert caught.value.agreed and caught.value.exit_code == 1
    assert "metrics.jsonl" in text and str(tmp_path / "checkpoints" / "step-0000010") in text
    assert "free space, then run the same command to continue" in text
    assert re.search(r"a checkpoint of this run needs \d+(\.\d)? (B|KiB)\b", text), text


@pytest.mark.skipif(not DEV_FULL.exists(), reason="needs /dev/full (Linux) to fake a full disk")
def test_a_checkpoint_on_a_full_disk_stops_the_run_in_one_line(tmp_path: Path) -> None:
    mgr = ckpt.CheckpointManager(tmp_path, Comm(None), every=10, keep=2)
    mgr.save(10, STATE, final=True)
    real = mgr._writer.start

    def onto_a_full_disk(job: dict) -> None:  # this rank's part lands on a full disk
        job["tmp"].mkdir(parents=True)
        os.symlink(DEV_FULL, job["tmp"] / "part-00000.bin")
        real(job)

    mgr._writer.start = onto_a_full_disk
    mgr.save(20, STATE)  # asynchronous: the failure is known at a later boundary, once the write has ended
    deadline = time.monotonic() + 60
    with pytest.raises(CheckpointError) as caught:
        for step in itertools.count(21):  # the steps go on until the failure stops them (it must, in time)
            assert time.monotonic() < deadline, "a failed checkpoint write never stopped the run"
            mgr.save(step, STATE)
            time.sleep(0.01)
    text = str(caught.value)
    assert caught.value.exit_code == 1 and len(text) < 400 and "\n" not in text, text
    assert "step 20" in text and "No space left on device" in text and " free" in text and "needed" in text
    assert f"last complete checkpoint: {tmp_path / 'checkpoints' / 'step-0000010'}" in text
    assert "free space, then run the same command to continue" in text
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-0000010"]
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
