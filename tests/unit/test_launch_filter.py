"""`MpirunFilter`, the filter `hpctrain launch` reads mpirun's stderr through, fed the byte sequences mpirun
really writes: every rank's output and mpirun's own messages share one pipe, so they interleave at any byte."""
from __future__ import annotations

from hpctrain.tools.launch import MpirunFilter

FORWARDING = b"mpirun: Forwarding signal 12 to job\n"
BLOCK = (b"-" * 74 + b"\nPrimary job  terminated normally, but 1 process returned\na non-zero exit code.\n"
         + b"-" * 74 + b"\n")


def run(*chunks: bytes) -> bytes:
    out: list[bytes] = []
    f = MpirunFilter(out.append)
    for chunk in chunks:
        f.feed(chunk)
    f.end()
    return b"".join(out)


def test_the_forwarding_line_is_dropped_on_a_line_of_its_own() -> None:
    assert run(b"step 1\n", FORWARDING, b"stopped by SIGUSR2 at step 1\n") == b"step 1\nstopped by SIGUSR2 at step 1\n"


def test_the_forwarding_line_is_dropped_when_it_comes_in_the_middle_of_a_rank_s_line() -> None:
    # CI saw this: a rank's progress line had been passed on up to its last byte, mpirun's message came, and
    # then the rank's newline. The message is not the rank's text and is dropped; the rank's line is whole.
    assert run(b"step 100  288 samples/s", FORWARDING, b"\nstopped\n") == b"step 100  288 samples/s\nstopped\n"


def test_the_forwarding_line_is_dropped_when_one_read_holds_it_inside_a_rank_s_line() -> None:
    assert run(b"step 100  288 samples/s" + FORWARDING + b"\nstopped\n") == b"step 100  288 samples/s\nstopped\n"


def test_a_rank_s_partial_line_is_passed_on_at_once() -> None:
    out: list[bytes] = []
    f = MpirunFilter(out.append)
    f.feed(b"epoch 1 step 3/9 [#####")
    assert b"".join(out) == b"epoch 1 step 3/9 [#####"


def test_mpirun_s_failure_report_is_dropped_only_when_a_rank_said_why() -> None:
    said = b"error: the data directory 'x' has no manifest.json; run `hpctrain shard` first\n"
    assert run(said, BLOCK) == said
    assert run(BLOCK, said) == said  # which comes first is a race
    assert run(b"step 1\n", BLOCK) == b"step 1\n" + BLOCK  # nobody said why: mpirun's report is all there is


def test_text_that_only_looks_like_mpirun_s_is_passed_on() -> None:
    text = b"[rank 0] mpirun: Forwarding signal is a phrase\n" + b"-" * 74 + b"\nnot a report\n" + b"-" * 74 + b"\n"
    assert run(text) == text
