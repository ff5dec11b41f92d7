"""A randomized end-to-end hang matrix for `hpctrain launch -n W -- train ...`.

A *case* is one training configuration drawn from every option of `train` (chaos_space.SPACE, derived from
TrainConfig: world size, shard set, model, optimizer, schedule, ZeRO, wire format, precision, staging,
checkpoints, ...) plus one *event* at a random moment: nothing, SIGTERM/SIGUSR2 to the launcher or to one
rank, `kill -9` of one rank, or SIGSTOP of one rank. `draw_case(seed, index, data)` is a pure function of
(seed, index), so any failure reruns alone (`python benchmarks/soak.py --seed S --case K`).
`Harness.run_case` runs it and judges it against the contract (README "Checkpoints and restart", "Hangs
and failures", CONTRACT.md):

- no event: exit 0, summary `steps` = the expected total, `ranks_in_sync`;
- SIGTERM/SIGUSR2 (launcher or a rank): exit 3 (stopped: a checkpoint written, or none when the stop came during
  start-up, before the first step: nothing new to save) or 0 (already finished)
  within 30 s of the signal; never killed by the signal, unless it reached a process that at that instant
  neither blocked nor caught it (its SigBlk/SigCgt in /proc, read just before sending): the first
  milliseconds of the launcher's interpreter, or of a rank's `env` wrapper before it blocks the signals.
  No program can see a signal then; the default action ends it, and the resume below must still be exact;
- `kill -9` of a rank: non-zero exit within 30 s (0 if it had already finished);
- SIGSTOP of a rank: non-zero exit within `--collective-timeout` + 30 s (0 if it had already finished);
- after any non-zero exit, the same command again (`--resume auto`) exits 0 with the expected `steps` and
  the `param_sha256` of an uninterrupted run of the same configuration (run once per configuration and
  cached); an exit 0 after an event must give that hash too;
- every run that ends with exit 0 logged only finite losses (metrics.jsonl, summary.json), and with
  `--stage-to` staged something and left its copies exactly when `--keep-staged`;
- a refused combination (chaos_space.REFUSALS) exits 2 before the first step with exactly one `error:`
  line naming the problem; a combination that should run and is refused fails the case, and so does one
  that runs and should have been refused;
- a pair (chaos_space.PAIRS): the partner configuration's final model.pt equals the case's within
  PAIR_RTOL (relative to the largest parameter), or bit for bit for --deterministic;
- every run ends within its deadline, or, with no event, stops making progress only after it (a run still
  writing its metrics or logs or entering new waits gets 20 s more at a time, up to 3 deadlines: slow on a
  loaded node is not hung); else it is a HANG: every process of it is killed by PID; and
  leaves no process behind.

The processes of a run are found, signalled and reaped in chaos_procs; shard sets and weight files are
built in chaos_data.
"""

from __future__ import annotations

import json
import math
import shutil
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

from chaos_data import DataCache
from chaos_procs import ABORT, PYTHON, SIGNALS, EventPlan, RunResult, run_job, scan, subreaper
from chaos_space import (EVENTS, OTHER_MODEL, PAIR_RTOL, PAIRS, REFUSALS, SPACE, STAGE_MISSING, WEIGHTS,
                         WEIGHTS_OTHER, Case, Drawn, draw_case, event_of)

__all__ = ["ABORT", "EVENTS", "Harness", "Outcome", "draw_case", "event_of", "option_table", "repro_command",
           "subreaper", "table_header", "table_row", "totals"]
LOSS_KEYS = ("loss", "val_loss", "epoch_train_loss", "train_loss")


@dataclass
class Failure:
    kind: str  # hang | exit | steps | hash | sync | leftover | refused | nonfinite | staged | pair
    text: str


@dataclass
class Reference:
    """An uninterrupted run of one configuration: its hash, and its timing for placing events."""

    result: RunResult
    failures: list[Failure]

    @property
    def ok(self) -> bool:
        return not self.failures


