"""Notebook 15's figures, each drawn from the cost model's own numbers (no figure typed in).

Each figure has a data function (what is drawn, tested against the model: tests/test_scale_figures.py)
and a plot function that draws exactly that data and returns the matplotlib Figure:

    validation_points(sets)         predicted against published tokens/s/GPU, per set, and how many within the band
    plot_validation({"flat": sets}) log-log, the line y = x and the +-25% band (issue 34's aim)
    step_parts({label: Prediction}) a step's seconds split into compute, exposed traffic per axis, bubble, optimizer
    plot_step_parts(...)            one stacked bar per layout (one panel per cost model)
    landscape(predictions)          tokens/s/GPU against peak memory per GPU, and the pick (`ranked`'s first that fits)
    plot_landscape(...)             every layout a dot coloured by its recompute policy, the GPU's memory a line,
                                    the pick a star
"""
from __future__ import annotations

import matplotlib.pyplot as plt

from labkit.scale.cost import ranked
from labkit.scale.layout import RECOMPUTE

BAND = 0.25  # issue 34's aim for every row: |predicted / published - 1| <= 25%
PARTS = ("compute", "exposed_tp", "exposed_cp", "exposed_ep", "exposed_pp", "exposed_dp", "contention", "contention_dp",
         "bubble", "fsdp_copies", "optimizer")
PART_COLORS = {"compute": "#4c72b0", "exposed_tp": "#dd8452", "exposed_cp": "#55a868", "exposed_ep": "#c44e52",
               "exposed_pp": "#8172b3", "exposed_dp": "#937860", "contention": "#8c8c3c", "contention_dp": "#b5b56a", "bubble": "#bbbbbb",
               "fsdp_copies": "#8fbcd4", "optimizer": "#da8bc3"}
SUM_RTOL = 1e-9  # the parts are the step's own terms, added in another order: float64 rounding only


def validation_points(sets: dict, band: float = BAND) -> dict:
    """{set name: {"ids", "published", "predicted", "within"}} from labkit.scale.validation.predict_sets'
    result: each row's published and predicted tokens/s per GPU, and how many rows of the set lie
    within the band (|predicted / published - 1| <= band)."""
    out = {}
    for name, rows in sets.items():
        pub = [r["published_tps"] for r in rows]
        pred = [r["predicted_tps"] for r in rows]
        out[name] = dict(ids=[r["id"] for r in rows], published=pub, predicted=pred,
                         within=sum(abs(q / p - 1) <= band for p, q in zip(pub, pred)))
    return out


def plot_validation(by_model: dict, band: float = BAND, ax=None):
    """by_model: {cost model name: predict_sets(model=...)}; one marker per model, one colour per set."""
    fig, ax = _axes(ax, (6.4, 5.2))
    markers = ("o", "^", "s", "D")
    lo, hi = float("inf"), 0.0
    for m, (model, sets) in enumerate(by_model.items()):
        points = validation_points(sets, band)
        for c, (name, pts) in enumerate(points.items()):
            ax.scatter(pts["published"], pts["predicted"], marker=markers[m % len(markers)], color=f"C{c}",
                       alpha=0.85, label=f"{name} ({model}: {pts['within']}/{len(pts['ids'])})")
            lo, hi = min(lo, *pts["published"], *pts["predicted"]), max(hi, *pts["published"], *pts["predicted"])
    xs = [lo / 1.5, hi * 1.5]
    ax.plot(xs, xs, color="black", lw=1)
    ax.fill_between(xs, [x * (1 - band) for x in xs], [x * (1 + band) for x in xs], color="grey", alpha=0.2,
                    label=f"within {band:.0%}")
    ax.set_xscale("log"), ax.set_yscale("log")
    ax.set_xlim(*xs), ax.set_ylim(*xs)
    ax.set_xlabel("published tokens/s per GPU"), ax.set_ylabel("predicted tokens/s per GPU")
    ax.set_title("predicted against published (rows within the band per set)")
    ax.legend(fontsize=7, loc="upper left")
    return fig


