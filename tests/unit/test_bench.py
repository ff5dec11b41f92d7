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


def test_bench_rejects_bad_sizes() -> None:
    proc = hpctrain(["bench", "allreduce", "-n", "1", "--sizes", "4K,lots"], check=False)
    assert proc.returncode == 2 and "lots" in proc.stderr
