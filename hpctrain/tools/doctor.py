"""`hpctrain doctor`: what each rank sees, and what is wrong with it, each problem with a one-line fix.

Three steps, so the judgement can be tested on any facts: `collect()` gathers this rank's facts (MPI library,
thread level and CUDA-aware support from the comm layer's run-time probe, the launcher and Slurm environment, the
GPUs visible and the one this rank would use, HDF5's version and file locking, torch's threads against the CPUs
the rank owns); `problems(facts)` is a pure function from those facts to problems; `doctor(comm)` runs both on every
rank and gathers the reports, so every rank returns the same combined report. `format_report()` renders it.
"""

from __future__ import annotations

import os
import platform
import socket
from typing import Any

from .. import __version__
from ..base.rankenv import RankEnv, read_env, select_device
from ..base.errors import HpctrainError

# CUDA_VISIBLE_DEVICES values that give a process no GPU.
_NO_GPU = ("", "-1", "NoDevFiles", "none")


def _gpus_assigned(cuda_visible_devices: str | None) -> bool:
    return cuda_visible_devices is not None and cuda_visible_devices.strip() not in _NO_GPU


def mpi_facts() -> dict[str, Any]:
    """The MPI library as the comm layer sees it; rank and size are COMM_WORLD's (what the launcher wired up)."""
    from ..comm import mpi_info, world

    try:
        info = mpi_info()
        comm_world = world()
    except HpctrainError as exc:
        return {"error": str(exc)}
    return {
        "library": info.library.replace("\x00", "").strip(),
        "mpi_version": info.mpi_version,
        "mpi4py": info.mpi4py_version,
        "thread_level": info.thread_level,
        "cuda_aware": info.cuda_aware,
        "rank": comm_world.rank,
        "world_size": comm_world.size,
    }


def torch_facts(env: RankEnv) -> dict[str, Any]:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - depends on the install
        return {"error": f"cannot import torch ({exc})"}
    available = torch.cuda.is_available()
    return {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": torch.cuda.device_count() if available else 0,
        "threads": torch.get_num_threads(),
        "cpus_owned": env.torch_threads(),
        "cpus_available": env.cpus_available,
        "huge_pages": huge_pages_text(),
    }


def huge_pages_text() -> str:
    """Whether torch places large CPU tensors on huge pages in a training process here (`hpctrain train` and
    `hpctrain.init()` ask for them: `base.hostmem.tune_host_memory`), unless the user chose."""
    from ..base.hostmem import OPT_OUT_ENV, THP_ENV, huge_pages_possible, opted_out

    if not huge_pages_possible():
        return "off (the kernel gives none)"
    value = os.environ.get(THP_ENV)
    if value is not None:
        return "on" if value == "1" else f"off ({THP_ENV}={value})"
    return f"off ({OPT_OUT_ENV}={os.environ[OPT_OUT_ENV]})" if opted_out() else "on"


def hdf5_facts() -> dict[str, Any]:
    from ..data.hdf5env import file_locking

    try:
        import h5py
    except ImportError as exc:  # pragma: no cover - depends on the install
        return {"error": f"cannot import h5py ({exc})"}
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    try:
        default = tuple(bool(x) for x in fapl.get_file_locking())
    except AttributeError:  # pragma: no cover - HDF5 older than 1.12.1 has no locking property
        default = (True, False)
    locking = file_locking(default)  # type: ignore[arg-type]
    return {"h5py": h5py.version.version, "hdf5": h5py.version.hdf5_version, "file_locking": locking.mode,
            "source": locking.source, "raw": locking.raw, "valid": locking.valid}


def collect(mpi_started: bool = True, env: RankEnv | None = None) -> dict[str, Any]:
    """This rank's facts (`mpi_started` False: MPI could not start, so it is not asked)."""
    env = read_env() if env is None else env
    torch = torch_facts(env)
    visible = torch.get("gpus", 0)
    device, device_error = None, None
    try:
        device = select_device(env, visible)
    except HpctrainError as exc:
        device_error = str(exc)
    mpi = mpi_facts() if mpi_started else {"error": "MPI did not start"}
    return {
        "rank": mpi.get("rank", env.rank or 0),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "hpctrain": __version__,
        "mpi": mpi,
        "launcher": {
            "name": env.launcher, "rank": env.rank, "world_size": env.world_size, "local_rank": env.local_rank,
            "local_size": env.local_size, "slurm_job_id": env.job_id, "node": env.node_name,
            "cpus_per_task": env.cpus_per_task, "restart_count": env.restart_count,
        },
        "gpus": {"cuda_visible_devices": env.cuda_visible_devices, "visible": visible, "device": device,
                 "device_error": device_error},
        "hdf5": hdf5_facts(),
        "torch": torch,
    }


def _problem(check: str, message: str, fix: str) -> dict[str, str]:
    return {"check": check, "message": message, "fix": fix}


