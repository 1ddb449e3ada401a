"""The search's spaces (labkit/scale/space.py, labkit/scale/frameworks.json): the lab's whole space, and the options
each published run's framework had. A framework's space holds only its options (every layout the search predicts
in it is one its code could run), it equals brute force like the lab's (tests/test_scale_ranking.py), and a
frameworks file with a bad entry is refused by field. Arithmetic only: about 2 s."""
import json
from dataclasses import replace

import pytest

import labkit.scale.ranking as ranking
from labkit.scale.cluster import load_cluster
from labkit.scale.ranking import rank_published, search_around
from labkit.scale.space import FRAMEWORKS_FILE, LAB, Space, load_frameworks, space_from, space_of
from labkit.scale.validation import layout_of, load_sets, model_options, row_spec

SETS = load_sets()
ROWS = {r["id"]: (r, info) for info in SETS.values() for r in info["rows"]}


def test_every_set_names_a_framework_in_the_file_and_each_field_its_source():
    frameworks = load_frameworks()
    raw = json.loads(FRAMEWORKS_FILE.read_text())["frameworks"]
    for name, given in raw.items():
        assert set(given) - {"sources"} == set(given["sources"]), name  # a reason for each option left out
    for info in SETS.values():
        for row in info["rows"]:
            name, space = space_of(row, info, frameworks)
            assert name in frameworks and space == frameworks[name], row["id"]
    # the edge case: a row naming its own framework (DeepSpeed's ZeRO-3 rows in Megatron-LM 2021's Table 2)
    row, info = ROWS["meg21-t2-zero3-175b-384"]
    assert space_of(row, info)[0] == "deepspeed-zero-2021" and space_of(ROWS["meg21-t2-ptd-175b-384"][0], info)[0] == "megatron-lm-2021"


@pytest.mark.parametrize("given,match", [
    ({"zero": ["zero4"], "sources": {"zero": "x"}}, r"demo\.zero=\['zero4'\]: a list of some of"),
    ({"cp_methods": "ring", "sources": {"cp_methods": "x"}}, r"demo\.cp_methods='ring'"),
    ({"tp": "no", "sources": {"tp": "x"}}, r"demo\.tp='no': true or false"),
    ({"ep": False, "sources": {"ep": "x"}}, r"demo\.ep: not an option of a search's space"),
    ({"zero": ["dp"]}, r"demo\.zero: give its reason in demo\.sources\.zero"),
    ({"recompute": [], "sources": {"recompute": "x"}}, r"demo\.recompute=\[\]: name at least one"),
])
def test_a_bad_framework_entry_is_refused_by_field(given, match):
    with pytest.raises(ValueError, match=match):
        space_from(given, "demo")


def test_an_unknown_framework_or_space_is_refused_with_the_choices():
    row, info = ROWS["meg22-22b"]
    with pytest.raises(ValueError, match=r"framework 'megatron-1999' is not in frameworks\.json: one of \["):
        space_of(dict(row, framework="megatron-1999"), info)
    with pytest.raises(ValueError, match=r"space='mine': 'lab' .* or 'framework'"):
        rank_published(row, info, "flat", space="mine")
    assert space_of(row, {k: v for k, v in info.items() if k != "framework"}) == ("lab", LAB)


def _searched(monkeypatch, row_id: str, space, model: str = "flat", batch: int | None = None) -> list:
    """Every layout the unpruned search over `space` predicts for a published row's question (its model, cluster,
    sequence and GPU count; its global batch unless `batch` is given)."""
    row, info = ROWS[row_id]
    seen, real = [], ranking.predict

    def spy(spec, lay, *args, **kwargs):
        seen.append(lay)
        return real(spec, lay, *args, **kwargs)
    monkeypatch.setattr(ranking, "predict", spy)
    search_around(row_spec(row), load_cluster(info["cluster"]), batch or row["global_batch"], row["seq_len"],
                  layout_of(row).world_size, None, model_options(row, model), prune=False, space=space)
    monkeypatch.undo()
    return seen


