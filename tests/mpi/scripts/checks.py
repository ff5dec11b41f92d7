"""Under mpirun -n N: several check scripts one after another in each rank's one process, so that they share one
start-up (importing torch, the torch._dynamo import of the first optimizer step, MPI init) instead of paying one
each (tests/conftest.py `mpi_checks`).

argv: SCRIPT [ARG ...] [--- SCRIPT [ARG ...]] ...: each runs as `__main__` with its own sys.argv. A script that
fails ends the job at once, naming itself (exit 1): the other ranks would otherwise wait in its collectives."""

import os
import runpy
import sys
import traceback


def groups(argv: list[str]) -> list[list[str]]:
    out: list[list[str]] = [[]]
    for arg in argv:
        if arg == "---":
            out.append([])
        else:
            out[-1].append(arg)
    return [g for g in out if g]


def fail(script: str) -> None:
    traceback.print_exc()
    print(f"checks.py: {script} failed; the checks after it did not run", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


for argv in groups(sys.argv[1:]):
    sys.argv = argv
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            fail(argv[0])
    except BaseException:
        fail(argv[0])
    sys.stdout.flush()
