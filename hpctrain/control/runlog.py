"""What a run writes as it goes, besides checkpoints: the metrics and audit sink.

    RUN/metrics.jsonl          rank 0: one record per logged step (loss, lr, throughput, timing, validation)
    RUN/logs/rank-NNNN.jsonl   every rank: its own step timing (compute, comm, data), for `hpctrain report`
    RUN/samples/rank-NNNN.txt  with --audit-samples: `EPOCH SAMPLE_ID` per sample trained on
    RUN/tensorboard/           with --tensorboard (rank 0)
    RUN/logs/rank-NNNN.log     every rank's log (`setup_logging`)
    RUN/config.toml            rank 0: the resolved config (`write_config`)
    RUN/stopped.json           rank 0, after a stop: its step, signal and who asked (`record_stop`)
and on rank 0 a progress bar on a terminal, or one plain line per logged step in a log file (Slurm).

Only files: the reductions that make a record (loss over ranks, validation) are the trainer's. A resumed
run first cuts every file back to the checkpoint's step (`prepare`), so nothing trained after the
checkpoint, and redone now, appears twice. A write that fails while the run trains (a full disk) is not
raised where it happens, by this rank alone mid-step, but recorded once (`durable.FAULTS`): the checkpoint
policy stops every rank at the next step boundary with one line that says so.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ..base.config import write_toml
from ..base.sections import LoggingConfig
from ..base.errors import HpctrainError
from ..base.durable import FAULTS, write_failure, write_text
from ..base.progress import Progress
from ..base.stop import FLAG as STOP
from ..checkpoint.manager import step_dir_name


class RunFile:
    """A run file this rank appends to while it trains (metrics, timing, audit). A write that fails is recorded
    once in `durable.FAULTS` and later writes are dropped (a resumed run cuts the file back to its checkpoint
    anyway). Only a failure first seen when the file is closed is raised: nobody is left to report it."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.fh = open(self.path, "a")
        self.failed = False

    def write(self, text: str) -> int:
        if not self.failed:
            try:
                self.fh.write(text)
            except OSError as exc:
                self._fail(exc)
        return len(text)

    def flush(self) -> None:
        if not self.failed:
            try:
                self.fh.flush()
            except OSError as exc:
                self._fail(exc)

    def _fail(self, exc: OSError) -> None:
        self.failed = True
        FAULTS.record(write_failure(exc, self.path))

    def close(self) -> None:
        try:
            self.fh.close()
        except OSError as exc:
            if not self.failed and FAULTS.first is None:
                self.failed = True
                raise write_failure(exc, self.path) from None

    def __enter__(self) -> "RunFile":
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        if kind is None:
            self.close()
            return
        with contextlib.suppress(HpctrainError):  # the run already fails: that error is the one to report
            self.close()


class _LogHandler(logging.FileHandler):
    """A rank's log file. A line that cannot be written (a full disk) is recorded once in `durable.FAULTS`, and
    the lines after it are dropped; logging's default prints `--- Logging error ---` and a traceback for
    every line instead, pages of them on a full disk."""

    failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        exc = sys.exc_info()[1]
        if not isinstance(exc, OSError):  # a bad format string or the like: a bug, logging's report stays
            super().handleError(record)
            return
        self.failed = True
        FAULTS.record(write_failure(exc, Path(self.baseFilename)))

    def close(self) -> None:
        try:
            super().close()
        except OSError as exc:  # the last lines could not be written either
            if not self.failed and FAULTS.first is None:
                print(f"warning: {write_failure(exc, Path(self.baseFilename))}: the end of this log is lost",
                      file=sys.stderr, flush=True)
            self.failed = True


def setup_logging(run_dir: Path, rank: int) -> logging.Logger:
    """This rank's log, RUN/logs/rank-NNNN.log; a new run starts with no write failure recorded."""
    FAULTS.clear()
    log = logging.getLogger(f"hpctrain.rank{rank}")
    log.setLevel(logging.INFO)
    log.propagate = False
    for h in list(log.handlers):
        log.removeHandler(h)
        h.close()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    handler = _LogHandler(run_dir / "logs" / f"rank-{rank:04d}.log")
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank {rank} %(levelname)s %(message)s"))
    log.addHandler(handler)
    return log


class _AfterRunHandler(logging.Handler):
    """What a rank logs after its run closed the log (the trainer's last word on a failure, the traceback its
    one-line error points to) is appended to the same file, opened for each record: no file stays open, and
    nothing falls through to logging's last-resort handler, which prints it on the console. A line that
    cannot be written is dropped: the run is over, its error already said."""

    def __init__(self, path: Path, formatter: logging.Formatter | None):
        super().__init__()
        self.path = path
        self.setFormatter(formatter)

    def emit(self, record: logging.LogRecord) -> None:
        text = self.format(record) + "\n"
        with contextlib.suppress(OSError), open(self.path, "a") as fh:
            fh.write(text)


