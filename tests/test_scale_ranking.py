"""Where each published layout ranks in the search over its own space (labkit/scale/ranking.py, issue 34 item 5).

The pruned search is exact: it equals the enumeration of every layout (prune=False) on small spaces, under
both cost models; the group floor it prunes by is shared by every ZeRO stage and dp_replicate. The criterion
("the published layout is in the top 5, or within 5% of the top prediction") is tested on the rows where it
holds (`MEETS`); the rows where it does not are listed, with the model's reasons, by `python bench/scale.py`
(`--ranks`); four rows that meet it in their framework's space (labkit.scale.space) are tested there too. The rows
validate: no constant is tuned to them. Arithmetic only: 3 s on 2 idle cores (9 s on busy ones), most of it the kernel
bound checked against every layout of a small space and 22B pruned against everything; the framework rows about 5 s.
"""
import pytest

from labkit.scale.cluster import load_cluster
from labkit.scale.cost import predict
from labkit.scale.layout import Layout
from labkit.scale.ranking import ZERO_PARTS, rank_published
from labkit.scale.specs import LLAMA3
from labkit.scale.validation import load_sets

ROWS = {r["id"]: (r, info) for info in load_sets().values() for r in info["rows"]}

# the rows that meet the criterion, by cost model (bench/scale.py --ranks lists the others and why)
MEETS = {"flat": ("tt24-t2-7",), "kernels": ("tt24-t2-7",)}


@pytest.mark.parametrize("model", ("flat", "kernels"))
@pytest.mark.parametrize("row", ("tt24-t2-7", "meg22-22b"))
def test_pruned_ranking_equals_every_layout(model, row):
    """The same top layout and the same exact rank with and without pruning (cap: no limit). Planted when
    written: a bound from full recompute instead of none (1.33x the compute) skips layouts that beat the
    published one, and the ranks differ."""
    r, info = ROWS[row]
    pruned = rank_published(r, info, model, cap=10**9, layout_cap=10**9)
    every = rank_published(r, info, model, prune=False, cap=10**9, layout_cap=10**9)
    assert pruned["top"].layout == every["top"].layout
    assert pruned["rank"] == every["rank"]
    assert pruned["predicted"] <= every["predicted"]
    # the layout level (ranking's docstring): the same rank and the same best configuration of the published layout
    assert pruned["layout"]["rank"] == every["layout"]["rank"]
    assert pruned["layout"]["best"].layout == every["layout"]["best"].layout


def test_pruned_ranking_reads_the_loss_memory_predict_counts():
    """A compiled loss holds 4 bytes a logit, not 12 (labkit.scale.footprint), so layouts fit that an eager loss would
    not; the pruned search reads the logits as predict does and still equals every layout. 8B on 8 H100s, local
    batch 2 of 8,192 tokens, full recompute, compiled with its loss (torchtitan's June 2025 code): the same top,
    rank and best configuration of the published layout. Planted when written: the prune's stage memory at the
    eager 12 bytes skips layouts that fit and beat the published one, which ranks 1,048th against 1,071st."""
    import copy

    info = dict(ROWS["tt24-t1-2"][1], compiled_loss=None)
    r = dict(copy.deepcopy(ROWS["tt24-t1-2"][0]), id="tt24-t1-2, full recompute, compiled loss", recompute="full")
    pruned = rank_published(r, info, "kernels", cap=10**9, layout_cap=10**9)
    every = rank_published(r, info, "kernels", prune=False, cap=10**9, layout_cap=10**9)
    assert pruned["top"] is not None and pruned["top"].layout == every["top"].layout
    assert pruned["rank"] == every["rank"] and pruned["layout"]["rank"] == every["layout"]["rank"]
    assert pruned["predicted"] < every["predicted"]


def test_pruned_ranking_under_float8_all_gather_takes_fsdps_floor():
    """Under torchao's float8 all-gather FSDP's layouts cast less than the other ZeRO stages of their group (their
    weights arrive in float8), so the group's floor is FSDP's: the pruned search tries FSDP first and equals every
    layout. Trainy's 8B H200 row on 16 GPUs (local batch 2, compile, float8 with float8 all-gather), the lab's space.
    Planted when written: the floor taken from whichever ZeRO stage came first skips FSDP layouts that beat the
    published one, which ranks 330th against 338th."""
    import copy

    r, info = ROWS["tt25-h200-32"]
    r = dict(copy.deepcopy(r), id="tt25-h200 on 16 GPUs", dp=16, global_batch=32)
    pruned = rank_published(r, info, "kernels", cap=10**9, layout_cap=10**9)
    every = rank_published(r, info, "kernels", prune=False, cap=10**9, layout_cap=10**9)
    assert pruned["top"].layout == every["top"].layout
    assert pruned["rank"] == every["rank"] and pruned["layout"]["rank"] == every["layout"]["rank"]
    assert pruned["predicted"] < every["predicted"]


