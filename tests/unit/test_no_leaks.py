"""What a run starts, it stops: threads, signal handlers, files, on success and on any failure.

In-process runs on a world of one (`Comm(None)`, no MPI: nothing here claims MPI behaviour), and the
watchdog's phase budgets with an injected `abort` (the real MPI_Abort is exercised in tests/mpi).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from hpctrain.comm import Comm
from hpctrain.base.config import ShardConfig, TrainConfig
from hpctrain.data.reader import ShardReader
from hpctrain.data.shardformat import load_manifest
from hpctrain.base.errors import HpctrainError
from hpctrain.data.sharding import shard
from hpctrain.control.trainer import train
from hpctrain.control.watchdog import Watchdog

BOOM = '''
import torch


class Boom(torch.nn.Module):
    """Fails in its 7th forward: a failure in the middle of training, after every resource is set up."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.lin = torch.nn.Linear(n_in, n_out)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 7:
            raise RuntimeError("boom")
        return self.lin(x.reshape(len(x), -1))


def factory(input_shape, num_classes):
    return Boom(int(torch.tensor(input_shape).prod()), num_classes)
'''


def _hpctrain_threads() -> list[str]:
    deadline = time.monotonic() + 5
    while True:
        names = [t.name for t in threading.enumerate() if t.name.startswith("hpctrain")]
        if not names or time.monotonic() > deadline:
            return names
        time.sleep(0.05)


def _open_files_under(root: Path) -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(root)):
            found.append(target)
    return found


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("leaks") / "d"
    shard(ShardConfig(source="synthetic:300:8:3", out=out, shards=1, val_fraction=0.1), show_progress=False,
          comm=Comm(None))
    return out


@pytest.mark.parametrize("model", ["mlp", "boom"])
def test_a_run_leaves_no_thread_handler_or_open_file(data: Path, tmp_path: Path, model: str) -> None:
    (tmp_path / "boom.py").write_text(BOOM)
    run = tmp_path / "run"
    spec = f"{tmp_path / 'boom.py'}:factory" if model == "boom" else "mlp"
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR2)}
    for attempt in range(2):  # the second one resumes (and reopens the audit file) before failing again
        cfg = TrainConfig.flat(data=data, run_dir=run, model=spec, epochs=3, batch_size=16, checkpoint_every=2,
                          audit_samples=True, overlap=True, progress=False)
        if model == "boom":
            with pytest.raises(HpctrainError, match="boom"):
                train(cfg, comm=Comm(None))
        else:
            train(cfg, comm=Comm(None))
        assert _hpctrain_threads() == []
        assert {sig: signal.getsignal(sig) for sig in before} == before
        assert _open_files_under(run) == []


def test_closing_the_reader_with_the_prefetch_depth_left_returns_at_once(data: Path) -> None:
    """The reported hang: the consumer stopped with exactly `prefetch` batches left, and the producer's
    final put had no timeout. Run in a thread so that a regression fails instead of hanging pytest."""
    shards = load_manifest(data)
    for prefetch in (1, 2, 3):
        reader = ShardReader(shards, "train", rank=0, world=1, batch_size=16, prefetch=prefetch)
        for left in range(prefetch + 2):
            def consume() -> None:
                batches = reader.epoch(0)
                for _ in range(reader.steps_per_epoch - left):
                    next(batches)
                time.sleep(0.3)  # let the producer finish and block on its last put
                batches.close()
            worker = threading.Thread(target=consume, daemon=True)
            worker.start()
            worker.join(10)
            assert not worker.is_alive(), f"close() blocked: prefetch {prefetch}, {left} batches left"
        reader.close()
        assert _hpctrain_threads() == []


def test_reader_close_stops_an_epoch_still_being_read(data: Path) -> None:
    shards = load_manifest(data)
    reader = ShardReader(shards, "train", rank=0, world=1, batch_size=4, prefetch=2)
    batches = reader.epoch(0)
    next(batches)
    reader.close()  # e.g. the trainer's cleanup after an error, with the epoch's generator still open
    assert _hpctrain_threads() == []


def _watchdog(budget_s: float) -> tuple[Watchdog, list[int]]:
    aborted: list[int] = []
    dog = Watchdog(None, 0, 2, timeout=budget_s, abort=aborted.append, interval=0.1).start()
    return dog, aborted


def test_watchdog_leaves_unwatched_work_alone_and_budgets_each_phase() -> None:
    dog, aborted = _watchdog(0.3)
    try:
        dog.idle()  # e.g. a validation pass or the summary: this rank's own work
        time.sleep(0.8)
        assert aborted == []
        dog.phase("checkpoint write", 5, budget=5.0)  # slower than a collective, within its own budget
        time.sleep(0.8)
        assert aborted == []
        dog.phase("gradient allreduce", 6)  # the collective timeout
        time.sleep(0.8)
        assert aborted == [1] and "gradient allreduce at step 6" in (dog.fired or "")
    finally:
        dog.close()


def test_watchdog_ends_a_long_budgeted_wait_once_a_rank_goes_silent(tmp_path: Path) -> None:
    """A checkpoint write may take its long budget while the writer still beats; a rank that stopped beating
    (SIGSTOP, dead) for longer than the collective timeout will never come, whatever the phase's budget."""
    import json as _json

    (tmp_path / "logs").mkdir()
    beat = tmp_path / "logs" / "rank-0001.heartbeat"

    def peer(at: float) -> None:
        beat.write_text(_json.dumps({"rank": 1, "step": 5, "phase": "checkpoint write", "since": at, "time": at,
                                     "pid": 0}))

    aborted: list[int] = []
    dog = Watchdog(tmp_path, 0, 2, timeout=0.5, abort=aborted.append, interval=0.1).start()
    try:
        dog.phase("checkpoint write", 5, budget=60.0)
        for _ in range(15):  # a slow but live peer: beats every 0.1 s
            peer(time.time())
            time.sleep(0.1)
        assert aborted == []
        peer(time.time())  # then it goes silent
        deadline = time.monotonic() + 5
        while not aborted and time.monotonic() < deadline:
            time.sleep(0.1)
        assert aborted == [1] and "rank 1 (silent for" in (dog.fired or ""), dog.fired
    finally:
        dog.close()


def test_closing_the_watchdog_wakes_its_thread_instead_of_waiting_out_its_interval() -> None:
    """On the main thread the watchdog sleeps in select() on the signal wakeup pipe; a close that only set its
    stop event waited for the rest of the interval (every rank's exit took up to a second longer)."""
    assert threading.current_thread() is threading.main_thread()
    previous = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(previous)
    dog = Watchdog(None, 0, 2, timeout=60.0, abort=lambda code: None, interval=30.0).start()
    assert dog._wakeup is not None  # the select() path, not the event's wait
    time.sleep(0.2)  # the thread is in its sleep
    started = time.monotonic()
    dog.close()
    assert time.monotonic() - started < 5.0  # not the 30 s interval
    assert _hpctrain_threads() == [] and signal.set_wakeup_fd(previous) == previous  # the previous fd restored
