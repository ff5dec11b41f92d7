"""Host memory for a training process: freed gradient memory is reused, not handed back to the OS.

Autograd hands over fresh gradient tensors every step (GradSync drops the old ones, as `zero_grad()` does).
glibc serves an allocation above its mmap threshold (dynamic, from 128 KiB) with a fresh mapping and
returns it to the OS on free, and trims the heap's free top above its trim threshold: every step then
page-faults its gradients in anew, which costs a large share of a step (docs/performance.md). Keeping a
fixed 32 MiB mmap threshold and a 1 GiB trim threshold avoids it: `reuse_freed_memory()` sets those two with `mallopt`; an allocation above 32 MiB
(glibc's largest threshold) is still mapped afresh. A process whose `MALLOC_MMAP_THRESHOLD_` or
`MALLOC_TRIM_THRESHOLD_` is set keeps its own choice; not glibc: nothing to do.

Huge pages (`prefer_huge_pages`, at `import hpctrain`): torch's CPU allocator places a tensor of 2 MiB or more
on a page boundary and advises transparent huge pages for it when `THP_MEM_ALLOC_ENABLE=1` (c10's
`alloc_cpu`; off by default). MPI moves a large message between ranks of a node by a single copy from the
other process's memory (Open MPI's vader BTL through CMA, `process_vm_readv`), which takes the source page
by page, so over 4 KiB pages an allreduce of a large gradient in torch memory is far slower than over huge
pages (numpy advises huge pages for its large arrays; torch only with the setting). The gradients autograd
hands over are torch memory. Huge pages pay only where memory is kept (above): a loop that faults its fresh
gradients' huge pages in anew every step is slower with them.
torch reads the variable once, at its first CPU allocation: hence the package import sets it, before any
model is built.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's maximum (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 1 << 30
THP_ENV = "THP_MEM_ALLOC_ENABLE"  # torch's (c10/core/alloc_cpu.cpp)
THP_SYSFS = "/sys/kernel/mm/transparent_hugepage/enabled"
THP_PROBE_BYTES = 4 << 20  # above torch's 2 MiB threshold for huge pages
PAGE_BYTES = 4096

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
    `import hpctrain` calls it; a process that allocated first keeps 4 KiB pages. `hpctrain doctor` shows the
    setting."""
    if THP_ENV not in os.environ and huge_pages_possible(sysfs):
        os.environ[THP_ENV] = "1"
    return os.environ.get(THP_ENV) == "1"


def huge_pages_missed() -> bool:
    """Whether huge pages were asked for but torch did not take the setting: it had allocated CPU memory before
    `import hpctrain` set it (torch reads it once). Probed: with the setting, torch puts a tensor of 2 MiB or
    more on a page boundary; without it, on 64 bytes (two probes on page boundaries by chance: 1 in 4096)."""
    if os.environ.get(THP_ENV) != "1" or not huge_pages_possible():
        return False
    import torch

    probes = [torch.empty(THP_PROBE_BYTES, dtype=torch.uint8) for _ in range(2)]
    return any(p.data_ptr() % PAGE_BYTES for p in probes)


HUGE_PAGES_MISSED = ("torch allocated CPU memory before `import hpctrain` asked it for huge pages, so its large "
                     "tensors sit on 4 KiB pages and gradient allreduces between the ranks of a node run up to 2x "
                     "slower: import hpctrain before building the model, or export THP_MEM_ALLOC_ENABLE=1 before "
                     "starting Python")


def warn_if_huge_pages_missed(rank: int) -> None:
    """The library entries' start (`hpctrain.init()`, `hvd.init()`): on rank 0, a warning when torch missed the
    huge pages (`huge_pages_missed`), pointing at the caller's script."""
    if rank == 0 and huge_pages_missed():
        import warnings

        warnings.warn(HUGE_PAGES_MISSED, stacklevel=3)


def reuse_freed_memory() -> bool:
    """Keep freed memory of up to 32 MiB per allocation in the process for the next step (once per process);
    returns whether the allocator was told so."""
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