@pytest.mark.parametrize("efficiency", (0.40, None))
def test_group_floor_is_shared_by_zero_stages_and_replicas(efficiency):
    """Stage 2's floor: step less exposed dp, its contention, the optimizer and FSDP's copies (ranking.ZERO_PARTS) is
    the same for every ZeRO stage and dp_replicate of a group (they change only those terms and the memory); under
    float8 all-gather FSDP's is lower (the test above)."""
    cluster, spec = load_cluster("h100-sxm"), LLAMA3["8b"]
    floors = set()
    for zero in ("dp", "zero1", "zero2", "zero3"):
        for r in (1, 2, 4) if zero != "dp" else (1,):
            p = predict(spec, Layout(dp=4, pp=2, cp=2, tp=2, zero=zero, dp_replicate=r, micro_batch=1), cluster,
                        32, 8192, efficiency=efficiency)
            floors.add(round(p.step_s - sum(p.parts_s.get(k, 0.0) for k in ZERO_PARTS), 12))
    assert len(floors) == 1, floors
    # without a pipeline DeepSpeed's ZeRO-3 (zero3_unit="module", its own clocks) shares the floor too: what its
    # clocks add beyond the kernels is exposed_dp and contention_dp, as for the other stages
    floors = set()
    for zero, unit in (("dp", "block"), ("zero1", "block"), ("zero2", "block"), ("zero3", "block"), ("zero3", "module")):
        p = predict(spec, Layout(dp=8, zero=zero, zero3_unit=unit, micro_batch=1, recompute="full"), cluster, 32, 8192,
                    efficiency=efficiency)
        floors.add(round(p.step_s - sum(p.parts_s.get(k, 0.0) for k in ZERO_PARTS), 12))
    assert len(floors) == 1, floors


@pytest.mark.parametrize("model,row", [(m, r) for m, rows in MEETS.items() for r in rows])
def test_published_layout_in_top_5_or_within_5_percent(model, row):
    r, info = ROWS[row]
    got = rank_published(r, info, model)
    assert got["meets"], (f"{row} under the {model} model: the published layout ranks #{got['rank']}, "
                          f"{got['gap']:+.1%} from the top ({got['top'].layout.short()})")


# in its framework's space (labkit.scale.space), kernel model: a few of the 18 rows that meet it there, the quick ones
MEETS_IN_FRAMEWORK = ("meg22-530b", "meg22-1t", "meg21-t2-zero3-530b-2240", "meg21-t1-1t")


@pytest.mark.parametrize("row", MEETS_IN_FRAMEWORK)
def test_published_layout_in_top_5_or_within_5_percent_of_its_frameworks_space(row):
    r, info = ROWS[row]
    got = rank_published(r, info, "kernels", space="framework")
    assert got["meets"], (f"{row} in {got['space']}'s space: the published layout ranks #{got['rank']}, "
                          f"{got['gap']:+.1%} from the top ({got['top'].layout.short()})")


@pytest.mark.parametrize("float8", (False, True))
def test_kernel_bound_is_below_every_step_and_holds_the_bubble(float8):
    """The kernel model's group bound (labkit.scale.bounds.group_bounds, through the pipeline's critical path) is a
    lower bound on the step of every layout of its group, under every schedule of the space (1F1B, interleaved x2, ZB): 8B on 8 H100s, a
    batch of 8 x 4,096, every pp. It holds the bubble: on pp = 4 1F1B, it is above the busiest rank's work alone.
    Planted when written: the backwards behind a rank's last action counted whatever that action is (a ZB rank ends
    on a W, which no stage waits for) and in full (b_s, not ZB's B = b_s - w_s): the bound exceeds a ZB step.
    float8=True: TP's all-gathers move float8 values (labkit.scale.float8.tp_gather_bytes) in the bound as in the
    step; planted when written, the bound's gathers at bf16 exceed the step of tp 8 layouts."""
    from dataclasses import replace

    from labkit.scale.bounds import group_bounds
    from labkit.scale.layout import CP_METHODS, ZERO_STAGES, LayoutError
    from labkit.scale.ranking import _axes, schedules_of

    cluster, spec, options = load_cluster("h100-sxm"), LLAMA3["8b"], dict(efficiency=None, compile=False,
                                                                           float8=float8, async_tp=False)
    checked, bubbles = 0, []
    for (dp, pp, cp, tp), sched in ((axes, s) for axes in _axes(8) for s in schedules_of(Layout(), "kernels")):
        if pp == 1 and sched["schedule"] != "1f1b":
            continue
        base = Layout(dp=dp, pp=pp, cp=cp, tp=tp, **sched)
        for (mb, rc), bound in group_bounds(spec, base, cluster, 8, 4096, 8, options).items():
            for method in CP_METHODS if cp > 1 else ("ring",):
                for zero in ZERO_STAGES:
                    try:
                        p = predict(spec, replace(base, micro_batch=mb, recompute=rc, cp_method=method, zero=zero),
                                    cluster, 8, 4096, efficiency=None, float8=float8)
                    except LayoutError:
                        continue
                    assert bound <= p.step_s * (1 + 1e-12), (base.short(), mb, rc, method, zero, bound, p.step_s)
                    checked += 1
                    if pp == 4 and sched["schedule"] == "1f1b" and zero == "dp":
                        bubbles.append(bound - p.parts_s["compute"] - p.parts_s["exposed_tp"])
    assert checked > 500
    assert bubbles and min(bubbles) > 0
