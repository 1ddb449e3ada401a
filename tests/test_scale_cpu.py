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