@dataclass
class Outcome:
    case: Case
    runs: list[RunResult]
    failures: list[Failure]
    seconds: float
    reference_cached: bool = False
    pair_diff: float | None = None  # max |a - b| / max |a| of the pair's final parameters

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def verdict(self) -> str:
        if self.passed:
            return "PASS"
        return "HANG" if any(f.kind == "hang" for f in self.failures) else "FAIL"

    @property
    def event_run(self) -> RunResult | None:
        return next((r for r in self.runs if r.name == "run"), None)

    def exits(self) -> str:
        return " ".join(f"{r.name}:{r.exit_label()}" for r in self.runs)

    def moment(self) -> str:
        run = self.event_run
        if self.pair_diff is not None:
            return f"pair diff {self.pair_diff:.1e}"
        return run.moment if run is not None and self.case.event != "none" else "-"

    def report(self) -> str:
        """Everything needed to understand a failure: reasons, commands, stderr and rank-log tails."""
        lines = [f"case {self.case.index} of seed {self.case.seed}: {self.verdict}: {self.case.summary()}; "
                 f"event {self.case.event_label()} ({self.case.anchor} x{self.case.fraction}) at {self.moment()}"]
        lines += [f"  [{f.kind}] {f.text}" for f in self.failures]
        for run in self.runs:
            lines.append(f"  {run.name}: exit {run.exit_label()} after {run.seconds:.1f} s: {run.command}")
            if run.killed:
                lines.append(f"  {run.name}: killed {len(run.killed)} processes: {', '.join(run.killed)}")
            if run.stderr_tail and (run.hung or run.rc not in (0, 3)):
                lines.append(f"  {run.name} stderr (tail):\n" + indent(run.stderr_tail, 6))
                for name, text in run.rank_logs.items():
                    lines.append(f"  {run.name} {name} (tail):\n" + indent(text, 6))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"case": asdict(self.case), "verdict": self.verdict, "seconds": round(self.seconds, 2),
                "exits": self.exits(), "moment": self.moment(), "reference_cached": self.reference_cached,
                "pair_diff": self.pair_diff, "failures": [asdict(f) for f in self.failures],
                "runs": [asdict(r) for r in self.runs]}


def indent(text: str, n: int) -> str:
    return "\n".join(" " * n + line for line in text.splitlines())


# --- judging a case ----------------------------------------------------------------------------------


def check_finished(run: RunResult, case: Case, want_hash: str | None, stage: Path) -> list[Failure]:
    """A run that exited 0: the expected steps, ranks agree, the reference's hash, finite losses, staging."""
    s = run.summary
    if s is None:
        return [Failure("exit", f"{run.name}: exit 0 but no readable summary.json")]
    failures = []
    if s.get("steps") != case.expected_steps:
        failures.append(Failure("steps", f"{run.name}: summary steps {s.get('steps')}, expected {case.expected_steps}"))
    if s.get("ranks_in_sync") is not True:
        failures.append(Failure("sync", f"{run.name}: ranks_in_sync is {s.get('ranks_in_sync')}"))
    if want_hash is not None and s.get("param_sha256") != want_hash:
        failures.append(Failure("hash", f"{run.name}: param_sha256 {str(s.get('param_sha256'))[:16]} differs from the "
                                        f"uninterrupted run's {want_hash[:16]}"))
    bad = nonfinite_losses(run)
    if bad:
        failures.append(Failure("nonfinite", f"{run.name}: {len(bad)} non-finite losses logged, first {', '.join(bad[:3])}"))
    return failures + check_staged(run, case, stage)


def nonfinite_losses(run: RunResult) -> list[str]:
    """Every loss in metrics.jsonl and summary.json that is NaN or infinite ("no loss logged" if none is)."""
    try:
        lines = (Path(run.run_dir) / "metrics.jsonl").read_text().splitlines()
    except OSError:
        lines = []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    bad = [f"step {r.get('step')} {k}={r[k]}" for r in records + [dict(run.summary or {}, step="summary")]
           for k in LOSS_KEYS if isinstance(r.get(k), (int, float)) and not math.isfinite(r[k])]
    if not any(isinstance(r.get("loss"), (int, float)) for r in records):
        bad.append("no loss logged in metrics.jsonl")
    return bad


