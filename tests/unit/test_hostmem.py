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


def test_a_gradient_sync_leaves_the_allocator_alone() -> None:
    """The allocator is tuned where that is decided (`tune_host_memory`: `train`, `init()`), not as a side effect
    of building a gradient sync."""
    then = ("import torch\n"
            "from hpctrain.comm import GradSync, world\n"
            "GradSync(torch.nn.Linear(4, 2).parameters(), world(), overlap=False).close()\n")
    assert _untouched("hpctrain", then) == UNTOUCHED


IMPORT_PROBE = ("import ctypes, os, sys\n"
                "asked = []\n"
                "class Libc:\n"
                "    def __init__(self, *a, **k):\n"
                "        self.real = real(*a, **k)\n"
                "    def __getattr__(self, name):\n"
                "        asked.append(name)\n"
                "        return getattr(self.real, name)\n"
                "real, ctypes.CDLL = ctypes.CDLL, Libc\n"
                "before = dict(os.environ)\n"
                "import {module}\n"
                "{then}"
                "changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))\n"
                "from hpctrain.base import hostmem\n"
                "print(changed, [a for a in asked if a == 'mallopt'], hostmem.host_tuning_line())\n")


UNTOUCHED = "[] [] host memory: not tuned in this process (hpctrain.tune_host_memory() before the model tunes it)"


def _untouched(module: str, then: str = "") -> str:
    """What importing `module` (and running `then`) changed in a fresh process: the environment variables, the
    allocator calls asked of libc, the tuning recorded."""
    clean = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE" and not k.startswith("MALLOC_")}
    return subprocess.run([sys.executable, "-c", IMPORT_PROBE.format(module=module, then=then)], capture_output=True,
                          text=True, check=True, timeout=120, env=clean).stdout.strip()


@pytest.mark.parametrize("module", ["hpctrain", "hpctrain.horovod"])
def test_importing_hpctrain_changes_nothing_process_wide(module: str) -> None:
    """No environment variable set, no allocator option (mallopt) asked for, no tuning recorded: the import is
    not where a process's memory is decided."""
    assert _untouched(module) == UNTOUCHED


HUGE_PROBE = ("import os, sys\n"
              "import hpctrain\n"
              "print(hpctrain.tune_host_memory().line())\n"
              "import torch\n"
              "t = torch.ones(8 << 20, dtype=torch.uint8)\n"
              "print(os.environ.get('THP_MEM_ALLOC_ENABLE'), t.data_ptr() % 4096 == 0)\n")


def _huge(**env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("THP_MEM_ALLOC_ENABLE", "HPCTRAIN_HOST_TUNING")}
    return subprocess.run([sys.executable, "-c", HUGE_PROBE], capture_output=True, text=True, check=True, timeout=60,
                          env={**clean, **env}).stdout.strip().splitlines()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_tuning_puts_torchs_large_tensors_on_huge_pages_unless_the_user_chose() -> None:
    """torch (c10's alloc_cpu) page-aligns a large CPU tensor and advises huge pages for it only under
    THP_MEM_ALLOC_ENABLE=1, read at its first allocation: the tuning must set it before any tensor exists.
    Without it, torch aligns to 64 bytes (so page alignment is the mark; one chance in 64 of it by luck, which
    is why the user's own choice is checked only through the variable)."""
    from hpctrain.base.hostmem import huge_pages_possible

    if not huge_pages_possible():
        pytest.skip("this kernel gives no transparent huge pages (mode never): nothing to ask for")
    line, pages = _huge()
    assert pages == "1 True" and line.startswith("host memory: huge pages on (THP_MEM_ALLOC_ENABLE=1)"), line
    assert _huge(THP_MEM_ALLOC_ENABLE="0")[1].startswith("0 ")
    for off in ("0", "off"):  # the opt-out: the process left as it is
        line, pages = _huge(HPCTRAIN_HOST_TUNING=off)
        assert line.startswith("host memory: left as it is") and pages.startswith("None "), (line, pages)


def test_huge_pages_are_asked_for_only_where_the_kernel_has_them(tmp_path, monkeypatch) -> None:
    from hpctrain.base import hostmem

    monkeypatch.delenv(hostmem.THP_ENV, raising=False)
    never = tmp_path / "never"
    never.write_text("always madvise [never]\n")
    assert not hostmem.prefer_huge_pages(str(never)) and hostmem.THP_ENV not in os.environ
    assert not hostmem.prefer_huge_pages(str(tmp_path / "absent")) and hostmem.THP_ENV not in os.environ
    madvise = tmp_path / "madvise"
    madvise.write_text("always [madvise] never\n")
    assert hostmem.prefer_huge_pages(str(madvise)) and os.environ[hostmem.THP_ENV] == "1"
    monkeypatch.setenv(hostmem.THP_ENV, "0")
    assert not hostmem.prefer_huge_pages(str(madvise)) and os.environ[hostmem.THP_ENV] == "0"


INIT_PROBE = ("import warnings\n"
              "import torch\n"
              "{first}"
              "model = torch.nn.Linear(784, 2048)\n"
              "import {module} as lib\n"
              "with warnings.catch_warnings(record=True) as seen:\n"
              "    warnings.simplefilter('always')\n"
              "    lib.init()\n"
              "print([str(w.message).split(',')[0] for w in seen if 'huge pages' in str(w.message)],\n"
              "      {{w.filename for w in seen if 'huge pages' in str(w.message)}})\n")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
@pytest.mark.parametrize("module", ["hpctrain", "hpctrain.horovod"])
def test_init_tunes_and_warns_when_torch_allocated_before_the_tuning(module: str) -> None:
    from hpctrain.base.hostmem import huge_pages_possible

    if not huge_pages_possible():
        pytest.skip("this kernel gives no transparent huge pages (mode never): nothing is missed")
    clean = {k: v for k, v in os.environ.items()
             if k not in ("THP_MEM_ALLOC_ENABLE", "HPCTRAIN_HOST_TUNING") and not k.startswith("OMPI_COMM")}

    def run(first: str, **env: str) -> str:
        return subprocess.run([sys.executable, "-c", INIT_PROBE.format(first=first, module=module)],
                              capture_output=True, text=True, check=True, timeout=120, env={**clean, **env}).stdout.strip()

    # the model built, then init(): torch took its setting before hpctrain could give it; the warning points at
    # the script's own line (`<string>`), not at hpctrain's
    assert run("") == "['torch allocated CPU memory before hpctrain asked it for huge pages'] {'<string>'}"
    # tuned first, as at a script's top: nothing to say
    assert run("import hpctrain\nhpctrain.tune_host_memory()\n") == "[] set()"
    assert run("", HPCTRAIN_HOST_TUNING="0") == "[] set()"  # opted out: nothing asked, nothing missed
    assert run("import hpctrain\nhpctrain.tune_host_memory(False)\n") == "[] set()"  # the script's choice stands


def test_the_opt_out_takes_the_usual_spellings() -> None:
    from hpctrain.base.hostmem import opted_out

    assert [opted_out({"HPCTRAIN_HOST_TUNING": v}) for v in ("0", "off", "False", " no ")] == [True] * 4
    assert [opted_out(e) for e in ({}, {"HPCTRAIN_HOST_TUNING": "1"}, {"HPCTRAIN_HOST_TUNING": "on"})] == [False] * 3
