"""The bench commands run for real (on small sizes) and print the JSON fields the README's numbers use."""

import json

import pytest

from conftest import hpctrain


@pytest.mark.mpi
def test_bench_allreduce_json() -> None:
    proc = hpctrain(["bench", "allreduce", "-n", "2", "--sizes", "4K,64K", "--json"], timeout=120)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["world_size"] == 2 and [r["bytes"] for r in result["sizes"]] == [4096, 65536]
    for row in result["sizes"]:
        for key in ("raw_ms", "hpctrain_ms", "raw_algbw_gbs", "raw_busbw_gbs", "hpctrain_algbw_gbs",
                    "hpctrain_busbw_gbs", "ratio"):
            assert row[key] > 0


@pytest.mark.mpi
def test_bench_train_json() -> None:
    proc = hpctrain(["bench", "train", "-n", "2", "--model", "mlp:64", "--input-dim", "32", "--steps", "3",
                     "--rounds", "1", "--json"], timeout=180)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["world_size"] == 2 and r["parameters"] == 32 * 64 + 64 + 64 * 10 + 10
    for key in ("ddp_over_hpctrain", "sync_ms", "raw_allreduce_ms", "sync_over_raw", "single_rank_step_ms",
                "scaling_efficiency"):
        assert r[key] > 0
    assert r["hpctrain"]["step_ms"] > 0 and r["ddp"]["step_ms"] > 0
    # the honest limit: a plain torch step on every rank at once plus one raw allreduce where overlap cannot
    # hide it, timed in the step (the back-to-back one beside it), judged round by round; hpctrain's step as
    # its own world stays beside it
    assert not r["overlap"] and r["limit_comm_ms"] == r["raw_allreduce_in_step_ms"] > 0
    assert r["raw_allreduce_in_step_rounds_ms"] == [r["raw_allreduce_in_step_ms"]]
    assert r["plain_torch_step_ms"] > 0
    assert r["limit_step_ms"] == pytest.approx(r["plain_torch_step_ms"] + r["limit_comm_ms"])
    assert len(r["step_over_limit_rounds"]) == 1 and r["step_over_limit"] == r["step_over_limit_rounds"][0]
    assert r["step_over_limit"] == pytest.approx(r["hpctrain"]["step_ms"] / r["limit_step_ms"])
    assert r["step_over_limit_back_to_back"] == pytest.approx(
        r["hpctrain"]["step_ms"] / (r["plain_torch_step_ms"] + r["raw_allreduce_ms"]))
    assert r["self_world_step_ms"] > 0 and "compute_only_step_ms" not in r
    assert r["self_world_over_plain"] == pytest.approx(r["self_world_step_ms"] / r["plain_torch_step_ms"])
    # the loop a user writes by hand (plain torch, one raw allreduce per gradient), timed in the same rounds
    assert r["handwritten_step_ms"] > 0 and len(r["step_over_handwritten_rounds"]) == 1
    assert r["step_over_handwritten"] == pytest.approx(r["hpctrain"]["step_ms"] / r["handwritten_step_ms"])
    assert r["handwritten_over_limit"] == pytest.approx(r["handwritten_step_ms"] / r["limit_step_ms"])


@pytest.mark.mpi
def test_bench_train_lm_json() -> None:
    """A gpt spec steps on random token rows and reports the token figures `train` reports, beside DDP."""
    proc = hpctrain(["bench", "train", "-n", "2", "--model", "gpt:layers=1,dim=32,heads=2", "--seq-len", "16",
                     "--batch-size", "8", "--steps", "2", "--rounds", "1", "--json"], timeout=180)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["world_size"] == 2 and r["seq_len"] == 16 and r["vocab"] == 257
    # tied embedding/head 257 x 32 and positions 16 x 32; one block: 2 LayerNorms, qkv, proj, fc, proj; ln_f
    block = 2 * 2 * 32 + (32 * 96 + 96) + (32 * 32 + 32) + (32 * 128 + 128) + (128 * 32 + 32)
    assert r["parameters"] == 257 * 32 + 16 * 32 + block + 2 * 32
    assert r["flops_per_token"] == 6 * (r["parameters"] - 16 * 32) + 12 * 1 * 32 * 16
    assert r["tokens_per_s"] == pytest.approx(2 * 8 * 16 / r["hpctrain"]["step_ms"] * 1e3)
    assert r["mfu"] == pytest.approx(r["tokens_per_s"] * r["flops_per_token"] / r["peak_flops"])
    for key in ("peak_flops", "mfu", "ddp_over_hpctrain", "sync_ms", "single_rank_step_ms", "scaling_efficiency"):
        assert r[key] > 0


def test_bench_rejects_bad_sizes() -> None:
    proc = hpctrain(["bench", "allreduce", "-n", "1", "--sizes", "4K,lots"], check=False)
    assert proc.returncode == 2 and "lots" in proc.stderr


