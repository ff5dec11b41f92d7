"""A wait on other ranks is named for a block (`with watchdog.waiting(what, step):`), never by a pair of calls that
an early return or a new branch can leave unbalanced."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hpctrain.control.watchdog import Watchdog, waiting
from hpctrain.trace.flight import RECORDER

PACKAGE = Path(__file__).resolve().parents[2] / "hpctrain"


def _dog() -> Watchdog:
    return Watchdog(None, 0, 1, timeout=60, abort=lambda code: None)


def test_a_wait_is_named_for_its_block_and_the_one_it_was_nested_in_comes_back() -> None:
    dog = _dog()
    with dog.waiting("gradient allreduce", 7):
        assert (dog.current, RECORDER.phase, RECORDER.step) == ("gradient allreduce", "gradient allreduce", 7)
        with dog.waiting("pipeline stage 1 waiting for stage 0", 7, budget=5):
            assert dog.current == "pipeline stage 1 waiting for stage 0" and dog._budget == 5
        assert dog.current == "gradient allreduce" and dog._budget == 60  # the outer wait's own budget again
    assert dog.current is None and RECORDER.phase is None
    with dog.waiting("metrics reduction"):  # no step given: the last one
        assert dog._step == 7


def test_a_block_left_by_an_exception_keeps_its_wait_named() -> None:
    """The hang report, the flight record and the heartbeat then say where the rank was."""
    dog = _dog()
    with pytest.raises(RuntimeError), dog.waiting("start-up agreement", 0):
        raise RuntimeError("a rank failed its checks")
    assert dog.current == "start-up agreement"
    dog.idle()


def test_without_a_watchdog_nothing_is_named() -> None:
    with waiting(None, "validation reduction", 3):
        pass


def test_no_wait_is_named_by_a_pair_of_calls() -> None:
    """`.idle()` outside the watchdog: only the trainer's, after the checkpoint writer named its own waits
    (`on_write` switches the wait while a write is waiting for every rank's part)."""
    idles = {str(p.relative_to(PACKAGE)): len(re.findall(r"\.idle\(\)", p.read_text()))
             for p in PACKAGE.rglob("*.py") if p.name != "watchdog.py"}
    assert {k: v for k, v in idles.items() if v} == {"control/trainer.py": 1}
