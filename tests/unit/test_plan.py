"""`hpctrain plan`: the bytes a rank holds, against what a real step leaves in memory (one process), and the
command's answers."""

from __future__ import annotations

import json

import numpy as np

import pytest
import torch

from conftest import hpctrain
from hpctrain.base.errors import ConfigError
from hpctrain.comm import GradSync, ShardedOptimizer, self_comm
from hpctrain.control import plan
from hpctrain.control.step import train_step
from hpctrain.control.update import StepSetup


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_the_plan_is_what_a_step_leaves_held(zero: int, optimizer: str) -> None:
    """Parameters, gradients and optimizer state after two real steps of a small model (one rank, buckets small
    enough to cut it in several) equal the plan's, which reads the same model built on the meta device."""
    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(20, 300), torch.nn.ReLU(),
                                   torch.nn.Linear(300, 40), torch.nn.ReLU(), torch.nn.Linear(40, 5))

    model = build()
    opt = (torch.optim.Adam(model.parameters(), lr=0.01) if optimizer == "adam"
           else torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    sync = GradSync(model.parameters(), self_comm(), stage=zero, module=model, bucket_mb=0.01, overlap=False)
    opt = ShardedOptimizer(opt, sync) if zero else opt
    loss = torch.nn.CrossEntropyLoss(reduction="sum")
    x, y = torch.randn(8, 20).numpy(), torch.randint(0, 5, (8,)).numpy()
    for _ in range(2):
        train_step(StepSetup(model=model, sync=sync, optimizer=opt, loss_fn=loss), x, y, 8)
    state = opt.state_bytes() if zero else sum(v.numel() * v.element_size() for st in opt.state.values()
                                               for v in st.values())
    meta = plan.meta_model(build)
    p = plan.plan(meta, world=1, zero=zero, optimizer=optimizer, activations=0, bucket_mb=0.01, runtime=0)
    assert (p.params, p.grads, p.optimizer) == (sync.param_bytes(), sync.grad_bytes(), state)
    sync.close()


def test_more_ranks_and_higher_stages_hold_less_and_the_gpt_s_activations_grow_with_the_batch() -> None:
    model, activations = plan.spec_model("gpt:layers=2,dim=64,heads=4", lm=True, seq_len=64, vocab=257)
    small, large = activations(2), activations(8)
    assert 0 < small < large and large == pytest.approx(4 * small, rel=0.1)
    work = plan.Workload("adam", "fp32", 2)
    one, four = plan.stages(model, small, 1, work, runtime=0), plan.stages(model, small, 4, work, runtime=0)
    assert [p.state for p in four] == sorted((p.state for p in four), reverse=True)
    assert four[3].state == pytest.approx(one[0].state / 4, rel=0.02)  # 16 bytes x P over 4 ranks
    assert four[3].gathered > 0 and four[2].gathered == 0 and one[3].gathered == 0
    assert plan.parse_memory("80GiB") == 80 << 30 and plan.parse_memory("512M") == 512 << 20
    with pytest.raises(ConfigError, match="--memory"):
        plan.parse_memory("lots")


def test_the_command_prints_every_stage_and_which_fit() -> None:
    out = json.loads(hpctrain(["plan", "--model", "gpt:layers=2,dim=64,heads=4", "--world", "4", "--zero", "3",
                               "--batch-size", "2", "--seq-len", "64", "--memory", "2GiB", "--json"]).stdout)
    assert [s["stage"] for s in out["stages"]] == [0, 1, 2, 3] and out["world"] == 4 and 0 < out["parameters"]
    assert out["fits"] == [0, 1, 2, 3] and out["fewest_ranks"]["3"] == 1
    text = hpctrain(["plan", "--model", "mlp:4096,4096", "--world", "2", "--memory", "300MiB"]).stdout
    assert "stage  " in text and "--memory 300MiB" in text and "start-up" in text
    bad = hpctrain(["plan", "--optimizer", "lbfgs"], check=False)
    assert bad.returncode == 2 and "choose one of sgd, adam, adamw" in bad.stderr and "Traceback" not in bad.stderr


def test_the_plan_counts_what_the_data_readers_hold(tmp_path) -> None:
    from hpctrain.base.config import ShardConfig
    from hpctrain.data.reader import ShardReader, planned_bytes
    from hpctrain.data.shardformat import load_manifest
    from hpctrain.data.sharding import shard

    data = tmp_path / "d"
    shard(ShardConfig(source="synthetic:3000:784:10", out=data, shards=4, val_fraction=0.2), show_progress=False)
    shardset = load_manifest(data)
    held = 0
    for split, kw in (("train", {}), ("val", {"batch_size": 256, "shuffle": False, "prefetch": 0})):
        reader = ShardReader(shardset, split, rank=0, world=2, **{"batch_size": 64, **kw})  # as train makes them
        for epoch in range(3):
            for _ in reader.epoch(epoch):
                pass
        held += sum(a.nbytes for bufs in reader._pool for a in bufs.values())  # window buffers
        held += sum(a.nbytes for a in reader._datasets.values() if isinstance(a, np.ndarray))  # labels and ids
        reader.close()
    assert planned_bytes(shardset, 2) == held  # equal shards: rank 0 holds what the largest rank does
    out = json.loads(hpctrain(["plan", "--model", "mlp:64", "--data", str(data), "--world", "2", "--json"]).stdout)
    stage = out["stages"][0]
    assert stage["data"] == held and stage["peak"] == stage["runtime"] + max(
        stage["startup"], stage["state"] + stage["gathered"] + stage["activations"] + held)