def problems(facts: dict[str, Any]) -> list[dict[str, str]]:
    """The problems in one rank's facts (a pure function), each with a one-line fix."""
    problems = []
    mpi, launcher, gpus, torch, hdf5 = (facts[k] for k in ("mpi", "launcher", "gpus", "torch", "hdf5"))
    visible = gpus["visible"]
    if "error" in mpi:
        problems.append(_problem(
            "mpi", f"MPI is not usable: {mpi['error']}",
            "install an MPI and an mpi4py built against it (Debian: apt-get install openmpi-bin libopenmpi-dev; "
            "pip install --no-binary mpi4py mpi4py), or run in the hpctrain image (hpctrain container recipe)"))
    else:
        library = short_library(mpi["library"])
        if mpi["thread_level"] != "multiple":
            problems.append(_problem(
                "thread-level", f"{library} provides MPI_THREAD_{mpi['thread_level'].upper()}, but hpctrain "
                "overlaps gradient allreduce with backward on a second thread (needs MPI_THREAD_MULTIPLE)",
                "use an MPI built with thread support (Open MPI over UCX: UCX configured --enable-mt), "
                "e.g. the hpctrain image"))
        if launcher["name"] != "none" and launcher["world_size"] and launcher["world_size"] != mpi["world_size"]:
            problems.append(_problem(
                "launcher", f"{launcher['name']} started {launcher['world_size']} tasks but MPI sees a world of "
                f"{mpi['world_size']}: every task trains alone",
                "start the ranks with `srun --mpi=pmix` (see `srun --mpi=list`) or with the mpirun of the MPI "
                "that mpi4py was built against"))
        if visible > 0 and mpi["cuda_aware"] is not True:
            state = "is not CUDA-aware" if mpi["cuda_aware"] is False else "cannot say whether it is CUDA-aware"
            problems.append(_problem(
                "cuda-aware", f"{visible} GPU(s) visible but {library} {state}: every gradient bucket is copied "
                "through host memory",
                "run in the hpctrain image (hpctrain container recipe --mode hybrid) or load an Open MPI built "
                "with CUDA and UCX (check: ompi_info --parsable --all | grep mpi_built_with_cuda_support)"))
    if gpus["device_error"]:
        problems.append(_problem("gpu-device", gpus["device_error"],
                                 "start at most one task per visible GPU (hpctrain submit --gpus G)"))
    if "error" in torch:
        problems.append(_problem("torch", torch["error"], "pip install torch (see the README for the pinned version)"))
    else:
        assigned = _gpus_assigned(gpus["cuda_visible_devices"])
        if assigned and torch["cuda"] is None:
            problems.append(_problem(
                "torch-cuda", f"the launcher gave this rank GPU(s) (CUDA_VISIBLE_DEVICES="
                f"{gpus['cuda_visible_devices']}) but torch {torch['version']} is a CPU-only build",
                f"pip install torch=={torch['version'].split('+')[0]} --index-url "
                "https://download.pytorch.org/whl/cu129 (the cuXY your driver supports), or run in the hpctrain image"))
        elif assigned and visible == 0:
            problems.append(_problem(
                "gpu-visible", f"CUDA_VISIBLE_DEVICES={gpus['cuda_visible_devices']} but torch finds no GPU "
                "(no NVIDIA driver in reach)",
                "in a container pass --nv (apptainer exec --nv ...); on the host check that nvidia-smi works"))
        if torch["threads"] > torch["cpus_owned"]:
            owned = torch["cpus_owned"]
            problems.append(_problem(
                "torch-threads", f"torch would use {torch['threads']} threads but this rank owns {owned} CPU(s) "
                f"({launcher['local_size']} rank(s) on {torch['cpus_available']} CPU(s)): ranks oversubscribe "
                "the cores",
                f"export OMP_NUM_THREADS={owned} (hpctrain train sets {owned} itself; your own loops should call "
                f"torch.set_num_threads({owned}))"))
        cpt = launcher["cpus_per_task"]
        if cpt and cpt > torch["cpus_available"]:
            problems.append(_problem(
                "cpus-per-task", f"Slurm allotted {cpt} CPUs per task but this rank may run on only "
                f"{torch['cpus_available']}: since Slurm 22.05 srun does not inherit --cpus-per-task from sbatch",
                "export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK before srun, or pass srun -c explicitly"))
    if "error" in hdf5:
        problems.append(_problem("hdf5", hdf5["error"], "pip install h5py"))
    elif not hdf5["valid"]:
        problems.append(_problem(
            "hdf5-locking", f"HDF5 ignores HDF5_USE_FILE_LOCKING={hdf5['raw']!r}: it is not a value HDF5 knows",
            "set HDF5_USE_FILE_LOCKING to FALSE (shared file systems without flock), TRUE or BEST_EFFORT"))
    return problems


def short_library(library: str) -> str:
    """'Open MPI v4.1.4, package: ...' -> 'Open MPI v4.1.4'; 'MPICH Version: 4.3.2 ...' -> 'MPICH 4.3.2'."""
    first = library.split(",")[0].strip()
    if first.startswith("MPICH Version:"):
        return "MPICH " + first.split(":", 1)[1].split()[0]
    return first


