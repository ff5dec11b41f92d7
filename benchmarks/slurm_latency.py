"""Submit-to-first-step latency of `hpctrain submit` on the local Slurm cluster (slurm/cluster.sh).

For each repeat: submit a 2-node `train` job (digits, --log-every 1) and time, from just before the
submission, (a) sbatch returning the job id, (b) the job's supervisor starting (the record's `start` event),
(c) the first training step landing in RUN/metrics.jsonl. For comparison, the same first step under
`hpctrain launch -n 2` (no scheduler). Prints one JSON object; docs/performance.md's numbers come from it.

    .venv/bin/python benchmarks/slurm_latency.py [--repeats 5] [--nodes 2] [--json-out FILE]

Needs root for the cluster (it is started when not running and left running).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hpctrain.tools.slurm.config import SubmitConfig
from hpctrain.tools.slurm.core import read_record
from hpctrain.tools.slurm.status import job_status
from hpctrain.tools.slurm.submission import submit

ROOT = Path(__file__).resolve().parents[1]


def first_line_time(path: Path, start: float, timeout: float) -> float:
    """Seconds from `start` until `path` holds one complete line (polled every 10 ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if b"\n" in path.read_bytes():
                return time.time() - start
        except FileNotFoundError:
            pass
        time.sleep(0.01)
    raise SystemExit(f"no first step in {path} after {timeout} s")


def one_job(data: Path, work: Path, i: int, nodes: int) -> dict[str, float]:
    run = work / f"run-{i}"
    command = ["train", "--data", str(data), "--run-dir", str(run), "--epochs", "1", "--max-steps", "5",
               "--log-every", "1"]
    cfg = SubmitConfig(nodes=nodes, time=5, folder=work / "jobs")
    t0 = time.time()
    info = submit(cfg, command)
    t_submitted = time.time() - t0
    t_first = first_line_time(run / "metrics.jsonl", t0, 120)
    while job_status(cfg.folder, info["job_id"])["state"] not in ("completed", "failed", "cancelled"):
        time.sleep(0.2)
    start = next(e["time"] for e in read_record(cfg.folder, info["job_id"]) if e["event"] == "start")
    return {"sbatch_s": t_submitted, "job_start_s": start - t0, "first_step_s": t_first}


def launch_first_step(data: Path, work: Path, i: int) -> float:
    run = work / f"launch-{i}"
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "hpctrain", "launch", "-n", "2", "--", "train", "--data", str(data),
                             "--run-dir", str(run), "--epochs", "1", "--max-steps", "5", "--log-every", "1"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t = first_line_time(run / "metrics.jsonl", t0, 120)
    proc.wait()
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    subprocess.run(["bash", str(ROOT / "slurm" / "cluster.sh"), "up"], check=True, stdout=subprocess.DEVNULL)
    with tempfile.TemporaryDirectory(prefix="hpctrain-bench-") as tmp:
        work = Path(tmp)
        data = work / "data"
        subprocess.run([sys.executable, "-m", "hpctrain", "shard", "digits", str(data), "--shards", "2"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        jobs = [one_job(data, work, i, args.nodes) for i in range(args.repeats)]
        launch = [launch_first_step(data, work, i) for i in range(args.repeats)]
    result = {
        "what": f"submit-to-first-step, {args.nodes}-node digits job on the local cluster",
        "repeats": args.repeats,
        "median": {key: round(statistics.median(j[key] for j in jobs), 3) for key in jobs[0]},
        "min": {key: round(min(j[key] for j in jobs), 3) for key in jobs[0]},
        "max": {key: round(max(j[key] for j in jobs), 3) for key in jobs[0]},
        "launch_first_step_s": {"median": round(statistics.median(launch), 3), "min": round(min(launch), 3),
                                "max": round(max(launch), 3)},
        "runs": jobs,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        args.json_out.write_text(text + "\n")


if __name__ == "__main__":
    main()
