"""What every thread hpctrain starts shares: it can be stopped, and is joined with a deadline; and how
worker processes start.

A join that waits forever turns one stuck thread (a read on a hung filesystem, a collective whose peer
died) into a job that never ends; here a join gives up after its timeout and says in the log what it
waited for. The threads are daemons, so a thread left behind never keeps the process alive.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from typing import Any

log = logging.getLogger("hpctrain")


def join_logged(thread: threading.Thread | None, timeout: float, what: str) -> bool:
    """Join `thread` for at most `timeout` seconds; log what it was doing when it did not end. True: ended."""
    if thread is None or thread is threading.current_thread():
        return True
    thread.join(timeout)
    if thread.is_alive():
        log.warning("thread %s (%s) did not stop within %.0f s; leaving it behind (daemon)", thread.name, what, timeout)
        return False
    return True


def worker_context(preload: list[str]) -> Any:
    """The multiprocessing context for worker processes: forkserver (spawn where there is none), never fork,
    because the parent may hold open HDF5 files and threads; the server imports `preload` once for all."""
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    if ctx.get_start_method() == "forkserver":
        ctx.set_forkserver_preload(preload)
    return ctx