def doctor(comm: Any = None) -> dict[str, Any]:
    """Check every rank of `comm` (an hpctrain Comm; COMM_WORLD unless given, and one process without a launcher
    is a world of one).

    Returns the same report on every rank: `ok`, `world_size`, `problems` (each with the ranks it was seen on)
    and `ranks` (every rank's facts and problems, in rank order).
    """
    if comm is None:
        from ..comm import world

        try:
            comm = world()
        except HpctrainError:
            comm = None
    facts = collect(mpi_started=comm is not None)
    facts["problems"] = problems(facts)
    reports = comm.allgather(facts) if comm is not None else [facts]
    merged: dict[tuple[str, str, str], list[int]] = {}
    for report in reports:
        for p in report["problems"]:
            merged.setdefault((p["check"], p["message"], p["fix"]), []).append(report["rank"])
    found = [{"check": c, "message": m, "fix": f, "ranks": r} for (c, m, f), r in merged.items()]
    return {"ok": not found, "world_size": len(reports), "problems": found, "ranks": reports}


def format_report(report: dict[str, Any]) -> str:
    """The report as text: rank 0's view, one line per rank when there are several, then the problems."""
    first = report["ranks"][0]
    n = report["world_size"]
    hosts = sorted({r["host"] for r in report["ranks"]})
    lines = [f"hpctrain doctor: {n} rank{'s' if n != 1 else ''} on {', '.join(hosts)} "
             f"(hpctrain {first['hpctrain']}, Python {first['python']})"]

    def row(name: str, text: str) -> None:
        lines.append(f"  {name:<11} {text}")

    mpi, launcher, gpus, torch, hdf5 = (first[k] for k in ("mpi", "launcher", "gpus", "torch", "hdf5"))
    if "error" in mpi:
        row("MPI", f"not usable: {mpi['error']}")
    else:
        library = short_library(mpi["library"])
        row("MPI", f"{library} (MPI {mpi['mpi_version']}), mpi4py {mpi['mpi4py']}, thread level "
                   f"{mpi['thread_level']}, world of {mpi['world_size']}")
        aware = mpi["cuda_aware"]
        text = {True: f"yes: {library} can take GPU memory", False: f"no: {library} cannot take GPU memory",
                None: f"unknown: {library} does not say"}[aware]
        if aware is not True and not gpus["visible"]:
            text += " (not needed here: no GPU visible)"
        row("CUDA-aware", text)
    cvd = gpus["cuda_visible_devices"]
    device = gpus["device"] or f"none ({gpus['device_error']})"
    row("GPUs", f"{gpus['visible']} visible (CUDA_VISIBLE_DEVICES={'unset' if cvd is None else cvd}); "
                f"rank {first['rank']} uses {device}")
    if launcher["name"] == "none":
        where = "none (a single process)"
    else:
        where = (f"{launcher['name']}: rank {launcher['rank']} of {launcher['world_size']}, local rank "
                 f"{launcher['local_rank']} of {launcher['local_size']}")
    slurm = (f"Slurm job {launcher['slurm_job_id']} on node {launcher['node']}, cpus-per-task "
             f"{launcher['cpus_per_task'] or 'unset'}, restarts {launcher['restart_count']}"
             if launcher["slurm_job_id"] else "no Slurm job")
    row("Launcher", f"{where}; {slurm}")
    if "error" in hdf5:
        row("HDF5", hdf5["error"])
    else:
        row("HDF5", f"h5py {hdf5['h5py']}, HDF5 {hdf5['hdf5']}, file locking {hdf5['file_locking']} "
                    f"({hdf5['source']})")
    if "error" in torch:
        row("torch", torch["error"])
    else:
        build = f"CUDA {torch['cuda']}" if torch["cuda"] else "CPU-only build"
        row("torch", f"{torch['version']} ({build}), {torch['threads']} thread(s); this rank owns "
                     f"{torch['cpus_owned']} of {torch['cpus_available']} CPU(s); huge pages "
                     f"{torch.get('huge_pages', 'unknown')}")
    if n > 1:
        lines.append("  ranks:")
        for r in report["ranks"]:
            t = r["torch"]
            threads = f"{t['threads']} threads/{t['cpus_owned']} CPUs" if "error" not in t else "torch missing"
            lines.append(f"    rank {r['rank']:<4} {r['host']:<16} local {r['launcher']['local_rank']:<3} "
                         f"device {r['gpus']['device'] or '-':<8} {threads}, "
                         f"{len(r['problems'])} problem(s)")
    if not report["problems"]:
        lines.append("no problems found")
    else:
        lines.append(f"{len(report['problems'])} problem(s):")
        for p in report["problems"]:
            ranks = ", ".join(map(str, p["ranks"]))
            lines.append(f"  [{p['check']}] rank{'s' if len(p['ranks']) > 1 else ''} {ranks}: {p['message']}")
            lines.append(f"      fix: {p['fix']}")
    return "\n".join(lines)
