"""Host memory for a training process: huge pages under torch's large CPU tensors, and freed gradient memory
reused, not handed back to the OS. Nothing here acts at import: `tune_host_memory()` is the one call that tunes a
process, made by `hpctrain train` and `hpctrain bench` before torch's first allocation and by `hpctrain.init()` /
`hvd.init()` (unless the process called it first). `HPCTRAIN_HOST_TUNING=0` (or `hpctrain.tune_host_memory(False)`
before `init()`) leaves the process as it is.

Autograd hands over fresh gradient tensors every step (GradSync drops the old ones, as `zero_grad()` does).
glibc serves an allocation above its mmap threshold (dynamic, from 128 KiB) with a fresh mapping and
returns it to the OS on free, and trims the heap's free top above its trim threshold: every step then
page-faults its gradients in anew, which costs a large share of a step (docs/performance.md). Keeping a
fixed 32 MiB mmap threshold and a 1 GiB trim threshold avoids it: `reuse_freed_memory()` sets those two with `mallopt`; an allocation above 32 MiB
(glibc's largest threshold) is still mapped afresh. A process whose `MALLOC_MMAP_THRESHOLD_` or
`MALLOC_TRIM_THRESHOLD_` is set keeps its own choice; not glibc: nothing to do.

Huge pages (`prefer_huge_pages`): torch's CPU allocator places a tensor of 2 MiB or more
on a page boundary and advises transparent huge pages for it when `THP_MEM_ALLOC_ENABLE=1` (c10's
`alloc_cpu`; off by default). MPI moves a large message between ranks of a node by a single copy from the
other process's memory (Open MPI's vader BTL through CMA, `process_vm_readv`), which takes the source page
by page, so over 4 KiB pages an allreduce of a large gradient in torch memory is far slower than over huge
pages (numpy advises huge pages for its large arrays; torch only with the setting). The gradients autograd
hands over are torch memory. Huge pages pay only where memory is kept (above): a loop that faults its fresh
gradients' huge pages in anew every step is slower with them.
torch reads the variable once, at its first CPU allocation (importing torch allocates nothing): hence the tuning
comes before any model is built, and `tune_host_memory` says when it came too late.
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Mapping

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's maximum (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 1 << 30
THP_ENV = "THP_MEM_ALLOC_ENABLE"  # torch's (c10/core/alloc_cpu.cpp)
THP_SYSFS = "/sys/kernel/mm/transparent_hugepage/enabled"
THP_PROBE_BYTES = 4 << 20  # above torch's 2 MiB threshold for huge pages
PAGE_BYTES = 4096
OPT_OUT_ENV = "HPCTRAIN_HOST_TUNING"  # 0/off/false/no: tune_host_memory() leaves the process as it is

_done = False


def huge_pages_possible(sysfs: str = THP_SYSFS) -> bool:
    """Whether the kernel gives a process transparent huge pages where it asks (mode `always` or `madvise`).
    Where it has none (no such file: built without them) torch's advice would fail, and torch warns."""
    try:
        with open(sysfs) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def prefer_huge_pages(sysfs: str = THP_SYSFS) -> bool:
    """Ask torch to place its large CPU tensors on huge pages (`THP_MEM_ALLOC_ENABLE=1`), unless the user set
    the variable or the kernel has none to give; returns whether torch's setting is now on. It takes effect only
    if torch has not allocated CPU memory yet in this process (torch reads it once), which is why
    `tune_host_memory` comes first; a process that allocated first keeps 4 KiB pages. `hpctrain doctor` shows
    what `train` does."""
    if THP_ENV not in os.environ and huge_pages_possible(sysfs):
        os.environ[THP_ENV] = "1"
    return os.environ.get(THP_ENV) == "1"


def huge_pages_missed() -> bool:
    """Whether huge pages were asked for but torch did not take the setting: it had allocated CPU memory before
    the setting was made (torch reads it once). Probed: with the setting, torch puts a tensor of 2 MiB or
    more on a page boundary; without it, on 64 bytes (two probes on page boundaries by chance: 1 in 4096).
    A process that has not imported torch yet cannot have missed it (and is not made to import it here)."""
    if os.environ.get(THP_ENV) != "1" or "torch" not in sys.modules or not huge_pages_possible():
        return False
    import torch

    probes = [torch.empty(THP_PROBE_BYTES, dtype=torch.uint8) for _ in range(2)]
    return any(p.data_ptr() % PAGE_BYTES for p in probes)


