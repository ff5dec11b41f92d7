"""The pure parts of model parallelism: the layout of ranks, which layouts a model and its data allow (and the
one line that refuses the others), the pipeline schedules, and where a rank's share of a tensor sits in the
whole one. The split model itself trains on real MPI ranks in tests/mpi/test_parallel_mpi.py."""

from __future__ import annotations

import pytest
import torch

from hpctrain.base.config import TrainConfig
from hpctrain.base.errors import ConfigError
from hpctrain.comm import Comm
from hpctrain.compute.gpt import GPT
from hpctrain.compute.models import mlp
from hpctrain.parallel.groups import Groups, make_groups
from hpctrain.parallel.layout import Layout, ModelLimits, check_layout, layouts_that_work
from hpctrain.parallel.pipeline import expected_bubble, schedule
from hpctrain.parallel.stages import build_stage, model_limits, put, take

GPT_LIMITS = ModelLimits("gpt", 4, heads=2, vocab=257)


def test_ranks_are_numbered_tensor_fastest_then_data_then_stage() -> None:
    lay = Layout(2, 2, 2)
    assert [lay.coords(r) for r in range(4)] == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    assert lay.coords(4) == (0, 0, 1) and all(lay.rank(*lay.coords(r)) == r for r in range(8))
    assert str(lay) == "(D,T,P) = (2,2,2)" and Layout(8).plain and not lay.plain


def test_the_layouts_that_work_respect_heads_blocks_and_shards() -> None:
    fits = {(lay.data, lay.tensor, lay.pipe) for lay in layouts_that_work(8, GPT_LIMITS, shards=4)}
    assert fits == {(4, 1, 2), (2, 1, 4), (4, 2, 1), (2, 2, 2), (1, 2, 4)}  # T | 2 heads, P <= 4, D | 4 shards


@pytest.mark.parametrize("world, tp, pp, problem", [
    (6, 4, 1, "--tp 4 x --pp 1 = 4 does not divide the 6 ranks"),
    (8, 1, 8, "--pp 8 is more stages than the model's 4 blocks"),
    (4, 4, 1, "--tp 4 does not divide the model's 2 attention heads"),
    (8, 1, 1, "the data's 4 shards per split cannot be shared evenly by D = 8"),
])
def test_a_bad_layout_is_refused_in_one_line_that_lists_the_layouts_that_work(world: int, tp: int, pp: int,
                                                                             problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_layout(world, tp, pp, GPT_LIMITS, shards=4)
    text = str(info.value)
    assert text.startswith(problem) and "\n" not in text
    assert "use --tp" in text
    for lay in layouts_that_work(world, GPT_LIMITS, shards=4):
        assert f"--tp {lay.tensor} --pp {lay.pipe} (D={lay.data})" in text


def test_a_vocabulary_that_tp_does_not_divide_still_splits_but_not_below_one_id_per_rank() -> None:
    assert check_layout(2, 2, 1, ModelLimits("gpt", 2, heads=2, vocab=257)) == Layout(1, 2, 1)
    assert "more than the vocabulary's 3 ids" in ModelLimits("gpt", 2, heads=4, vocab=3).tensor_problem(4)


def test_a_model_that_does_not_declare_how_to_split_is_refused() -> None:
    limits = model_limits(mlp((8,), 3), "mlp")
    assert limits.blocks == 6 and "does not declare how to split" in limits.tensor_problem(2)
    assert "not a sequence of blocks" in ModelLimits("x", None).pipe_problem(2)
    gpt = model_limits(GPT(257, 16, layers=3, dim=32, heads=4), "gpt")
    assert (gpt.blocks, gpt.heads, gpt.vocab) == (3, 4, 257)


def test_tp_and_pp_are_checked_with_the_config() -> None:
    for bad in (dict(tp=0), dict(pp=-1), dict(micro_batches=-1), dict(pipeline_schedule="zb"),
                dict(micro_batches=40, batch_size=32), dict(tp=2, stage_to="/tmp")):
        with pytest.raises(ConfigError):
            TrainConfig.flat(data=".", run_dir=".", **bad)


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
@pytest.mark.parametrize("stages, micro", [(1, 1), (2, 3), (4, 8), (4, 2)])
def test_every_stage_runs_each_micro_batch_once_each_way_in_an_order_its_neighbours_can_serve(
        kind: str, stages: int, micro: int) -> None:
    plans = [schedule(kind, p, stages, micro) for p in range(stages)]
    for p, ops in enumerate(plans):
        assert sorted(ops) == sorted([("F", i) for i in range(micro)] + [("B", i) for i in range(micro)])
        assert all(ops.index(("F", i)) < ops.index(("B", i)) for i in range(micro))
        forwards = [i for k, i in ops if k == "F"]
        assert forwards == sorted(forwards)  # activations flow in micro-batch order
        if p:  # gradients come back in the order the stage before runs its backwards
            assert [i for k, i in ops if k == "B"] == [i for k, i in plans[p - 1] if k == "B"]
    if kind == "1f1b":  # at most P - p micro-batches in flight on stage p
        for p, ops in enumerate(plans):
            live = peak = 0
            for k, _ in ops:
                live += 1 if k == "F" else -1
                peak = max(peak, live)
            assert peak == min(stages - p, micro)


def test_the_expected_bubble() -> None:
    assert expected_bubble(4, 8) == pytest.approx(3 / 11) and expected_bubble(4, 16) == pytest.approx(3 / 19)
    assert expected_bubble(1, 5) == 0


def test_a_whole_tensor_is_rebuilt_from_its_shares() -> None:
    whole = torch.arange(6 * 4, dtype=torch.float32).view(6, 4)
    pieces = [(0, 0, 0, 1), (0, 2, 1, 1), (0, 4, 2, 1)]  # rows 0, 2 and 4, as q/k/v slices of one head
    share = take(whole, pieces)
    assert share.tolist() == [whole[0].tolist(), whole[2].tolist(), whole[4].tolist()]
    again = torch.zeros_like(whole)
    put(again, share, pieces)
    assert torch.equal(again[[0, 2, 4]], whole[[0, 2, 4]]) and not again[[1, 3, 5]].any()


def test_one_rank_holds_the_whole_gpt_under_its_own_names() -> None:
    torch.manual_seed(0)
    gpt = GPT(257, 16, layers=2, dim=32, heads=2)
    tokens = torch.randint(0, 257, (3, 16))
    expected = gpt(tokens)
    stage = build_stage(gpt, make_groups(Comm(None), Layout(1, 1, 1)))
    assert stage.first and stage.last and stage.tied == [] and stage.aliases == {"head.weight": "tok_emb.weight"}
    assert set(stage.state_dict()) == set(gpt.state_dict()) and stage.keys == list(gpt.state_dict())
    assert torch.equal(stage(tokens), expected)


def test_a_stage_with_nothing_to_train_or_a_weight_two_stages_share_is_refused() -> None:
    def first_stage_of(stages: int) -> Groups:  # each rank checks every stage: the first stage's rank will do
        one = Comm(None)
        return Groups(one, Layout(1, 1, stages), 0, 0, 0, one, one, one, None)

    with pytest.raises(ConfigError, match="stage 0 would hold only Flatten, with no parameter to train"):
        build_stage(mlp((8,), 3, (4, 4)), first_stage_of(6))
    tied = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    tied[1].weight = tied[0].weight
    with pytest.raises(ConfigError, match="parameter 1.weight is used by stages 0 and 1"):
        build_stage(tied, first_stage_of(2))