def check_staged(run: RunResult, case: Case, stage: Path) -> list[Failure]:
    """With --stage-to: bytes were staged, and the copies are gone at the end unless --keep-staged."""
    if case.opt("stage_to") in (None, STAGE_MISSING):
        return []
    failures = []
    if not (run.summary or {}).get("staged_bytes"):
        failures.append(Failure("staged", f"{run.name}: --stage-to but summary staged_bytes is "
                                          f"{(run.summary or {}).get('staged_bytes')}"))
    left = sorted(p.name for p in stage.glob("hpctrain-*"))
    if case.opt("keep_staged") and not left:
        failures.append(Failure("staged", f"{run.name}: --keep-staged, yet no copies are left in {stage}"))
    if not case.opt("keep_staged") and left:
        failures.append(Failure("staged", f"{run.name}: copies left in {stage} without --keep-staged: {left}"))
    return failures


def check_ended(run: RunResult, case: Case) -> list[Failure]:
    """Hangs, processes left behind, and exit codes the event does not allow."""
    failures = []
    if run.hung:
        failures.append(Failure("hang", run.hang_reason + (f"; killed {len(run.killed)} processes" if run.killed else "")))
        return failures
    if run.leftovers:
        failures.append(Failure("leftover", f"{run.name}: processes left behind after exit: {'; '.join(run.leftovers)}"))
    event = case.event if run.event_delivered else "none"
    kind = event.split("-")[0]
    allowed = {"none": {0}, "term": {0, 3}, "usr2": {0, 3}}.get(kind)
    if allowed is not None and kind != "none" and run.event_unheld:  # nothing could see it: the default action
        allowed = allowed | {-SIGNALS[kind], 128 + SIGNALS[kind]}
    if run.rc == 2 and run.error_lines:
        failures.append(Failure("refused", f"{run.name}: refused a configuration that should run: {run.error_lines[0]}"))
    elif allowed is not None and run.rc not in allowed:
        failures.append(Failure("exit", f"{run.name}: exit {run.exit_label()} after {case.event_label() if event != 'none' else 'no event'}"
                                        f" (expected {' or '.join(map(str, sorted(allowed)))}); stderr: {last_line(run.stderr_tail)}"))
    return failures


def check_refused(run: RunResult, case: Case) -> list[Failure]:
    """A refused combination: exit 2, one `error:` line that names the problem, no step trained."""
    if run.hung:
        return [Failure("hang", run.hang_reason)]
    failures = []
    if run.leftovers:
        failures.append(Failure("leftover", f"{run.name}: processes left behind after exit: {'; '.join(run.leftovers)}"))
    want = REFUSALS[case.refusal].fragment
    errors = run.error_lines
    if run.rc != 2 or len(errors) != 1 or want not in errors[0]:
        got = " | ".join(errors) if errors else f"no error line (stderr: {last_line(run.stderr_tail)})"
        failures.append(Failure("refused", f"{run.name}: {case.refusal} should exit 2 with one error line naming "
                                           f"{want!r}; got exit {run.exit_label()}, {len(errors)} error lines: {got}"))
    if (Path(run.run_dir) / "metrics.jsonl").exists():
        failures.append(Failure("refused", f"{run.name}: trained before refusing {case.refusal} (metrics.jsonl exists)"))
    return failures


def compare_pair(case: Case, a: RunResult, b: RunResult) -> tuple[list[Failure], float | None]:
    """The pair's final models: within PAIR_RTOL, or the same param_sha256 for an exact pair."""
    diff = relative_difference(Path(a.run_dir) / "model.pt", Path(b.run_dir) / "model.pt")
    if PAIRS[case.pair].exact:
        ha, hb = (r.summary.get("param_sha256", "") for r in (a, b))
        return ([] if ha == hb else [Failure("pair", f"{case.pair}: param_sha256 {ha[:16]} and {hb[:16]} differ "
                                                     f"(relative difference {diff}); expected the same bits")]), diff
    if diff is None or not diff <= PAIR_RTOL:
        return [Failure("pair", f"{case.pair}: final parameters differ by {diff} of the largest one "
                                f"(tolerance {PAIR_RTOL:g})")], diff
    return [], diff


