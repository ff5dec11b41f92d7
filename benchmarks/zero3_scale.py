#!/usr/bin/env python3
"""A model that does not fit at stage 0 trains at ZeRO stage 3, checkpoints, and resumes on fewer ranks (issue 29).

Default: a GPT of 403.6 M parameters (32 layers, dim 1024, 16 heads; seq_len 256), Adam, 4 ranks on this one
machine. Stage 0 would hold 16 bytes x 403.6 M = 6.0 GiB of parameters, gradients and Adam state on every
rank, 24 GiB for 4 ranks: more than the machine's memory. At stage 3 each rank holds a quarter of it (plus the
units it gathers and the activations): `hpctrain plan` says about 3.2 GiB per rank.

1. `hpctrain shard` this Python's standard library text into token rows (4 shards);
2. `hpctrain launch -n RANKS -- train --zero 3 --optimizer adam --max-steps STEPS` (the last step checkpoints);
3. `hpctrain launch -n RESUME -- train --zero 3 --max-steps STEPS+EXTRA`: resumes that checkpoint on fewer ranks.

While each job runs, a sampler reads every rank's resident memory from /proc every 0.2 s: the peak of their
sum (all ranks together, at one instant) and each rank's own peak (VmHWM). From the ranks' logs: the memory
plan, what each rank held, how many bytes of the checkpoint each resumed rank read and its peak RSS once the
resume was done (start-up and the resume); then the sampler resets that rank's high-water mark, so that the peak
of the steps after the resume is read apart from it: the resume passes when its peak is no higher than the
steps'. Needs about 16 GiB free at the default size: it refuses to start with less
than 18 GiB available (--force to run anyway). Smaller, for a check: --model gpt:layers=2,dim=128,heads=4.

    python benchmarks/zero3_scale.py [--model SPEC] [--ranks 4] [--resume-ranks 2] [--steps 10] [--json]
    python benchmarks/zero3_scale.py --model mlp:4096,4096,4096,4096,4096 --data synthetic --extra 10  # the 70 M MLP
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

GIB = 2**30


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def ranks_of(run: Path) -> list[int]:
    """The pids of the rank processes of the job writing `run` (python -m hpctrain train ... --run-dir RUN)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"python" in cmd[0] and b"train" in cmd and b"launch" not in cmd and str(run).encode() in cmd:
            pids.append(int(entry.name))
    return pids


