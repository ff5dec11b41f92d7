"""ZeRO stages 1, 2 and 3 on real MPI ranks: the same model as stage 0, the memory plan against what the ranks
hold, resume on another world size and stage reading only what each rank owns, a checkpoint of format 1,
bit-exact --deterministic, 16-bit wire formats, and the library API."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from conftest import hpctrain, mpirun, summary
from hpctrain.control import checkpoint as ckpt

pytestmark = pytest.mark.mpi
# small buckets, so that slices cut through parameters and differ in size between the 4 ranks
BASE = ["--no-shuffle", "--batch-size", "16", "--seed", "1", "--bucket-mb", "0.02", "--model", "mlp:64,32",
        "--checkpoint-every", "0", "--json"]


@pytest.fixture(scope="module")
def digits4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("digits4") / "data"
    hpctrain(["shard", "digits", str(out), "--shards", "4"])
    return out


def train(n: int, data: Path, run: Path, *args: str) -> dict:
    hpctrain(["launch", "-n", str(n), "--", "train", "--data", str(data), "--run-dir", str(run), *BASE, *args])
    return summary(run)


def max_diff(a: Path, b: Path) -> float:
    wa = torch.load(a / "model.pt", weights_only=True)
    wb = torch.load(b / "model.pt", weights_only=True)
    assert wa.keys() == wb.keys()
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


@pytest.mark.parametrize("optimizer", [["--optimizer", "sgd", "--momentum", "0.9"],
                                       ["--optimizer", "adam", "--lr", "0.01", "--clip-grad", "0.5"]])
def test_stages_1_to_3_end_within_1e_5_of_stage_0_holding_what_the_plan_says(tmp_path: Path, digits4: Path,
                                                                              optimizer: list[str]) -> None:
    runs, held = {}, {}
    for stage in (0, 1, 2, 3):
        runs[stage] = tmp_path / f"z{stage}"
        s = train(4, digits4, runs[stage], "--max-steps", "12", "--zero", str(stage), *optimizer)
        assert s["ranks_in_sync"] and s["steps"] == 12
        memory, plan = s["memory"], s["memory"]["plan"]
        held[stage] = memory["params"] + memory["grads"] + memory["optimizer"]
        assert plan["stage"] == stage and abs(held[stage] / plan["state"] - 1) <= 0.10, (stage, memory)
    for stage in (1, 2, 3):
        assert max_diff(runs[0], runs[stage]) <= 1e-5, stage
    assert max_diff(runs[0], runs[3]) > 0 or optimizer[1] == "sgd"  # a real reduce-scatter, not a copy of stage 0
    assert held[3] < 0.4 * held[0]  # a 4-rank slice of everything (the tiny model's 0-d states weigh in)
    log = (runs[3] / "logs" / "rank-0000.log").read_text()
    assert "zero stage 3" in log and "ZeRO stage 3: gradients summed by" in log and "memory plan, ZeRO stage 3" in log


def read_bytes(run: Path, rank: int) -> int:
    """What a resumed rank read of its checkpoint's tensors (its log says)."""
    log = (run / "logs" / f"rank-{rank:04d}.log").read_text()
    return int(re.findall(r"resumed from .*; read (\d+) bytes of its tensors", log)[-1])


def test_a_zero_3_checkpoint_resumes_on_other_world_sizes_and_stages_reading_only_what_each_rank_owns(
        tmp_path: Path, digits4: Path) -> None:
    adam = ["--optimizer", "adam", "--lr", "0.01"]
    ref, sharded = tmp_path / "ref", tmp_path / "sharded"
    train(4, digits4, ref, "--max-steps", "6", "--zero", "0", *adam)
    train(4, digits4, sharded, "--max-steps", "6", "--zero", "3", *adam)
    path = ckpt.latest(sharded)
    state = ckpt.load_files(path)
    layout = state["train"]["optimizer"]
    assert layout["zero"] == 3 and layout["world_size"] == 4
    whole = torch.load(ref / "model.pt", weights_only=True)
    assert state["model"].keys() == whole.keys() and all(v.shape == whole[k].shape for k, v in state["model"].items())
    index = torch.load(path / "state.pt", weights_only=True)["index"]
    params = sum(v.numel() for v in state["model"].values())
    for name, entry in index.items():  # every parameter and its Adam moments: the ranks' boxes cover it once
        if name.startswith("model/") or name.endswith("exp_avg"):
            numel = torch.Size(entry["shape"]).numel()
            assert sum(torch.Size(piece[2]).numel() for piece in entry["pieces"]) == numel, name
            if name.endswith("weight"):  # (a bias lies in one rank's slice)
                assert {piece[0] for piece in entry["pieces"]} == {0, 1, 2, 3}, name

    def resumed(source: Path, name: str, n: int, stage: str) -> Path:
        run = tmp_path / name
        shutil.copytree(source, run)
        s = train(n, digits4, run, "--max-steps", "12", "--zero", stage, *adam)
        assert s["resumed_from"] == 6 and s["world_size"] == n and s["ranks_in_sync"]
        return run

    for n, stage in ((2, "3"), (1, "2")):
        plain = resumed(ref, f"ref-{n}", n, "0")
        assert max_diff(plain, resumed(sharded, f"sharded-{n}", n, stage)) <= 1e-5, (n, stage)
        if n == 2:  # each rank read its half of the parameters and of Adam's moments, nothing more
            for r in range(n):
                got = read_bytes(tmp_path / f"sharded-{n}", r)
                assert 12 * params / n - 12 * 64 <= got <= 12 * params / n + 4096, (r, got, params)
            assert max_diff(plain, resumed(ref, "ref-at-3", 2, "3")) <= 1e-5  # stage 0's checkpoint, read at 3


