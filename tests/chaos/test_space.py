"""The hang matrix draws from every option of `hpctrain train`: its table (chaos_space.SPACE) names each field
of TrainConfig, drawn or excluded with a reason, and the drawing does what the table says. Fast: it builds
a few small shard sets and trains nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from chaos_data import DataCache
from chaos_space import (PAIR_RTOL, PAIRS, REFUSALS, SPACE, Case, DataSpec, Drawn, Excluded, classifier_shard_sizes,
                         draw_case, event_of)
from hpctrain.base.config import TrainConfig
from hpctrain.base.sections import TRAIN_FLAT
from hpctrain.base.errors import ConfigError

SEEDS, CASES = (1, 2), 500


def test_the_table_names_every_field_of_trainconfig_and_no_other() -> None:
    fields = {*TRAIN_FLAT, "extra"}  # the flat names: one a `train` option, and the config file's extra keys
    missing, unknown = sorted(fields - set(SPACE)), sorted(set(SPACE) - fields)
    assert not missing, (f"TrainConfig fields that tests/chaos/chaos_space.py SPACE neither draws nor excludes: "
                         f"{missing}; add a Drawn(...) or an Excluded(reason) for each")
    assert not unknown, f"SPACE names fields TrainConfig does not have: {unknown}; remove or rename them"


def test_every_entry_is_drawn_or_excluded_with_a_reason() -> None:
    for name, entry in SPACE.items():
        assert isinstance(entry, (Drawn, Excluded)), name
        text = entry.how if isinstance(entry, Drawn) else entry.reason
        assert isinstance(text, str) and text.strip(), f"SPACE[{name!r}] says nothing about how or why"


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("space")


@pytest.fixture(scope="module")
def drawn(cache_root: Path) -> list[Case]:
    data = DataCache(cache_root)
    return [draw_case(seed, i, data) for seed in SEEDS for i in range(CASES)]


def config(options: tuple, tmp: str = "/nonexistent") -> TrainConfig:
    return TrainConfig.flat(data=tmp, run_dir=tmp, **{k: v for k, v in options if v is not None})


def test_every_drawn_option_takes_more_than_one_value(drawn: list[Case]) -> None:
    for name, entry in SPACE.items():
        if isinstance(entry, Drawn) and entry.draw is not None:
            values = {dict(c.options)[name] for c in drawn}
            assert len(values) > 1, f"option {name} was drawn as {values} only in {len(drawn)} cases"
    assert {c.data.source for c in drawn} >= {"digits", "stdlib:32"} and {c.world for c in drawn} == {1, 2, 3, 4}


def test_drawn_configurations_are_valid_and_refused_ones_are_refused_for_their_reason(drawn: list[Case]) -> None:
    for c in drawn:
        refusal = REFUSALS.get(c.refusal) if c.refusal else None
        if refusal is not None and refusal.where == "config":
            with pytest.raises(ConfigError, match=refusal.fragment):
                config(c.options)
        else:
            config(c.options)
            config(c.partner) if c.partner else None


def test_refusals_and_pairs_of_every_kind_are_drawn(drawn: list[Case]) -> None:
    refused = [c for c in drawn if c.refusal]
    assert 0.04 <= len(refused) / len(drawn) <= 0.12
    assert {c.refusal for c in refused} == set(REFUSALS)
    assert all(c.event == "none" and c.pair is None for c in refused)
    assert {c.pair for c in drawn if c.pair} == set(PAIRS)
    assert {c.event for c in drawn} == {event_of(c.seed, c.index) for c in drawn}


def test_a_pair_changes_its_axis_only_and_in_fp32(drawn: list[Case]) -> None:
    for c in (c for c in drawn if c.pair):
        a, b = dict(c.options), dict(c.partner)
        changed = {k for k in a if a[k] != b[k]}
        allowed = {"zero", "zero_reduce"} if c.pair == "zero" else {c.pair}
        if PAIRS[c.pair].exact:
            assert not changed and a["deterministic"] is True, c
        else:
            assert changed and changed <= allowed, (c.pair, changed)
            assert a["precision"] == "fp32" and a["grad_compression"] == "none", c
    assert 0 < PAIR_RTOL < 1e-3


def test_a_case_is_a_pure_function_of_seed_and_index(drawn: list[Case], cache_root: Path) -> None:
    again = DataCache(cache_root)  # a new cache: only the shard sets on disk are shared
    assert [draw_case(SEEDS[0], i, again) for i in range(CASES)] == drawn[:CASES]
    assert draw_case(SEEDS[0], 0, again) != draw_case(SEEDS[0], 1, again)


@pytest.mark.parametrize("spec", [DataSpec("synthetic:39:5:3", 3, 0.25), DataSpec("synthetic:203:8:4", 4, 0.1)],
                         ids=lambda s: s.name)
def test_the_shard_sizes_the_drawing_assumes_are_those_shard_writes(tmp_path: Path, spec: DataSpec) -> None:
    manifest = DataCache(tmp_path).manifest(spec)  # it raises when they differ; here the sizes are also read
    assert [s["samples"] for s in manifest["splits"]["train"]["shards"]] == classifier_shard_sizes(spec)


def test_the_docs_section_names_every_option_of_the_table() -> None:
    guide = (Path(__file__).resolve().parents[2] / "docs" / "guides" / "hangs.md").read_text()
    section = guide[guide.index("## The hang matrix"):]
    section = section[:section.index("\n## ")] if "\n## " in section else section
    absent = [name for name, entry in SPACE.items()
              if f"--{name.replace('_', '-')}" not in section and f"`{name}`" not in section]
    assert not absent, f"docs/guides/hangs.md's 'The hang matrix' does not say how these options are drawn or why not: {absent}"
    assert "(filled by the 300-case soak)" in section or "| option | value | cases |" in section