HUGE_PAGES_MISSED = ("torch allocated CPU memory before hpctrain asked it for huge pages, so its large tensors sit "
                     "on 4 KiB pages and gradient allreduces between the ranks of a node run slower: call "
                     "hpctrain.tune_host_memory() before building the model, or export THP_MEM_ALLOC_ENABLE=1 before "
                     "starting Python (HPCTRAIN_HOST_TUNING=0 turns the tuning and this warning off)")


@dataclass(frozen=True, slots=True)
class HostTuning:
    """What `tune_host_memory` did to this process."""

    huge_pages: bool  # torch's THP_MEM_ALLOC_ENABLE is 1 (ours, or the user's own)
    reuse_freed: bool  # glibc keeps freed memory for the next step (our mallopt)
    late: bool = False  # huge pages asked for, but torch had allocated first and keeps 4 KiB pages
    off: bool = False  # opted out: the process was left as it is

    def line(self) -> str:
        """One line for a run's log."""
        if self.off:
            return f"host memory: left as it is ({OPT_OUT_ENV}=0 or tune_host_memory(False))"
        pages = ("huge pages asked too late (torch had allocated)" if self.late else
                 f"huge pages {'on' if self.huge_pages else 'off'} ({THP_ENV}={os.environ.get(THP_ENV, 'unset')})")
        freed = "freed memory kept for reuse (mallopt)" if self.reuse_freed else "allocator left as it is"
        return f"host memory: {pages}, {freed}; {OPT_OUT_ENV}=0 turns this off"


_applied: HostTuning | None = None


def opted_out(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the user turned the tuning off (`HPCTRAIN_HOST_TUNING=0`, `off`, `false` or `no`)."""
    return environ.get(OPT_OUT_ENV, "1").strip().lower() in ("0", "off", "false", "no")


def tune_host_memory(enable: bool = True) -> HostTuning:
    """Tune this process's host memory for training: ask torch for huge pages under its large CPU tensors
    (`prefer_huge_pages`) and keep freed memory for the next step (`reuse_freed_memory`). Both are process-wide,
    which is why nothing does it at import: call it before the model is built (torch takes the huge pages only
    before its first CPU allocation). `hpctrain train` and `hpctrain.init()` call it; a call that comes too late
    for the huge pages warns once, on rank 0, at the caller's line. `enable=False` or `HPCTRAIN_HOST_TUNING=0`
    leaves the process as it is. The user's own THP_MEM_ALLOC_ENABLE and MALLOC_* settings are kept. Returns what
    was done (`HostTuning.line()` says it in a line); safe to call again."""
    global _applied
    if not enable or opted_out():
        _applied = HostTuning(huge_pages=False, reuse_freed=False, off=True)
        return _applied
    huge = prefer_huge_pages()
    tuning = HostTuning(huge_pages=huge, reuse_freed=reuse_freed_memory(), late=huge and huge_pages_missed())
    if tuning.late and not (_applied is not None and _applied.late):
        from .rankenv import read_env

        if read_env().rank in (None, 0):
            warnings.warn(HUGE_PAGES_MISSED, stacklevel=_caller_outside_hpctrain())
    _applied = tuning
    return tuning


def tune_unless_decided() -> HostTuning:
    """`tune_host_memory()`, unless this process called it already: `hpctrain.init()` and `hvd.init()` make it, and
    a script's own earlier call (`tune_host_memory(False)` included) stands."""
    return _applied if _applied is not None else tune_host_memory()


def host_tuning_line() -> str:
    """What `tune_host_memory` last did in this process, in one line for a run's log."""
    if _applied is None:
        return "host memory: not tuned in this process (hpctrain.tune_host_memory() before the model tunes it)"
    return _applied.line()


def _caller_outside_hpctrain() -> int:
    """The stacklevel of the nearest caller outside the hpctrain package: a warning names the user's line, whether
    they called `tune_host_memory` or `hpctrain.init()` / `hvd.init()`."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level


def reuse_freed_memory() -> bool:
    """Keep freed memory of up to 32 MiB per allocation in the process for the next step (once per process);
    returns whether the allocator was told so. Part of `tune_host_memory`."""
    global _done
    if _done:
        return True
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    try:
        # The process's own symbols hold libc's: ctypes.util.find_library would run `ldconfig -p` in a
        # subprocess, a child of every rank in the middle of its start-up.
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): its allocator decides
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _done


def give_back_freed_memory() -> bool:
    """Hand the memory freed so far back to the OS (glibc's `malloc_trim`): after a start-up that freed much
    (ZeRO 3: the whole model built, then all but this rank's slices freed), and at ZeRO 3 before the backward
    of a unit too large for glibc to keep (its parameters and gradient are mapped afresh anyway); what steps
    free is otherwise kept for the next step. Returns whether anything was given back."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))