def test_a_checkpoint_of_format_1_resumes_at_stage_3_as_the_version_that_wrote_it_went_on(tmp_path: Path,
                                                                                        digits2: Path) -> None:
    """tests/golden/ckpt-format1: a --zero 2 checkpoint at step 4 written by the format of earlier versions (numbered
    tensors, the optimizer's slices in per-rank trees), and the model that version reached resuming it to step 8.
    The digits shards are the same; their manifest is the one of that run (the same files, its creation time)."""
    golden = Path(__file__).parents[1] / "golden"
    run, data = tmp_path / "run", tmp_path / "data"
    shutil.copytree(digits2, data)
    shutil.copy(golden / "ckpt-format1-manifest.json", data / "manifest.json")
    shutil.copytree(golden / "ckpt-format1", run / "checkpoints" / "step-0000004")
    s = train(2, data, run, "--model", "mlp:16", "--zero", "3", "--optimizer", "adam", "--lr", "0.01",
              "--bucket-mb", "0.002", "--max-steps", "8")
    assert s["resumed_from"] == 4 and s["ranks_in_sync"]
    want = torch.load(golden / "ckpt-format1-resumed-to-8.pt", weights_only=True)
    got = torch.load(run / "model.pt", weights_only=True)
    assert max(float((want[k] - got[k]).abs().max()) for k in want) <= 1e-6
    assert json.loads((ckpt.latest(run) / "meta.json").read_text())["format"] == 2  # and it saves in the new one


def test_deterministic_zero_2_is_bit_exact_across_runs_and_16_bit_wires_stay_in_sync(tmp_path: Path,
                                                                                     digits4: Path) -> None:
    first = train(4, digits4, tmp_path / "d1", "--max-steps", "8", "--zero", "2", "--deterministic")
    second = train(4, digits4, tmp_path / "d2", "--max-steps", "8", "--zero", "2", "--deterministic")
    assert first["param_sha256"] == second["param_sha256"] and first["ranks_in_sync"]
    for wire, stage in (("bf16", ["3", "--deterministic"]), ("fp16", ["2"])):
        s = train(4, digits4, tmp_path / wire, "--max-steps", "8", "--zero", *stage, "--grad-compression", wire)
        assert s["ranks_in_sync"] and s["train_loss"] == s["train_loss"]  # not NaN
        assert max_diff(tmp_path / wire, tmp_path / "d1") < 0.05


@pytest.fixture(scope="module")
def stage0_6_steps(tmp_path_factory: pytest.TempPathFactory, digits4: Path) -> Path:
    """Stage 0's model after 6 steps on 4 ranks: the reference every reducer is held to (trained once)."""
    ref = tmp_path_factory.mktemp("stage0") / "ref"
    train(4, digits4, ref, "--max-steps", "6")
    return ref


@pytest.mark.parametrize("reduce", ["reduce-scatter-block", "reduce-scatter", "allreduce"])
def test_every_reducer_gives_stage_0_s_model(tmp_path: Path, digits4: Path, stage0_6_steps: Path, reduce: str) -> None:
    run = tmp_path / reduce
    train(4, digits4, run, "--max-steps", "6", "--zero", "2", "--zero-reduce", reduce)
    assert max_diff(stage0_6_steps, run) <= 1e-5
    assert f"gradients summed by {reduce}" in (run / "logs" / "rank-0001.log").read_text()


@pytest.mark.parametrize("n", [1, 3])
def test_the_library_api_shards_steps_and_restores_across_stages(tmp_path: Path, n: int) -> None:
    proc = mpirun(n, [str(Path(__file__).parent / "scripts" / "zero_api_check.py"), str(tmp_path / "run")],
                  python_module=False, timeout=180)
    assert f"ZERO API OK {n}" in proc.stdout


def test_gradient_accumulation_at_stage_3_with_overlap_matches_stage_0(tmp_path: Path, digits4: Path) -> None:
    """Micro-batches accumulate into autograd's own gradients; only the last one's backward sends them; each
    micro-batch gathers the parameters again, on the communication thread, the next unit prefetched."""
    ref, run = tmp_path / "ref", tmp_path / "z3"
    train(2, digits4, ref, "--max-steps", "5", "--accumulate", "3", "--optimizer", "adamw", "--lr", "0.01")
    train(2, digits4, run, "--max-steps", "5", "--accumulate", "3", "--optimizer", "adamw", "--lr", "0.01",
          "--zero", "3", "--overlap")
    assert max_diff(ref, run) <= 1e-5


def test_a_resume_keeps_the_reducer_that_auto_chose(tmp_path: Path) -> None:
    """--zero-reduce auto times the reducers at start-up and keeps the fastest; on 3 or more ranks they sum in
    different orders, so a resume that chose anew continued with other bits (found by the soak: seed 7, case
    87, allreduce at one start and reduce-scatter at the next). The checkpoint records the choice; a resume on
    the same world size keeps it, and summary.json says which it was."""
    data, run = tmp_path / "d3", tmp_path / "r"
    hpctrain(["shard", "digits", str(data), "--shards", "3"])
    first = train(3, data, run, "--zero", "1", "--max-steps", "3")
    second = train(3, data, run, "--zero", "1", "--max-steps", "6")
    assert second["resumed_from"] == 3 and second["zero_reduce"] == first["zero_reduce"] != "auto"
    log = (run / "logs" / "rank-0000.log").read_text()
    assert f"--zero-reduce auto: keeping {first['zero_reduce']}" in log