def close_logging(log: logging.Logger) -> None:
    """Close this rank's log at the end of its run (what is logged later is appended line by line); the run's
    write failures are reported by then, or moot."""
    for handler in list(log.handlers):
        log.removeHandler(handler)
        handler.close()
        if isinstance(handler, _LogHandler):
            log.addHandler(_AfterRunHandler(Path(handler.baseFilename), handler.formatter))
    FAULTS.clear()


def write_config(run_dir: Path, sections: dict[str, Any]) -> None:
    """The resolved config (`TrainConfig.to_sections()`), as TOML beside the run: `hpctrain train --config
    RUN/config.toml` repeats it."""
    with _writing(run_dir / "config.toml"):
        write_text(run_dir / "config.toml", write_toml(sections))


def record_stop(comm: Any, run_dir: Path, step: int) -> str:
    """After the stop's checkpoint (of `step`), on every rank: agree whether a person asked on any rank (a
    Ctrl-C that reached one rank; one small allreduce), and on rank 0 write RUN/stopped.json: the
    step, this rank's stop signal and who asked, "user" (a person: nothing requeues the run) or "scheduler"
    (a preemption or the time limit: the Slurm supervisor requeues it). A run that starts again removes it
    (`prepare`). Returns who asked. `train` and the library's `Checkpointer` both stop through here."""
    by = "user" if comm.allreduce_array([float(STOP.user)], op="max")[0] else "scheduler"
    if comm.rank == 0:
        record = {"step": step, "signal": signal.Signals(STOP.signum).name if STOP.signum else None, "asked_by": by,
                  "checkpoint": str(run_dir / "checkpoints" / step_dir_name(step)), "time": time.time()}
        with _writing(run_dir / "stopped.json"):
            write_text(run_dir / "stopped.json", json.dumps(record) + "\n")
    return by


def prepare(run_dir: Path, audit: bool, rank: int, step: int, audit_lines: dict[str, int] | None) -> None:
    """Make the run's files describe steps 1..`step` only (`audit`: --audit-samples). `audit_lines`: the line
    count of every audit file at the checkpoint (None: a fresh run, every file starts empty). Rank 0 owns the
    shared files."""
    metrics, timing, audit_dir = run_dir / "metrics.jsonl", _timing_path(run_dir, rank), run_dir / "samples"
    if audit_lines is not None:
        if rank == 0:
            _keep_steps(metrics, step)
            for path in audit_dir.glob("rank-*.txt") if audit_dir.is_dir() else ():
                if path.name in audit_lines:
                    _keep_lines(path, audit_lines[path.name])
                else:
                    path.unlink()
        _keep_steps(timing, step)
    else:
        for path in (metrics if rank == 0 else None, timing, _audit_path(run_dir, rank) if audit else None):
            if path is not None and path.exists():
                path.unlink()
    for done in ("summary.json", "stopped.json") if rank == 0 else ():
        if (run_dir / done).exists():
            (run_dir / done).unlink()  # a summary, or a stop, always describes the run that wrote it
    if audit:
        audit_dir.mkdir(parents=True, exist_ok=True)


