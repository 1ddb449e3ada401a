"""Notebook 15's figures (labkit/scale/figures.py): what each draws is the cost model's own numbers.

The data functions are tested, not pixels: the validation figure's points are predict_sets' rows and
its count within the band is summarize's; the step's bars are predict's parts and add up to its step;
the landscape's star is `ranked`'s first layout that fits. Each plot function is drawn once on the
Agg backend and its artists are read back. Planted mistakes: parts that do not add up to the step, a
part the figure does not know, a faster layout that does not fit.
"""
import dataclasses
import json

import matplotlib
import pytest

matplotlib.use("Agg")

from labkit.scale.cluster import CLUSTER_DIR, load_cluster  # noqa: E402
from labkit.scale.cost import predict  # noqa: E402
from labkit.scale.figures import BAND, PARTS, landscape, plot_landscape, plot_step_parts, plot_validation, step_parts, validation_points  # noqa: E402
from labkit.scale.layout import Layout  # noqa: E402
from labkit.scale.specs import LLAMA3  # noqa: E402
from labkit.scale.validation import predict_sets, summarize  # noqa: E402

H100 = load_cluster("h100-sxm")
LAYOUTS = {  # Llama 3 70B on 256 H100s, global batch 512 x 8,192: one of each kind of part
    "fsdp32 x tp8": Layout(dp=32, tp=8, zero="zero3", recompute="full", micro_batch=4),
    "fsdp256": Layout(dp=256, zero="zero3", recompute="full", micro_batch=1),
    "dp8 pp4 tp8": Layout(dp=8, pp=4, tp=8, zero="zero1", recompute="full", micro_batch=1),
    "fsdp32 cp8 all-gather": Layout(dp=32, cp=8, zero="zero3", recompute="none", micro_batch=1, cp_method="allgather"),
}


def test_validation_points_are_the_rows_and_the_band_count_is_summarizes():
    sets = predict_sets()
    points = validation_points(sets)
    assert list(points) == list(sets)
    for name, rows in sets.items():
        assert points[name]["published"] == [r["published_tps"] for r in rows], name
        assert points[name]["predicted"] == [r["predicted_tps"] for r in rows], name
        assert points[name]["within"] == summarize(rows)["within_25"], name
    fig = plot_validation({"flat": sets})
    drawn = [c.get_offsets().tolist() for c in fig.axes[0].collections if c.get_label() != f"within {BAND:.0%}"]
    assert drawn == [[list(xy) for xy in zip(p["published"], p["predicted"])] for p in points.values()]
    # planted: a row 30% over its published figure leaves the band
    row = dict(sets[next(iter(sets))][0])
    row["predicted_tps"] = 1.3 * row["published_tps"]
    assert validation_points({"one": [row]})["one"]["within"] == 0


def test_step_parts_are_predicts_parts_and_add_up_to_the_step():
    for efficiency in (0.40, None):  # the flat model (predict's default) and the kernel model
        preds = {k: predict(LLAMA3["70b"], lay, H100, 512, 8192, efficiency=efficiency) for k, lay in LAYOUTS.items()}
        data = step_parts(preds)
        assert data["labels"] == list(LAYOUTS) and data["step_s"] == [p.step_s for p in preds.values()]
        assert data["tps"] == [p.tokens_per_s_per_gpu for p in preds.values()]
        assert data["fits"] == [p.fits for p in preds.values()]
        for part, secs in data["parts"].items():
            assert secs == [p.parts_s.get(part, 0.0) for p in preds.values()], part
        for part in set(PARTS) - set(data["parts"]):  # left out only where zero in every layout
            assert all(not p.parts_s.get(part, 0.0) for p in preds.values()), part
        for i, p in enumerate(preds.values()):  # float64: the same terms in another order
            assert sum(v[i] for v in data["parts"].values()) == pytest.approx(p.step_s, rel=1e-12)
        assert {"compute", "exposed_tp", "exposed_cp", "bubble"} <= set(data["parts"])
    fig = plot_step_parts({"flat": {k: preds[k] for k in list(preds)[:2]}})
    widths = [round(b.get_width(), 9) for b in fig.axes[0].patches]
    assert sorted(widths) == sorted(round(s, 9) for v in step_parts({k: preds[k] for k in list(preds)[:2]})["parts"].values() for s in v)
    # planted: parts that miss a term, and a part the figure has no colour for
    p = next(iter(preds.values()))
    with pytest.raises(ValueError, match="add up to"):
        step_parts({"short": dataclasses.replace(p, parts_s=dict(p.parts_s, compute=0.0))})
    with pytest.raises(ValueError, match="not in labkit.scale.figures.PARTS"):
        step_parts({"new": dataclasses.replace(p, parts_s=dict(p.parts_s, exposed_xx=0.0))})


def test_landscape_marks_the_fastest_layout_that_fits():
    h100_4 = load_cluster(dict(json.loads((CLUSTER_DIR / "h100-sxm.json").read_text()), gpus_per_node=4))
    preds = [predict(LLAMA3["70b"], lay, H100, 512, 8192) for lay in LAYOUTS.values()]
    preds.append(predict(LLAMA3["70b"], LAYOUTS["fsdp32 x tp8"], h100_4, 512, 8192))
    fast = max(preds, key=lambda p: p.tokens_per_s_per_gpu)
    # planted: the fastest layout made too big for the GPU must not be the pick
    preds.append(dataclasses.replace(fast, tokens_per_s_per_gpu=2 * fast.tokens_per_s_per_gpu, fits=False,
                                     peak_bytes=2 * H100.memory_bytes))
    data = landscape(preds)
    want = min((p for p in preds if p.fits), key=lambda p: -p.tokens_per_s_per_gpu)
    assert preds[data["pick"]] is want
    assert data["gib"] == [p.peak_gib for p in preds] and data["tps"] == [p.tokens_per_s_per_gpu for p in preds]
    assert landscape([preds[-1]])["pick"] is None
    fig = plot_landscape(preds, H100.memory_gib)
    star = [c for c in fig.axes[0].collections if c.get_label().startswith("the pick")]
    assert star[0].get_offsets().tolist() == [[want.peak_gib, want.tokens_per_s_per_gpu]]
