"""The stop flag: which signals ask for a stop, who asked, and when a Ctrl-C ends the process instead."""

from __future__ import annotations

import os
import signal
import time

import pytest

from hpctrain.base import stop


@pytest.fixture
def flag():
    f = stop.StopFlag()
    assert f.install()
    yield f
    f.restore()


@pytest.mark.parametrize("sig,user", [(signal.SIGTERM, False), (signal.SIGUSR2, False), (signal.SIGINT, True),
                                      (signal.SIGUSR1, True)])
def test_every_stop_signal_sets_the_flag_and_says_who_asked(flag: stop.StopFlag, sig: signal.Signals,
                                                            user: bool) -> None:
    os.kill(os.getpid(), sig)
    assert flag.requested and flag.signum == sig and flag.user == user


def test_a_copy_of_a_ctrl_c_is_not_a_second_one_but_a_later_ctrl_c_ends_now(flag: stop.StopFlag) -> None:
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGINT)  # Slurm's copy and the rank wrapper's, a moment apart
    assert flag.requested and flag.user
    time.sleep(stop.AGAIN_S)
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)  # the handler runs at the next bytecode boundary


def test_a_scheduler_s_stop_then_a_person_s_is_recorded_as_the_person_s(flag: stop.StopFlag) -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGINT)
    assert flag.signum == signal.SIGTERM and flag.user


def test_a_rank_started_by_the_launcher_holds_every_stop_signal_until_its_handler_is_in() -> None:
    """`hpctrain launch` starts ranks through `block_prefix()`: a Ctrl-C handed on as SIGUSR1, or a SIGINT, in
    a rank's first instants is pending, not fatal (their default action ends a process)."""
    import subprocess

    prefix = stop.block_prefix()
    if not prefix:
        pytest.skip("this `env` cannot block signals (GNU coreutils >= 8.31 can)")
    out = subprocess.run([*prefix, "grep", "SigBlk", "/proc/self/status"], capture_output=True, text=True)
    mask = int(out.stdout.split()[1], 16)
    assert all(mask >> (sig - 1) & 1 for sig in stop.STOP_SIGNALS), (out.stdout, stop.STOP_SIGNALS)