def relative_difference(a: Path, b: Path) -> float | None:
    """max |a - b| / max |a| over every tensor of two state_dicts (None when their keys or shapes differ)."""
    import torch

    wa, wb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    if wa.keys() != wb.keys() or any(wa[k].shape != wb[k].shape for k in wa):
        return None
    diff = max(float((wa[k].double() - wb[k].double()).abs().max()) for k in wa)
    scale = max(float(wa[k].double().abs().max()) for k in wa)
    return diff / scale if scale else diff


def last_line(text: str) -> str:
    """The last line that says something (mpirun frames its messages in lines of dashes)."""
    lines = [line.strip() for line in text.splitlines() if any(ch.isalpha() for ch in line)]
    return lines[-1][:300] if lines else "(empty)"


class Harness:
    """Runs and judges cases; holds the session's shard sets and reference runs (one per configuration)."""

    def __init__(self, workdir: Path, *, deadline_s: float = 120.0, keep_runs: bool = False):
        self.workdir = Path(workdir)
        self.data = DataCache(self.workdir / "data")
        self.deadline_s = deadline_s
        self.keep_runs = keep_runs
        self.session = uuid.uuid4().hex[:12]
        self._refs: dict[tuple, Reference] = {}
        self._ref_locks: dict[tuple, threading.Lock] = {}
        self._lock = threading.Lock()

    def token(self, label: str) -> str:
        return f"{self.session}-{label}-{uuid.uuid4().hex[:8]}"

    def paths(self, case: Case, stage: Path) -> tuple[dict[str, str], dict[str, str]]:
        """What a run's placeholders stand for, and its extra environment ($TMPDIR for --stage-to auto)."""
        stage.mkdir(parents=True, exist_ok=True)
        paths = {"stage": str(stage), "weights": "", "weights_other": ""}
        kind = "lm" if case.data.lm else "classifier"
        if case.opt("init_weights") == WEIGHTS:
            paths["weights"] = str(self.data.weights(case.opt("model"), case.data))
        if case.opt("init_weights") == WEIGHTS_OTHER:
            paths["weights_other"] = str(self.data.weights(OTHER_MODEL[kind], case.data))
        return paths, ({"TMPDIR": str(stage)} if case.opt("stage_to") == "auto" else {})

    def command(self, case: Case, run_dir: Path, paths: dict[str, str], partner: bool = False) -> list[str]:
        return [PYTHON, "-m", "hpctrain", "launch", "-n", str(case.world), "--", "train",
                *case.train_args(str(self.data.path(case.data)), str(run_dir), paths, partner)]

    def run_case(self, case: Case) -> Outcome:
        start = time.monotonic()
        case_dir = self.workdir / "cases" / f"seed{case.seed}-case{case.index}"
        shutil.rmtree(case_dir, ignore_errors=True)
        self.data.manifest(case.data)  # built before any run (a harness error, not the case's, if it fails)
        run_dir = case_dir / "run"
        runs: list[RunResult] = []
        cached, diff = False, None
        if case.refusal:
            runs.append(self._run(case, "run", run_dir, case_dir))
            failures = check_refused(runs[0], case)
        elif case.event == "none":
            failures, diff = self._uninterrupted(case, run_dir, case_dir, runs)
        else:
            ref, cached = self.reference(case)
            if not cached:
                runs.append(ref.result)
            if not ref.ok:
                failures = [Failure(f.kind, f"uninterrupted reference: {f.text}") for f in ref.failures]
            else:
                failures = self._interrupted(case, ref, run_dir, case_dir, runs)
        outcome = Outcome(case, runs, failures, time.monotonic() - start, reference_cached=cached, pair_diff=diff)
        if outcome.passed and not self.keep_runs:
            shutil.rmtree(case_dir, ignore_errors=True)
        return outcome

    def _uninterrupted(self, case: Case, run_dir: Path, case_dir: Path,
                       runs: list[RunResult]) -> tuple[list[Failure], float | None]:
        """The run (kept as the configuration's reference), then the pair's partner compared with it."""
        run = self._run(case, "run", run_dir, case_dir)
        runs.append(run)
        failures = check_ended(run, case) + (check_finished(run, case, None, case_dir / "stage") if run.rc == 0 else [])
        with self._lock:
            self._refs.setdefault(case.config_key(), Reference(run, failures))
        if case.pair is None or failures:
            return failures, None
        pair = self._run(case, "pair", case_dir / "pair", case_dir, partner=True)
        runs.append(pair)
        failures = check_ended(pair, case)
        if pair.rc != 0:
            return failures, None
        failures += check_finished(pair, case, None, case_dir / "stage-pair")
        more, diff = compare_pair(case, run, pair)
        return failures + more, diff

    def _interrupted(self, case: Case, ref: Reference, run_dir: Path, case_dir: Path, runs: list[RunResult]) -> list[Failure]:
        """The event run, then (after a non-zero exit) the resume, judged against the reference."""
        run = self._run(case, "run", run_dir, case_dir, plan=self.plan(case, ref.result))
        runs.append(run)
        failures = check_ended(run, case)
        if run.hung:
            return failures
        if run.rc == 0:  # it ended before the event: a run of its own, with its own choice of --zero-reduce auto
            return failures + check_finished(run, case, self._same_sums(case, ref, run, case_dir, runs), case_dir / "stage")
        resume = self._run(case, "resume", run_dir, case_dir)
        runs.append(resume)
        failures += check_ended(resume, case)
        if resume.rc == 0:
            failures += check_finished(resume, case, self._same_sums(case, ref, resume, case_dir, runs), case_dir / "stage")
        return failures

    def _same_sums(self, case: Case, ref: Reference, run: RunResult, case_dir: Path, runs: list[RunResult]) -> str:
        """The hash `run` must have: the reference's, unless --zero-reduce auto chose another reducer for the
        interrupted run than for the reference (timed at start-up; on 3+ ranks they sum in different orders,
        and a resume keeps its checkpoint's choice): then that of a reference run with the run's reducer."""
        chosen, theirs = (r.summary.get("zero_reduce") if r.summary else None for r in (run, ref.result))
        if chosen is None or chosen == theirs:
            return ref.result.summary["param_sha256"]
        again = self._run(case, "ref-reducer", case_dir / "ref-reducer", case_dir, extra=("--zero-reduce", chosen))
        runs.append(again)
        return (again.summary or {}).get("param_sha256", f"(the reference with --zero-reduce {chosen} failed)")

    def plan(self, case: Case, ref: RunResult) -> EventPlan:
        """Place the event on this machine's time scale: a fraction of its phase in the reference run."""
        marks = {"start": 0.0, "train": ref.train_start_s, "end": ref.summary_at_s, "exit": ref.seconds}
        order = ["start", "train", "end", "exit"]
        begin, end = marks[case.anchor], marks[order[order.index(case.anchor) + 1]]
        if begin is None or end is None:  # the reference was not seen in that phase: a fraction of all of it
            return EventPlan(case.event, case.target_rank, case.fraction * ref.seconds, "start", case.window())
        return EventPlan(case.event, case.target_rank, case.fraction * max(0.0, end - begin), case.anchor, case.window())

    def reference(self, case: Case) -> tuple[Reference, bool]:
        """The uninterrupted run of the case's configuration, run once per session (and whether cached)."""
        key = case.config_key()
        with self._lock:
            lock = self._ref_locks.setdefault(key, threading.Lock())
        with lock:
            with self._lock:
                if key in self._refs:
                    return self._refs[key], True
            ref_dir = self.workdir / "refs" / f"seed{case.seed}-case{case.index}"
            shutil.rmtree(ref_dir, ignore_errors=True)
            run = self._run(case, "ref", ref_dir / "run", ref_dir)
            failures = check_ended(run, case) + (check_finished(run, case, None, ref_dir / "stage") if run.rc == 0 else [])
            if run.rc == 0 and run.summary is None:
                failures.append(Failure("exit", "reference: no summary"))
            reference = Reference(run, failures)
            with self._lock:
                self._refs[key] = reference
            return reference, False

    def _run(self, case: Case, name: str, run_dir: Path, log_dir: Path, plan: EventPlan | None = None,
             partner: bool = False, extra: tuple[str, ...] = ()) -> RunResult:
        paths, env = self.paths(case, log_dir / ("stage-pair" if partner else "stage"))
        return run_job(name, [*self.command(case, run_dir, paths, partner), *extra], run_dir, log_dir,
                       deadline_s=self.deadline_s,
                       token=self.token(f"s{case.seed}c{case.index}{name}"), plan=plan,
                       expected_steps=case.expected_steps, env=env)

    def stray_processes(self) -> list[str]:
        """Any process of this session still alive (there should be none)."""
        return [f"{p.pid} {p.name} state {p.state}" for p in scan(self.session).values() if p.state != "Z"]


