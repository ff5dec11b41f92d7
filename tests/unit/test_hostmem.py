"""The allocator is told to keep freed gradient memory (glibc), once per process, unless the user chose.

Each case runs in a fresh interpreter: the allocator's settings are process-wide. Its effect on the step is
measured by `hpctrain bench train` and benchmarks/step_limit.py, not here."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = "from hpctrain.base.hostmem import reuse_freed_memory as r; print(r(), r())"


def _run(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=60,
                          env={**clean, **env}).stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_glibc_keeps_freed_memory_once_unless_the_environment_chose() -> None:
    assert _run() == "True True"
    assert _run(MALLOC_MMAP_THRESHOLD_="1048576") == "False False"  # the user's own allocator settings stay


def test_every_gradient_sync_asks_for_it() -> None:
    import torch

    from hpctrain.base import hostmem
    from hpctrain.comm import GradSync, world

    hostmem._done = False
    sync = GradSync(torch.nn.Linear(4, 2).parameters(), world(), overlap=False)
    sync.close()
    assert hostmem._done or any(k.startswith("MALLOC_") for k in os.environ)
