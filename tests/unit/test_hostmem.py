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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_it_starts_no_process() -> None:
    """A rank builds its gradient sync in the middle of its start-up, and a child process there (it was
    `ldconfig -p`, from ctypes.util.find_library) is one more process with the rank's environment for
    whoever counts or signals the ranks."""
    probe = ("import subprocess\n"
             "started = []\n"
             "real = subprocess.Popen.__init__\n"
             "def record(self, args, *a, **k):\n"
             "    started.append(args)\n"
             "    real(self, args, *a, **k)\n"
             "subprocess.Popen.__init__ = record\n"
             "from hpctrain.base.hostmem import reuse_freed_memory\n"
             "print(reuse_freed_memory(), started)\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60,
                         env=clean).stdout.strip()
    assert out == "True []", out


HUGE_PROBE = ("import os, sys\n"
              "import hpctrain, torch\n"
              "t = torch.ones(8 << 20, dtype=torch.uint8)\n"
              "print(os.environ.get('THP_MEM_ALLOC_ENABLE'), t.data_ptr() % 4096 == 0)\n")


def _huge(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    return subprocess.run([sys.executable, "-c", HUGE_PROBE], capture_output=True, text=True, check=True, timeout=60,
                          env={**clean, **env}).stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_importing_hpctrain_puts_torchs_large_tensors_on_huge_pages_unless_the_user_chose() -> None:
    """torch (c10's alloc_cpu) page-aligns a large CPU tensor and advises huge pages for it only under
    THP_MEM_ALLOC_ENABLE=1, read at its first allocation: the import must set it before any tensor exists.
    Without it, torch aligns to 64 bytes (so page alignment is the mark; one chance in 64 of it by luck, which
    is why the user's own choice is checked only through the variable)."""
    from hpctrain.base.hostmem import huge_pages_possible

    if not huge_pages_possible():
        pytest.skip("this kernel gives no transparent huge pages (mode never): nothing to ask for")
    assert _huge() == "1 True"
    assert _huge(THP_MEM_ALLOC_ENABLE="0").startswith("0 ")


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
def test_init_warns_when_torch_allocated_before_hpctrain_was_imported(module: str) -> None:
    from hpctrain.base.hostmem import huge_pages_possible

    if not huge_pages_possible():
        pytest.skip("this kernel gives no transparent huge pages (mode never): nothing is missed")
    clean = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE" and not k.startswith("OMPI_COMM")}

    def run(first: str) -> str:
        return subprocess.run([sys.executable, "-c", INIT_PROBE.format(first=first, module=module)],
                              capture_output=True, text=True, check=True, timeout=120, env=clean).stdout.strip()

    # the model built, then hpctrain imported: torch took its setting before hpctrain could give it; the warning
    # points at the script's own line (`<string>`), not at hpctrain's
    assert run("") == "['torch allocated CPU memory before `import hpctrain` asked it for huge pages'] {'<string>'}"
    assert run(f"import {module}\n") == "[] set()"  # imported first, as at a script's top: nothing to say