def status_kib(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class Sampler(threading.Thread):
    """Every 0.2 s: the ranks' summed VmRSS (its peak is all ranks together at one instant) and each rank's VmHWM.

    With `split_resume`, each rank's resume is cut from its training: once a rank's log says it has resumed,
    its high-water mark is reset (`echo 5 > /proc/PID/clear_refs`, Linux), so that what VmHWM reads from then
    on is the peak of the steps alone (`steps_hwm`), to set beside the peak the rank logged once resumed."""

    def __init__(self, directory: Path, split_resume: bool = False):
        super().__init__(daemon=True)
        self.directory, self.done, self.split_resume = directory, threading.Event(), split_resume
        self.peak_sum, self.hwm, self.pids = 0, {}, []
        self.steps_hwm: dict[int, int] = {}  # rank -> VmHWM since its high-water mark was reset after its resume

    def resumed_pids(self) -> dict[int, int]:
        """rank -> pid of the ranks of this job whose log says they have resumed."""
        out = {}
        for path in sorted((self.directory / "logs").glob("rank-*.log")):
            try:
                text = path.read_text()
            except OSError:
                continue
            starts = list(re.finditer(r"rank (\d+), local rank \d+, pid (\d+)", text))
            if starts and "resumed from" in text[starts[-1].end():] and int(starts[-1][2]) in self.pids:
                out[int(starts[-1][1])] = int(starts[-1][2])
        return out

    def run(self) -> None:
        while not self.done.wait(0.2):
            self.pids = ranks_of(self.directory)
            self.peak_sum = max(self.peak_sum, sum(status_kib(p, "VmRSS") for p in self.pids) * 1024)
            for p in self.pids:
                self.hwm[p] = max(self.hwm.get(p, 0), status_kib(p, "VmHWM") * 1024)
            if not self.split_resume:
                continue
            for rank, pid in self.resumed_pids().items():
                if rank not in self.steps_hwm:
                    Path(f"/proc/{pid}/clear_refs").write_text("5")
                    self.steps_hwm[rank] = 0
                self.steps_hwm[rank] = max(self.steps_hwm[rank], status_kib(pid, "VmHWM") * 1024)


def launch(n: int, data: Path, run: Path, args: list[str], split_resume: bool = False) -> tuple[dict, dict]:
    """One job; (its summary, what the sampler saw)."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [sys.executable, "-m", "hpctrain", "launch", "-n", str(n), "--", "train", "--data", str(data),
           "--run-dir", str(run), *args]
    sampler = Sampler(run, split_resume)
    started = time.perf_counter()
    sampler.start()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    sampler.done.set()
    sampler.join(5)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    summary = json.loads((run / "summary.json").read_text())
    return summary, {"seconds": time.perf_counter() - started, "peak_sum_rss": sampler.peak_sum,
                     "rank_peaks": sorted(sampler.hwm.values(), reverse=True), "processes": len(sampler.hwm),
                     "steps_peaks": dict(sorted(sampler.steps_hwm.items()))}


def log_figures(run: Path, n: int) -> list[dict]:
    """Per rank, from its log: bytes of the checkpoint read and peak RSS once resumed; its peak at the end."""
    out = []
    for r in range(n):
        text = (run / "logs" / f"rank-{r:04d}.log").read_text()
        read = re.findall(r"read (\d+) bytes of its tensors; peak RSS so far (\d+)", text)
        held = re.findall(r"this rank holds params (\d+), grads (\d+), optimizer (\d+); its peak RSS (\d+)", text)
        out.append({"read_bytes": int(read[-1][0]) if read else None,
                    "peak_rss_after_resume": int(read[-1][1]) if read else None,
                    **({"held": [int(v) for v in held[-1][:3]], "peak_rss_end": int(held[-1][3])} if held else {})})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt:layers=32,dim=1024,heads=16")
    parser.add_argument("--data", default="text", help="text (token rows of the standard library) or synthetic")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--resume-ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--extra", type=int, default=2, help="steps the resumed job trains")
    parser.add_argument("--force", action="store_true", help="run with less than 18 GiB available")
    parser.add_argument("--json", action="store_true")
    opts = parser.parse_args()
    if available_bytes() < 18 * GIB and not opts.force and opts.model.startswith("gpt:layers=32"):
        raise SystemExit(f"only {available_bytes() / GIB:.1f} GiB available, 18 GiB wanted for the 403.6 M GPT: "
                         "free memory, or pass --force, or a smaller --model")
    work = Path(tempfile.mkdtemp(prefix="zero3-"))
    data = work / "data"
    env = dict(os.environ)
    if opts.data == "text":
        stdlib = sysconfig.get_paths()["stdlib"]
        subprocess.run([sys.executable, "-m", "hpctrain", "shard", f"text:{stdlib}", str(data), "--glob", "[bh]*.py",
                        "--seq-len", str(opts.seq_len), "--shards", "4"], check=True, capture_output=True, env=env)
    else:
        subprocess.run([sys.executable, "-m", "hpctrain", "shard", "synthetic:4096:784:10", str(data), "--shards", "4"],
                       check=True, capture_output=True, env=env)
    run = work / "run"
    common = ["--model", opts.model, "--zero", "3", "--optimizer", "adam", "--lr", "1e-4", "--batch-size",
              str(opts.batch_size), "--checkpoint-every", "0", "--no-shuffle", "--json"]
    trained, seen = launch(opts.ranks, data, run, [*common, "--max-steps", str(opts.steps)])
    ranks_train = log_figures(run, opts.ranks)
    resumed, seen_resume = launch(opts.resume_ranks, data, run, [*common, "--max-steps", str(opts.steps + opts.extra)],
                                   split_resume=True)
    ranks_resume = log_figures(run, opts.resume_ranks)
    out = {"model": opts.model, "ranks": opts.ranks,
           "train": {"steps": trained["steps"], "summary_memory": trained["memory"], **seen, "logs": ranks_train,
                     "samples_per_s": trained["samples_per_s"]},
           "resume": {"ranks": opts.resume_ranks, "resumed_from": resumed["resumed_from"], "steps": resumed["steps"],
                      "summary_memory": resumed["memory"], **seen_resume, "logs": ranks_resume},
           "checkpoint_bytes": sum(f.stat().st_size for f in (run / "checkpoints").rglob("*") if f.is_file()),
           "work": str(work)}
    ok = {"10 steps at stage 3": trained["steps"] == opts.steps,
          "all ranks together under 16 GiB": seen["peak_sum_rss"] < 16 * GIB,
          "resumed on fewer ranks": resumed["resumed_from"] == opts.steps and resumed["steps"] == opts.steps + opts.extra,
          "resume peak no higher than training's": len(seen_resume["steps_peaks"]) == opts.resume_ranks and all(
              r["peak_rss_after_resume"] is not None and seen_resume["steps_peaks"][i] >= r["peak_rss_after_resume"]
              for i, r in enumerate(ranks_resume))}
    out["verdicts"] = ok
    if opts.json:
        print(json.dumps(out))
        return
    gib = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
    print(f"{opts.model}: {opts.ranks} ranks at stage 3, Adam, {trained['steps']} steps, then resumed on "
          f"{opts.resume_ranks} ranks to step {resumed['steps']} (files in {work})")
    print(f"  train:  all ranks together peak {gib(seen['peak_sum_rss'])} (sampled), per-rank peaks "
          f"{', '.join(gib(b) for b in seen['rank_peaks'])}; {seen['seconds']:.0f} s")
    print(f"  resume: all ranks together peak {gib(seen_resume['peak_sum_rss'])}, per-rank peaks "
          f"{', '.join(gib(b) for b in seen_resume['rank_peaks'])}; {seen_resume['seconds']:.0f} s")
    for r, fig in enumerate(ranks_resume):
        print(f"  resumed rank {r}: read {fig['read_bytes']:,} bytes of the checkpoint's {out['checkpoint_bytes']:,}; "
              f"peak RSS {gib(fig['peak_rss_after_resume'])} once resumed (start-up and the resume), "
              f"{gib(seen_resume['steps_peaks'].get(r, 0))} in the steps after it")
    for name, good in ok.items():
        print(f"  {'PASS' if good else 'FAIL'}  {name}")


if __name__ == "__main__":
    main()
