"""Why a published layout misses issue 34's criterion, in the model's own numbers: one class and one line per row
(bench/scale.py --ranks; notebook 15, "where the search prefers another layout, and why").

labkit.scale.ranking ranks each published run at two levels: its exact configuration, and its parallel layout
(dp, pp, cp, tp, schedule kind) at its best configuration. A miss splits into the two steps between them:

    published configuration -> its layout at its best   the choices inside the layout: recompute policy,
                                                         micro-batch, ZeRO stage, dp_replicate, cp_method, stages
    its layout at its best  -> the search's top          the parallel layout itself

and gets one class (`classify`):
    "config"         the layout at its best is within 5% of the top (it would meet the criterion's gap): the miss is
                     a published choice inside it that the model, by its own numbers, beats (most often recompute the model says is not needed). The line
                     gives both steps and the memory of the faster configuration: its peak plus the reserve
                     (labkit.scale.reserve) against the GPU's memory.
    "config-memory"  the same, but the faster configuration fits only by the model's memory, and not once that memory
                     is scaled by the model's own error on this row's published memory (torchtitan publishes its
                     peak reserved): where the model under-predicts the published run's memory by more than the
                     headroom, "fits" is the model's memory being too optimistic, not a choice the model beats.
    "layout"         the published layout at its best is more than 5% behind the top (even where it is among the
                     top 5 layouts, configurations of faster layouts fill the top 5): the line gives the step terms
                     (compute, bubble, exposed traffic per axis, optimizer) that separate it from the top. Whether such a term is a
                     mechanism the model gets wrong or a layout it rightly prefers is a judgement per mechanism,
                     made in notebook 15 with the numbers this line prints, not by a rule here.
    "...-memory"     where the row publishes its memory, the faster configuration of its layout, or the top, scaled
                     by the model's own error on that memory, would not fit: "layout-memory" when the top would not,
                     "config-memory" / "layout-memory" when the layout's best would not (its gain is then doubtful).
Nothing here changes a rank; it reads the Predictions `rank_published` returns.
"""
from __future__ import annotations

from labkit.scale.cluster import load_cluster
from labkit.scale.ranking import WITHIN

CHOICES = ("recompute", "micro_batch", "zero", "dp_replicate", "cp_method", "virtual_stages",
           "first_stage_embedding_only", "last_stage_loss_only")
TERMS = ("compute", "bubble", "exposed_tp", "exposed_cp", "exposed_ep", "exposed_pp", "exposed_dp", "contention",
         "contention_dp", "fsdp_copies", "optimizer")


def changed(a, b) -> str:
    """The configuration fields in which Prediction b's layout differs from a's, as "field a->b"."""
    out = [f"{f} {getattr(a.layout, f)}->{getattr(b.layout, f)}" for f in CHOICES
           if getattr(a.layout, f) != getattr(b.layout, f)]
    return ", ".join(out) or "none"


def terms(a, b, n: int = 3) -> str:
    """The n step terms that differ most between Predictions a and b: seconds of a - b and their share of a's step."""
    diffs = sorted(((a.parts_s.get(t, 0.0) - b.parts_s.get(t, 0.0), t) for t in TERMS), reverse=True)
    shown = [f"{t} {d:+.3f} s ({d / a.step_s:+.0%})" for d, t in diffs[:n] if abs(d) > 1e-4 * a.step_s]
    return ", ".join(shown) or "no term"


def memory(p, gpu_gib: float, scale: float = 1.0) -> tuple[float, bool]:
    """(GiB, fits) of Prediction p: its tensors' peak x scale plus the whole reserve, against the GPU's memory."""
    need = (p.peak_bytes * scale + p.reserve.get("total", 0.0)) / 2**30
    return need, need <= gpu_gib


def classify(result: dict, row: dict, set_info: dict) -> dict:
    """{"class", "line"} for a row that misses the criterion at the configuration level (module docstring)."""
    mine, top, lay = result["published"], result["top"], result["layout"]
    gpu = load_cluster(set_info["cluster"]).memory_gib
    if result["rank"] is None:
        need, _ = memory(mine, gpu)
        return {"class": "unfit", "line": f"the model says the published configuration does not fit: {need:.1f} GiB "
                                          f"with the reserve, of {gpu:.1f}"}
    own = lay["best"]
    inside = own.tokens_per_s_per_gpu / mine.tokens_per_s_per_gpu - 1
    need, _ = memory(own, gpu)
    line = (f"published {mine.layout.short()} -> its layout at its best, {own.layout.short()} ({changed(mine, own)}): "
            f"{inside:+.1%} (step {mine.step_s:.3f} -> {own.step_s:.3f} s: {terms(mine, own)}), {need:.1f} GiB with the "
            f"reserve of {gpu:.1f}")
    published = row["published"].get("memory_gib")
    scale = None if published is None else published / mine.reserved_gib  # the model's own error on this row's memory
    kind = "config" if lay["gap"] >= -WITHIN else "layout"
    if scale is not None and own is not mine:
        scaled, fits = memory(own, gpu, scale)
        line += (f"; the model's memory of the published run is {mine.reserved_gib / published - 1:+.0%} of its "
                 f"published {published:.1f} GiB: scaled by that, {scaled:.1f} GiB, "
                 + ("still fits" if fits else "does not fit: the model's memory may be too optimistic here"))
        kind += "" if fits else "-memory"
    if kind.startswith("config"):
        return {"class": kind, "line": line}
    line += (f"; that layout -> the top, {top.layout.short()}: {top.tokens_per_s_per_gpu / own.tokens_per_s_per_gpu - 1:+.1%} "
             f"(step {own.step_s:.3f} -> {top.step_s:.3f} s: {terms(own, top)}; memory {own.peak_gib:.1f} vs "
             f"{top.peak_gib:.1f} GiB")
    if scale is not None:
        scaled, fits = memory(top, gpu, scale)
        line += f"; the top scaled by the same error: {scaled:.1f} GiB, " + ("fits" if fits else "does not fit")
        kind = kind if fits else "layout-memory"
    return {"class": kind, "line": line + ")"}
