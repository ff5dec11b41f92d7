"""Sweeps as Slurm job arrays on the local cluster (slurm/cluster.sh: two 4-CPU nodes on this host).

Pins the issue's number: a sweep of 2 x 2 combinations completes in one `hpctrain submit --wait`, every run dir
with its summary, and the comparison report written. Also: an element that is signalled requeues alone and
resumes bit-identical; `cancel` stops one element or the whole array.
"""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import hpctrain, mpi_env, summary
from hpctrain.base.config import read_train_toml
from hpctrain.checkpoint import manager as ckpt
from hpctrain.tools.slurm.core import read_record
from hpctrain.tools.slurm.status import job_status

from slurm_util import cli, cluster_session, submit_json, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


@pytest.fixture(scope="session")
def slurm_cluster():
    """The local cluster, up for the session (started and stopped here unless it already ran)."""
    yield from cluster_session()


def most_at_once(folder: Path, elements: list[dict]) -> int:
    """The most elements that ran at the same time, from their records (first start to last event)."""
    spans = []
    for element in elements:
        events = read_record(folder, element["job_id"])
        spans.append((events[0]["time"], events[-1]["time"]))
    return max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)


def test_a_2x2_sweep_completes_with_every_summary_and_the_report(slurm_cluster, digits2: Path, tmp_path: Path) -> None:
    run, folder = tmp_path / "sweep", tmp_path / "jobs"
    info = submit_json(["--nodes", "1", "--time", "5", "--folder", str(folder), "--sweep", "lr=0.05,0.2", "--sweep",
                        "batch-size=16,64", "--max-parallel", "2", "--wait", "--", "train", "--data", str(digits2),
                        "--run-dir", str(run), "--max-steps", "30", "--log-every", "5"], cwd=tmp_path, timeout=600)
    assert info["state"] == "completed" and info["exit_code"] == 0, info
    job = info["job_id"]
    names = ["lr=0.05_batch-size=16", "lr=0.05_batch-size=64", "lr=0.2_batch-size=16", "lr=0.2_batch-size=64"]
    assert [e["run_dir"] for e in info["elements"]] == [str(run / name) for name in names]
    assert [e["job_id"] for e in info["elements"]] == [f"{job}_{task}" for task in range(4)]
    assert [e["state"] for e in info["elements"]] == ["completed"] * 4
    for name in names:  # each element trained its own combination, to the end
        got, config = summary(run / name), read_train_toml((run / name / "config.toml").read_text())
        assert got["steps"] == 30 and got["world_size"] == 1, got
        assert f"lr={config['lr']:g}_batch-size={config['batch_size']}" == name
    report = run / "report"
    assert {"compare.png", "compare.md", "compare.json"} <= {p.name for p in report.iterdir()}
    assert info["report"]["best"] in names and info["report"]["dir"] == str(report)
    assert info["report"]["best"] in (report / "compare.md").read_text()
    # One array of 4 elements, at most 2 at a time; each element's own logs and record.
    script = Path(info["script"]).read_text()
    assert "#SBATCH --array=0-3%2" in script and "#SBATCH --cpus-per-task=4" in script  # auto: 4 CPUs, 1 rank
    assert most_at_once(folder, info["elements"]) <= 2
    for element in info["elements"]:
        assert "on n" in (folder / f"{element['job_id']}_0_log.err").read_text()  # the supervisor's line
    text = cli(["status", job, "--folder", str(folder)], cwd=tmp_path).stdout
    assert text.splitlines()[0] == f"job {job}: completed (4 completed)" and all(name in text for name in names)
    one = json.loads(cli(["status", f"{job}_2", "--folder", str(folder), "--json"], cwd=tmp_path).stdout)
    assert one["state"] == "completed" and [e["event"] for e in one["events"]] == ["start", "completed"]
    listed = json.loads(cli(["jobs", "--folder", str(folder), "--json"], cwd=tmp_path).stdout)
    assert [j["job_id"] for j in listed] == [job] and len(listed[0]["elements"]) == 4


