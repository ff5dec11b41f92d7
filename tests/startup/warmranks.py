"""Warm ranks: the suite's MPI ranks start from a process that has already imported torch.

Most of a rank's start-up is importing torch and the `torch._dynamo` that torch.optim's first step imports
(about 3 s of CPU), and the suite starts hundreds of ranks. Each pytest worker keeps one server (`serve`), a
Python process that has imported them once; a rank that `mpirun` starts for a test (its environment has
`OMPI_COMM_WORLD_RANK` and `HPCTRAIN_WARM_RANKS`, the server's socket), or `hpctrain train` or `plan` started
alone outside a Slurm job, hands itself over from
`sitecustomize` (`hand_over`) before its program runs: it sends the server its standard streams, its command
line, environment, working directory, umask and signal state, and the server forks a copy of itself that takes
them on and runs the program as `python` would have, and ends as `python` would, less freeing the modules it
shares with the server (`end`). The process `mpirun` started stays as the rank's stand-in:
it passes on every signal it can catch to the copy, and ends as the copy ended (its exit code, or the same
signal). The server kills a copy whose stand-in has died (kill -9 included).

What a warm rank cannot be: a process in `mpirun`'s tree. A test that finds ranks by walking the process tree
finds their stand-ins, and `copy_of` names the copy behind one (SIGSTOP, which a stand-in cannot pass on, goes
to both). A test that cannot look through a stand-in, or that measures start-up, runs with cold ranks:
`@pytest.mark.cold` (tests/conftest.py). MPI itself is never initialised in the server (importing
`mpi4py.MPI` does that), so each copy joins its job as a fresh process would; torch allocates nothing there
either, so a copy still takes `THP_MEM_ALLOC_ENABLE` from its own environment.

Only `python [-u] SCRIPT ARGS` and `python [-u] -m MODULE ARGS` hand over, with the interpreter flags the
server runs with; anything else (`-c`, `-X ...`, another interpreter) starts cold, as it would without this.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import select
import signal
import socket
import struct
import sys
import threading
from typing import NoReturn

SOCKET_VAR = "HPCTRAIN_WARM_RANKS"
_threads_alone = 0  # torch's threads in a fresh process with no MPI around (warm_up)
# what a rank of the suite imports: torch and what `hpctrain train`, bench and the library API import when
# they run (typer's parameter adapters bring pydantic); nothing that initialises MPI (mpi4py.MPI is kept out)
WARM_IMPORTS = ("torch", "torch._dynamo", "torch.optim", "numpy", "h5py", "hpctrain.cli.main", "typer._adapters",
                "hpctrain.control.trainer", "hpctrain.compute.gpt", "hpctrain.horovod", "hpctrain.bench.train",
                "hpctrain.api")
FORWARDED = tuple(getattr(signal, name) for name in (
    "SIGHUP", "SIGINT", "SIGQUIT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGCONT", "SIGTSTP", "SIGWINCH"))
HEADER = struct.Struct("!Q")


# ---- the rank's side: hand the process over and stand in for the copy --------------------------------------

def _program(argv: list[str]) -> dict | None:
    """What `python ARGV` runs, if it is a plain script or module run with no other interpreter options."""
    args = argv[1:]
    if args[:1] == ["-u"]:
        args = args[1:]
    if len(args) >= 2 and args[0] == "-m":
        return {"module": args[1], "argv": ["-m", *args[2:]], "path0": os.getcwd()}
    if args and not args[0].startswith("-"):
        script = os.path.abspath(args[0])
        return {"script": script, "argv": args, "path0": os.path.dirname(os.path.realpath(script))}
    return None


def _a_rank() -> bool:
    return "OMPI_COMM_WORLD_RANK" in os.environ


def _alone(program: dict) -> bool:
    """`hpctrain train` or `plan` with no launcher, outside a Slurm job (whose supervisor looks for the
    processes that catch SIGUSR2 in its tree, where a copy is not)."""
    return (program.get("module") == "hpctrain" and program["argv"][1:2] in (["train"], ["plan"])
            and "SLURM_JOB_ID" not in os.environ)


def _ignored() -> list[int]:
    return [int(s) for s in FORWARDED if signal.getsignal(s) is signal.SIG_IGN]


def hand_over() -> None:
    """Called from sitecustomize in a rank: returns (the rank starts cold) when it cannot hand over, and
    otherwise never returns: the process ends as the warm copy ended."""
    path = os.environ.get(SOCKET_VAR)
    program = _program(list(sys.orig_argv))
    if not path or program is None or sys._xoptions or not (_a_rank() or _alone(program)):
        return
    request = dict(program, env=dict(os.environ), cwd=os.getcwd(), path=list(sys.path), umask=_umask(),
                   ignored=_ignored(), mask=[int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])],
                   flags=_flags())
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(10)
        sock.connect(path)
        body = json.dumps(request).encode()
        socket.send_fds(sock, [HEADER.pack(len(body))], [0, 1, 2])
        sock.sendall(body)
        reply = _line(sock)
    except OSError:
        sock.close()
        return
    if reply is None or not reply.isdigit():  # the server refused (other flags): start cold
        sock.close()
        return
    _stand_in(sock, int(reply))


def _stand_in(sock: socket.socket, child: int) -> None:
    def forward(signum: int, _frame: object) -> None:
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    # Every signal is passed on, even one this process was started ignoring: the copy starts ignoring it too,
    # and the program may take it later (the trainer's SIGINT under a pytest-xdist worker, which ignores it).
    # A signal the rank was started with blocked (hpctrain launch holds its stop signals until the trainer
    # can take them) is blocked in the copy; here it is passed on at once, and waits there.
    for sig in FORWARDED:
        signal.signal(sig, forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    sock.settimeout(None)
    status = _line(sock)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if status is None or not status.lstrip("-").isdigit():
        os.write(2, b"warm rank: lost the server before the rank ended\n")
        os._exit(1)
    code = int(status)
    if os.WIFSIGNALED(code):
        sig = os.WTERMSIG(code)
        signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(code))


def _line(sock: socket.socket) -> str | None:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(64)
        if not chunk:
            return None
        data += chunk
    return data.decode().strip()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _flags() -> list:
    """What must match between a rank and the server for a copy of the server to be that rank."""
    return [sys.executable, sys.version, *(getattr(sys.flags, name) for name in (
        "optimize", "dont_write_bytecode", "no_user_site", "isolated", "ignore_environment", "safe_path",
        "dev_mode", "utf8_mode", "hash_randomization"))]


def _same_imports(path: list[str]) -> bool:
    """Whether the rank's module path finds the warm packages where the server found them."""
    extra = [entry for entry in path if entry not in sys.path]
    return not any(os.path.exists(os.path.join(entry or ".", top)) for entry in extra
                   for top in ("hpctrain", "torch", "numpy", "h5py"))