@pytest.mark.parametrize("model", ("flat", "kernels"))
def test_a_framework_space_predicts_only_what_its_code_could_run_and_equals_brute_force(model, monkeypatch):
    """Megatron-LM 2022 on 8 GPUs (22B): no CP, plain DP, no HSDP, its recompute policies and schedules. Every
    layout the unpruned search predicts is in the space; pruned and unpruned agree on the top and the ranks."""
    row, info = ROWS["meg22-22b"]
    space = space_of(row, info)[1]
    every = rank_published(row, info, model, prune=False, cap=10**9, layout_cap=10**9, space="framework")
    pruned = rank_published(row, info, model, cap=10**9, layout_cap=10**9, space="framework")
    assert every["space"] == "megatron-lm-2022"
    assert (pruned["top"].layout, pruned["rank"], pruned["layout"]["rank"]) == \
           (every["top"].layout, every["rank"], every["layout"]["rank"])
    seen = _searched(monkeypatch, "meg22-22b", space, model)
    assert seen and all(lay.cp == 1 and lay.zero in space.zero and lay.recompute in space.recompute
                        and lay.dp_replicate == 1 and (lay.pp == 1 or lay.schedule in space.schedules) for lay in seen)
    # the edge case of the switches: DeepSpeed's ZeRO-3 baseline ran without TP or PP (a batch of 32: dp 8 splits it)
    seen = _searched(monkeypatch, "meg22-22b", load_frameworks()["deepspeed-zero-2021"], model, batch=32)
    assert seen and all(lay.tp == lay.pp == lay.cp == 1 and lay.zero != "dp" for lay in seen)
    lab = rank_published(row, info, model, prune=False, cap=10**9, layout_cap=10**9)
    assert lab["predicted"] > every["predicted"]  # the lab's space is larger: CP, ZeRO, HSDP, ZB


def test_torchtitans_plain_dp_runs_alone_as_its_code_requires(monkeypatch):
    """The edge case of `ddp_alone`: torchtitan applies DDP only to a one-dimensional mesh ("DDP has not supported
    > 1D parallelism"), so its space holds plain DP at dp 8 alone and never beside TP, PP or CP; the same space
    without the switch (the planted mistake) predicts DDP beside another axis."""
    space = space_of(*ROWS["tt24-t1-1"])[1]
    assert space.ddp_alone and space.zero_stages(1, 1, 1) == ("dp", "zero3") and space.zero_stages(1, 1, 2) == ("zero3",)
    for case in (space, replace(space, ddp_alone=False)):
        plain = [lay for lay in _searched(monkeypatch, "tt24-t1-1", case) if lay.zero == "dp"]
        assert any(lay.dp == 8 for lay in plain)
        assert all(lay.pp == lay.cp == lay.tp == 1 for lay in plain) == case.ddp_alone, case.ddp_alone


def test_torchtitan_of_2024_runs_the_whole_local_batch_at_once_without_a_pipeline(monkeypatch):
    """The edge case of `grad_accumulation`: torchtitan accumulated no gradients before June 2025, so without PP a
    step is one pass of the local batch (micro-batch = global batch / dp), while its pipelines still split it; the
    async TP file's torchtitan (2025) and the same space with the switch on (the planted mistake) accumulate."""
    row, info = ROWS["tt24-t1-1"]
    batch, space = row["global_batch"], space_of(row, info)[1]
    assert space_of(*ROWS["atp-8b-7"])[1].grad_accumulation and not space.grad_accumulation
    for case in (space, replace(space, grad_accumulation=True)):
        seen = _searched(monkeypatch, "tt24-t1-1", case)
        flat = [lay for lay in seen if lay.pp == 1]
        assert flat and all(lay.micro_batch == batch // lay.dp for lay in flat) != case.grad_accumulation
        assert any(lay.micro_batch < batch // lay.dp for lay in seen if lay.pp > 1)  # a pipeline splits it always


def test_a_framework_space_runs_its_layouts_as_the_rows_code_did_the_labs_as_the_lab_does():
    """Megatron-LM 2021's 1T row ran without SP and reduced gradients after the backward: its framework's space
    runs every layout so; the lab's space runs them with SP and overlapped buckets, whatever the row did."""
    row, info = ROWS["meg21-t1-1t"]
    mine = layout_of(row)
    assert space_of(row, info)[1].traits(mine) == dict(sequence_parallel=False, grad_reduce="after", zero3_unit="block",
                                                       kv_rotation="p2p")
    assert LAB.traits(mine) == dict(sequence_parallel=True, grad_reduce="overlap", zero3_unit="block", kv_rotation="p2p")
    row6, info6 = ROWS["tt24-t6-18"]  # torchtitan's CP rows rotate the ring's K/V by one all-gather (its default)
    assert space_of(row6, info6)[1].traits(layout_of(row6))["kv_rotation"] == "allgather"
    assert LAB.traits(layout_of(row6))["kv_rotation"] == "p2p"
    row, info = ROWS["meg21-t2-zero3-530b-640"]
    assert space_of(row, info)[1].traits(layout_of(row))["zero3_unit"] == "module"  # DeepSpeed's per-module gathers


def test_space_defaults_are_the_labs_whole_space():
    assert Space() == LAB and LAB.allows_axes(pp=2, cp=2, tp=2)
    assert not Space(cp_methods=()).allows_axes(pp=1, cp=2, tp=1) and not Space(tp=False).allows_axes(1, 1, 2)