def test_a_signalled_element_requeues_alone_and_resumes_bit_identical(slurm_cluster, digits2: Path,
                                                                      tmp_path: Path) -> None:
    run, folder = tmp_path / "sweep", tmp_path / "jobs"
    args = ["--epochs", "20", "--batch-size", "8", "--log-every", "1"]
    info = submit_json(["--nodes", "1", "--time", "5", "--folder", str(folder), "--sweep", "seed=1,2", "--", "train",
                        "--data", str(digits2), "--run-dir", str(run), *args], cwd=tmp_path)
    job = info["job_id"]
    metrics = run / "seed=1" / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 60, 120, "60 logged steps")
    assert not (run / "seed=1" / "summary.json").exists(), "the run ended before the signal: make it longer"
    subprocess.run(["scancel", "--signal=USR2", f"{job}_0"], check=True)
    wait_for(lambda: "requeued" in [e["event"] for e in job_status(folder, f"{job}_0")["events"]], 60,
             "the element's requeue")
    # the reference on the threads the element had (the local cluster's nodes declare 4 CPUs: --cpus-per-task
    # auto gives 4; this machine has 2): bit-exactness holds for the same threads per rank (README "Bit-exact").
    # It trains while Slurm holds the requeued element (cred_expire + 1 s).
    threads = ckpt.verify(ckpt.latest(run / "seed=1"))["torch_threads"]
    ref = tmp_path / "ref"
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(hpctrain, ["train", "--data", str(digits2), "--run-dir", str(ref), "--seed", "1",
                                           *args], timeout=300, env=mpi_env(SLURM_CPUS_PER_TASK=str(threads)))
        final = wait_for(lambda: (s := job_status(folder, job))["state"] in ("completed", "failed") and s, 240,
                         "both elements to finish")
        reference.result(timeout=300)
    assert final["state"] == "completed", final
    first, second = final["elements"]
    assert (first["restarts"], second["restarts"]) == (1, 0), final
    events = [e["event"] for e in job_status(folder, f"{job}_0")["events"]]
    assert events == ["start", "ranks_stopped", "requeued", "start", "completed"], events
    got = summary(run / "seed=1")
    assert got["resumed_from"] is not None and 0 < got["resumed_from"] < got["steps"]
    assert summary(ref)["torch_threads"] == got["torch_threads"] == threads
    assert got["param_sha256"] == summary(ref)["param_sha256"]
    assert summary(run / "seed=2")["resumed_from"] is None


def test_cancel_stops_one_element_or_the_whole_array(slurm_cluster, digits2: Path, tmp_path: Path) -> None:
    run, folder = tmp_path / "sweep", tmp_path / "jobs"
    info = submit_json(["--nodes", "1", "--time", "5", "--folder", str(folder), "--sweep", "seed=1,2,3",
                        "--max-parallel", "2", "--", "train", "--data", str(digits2), "--run-dir", str(run),
                        "--epochs", "1000", "--log-every", "50"], cwd=tmp_path)
    job = info["job_id"]
    states = lambda: [e["state"] for e in job_status(folder, job)["elements"]]  # noqa: E731
    wait_for(lambda: states() == ["running", "running", "pending"], 120, "two running elements and one pending")
    out = cli(["cancel", f"{job}_2", "--folder", str(folder)], cwd=tmp_path).stdout
    assert out.strip() == f"cancelled {job}_2"
    wait_for(lambda: states() == ["running", "running", "cancelled"], 60, "the pending element cancelled alone")
    out = cli(["cancel", job, "--folder", str(folder)], cwd=tmp_path).stdout
    assert out.strip() == f"cancelled {job} (a job array: all 3 elements)"
    final = wait_for(lambda: (s := job_status(folder, job))["state"] in ("cancelled", "failed", "completed") and s,
                     120, "the array to end")
    assert final["state"] == "cancelled" and states() == ["cancelled"] * 3, final
    assert not (run / "seed=3").exists()  # the cancelled pending element never started