# ---- the server: import once, fork a copy per rank ---------------------------------------------------------

class _NoMPI:
    """An import hook that keeps `mpi4py.MPI` (MPI_Init) out of the server."""

    @staticmethod
    def find_spec(name: str, *_args: object) -> None:
        if name == "mpi4py.MPI":
            raise ImportError("not in the warm-rank server")


def warm_up() -> None:
    """Import as a rank would: under mpirun torch (its MKL) sees `OMPI_COMM_WORLD_LOCAL_SIZE` at import and
    keeps one thread per process. What it keeps with no MPI around (`hpctrain train` alone) is asked of a
    fresh interpreter, and a copy takes the one its process would have had."""
    import subprocess

    probe = subprocess.Popen([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                             stdout=subprocess.PIPE, text=True, env={k: v for k, v in os.environ.items()
                                                                     if not k.startswith(("OMP", "MKL_"))})
    sys.meta_path.insert(0, _NoMPI)  # type: ignore[arg-type]
    os.environ["OMPI_COMM_WORLD_LOCAL_SIZE"] = "1"
    try:
        for name in WARM_IMPORTS:
            __import__(name)
    finally:
        sys.meta_path.remove(_NoMPI)  # type: ignore[arg-type]
        del os.environ["OMPI_COMM_WORLD_LOCAL_SIZE"]
    out, _ = probe.communicate(timeout=300)
    global _threads_alone
    _threads_alone = int(out)
    assert "mpi4py.MPI" not in sys.modules


def serve(path: str) -> tuple[dict, list[int]]:
    """Accept ranks until killed. Returns only in a forked copy: its request and streams. The server kills a
    copy whose stand-in has ended (its connection closed), and tells the stand-in how its copy ended."""
    warm_up()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(128)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket | None] = {}  # a copy's stand-in, None once that has ended
    print("ready", flush=True)
    while True:
        ready, _, _ = select.select([listener, wake_r, *filter(None, children.values())], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            _reap(children)
        for pid, conn in list(children.items()):
            if conn is not None and conn in ready and not _recv_or_eof(conn):  # the stand-in is gone (kill -9)
                _kill(pid)
                conn.close()
                children[pid] = None
        if listener not in ready:
            continue
        conn, _ = listener.accept()
        got = _receive(conn)
        if got is None:
            continue
        request, fds = got
        if request["flags"] != _flags() or not _same_imports(request["path"]):
            conn.sendall(b"cold\n")
            conn.close()
            for fd in fds:
                os.close(fd)
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        # The stand-in passes signals on from the moment it learns the copy's pid: until the copy has taken the
        # rank's handlers and mask (`become`) they wait in it, as they would in the rank (one that `hpctrain
        # launch` starts with its stop signals blocked keeps them pending), instead of ending it by the default
        # action the copy has from the server.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            for fd in (wake_r, wake_w):
                os.close(fd)
            listener.close()
            for other in (conn, *filter(None, children.values())):
                other.close()
            return request, fds
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for fd in fds:
            os.close(fd)
        children[pid] = conn
        _register(path, pid, conn)
        try:
            conn.sendall(f"{pid}\n".encode())
        except OSError:  # the stand-in died while it handed over (a stop signal early in its start-up)
            _kill(pid)
            conn.close()
            children[pid] = None
        _reap(children)


def _recv_or_eof(conn: socket.socket) -> bool:
    """Reads what a stand-in sent (it sends nothing after its request); False at its end."""
    try:
        return bool(conn.recv(64))
    except OSError:
        return False


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _receive(conn: socket.socket) -> tuple[dict, list[int]] | None:
    try:
        conn.settimeout(10)
        head, fds, _, _ = socket.recv_fds(conn, HEADER.size, 3)
        if len(head) != HEADER.size or len(fds) != 3:
            raise OSError("short request")
        size = HEADER.unpack(head)[0]
        body = b""
        while len(body) < size:
            chunk = conn.recv(size - len(body))
            if not chunk:
                raise OSError("short request")
            body += chunk
        conn.settimeout(None)
        return json.loads(body), fds
    except (OSError, ValueError):
        conn.close()
        return None


_LINKS: dict[int, str] = {}  # copy -> the link that names it after its stand-in, for `copy_of`


def _register(path: str, pid: int, conn: socket.socket) -> None:
    """Note which copy stands behind the connected stand-in: a link `PATH.copies/of-STANDIN` -> copy's pid."""
    standin = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[0]
    os.makedirs(path + ".copies", exist_ok=True)
    link = os.path.join(path + ".copies", f"of-{standin}")
    if os.path.lexists(link):  # a stand-in of the same pid before
        os.unlink(link)
    os.symlink(str(pid), link)
    _LINKS[pid] = link


def _unregister(pid: int) -> None:
    link = _LINKS.pop(pid, None)
    if link is not None and os.path.lexists(link) and os.readlink(link) == str(pid):
        os.unlink(link)


def copy_of(pid: int) -> int | None:
    """The warm copy that the stand-in `pid` of this process's server passes its signals to, if it is one: a
    test that looks at a rank's own state (which signals it holds) looks there."""
    path = os.environ.get(SOCKET_VAR)
    if not path or path == "0":
        return None
    try:
        return int(os.readlink(os.path.join(path + ".copies", f"of-{pid}")))
    except (OSError, ValueError):
        return None


def with_copy(pid: int) -> list[int]:
    """Where a SIGSTOP to the rank `pid` must go, copy first: its warm copy (if it is a stand-in), then `pid`.
    A stand-in cannot pass SIGSTOP on, and a stopped stand-in alone leaves the rank computing."""
    copy = copy_of(pid)
    return [pid] if copy is None else [copy, pid]


def _reap(children: dict[int, socket.socket | None]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _unregister(pid)
        conn = children.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(f"{status}\n".encode())
            except OSError:
                pass
            conn.close()


def become(request: dict, fds: list[int]) -> None:
    """In the forked copy: take on the rank's streams, environment and signal state, and run its program."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    ignored = set(request["ignored"])
    for sig in (*FORWARDED, signal.SIGCHLD):
        if int(sig) in ignored:
            signal.signal(sig, signal.SIG_IGN)
        elif sig == signal.SIGINT:
            signal.signal(sig, signal.default_int_handler)
        else:
            signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, request["mask"])
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    os.environ.clear()
    os.environ.update(request["env"])
    threads = request["env"].get("MKL_NUM_THREADS") or request["env"].get("OMP_NUM_THREADS")
    if not (threads and threads.isdigit() and int(threads) > 0):  # torch reads them at import, else:
        threads = "1" if "OMPI_COMM_WORLD_LOCAL_SIZE" in request["env"] else str(_threads_alone)
    import torch

    torch.set_num_threads(int(threads))
    sys.path[:] = [request["path0"], *request["path"]]
    sys.argv = list(request["argv"])


def run(request: dict) -> None:
    import runpy
    import types

    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    if "module" in request:
        runpy._run_module_as_main(request["module"])  # type: ignore[attr-defined]  # what `python -m` calls
        return
    script = request["script"]
    with open(script, "rb") as fh:
        code = compile(fh.read(), script, "exec")
    main.__dict__.update(__file__=script, __builtins__=__builtins__, __cached__=None)
    exec(code, main.__dict__)


def end(request: dict) -> NoReturn:
    """Run the program and end the copy as the interpreter would, less tearing down the modules the copy
    shares with the server (torch's take about 0.8 s of CPU to free, at every exit): the program's own
    objects go, non-daemon threads are joined, atexit runs, MPI is finalised (mpi4py asks for that at the
    very end of the interpreter's teardown), the streams are flushed; then the exit code, or SIGINT for a
    KeyboardInterrupt nothing caught."""
    code, interrupted = 0, False
    try:
        run(request)
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException as exc:  # what the interpreter prints for an uncaught exception, from the program on
        interrupted = isinstance(exc, KeyboardInterrupt)
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    main = sys.modules.get("__main__")
    if main is not None:
        main.__dict__.clear()
    gc.collect()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized() and \
            getattr(sys.modules["mpi4py"].rc, "finalize", None) is not False:
        mpi.Finalize()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            code = code or 120
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    _request, _fds = serve(sys.argv[1])
    become(_request, _fds)
    del _fds
    end(_request)
