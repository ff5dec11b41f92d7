"""The hang matrix on a fixed sample: one short case of each event kind, judged as `benchmarks/soak.py` does.

Each case is an ordinary `hpctrain launch -n W -- train ...` configuration with one event at a random
moment (tests/chaos/chaos.py: what is drawn and what is expected). The sample is fixed (seed 11, the
indices below: a short case of every event kind, world sizes 1 to 4), so a failure here reruns alone with
`python benchmarks/soak.py --seed 11 --case K --keep-runs`; `make soak` draws hundreds more.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from chaos import EVENTS, Harness, draw_case, event_of, repro_command, subreaper

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

SEED = 11
# index: world size, event, what else it exercises (full config: `python benchmarks/soak.py --seed 11 --case K`)
#   3 W4 SIGTERM launcher, --max-steps 1 (2 steps before the epoch's end)
#   5 W2 SIGUSR2 launcher, 8 shards, checkpoint every step      8 W3 no event, digits with a val split
#   9 W2 SIGSTOP rank 1, collective timeout 10 s                13 W2 kill -9 rank 1, checkpoint every step
#  20 W2 SIGUSR2 rank 0, digits, log every step                 22 W1 SIGTERM to the only rank
#  30 W2 SIGTERM rank 0, digits, one epoch
CASES = (3, 5, 8, 9, 13, 20, 22, 30)
DEADLINE_S = 90  # a healthy run takes 3-10 s here; past this it is a hang


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Harness:
    """One harness for the module: the shard sets are built once; orphans are reaped here meanwhile."""
    with subreaper():
        yield Harness(Path(tmp_path_factory.mktemp("chaos")), deadline_s=DEADLINE_S)


def test_the_sample_covers_every_event_kind() -> None:
    assert {event_of(SEED, i) for i in CASES} == set(EVENTS)


@pytest.mark.parametrize("index", CASES, ids=[f"{i}-{event_of(SEED, i)}" for i in CASES])
def test_case(harness: Harness, index: int) -> None:
    outcome = harness.run_case(draw_case(SEED, index, harness.data))
    if not outcome.passed:
        pytest.fail(f"{outcome.report()}\nreproduce: {repro_command(outcome.case, DEADLINE_S)}", pytrace=False)


def test_no_process_of_the_cases_is_left(harness: Harness) -> None:
    assert harness.stray_processes() == []