# --- presenting results ------------------------------------------------------------------------------

COLUMNS = (("#", 4), ("event", 34), ("moment", 34), ("exits", 30), ("sec", 6), ("verdict", 7), ("config", 0))


def table_header() -> str:
    return "  ".join(name.ljust(width) for name, width in COLUMNS).rstrip()


def table_row(o: Outcome) -> str:
    cells = (str(o.case.index), o.case.event_label(), o.moment(), o.exits(), f"{o.seconds:.1f}", o.verdict, o.case.summary())
    return "  ".join(c.ljust(w) for c, (_, w) in zip(cells, COLUMNS)).rstrip()


def totals(outcomes: list[Outcome]) -> dict[str, int | float | None]:
    """Cases with a hang, with an unexpected exit code, with a hash mismatch, ..., and any failure at all."""
    def count(kind: str) -> int:
        return sum(any(f.kind == kind for f in o.failures) for o in outcomes)

    diffs = [o.pair_diff for o in outcomes if o.pair_diff is not None]
    return {"cases": len(outcomes), "passed": sum(o.passed for o in outcomes), "failed": sum(not o.passed for o in outcomes),
            "hangs": count("hang"), "unexpected_exit_codes": count("exit"), "hash_mismatches": count("hash"),
            "step_mismatches": count("steps"), "ranks_out_of_sync": count("sync"), "left_processes": count("leftover"),
            "refused": sum(o.case.refusal is not None for o in outcomes), "refusal_mismatches": count("refused"),
            "nonfinite_losses": count("nonfinite"), "staging_failures": count("staged"),
            "pairs": sum(o.case.pair is not None for o in outcomes), "pair_mismatches": count("pair"),
            "max_pair_rel_diff": max(diffs) if diffs else None,
            "ended_by_an_unheld_signal": sum(any(r.died_of_an_unheld_stop() for r in o.runs) for o in outcomes)}