class RunLog:
    """The open files of one rank's run and the window of steps since the last logged one."""

    def __init__(self, run_dir: Path, cfg: LoggingConfig, audit: bool, rank: int, log: logging.Logger,
                 stack: contextlib.ExitStack, *, total_steps: int, step: int, rates: Any = None):
        self.run_dir, self.cfg, self.rank, self.log, self.total_steps = run_dir, cfg, rank, log, total_steps
        self.rates = rates  # a language model's: targets per sample, and what tokens_per_s and mfu need
        self.targets = rates.targets if rates is not None else 1
        self.metrics = stack.enter_context(RunFile(run_dir / "metrics.jsonl")) if rank == 0 else None
        self.timing = stack.enter_context(RunFile(_timing_path(run_dir, rank)))
        audit_path = _audit_path(run_dir, rank)
        self.audit_lines = 0
        if audit and audit_path.exists():
            with open(audit_path, "rb") as fh:
                self.audit_lines = sum(1 for _ in fh)
        self.audit = stack.enter_context(RunFile(audit_path)) if audit else None
        self.tb = None
        if cfg.tensorboard and rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=step or None)
            stack.callback(self.tb.close)
        self.interactive = rank == 0 and cfg.progress and not cfg.json and sys.stderr.isatty()
        self.bar = stack.enter_context(Progress(total_steps, "train", enabled=self.interactive, unit="steps"))
        self.bar.update(step)
        self.window = _Window()

    def step(self, epoch: int, index: np.ndarray, loss: float, step_s: float, comm_s: float, data_s: float) -> None:
        """One step of this rank: `index` the ids of its samples, `loss` their summed loss."""
        n = len(index)
        if self.audit is not None and n:
            np.savetxt(self.audit, np.column_stack([np.full(n, epoch), index]), fmt="%d")
            self.audit_lines += n
        self.window.add(loss, n, step_s, comm_s, data_s)
        self.bar.update(1, loss=f"{loss / max(1, n * self.targets):.4f}", epoch=epoch + 1)

    def due(self, step: int, end_of_epoch: bool, last: bool) -> bool:
        return step % self.cfg.log_every == 0 or end_of_epoch or last

    def flush_audit(self) -> int:
        """The audit file's line count, on disk (a checkpoint records it)."""
        if self.audit is not None:
            self.audit.flush()
        return self.audit_lines

    def write(self, step: int, epoch: int, loss_tot: float, n_tot: float, lr: float, extra: dict[str, float], *,
              ended: float) -> None:
        """Log the window that ended at time `ended` with `step` (`loss_tot`, `n_tot`: over all ranks; `extra`:
        validation and epoch figures), then start a new one."""
        w = self.window
        record = {"step": step, "epoch": epoch, "loss": loss_tot / max(1.0, n_tot * self.targets), "lr": lr,
                  "samples_per_s": n_tot / max(ended - w.start, 1e-9),
                  "step_ms": 1000 * w.step_s / w.steps, "comm_ms": 1000 * w.comm_s / w.steps,
                  "data_ms": 1000 * w.data_s / w.steps, **extra}
        if self.rates is not None:  # tokens_per_s and mfu of a language model
            record.update(self.rates.extra(record["samples_per_s"]))
        self.timing.write(json.dumps({
            "step": step, "epoch": epoch, "rank": self.rank, "step_ms": record["step_ms"],
            "compute_ms": record["step_ms"] - record["comm_ms"], "comm_ms": record["comm_ms"],
            "data_ms": record["data_ms"], "samples": int(w.n)}) + "\n")
        self.timing.flush()
        if self.metrics is not None:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()
        val = " ".join(f"{k} {v:.4f}" for k, v in extra.items() if k.startswith("val_"))
        self.log.info("step %d epoch %d loss %.4f %s", step, epoch, record["loss"], val)
        if self.tb is not None:
            for key, value in record.items():
                if key not in ("step", "epoch"):
                    self.tb.add_scalar(key, value, step)
        if self.rank == 0 and not self.interactive and not self.cfg.json:  # Slurm logs: a plain line per --log-every
            print(console_line(record, epoch, step, self.total_steps), file=sys.stderr, flush=True)
        self.window = _Window()

    def last_epoch_loss(self, comm: Any) -> float | None:
        """The last epoch_train_loss in metrics.jsonl (rank 0 reads, every rank gets it; a collective)."""
        value = None
        if self.rank == 0:
            for line in (self.run_dir / "metrics.jsonl").read_text().splitlines():
                value = json.loads(line).get("epoch_train_loss", value)
        return comm.bcast(value)


def console_line(record: dict[str, Any], epoch: int, step: int, total_steps: int) -> str:
    """One logged window for a person: the epoch counted from 1, as `--epochs` counts; a language model's
    tokens/s, bits per byte and perplexity where a classifier shows samples/s and accuracy."""
    lm = "tokens_per_s" in record
    keys = ("val_loss", "val_bits_per_byte", "val_perplexity") if lm else ("val_loss", "val_accuracy")
    shown = "".join(f"  {k} {record[k]:.4f}" for k in keys if record.get(k) is not None)
    rate = f"{record['tokens_per_s']:.0f} tokens/s" if lm else f"{record['samples_per_s']:.0f} samples/s"
    return f"epoch {epoch + 1} step {step}/{total_steps}  loss {record['loss']:.4f}{shown}  {rate}"


class _Window:
    """Sums over the steps since the last logged one."""

    __slots__ = ("loss", "n", "start", "step_s", "comm_s", "data_s", "steps")

    def __init__(self) -> None:
        self.loss = self.n = self.step_s = self.comm_s = self.data_s = 0.0
        self.steps = 0
        self.start = time.perf_counter()

    def add(self, loss: float, n: int, step_s: float, comm_s: float, data_s: float) -> None:
        self.loss += loss
        self.n += n
        self.step_s += step_s
        self.comm_s += comm_s
        self.data_s += data_s
        self.steps += 1


def _timing_path(run_dir: Path, rank: int) -> Path:
    return run_dir / "logs" / f"rank-{rank:04d}.jsonl"


def _audit_path(run_dir: Path, rank: int) -> Path:
    return run_dir / "samples" / f"rank-{rank:04d}.txt"


def _keep_lines(path: Path, keep: int) -> None:
    """Keep the first `keep` lines of a text file (drop what a resumed run will redo)."""
    with open(path, "rb") as fh:
        lines = fh.readlines()[:keep]
    with _writing(path), open(path, "wb") as fh:
        fh.writelines(lines)


def _keep_steps(path: Path, last_step: int) -> None:
    """Keep the JSON lines of steps up to `last_step`."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= last_step]
    with _writing(path):
        path.write_text("".join(line + "\n" for line in kept))


@contextlib.contextmanager
def _writing(path: Path) -> Iterator[None]:
    """A write at the start of a run, on one rank: a failure is raised at once, as one line (a full disk: the
    free bytes)."""
    try:
        yield
    except OSError as exc:
        raise write_failure(exc, path) from None
