"""labkit.apps.cpu_layouts' prediction and the cost model's CPU switches (value_bytes, overlap): arithmetic only,
no process (bench/scale_cpu.py runs the layouts). Each figure is derived here by hand from the model's terms."""
import pytest

from labkit.apps import cpu_layouts
from labkit.scale.cost import predict
from labkit.scale.layout import Layout
from labkit.scale.specs import spec_from_config

FIT = dict(rate=50e9, busy=40e9, cores=2, links={2: (1e-4, 1e9), 4: (2e-4, 0.5e9), 8: (1e-3, 0.25e9)})
SPEC = spec_from_config(cpu_layouts._config())
B, S = cpu_layouts.GLOBAL_BATCH, cpu_layouts.SEQ_LEN


def test_fp32_on_the_wire_doubles_every_plain_byte():
    """Activations, K/V and gradients travel in value_bytes: 4 instead of 2 doubles each axis's bytes."""
    cluster = cpu_layouts.cpu_cluster(FIT, 4)
    for lay in (Layout(dp=2, pp=2, micro_batch=2, zero="dp"), Layout(cp=2, tp=2, micro_batch=8, zero="zero1")):
        bf16 = predict(SPEC, lay, cluster, B, S).traffic
        fp32 = predict(SPEC, lay, cluster, B, S, value_bytes=4).traffic
        assert {a: 2 * v["bytes"] for a, v in bf16.items()} == {a: v["bytes"] for a, v in fp32.items()}


def test_without_overlap_every_axis_is_exposed_in_full():
    lay = Layout(dp=2, pp=2, micro_batch=2, zero="dp", recompute="none")
    p = predict(SPEC, lay, cpu_layouts.cpu_cluster(FIT, 4), B, S, efficiency=1.0, overlap=False)
    traffic = sum(v["seconds"] for v in p.traffic.values())
    bubble = (2 - 1) / p.n_micro * p.parts_s["compute"]
    assert p.step_s == pytest.approx(p.parts_s["compute"] + traffic + bubble, rel=1e-12)
    assert p.step_s > predict(SPEC, lay, cpu_layouts.cpu_cluster(FIT, 4), B, S, efficiency=1.0).step_s


def test_two_ranks_on_two_cores_compute_half_the_flops_at_the_given_rate():
    p = cpu_layouts.predict_layout("dp2", FIT, rate=30e9)
    assert p.parts_s["compute"] == pytest.approx(SPEC.flops_per_token(S) * B * S / 2 / 30e9, rel=1e-12)
    alpha, beta = FIT["links"][2]
    assert p.parts_s["exposed_dp"] == pytest.approx(2 * alpha + 4 * SPEC.n_params / beta, rel=1e-12)


def test_oversubscribed_pipeline_lends_its_bubble():
    """dp2 x pp2 on 2 cores: the step is the cores' total work, (compute + bubble) x 2/4 < compute, so no bubble
    is paid; a planted 'bubble always paid' rule would give compute + bubble."""
    p = cpu_layouts.predict_layout("dp2 x pp2", FIT, rate=20e9)
    comm = p.parts_s["exposed_dp"] + p.parts_s["exposed_pp"]
    assert p.parts_s["bubble"] == 0 and p.step_s == pytest.approx(p.parts_s["compute"] + comm, rel=1e-12)
    alone = cpu_layouts.predict_layout("pp2 1f1b m4", FIT, rate=20e9)  # 2 ranks, 2 cores: the bubble is paid
    assert alone.parts_s["bubble"] == pytest.approx((2 - 1) / 4 * alone.parts_s["compute"], rel=1e-12)


def test_every_registered_layout_is_predictable_and_a_bad_name_is_named():
    for name in cpu_layouts.LAYOUTS:
        assert cpu_layouts.predict_layout(name, FIT).step_s > 0
    with pytest.raises(ValueError, match="no layout named 'dp3'"):
        cpu_layouts.run_layout("dp3")


def test_step_alpha_solves_the_ring_all_reduce_for_alpha_per_size_and_takes_the_median():
    """t(S) = 2 (W-1) (alpha + S / (W beta)) for every S gives back alpha exactly (a planted S / beta, without
    the W, would not); one size far off (a stall) moves nothing: the median of three."""
    alpha, beta = 4e-4, 1e9
    for world in (2, 4, 8):
        costs = {s: 2 * (world - 1) * (alpha + s / (world * beta)) for s in (4 << 10, 64 << 10, 1 << 20)}
        assert cpu_layouts.step_alpha(costs, world, beta) == pytest.approx(alpha, rel=1e-12)
        costs[4 << 10] += 0.5
        assert cpu_layouts.step_alpha(costs, world, beta) == pytest.approx(alpha, rel=1e-12)
    assert cpu_layouts.step_alpha({1 << 20: 1e-6}, 2, 1e9) == 0.0  # faster than the bytes alone: never below 0


def test_the_prediction_takes_the_in_step_alpha_where_the_fit_has_one():
    """tp2's 24 all-reduces each pay 2 alphas: with step_alpha 10 x the ring step's, the exposed TP time
    grows by exactly 2 x 24 x 9 alpha; the beta term is the same."""
    ring = cpu_layouts.predict_layout("tp2", FIT, rate=30e9).parts_s["exposed_tp"]
    fit = dict(FIT, step_alpha={2: 10 * FIT["links"][2][0]})
    in_step = cpu_layouts.predict_layout("tp2", fit, rate=30e9).parts_s["exposed_tp"]
    assert in_step - ring == pytest.approx(2 * 24 * 9 * FIT["links"][2][0], rel=1e-9)


def test_notebook_08s_tp_computes_the_whole_head_on_every_rank():
    """The "tp" runner keeps the head replicated: each of the 2 ranks computes 6 d V FLOPs per token on
    all B x S tokens, where labkit.scale counts half: one more half of that, at the given rate, as its own
    part. The composed step's head is vocabulary-parallel: no such part."""
    cfg = cpu_layouts._config()
    p = cpu_layouts.predict_layout("tp2", FIT, rate=30e9)
    head = 6 * cfg.d_model * cfg.vocab_size * B * S / 2 / 30e9
    assert p.parts_s["replicated_head"] == pytest.approx(head, rel=1e-12)
    assert p.step_s == pytest.approx(sum(p.parts_s.values()), rel=1e-12)
    assert "replicated_head" not in cpu_layouts.predict_layout("composed dp2 x tp2", FIT, rate=30e9).parts_s


def _slowed_collectives(rank, world):
    import time

    import torch.distributed as dist

    from labkit.links.bandwidth import collective_cost_in_a_step

    real = dist.all_reduce

    def slow(tensor, *args, **kwargs):  # every collective of the benchmark takes 4 ms more
        time.sleep(0.004)
        return real(tensor, *args, **kwargs)
    dist.all_reduce = slow
    try:
        return collective_cost_in_a_step(sizes=(4096, 1 << 16), calls=10)
    finally:
        dist.all_reduce = real


@pytest.mark.timeout(120)
def test_the_in_step_benchmark_counts_the_time_spent_in_the_collectives_and_agrees_across_ranks():
    """A 4 ms sleep inside every all-reduce: each size's cost is at least 4 ms (a lower bound, whatever the
    machine's load; a loop that subtracted the wrong run, or divided twice, would fall below it), and every
    rank returns the same numbers (the slowest rank's)."""
    from labkit import launch

    per_rank = launch(_slowed_collectives, 2, timeout=90)
    assert per_rank[0] == per_rank[1]
    assert set(per_rank[0]) == {4096, 1 << 16} and all(t >= 0.004 for t in per_rank[0].values()), per_rank[0]