def option_values(case: Case) -> list[tuple[str, str]]:
    """(option, value) pairs a case counts under in the per-option table."""
    kind = case.event.split("-")
    event = "refused" if case.refusal else case.event if kind[0] == "none" else f"{kind[0]} {kind[1]}"
    items = [("world size", str(case.world)), ("data", case.data.source), ("event", event),
             ("refusal", case.refusal or "-"), ("pair", case.pair or "-")]
    for name, value in case.options:
        entry = SPACE[name]
        if isinstance(entry, Drawn) and entry.tabulate:
            items.append((name, "(not passed)" if value is None else str(value)))
    return items


def option_table(outcomes: list[Outcome]) -> str:
    """Markdown: for each option value, the cases drawn with it, passed, hangs and other failures."""
    rows: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for o in outcomes:
        hang = o.verdict == "HANG"
        for key in option_values(o.case):
            row = rows[key]
            row[0] += 1
            row[1] += o.passed
            row[2] += hang
            row[3] += not o.passed and not hang
    order = ["world size", "data", "event", "refusal", "pair"] + [n for n, e in SPACE.items() if isinstance(e, Drawn)]
    lines = ["| option | value | cases | passed | hangs | failures |", "|---|---|---|---|---|---|"]
    for (name, value), (n, ok, hangs, fails) in sorted(rows.items(), key=lambda kv: (order.index(kv[0][0]), kv[0][1])):
        lines.append(f"| {name} | {value} | {n} | {ok} | {hangs} | {fails} |")
    return "\n".join(lines)


def repro_command(case: Case, deadline_s: float | None = None) -> str:
    extra = f" --deadline {deadline_s:g}" if deadline_s is not None and deadline_s != 120 else ""
    return f"python benchmarks/soak.py --seed {case.seed} --case {case.index}{extra}"