@pytest.mark.mpi
def test_bench_train_split_json_and_its_table(capsys: pytest.CaptureFixture) -> None:
    from pathlib import Path

    from hpctrain.cli.bench import _print_parallel

    paced = Path(__file__).resolve().parents[2] / "benchmarks" / "paced_blocks.py"
    proc = hpctrain(["bench", "train", "-n", "2", "--pp", "2", "--micro-batches", "4", "--model", f"{paced}:factory",
                     "--input-dim", "32", "--batch-size", "4", "--steps", "2", "--rounds", "1", "--json"], timeout=180)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["layout"] == {"data": 1, "tensor": 1, "pipe": 2} and r["micro_batches"] == 4
    assert r["expected_bubble"] == pytest.approx(1 / 5) and 0 < r["bubble"] < 0.5  # stages of fixed duration
    assert [s["stage"] for s in r["stages"]] == [0, 1] and all(s["forward"] > 0 and s["backward"] > 0 for s in r["stages"])
    assert 0.3 < r["memory"]["ratio_to_whole"] < 1 and r["step_ms"] > 0
    _print_parallel(r)
    out = capsys.readouterr().out
    assert "(D,T,P) = (1,1,2)" in out and "expected (P-1)/(M+P-1) = 0.200" in out


def test_overlap_is_on_by_default_on_a_gpu_only() -> None:
    """On CPUs the communication thread competes with torch's threads: the reference step was slower with it at
    one thread a rank (2 cores) and at 8 threads a rank (16 cores; docs/performance.md),
    so auto overlaps only where a GPU computes, however many cores a rank owns (the rule takes no core count)."""
    from hpctrain.control.step import auto_overlap

    assert auto_overlap("cpu") is False and auto_overlap("cuda") is True


def test_the_limit_of_each_round_adds_that_rounds_allreduce_timed_in_the_step() -> None:
    from types import SimpleNamespace

    from hpctrain.bench.limit import limit_figures

    # seconds per round: hpctrain, the plain step, the allreduce timed in the step; back to back 3.0 ms
    in_step = SimpleNamespace(rounds=[0.005, 0.006, 0.004])  # what InStepAllreduce kept, one figure per round
    r = limit_figures([0.036, 0.034, 0.040], [0.030, 0.029, 0.033], in_step, 3.0, overlap=False,
                      hand_rounds=[0.037, 0.035, 0.041])
    assert r["step_over_limit_rounds"] == pytest.approx([36 / 35, 34 / 35, 40 / 37])
    assert r["step_over_limit"] == pytest.approx(36 / 35)
    assert r["limit_comm_ms"] == r["raw_allreduce_in_step_ms"] == pytest.approx(5.0)
    assert r["limit_step_ms"] == pytest.approx(30.0 + 5.0)
    assert r["step_over_limit_back_to_back"] == pytest.approx(36 / 33)  # median of 36/33, 34/32, 40/36
    assert r["raw_allreduce_ms"] == 3.0
    assert r["handwritten_over_limit"] == pytest.approx(37 / 35)
    # where overlap hides communication the limit is the plain step alone, and no allreduce figure is made up
    r = limit_figures([0.036], [0.030], None, None, overlap=True)
    assert r["limit_comm_ms"] == 0.0 and r["step_over_limit"] == pytest.approx(36 / 30)
    assert "raw_allreduce_in_step_ms" not in r and "step_over_limit_back_to_back" not in r


@pytest.mark.mpi
def test_bench_train_prints_the_limit_and_stage_0_beside_a_sharded_step() -> None:
    proc = hpctrain(["bench", "train", "-n", "2", "--model", "mlp:64", "--input-dim", "32", "--steps", "3",
                     "--rounds", "1", "--zero", "1"], timeout=180)
    assert "plus one raw allreduce in the step:" in proc.stdout, proc.stdout
    assert "with the allreduce timed back to back instead" in proc.stdout and "stage 0 step" in proc.stdout


def test_bench_startup_takes_each_part_from_the_import_timer_of_the_ranks() -> None:
    """Each process prints a module once, where it first imports it: a part is the mean over the ranks."""
    from hpctrain.bench.startup import format_startup, import_parts

    lines = ["import time: self [us] | cumulative | imported package",
             "import time:     21944 |    1200000 |       torch", "import time:     20000 |    1400000 | torch",
             "import time:       776 |    1000000 | torch._dynamo", "import time:       700 |    1200000 | torch._dynamo",
             "import time:    327060 |     300000 | mpi4py.MPI", "import time:     327060 |     500000 | mpi4py.MPI",
             "import time:       100 |       9000 |   torch.optim", "epoch 1 step 1/23"]
    parts = import_parts(lines)
    assert parts == pytest.approx({"import_torch_s": 1.3, "torch_dynamo_s": 1.1, "mpi_init_s": 0.4})
    line = format_startup({"ranks": 2, "first_step_s": 3.5, "first_line_s": 0.3, **parts, "ours_s": 0.7})
    assert line == ("start-up on 2 ranks: 3.50 s to the first step, of which import torch 1.30, torch._dynamo 1.10, "
                    "MPI init 0.40, ours 0.70 (the first line after 0.30 s)")