def step_parts(predictions: dict) -> dict:
    """{"labels", "step_s", "tps", "fits", "parts": {part: [seconds per layout]}} from {label: Prediction}
    (tps: tokens/s per GPU), in PARTS' order, parts that are zero in every layout left out. ValueError if a prediction's parts do not add
    up to its step (the bars would not show the step), or if it has a part PARTS does not name."""
    labels, steps, table = list(predictions), [], {part: [] for part in PARTS}
    tps, fits = [p.tokens_per_s_per_gpu for p in predictions.values()], [p.fits for p in predictions.values()]
    for label, p in predictions.items():
        unknown = set(p.parts_s) - set(PARTS)
        if unknown:
            raise ValueError(f"{label}: parts {sorted(unknown)} are not in labkit.scale.figures.PARTS; add them there")
        total = sum(p.parts_s.values())
        if abs(total - p.step_s) > SUM_RTOL * p.step_s:
            raise ValueError(f"{label}: its parts add up to {total:.6g} s, its step is {p.step_s:.6g} s")
        steps.append(p.step_s)
        for part in PARTS:
            table[part].append(p.parts_s.get(part, 0.0))
    return dict(labels=labels, step_s=steps, tps=tps, fits=fits, parts={k: v for k, v in table.items() if any(v)})


def plot_step_parts(by_model: dict, title: str = ""):
    """by_model: {cost model name: {label: Prediction}}; one panel per model, one stacked bar per layout,
    its tokens/s per GPU at its end ("does not fit" where it does not)."""
    rows = max(len(v) for v in by_model.values())
    fig, axes = plt.subplots(1, len(by_model), figsize=(5.4 * len(by_model), 1.2 + 0.45 * rows), sharey=True,
                             squeeze=False)
    handles = {}
    for ax, (model, predictions) in zip(axes[0], by_model.items()):
        data = step_parts(predictions)
        left = [0.0] * len(data["labels"])
        for part, secs in data["parts"].items():
            bars = ax.barh(range(len(secs)), secs, left=left, color=PART_COLORS[part])
            handles[part.replace("exposed_", "exposed ")] = bars
            left = [a + b for a, b in zip(left, secs)]
        for y, (end, tps, fits) in enumerate(zip(left, data["tps"], data["fits"])):
            ax.text(end, y, f" {tps:,.0f} tok/s/GPU" + ("" if fits else ", does not fit"), va="center", fontsize=7)
        ax.set_xlim(0, 1.35 * max(left))
        ax.set_yticks(range(len(data["labels"])), data["labels"], fontsize=8)
        ax.set_xlabel("seconds per step")
        ax.set_title(f"{model} model", fontsize=9)
    axes[0][0].invert_yaxis()
    fig.legend(list(handles.values()), list(handles), ncol=len(handles), fontsize=7, loc="lower center")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def landscape(predictions: list) -> dict:
    """{"gib", "tps", "fits", "recompute", "pick"} from a search's predictions: each layout's peak memory
    per GPU (GiB) and tokens/s per GPU, and the index of the pick (`ranked`'s first among those that
    fit; None if none fits)."""
    fitting = [i for i, p in enumerate(predictions) if p.fits]
    first = ranked([predictions[i] for i in fitting])[0] if fitting else None
    pick = next(i for i in fitting if predictions[i] is first) if fitting else None
    return dict(gib=[p.peak_gib for p in predictions], tps=[p.tokens_per_s_per_gpu for p in predictions],
                fits=[p.fits for p in predictions], recompute=[p.layout.recompute for p in predictions], pick=pick)


def plot_landscape(predictions: list, memory_gib: float, title: str = "", ax=None):
    """Every layout a dot (its recompute policy the colour), the GPU's memory a dashed line, the pick a star."""
    fig, ax = _axes(ax, (7.0, 4.2))
    data = landscape(predictions)
    for c, policy in enumerate(RECOMPUTE):
        idx = [i for i, r in enumerate(data["recompute"]) if r == policy]
        if idx:
            ax.scatter([data["gib"][i] for i in idx], [data["tps"][i] for i in idx], s=8, alpha=0.5, color=f"C{c}",
                       label=f"recompute {policy}")
    ax.axvline(memory_gib, color="black", ls="--", lw=1, label=f"GPU memory {memory_gib:g} GiB")
    if data["pick"] is not None:
        best = predictions[data["pick"]]
        ax.scatter([best.peak_gib], [best.tokens_per_s_per_gpu], marker="*", s=260, color="red", edgecolor="black",
                   zorder=3, label=f"the pick: {best.layout.short()}")
    ax.set_xlabel("peak memory per GPU (GiB)"), ax.set_ylabel("tokens/s per GPU")
    ax.set_title(title or f"{len(predictions):,} layouts", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    return fig


def _axes(ax, figsize):
    if ax is None:
        fig, ax = plt.subplots(figsize=figsize)
        return fig, ax
    return ax.figure, ax
