"""Pictures for the lab: measured timelines, ideal schedules, simple curves, an explorer.

Every plotting function returns the matplotlib Figure (and draws into ``ax`` when given):

    plot_timeline(spans)                      # per-rank Gantt of a measured run
    plot_schedule(schedule)                   # the ideal grid of a schedule (its lowered list, unit time);
                                              # a wrong one is drawn with its first error in red
    plot_schedule_vs_timeline(schedule, spans)  # both, theory vs measured bubble in the title
    plot_lines(x, {"ring": ys, "torch": zs})  # line helper (bandwidth vs size, ...)
    plot_bars({"GPipe": 3.1, "1F1B": 1.2})    # bar helper
    plot_loss({"single": losses, "pipeline": losses2})
    schedule_explorer({"GPipe": gpipe_schedule, "1F1B": one_f_one_b_schedule})  # ipywidgets

Colours: forward in blues, backward in oranges (darker = later micro-batch), weight
gradient in greens, communication as thin grey bars under the compute row. A rank that
holds several stages (interleaved 1F1B) draws its second stage hatched ///, its third ...
"""
from __future__ import annotations

import matplotlib
import matplotlib.patches
import matplotlib.pyplot as plt
import matplotlib.ticker

from labkit.parallel import schedules
from labkit.measure import timeline as tlmod

_CMAPS = {"F": "Blues", "B": "Oranges", "W": "Greens"}
_HATCHES = (None, "///", "...", "xxx")
_COMM = {"send": "#888888", "recv": "#bbbbbb", "wait": "#dddddd", "allreduce": "#9467bd",
         "allgather": "#8c564b", "dispatch": "#17becf", "combine": "#e377c2"}
_NAMES = {"F": "forward", "B": "backward", "W": "weight gradient (W)"}


def _color(kind: str, mb, n_mb: int):
    if kind in _CMAPS:
        shade = 0.45 + 0.4 * ((mb or 0) / max(1, n_mb - 1)) if n_mb > 1 else 0.6
        return matplotlib.colormaps[_CMAPS[kind]](shade)
    return _COMM.get(kind, "#cccccc")


def _axes(ax, figsize):
    if ax is None:
        fig, ax = plt.subplots(figsize=figsize)
        return fig, ax
    return ax.figure, ax


def _boxes(ax, rows, n_mb, width_for_text):
    """rows: rank -> list of (start, end, kind, mb, stage). Draws compute boxes with labels.

    A rank that holds several stages (interleaved schedules) draws its later stages hatched.
    """
    for rank, items in rows.items():
        compute = [it for it in items if it[2] in tlmod.COMPUTE_KINDS]
        comm = [it for it in items if it[2] not in tlmod.COMPUTE_KINDS]
        chunks = sorted({it[4] for it in compute}, key=lambda s: (s is None, s))
        # one collection per row, stage and kind of bar: fast even with thousands of spans
        groups = [([it for it in compute if it[4] == st], (rank - 0.4, 0.8), "black", _HATCHES[i % len(_HATCHES)])
                  for i, st in enumerate(chunks)] + [(comm, (rank + 0.28, 0.12), "none", None)]
        for group, (y, h), edge, hatch in groups:
            if group:
                ax.broken_barh([(s, e - s) for s, e, *_ in group], (y, h), edgecolor=edge, linewidth=0.4,
                               facecolors=[_color(k, mb, n_mb) for _, _, k, mb, _ in group], hatch=hatch)
        for start, end, kind, mb, _ in compute:
            if mb is not None and end - start >= width_for_text:
                ax.text((start + end) / 2, rank, f"{kind}{mb}" if n_mb <= 12 else str(mb),
                        ha="center", va="center", fontsize=7)


def _finish(ax, n_ranks, xlabel, title):
    ax.set_yticks(range(n_ranks), [f"rank {r}" for r in range(n_ranks)])
    ax.set_ylim(n_ranks - 0.5, -0.5)  # rank 0 on top
    ax.set_xlabel(xlabel)
    if title:
        ax.set_title(title, fontsize=10)


def plot_timeline(spans, ax=None, title: str | None = None, unit: str = "ms", comm: bool = True, schedule=None,
                  legend: bool = True):
    """Per-rank Gantt chart of measured spans (`labkit.measure.timeline.Span`); the bubble in the title.

    Times are shifted so the first span drawn starts at 0 (no negative times, communication
    before the first compute included) and shown in ``unit`` ("s" or "ms"). ``comm=False``
    hides send/recv/wait spans. With ``schedule`` (what the ranks were meant to run), the first
    compute span out of the schedule's order on each rank is outlined in red and labelled with
    what was expected. ``legend``: a legend of the kinds drawn (compute boxes, thin comm bars).
    """
    fig, ax = _axes(ax, (9, 0.6 + 0.55 * max(1, len(tlmod.ranks_of(spans)))))
    scale = {"s": 1.0, "ms": 1e3}[unit]
    t0, t1 = tlmod.window(spans)
    shown = [s for s in spans if comm or s.kind in tlmod.COMPUTE_KINDS]
    t0 = min([t0] + [s.start for s in shown])  # the origin: the first span drawn, so no time is negative
    n_mb = 1 + max((s.mb for s in spans if s.mb is not None), default=0)
    rows = {}
    for s in shown:
        rows.setdefault(s.rank, []).append(((s.start - t0) * scale, (s.end - t0) * scale, s.kind, s.mb, s.stage))
    _boxes(ax, rows, n_mb, width_for_text=(t1 - t0) * scale / 40)
    bubble = tlmod.bubble_fraction(spans)
    wrong = _out_of_order(spans, schedule) if schedule is not None else []
    for rank, span, expected in wrong:
        _mark(ax, rank, (span.start - t0) * scale, (span.end - t0) * scale, f"expected {expected}")
    n_ranks = 1 + max(tlmod.ranks_of(spans) + [r for r, *_ in wrong], default=0)
    default = f"measured: bubble {bubble:.1%}"
    if wrong:
        default = f"measured: rank {wrong[0][0]} ran {_name(wrong[0][1])} where the schedule has {wrong[0][2]}"
    _finish(ax, n_ranks, f"time ({unit})", title if title is not None else default)
    if legend:
        _legend(ax, [s.kind for s in shown])
    return fig


def _legend(ax, kinds):
    """One entry per kind drawn, in a fixed order: compute first (mid shade), then communication."""
    seen = list(dict.fromkeys(k for k in ("F", "B", "W") if k in kinds)) + sorted({k for k in kinds if k not in _CMAPS})
    handles = [matplotlib.patches.Patch(facecolor=_color(k, 0, 1), edgecolor="black" if k in _CMAPS else "none",
                                        label=_NAMES.get(k, k)) for k in seen]
    if handles:
        ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)


def _name(span) -> str:
    return f"{span.stage}{span.kind}{span.mb}"


def _out_of_order(spans, schedule):
    """Per rank, the first measured compute span that is not the schedule's next action: (rank, span, expected)."""
    wanted = schedules.parse_schedule(schedule)
    out = []
    for rank in tlmod.ranks_of(spans):
        ran = [s for s in spans if s.rank == rank and s.kind in tlmod.COMPUTE_KINDS]
        want = [str(a) for a in wanted[rank]] if rank < len(wanted) else []
        for i, span in enumerate(ran):
            if i >= len(want) or _name(span) != want[i]:
                out.append((rank, span, want[i] if i < len(want) else "nothing"))
                break
    return out


def _mark(ax, rank, start, end, label, color="red"):
    """Outline one box in red and write why next to it."""
    ax.add_patch(matplotlib.patches.Rectangle((start, rank - 0.45), max(end - start, 1e-9), 0.9, fill=False,
                                              edgecolor=color, linewidth=2.5, zorder=5))
    ax.annotate(label, (end, rank - 0.45), xytext=(3, 2), textcoords="offset points", color=color,
                fontsize=8, fontweight="bold", va="bottom", zorder=6)


def plot_schedule(schedule, t_f: float = 1.0, t_b: float = 2.0, ax=None, title: str | None = None,
                  blocking_send: bool = False, t_w: float | None = None):
    """The ideal picture of a schedule: its lowered list run on a unit-time model, F takes t_f and B t_b.

    A backward split by a W action takes t_b - t_w for B and t_w for W (default t_b / 2).
    A rank that holds two stages (interleaved, or a V: ZB-V, DualPipeV) draws its second hatched.

    A wrong schedule is drawn anyway, as far as it runs, with its FIRST error marked in
    red: the first action out of order (outlined), or where each rank of a deadlock waits
    (a red bar from the moment it gets stuck, labelled with the message it waits on); the
    title says what is wrong. Only a schedule that cannot be parsed or placed (a typo, a
    stage on two ranks) is shown as its error message alone.
    """
    try:
        sim = schedules.simulate(schedule, t_f, t_b, t_w=t_w, blocking_send=blocking_send, strict=False)
    except schedules.ScheduleError as err:  # cannot even be lowered: say why, in the figure
        fig, ax = _axes(ax, (9, 1.2))
        ax.axis("off")
        ax.text(0, 0.5, f"cannot draw this schedule:\n{err}", color="red", fontsize=9, va="center",
                transform=ax.transAxes)
        return fig
    n_ranks = len(sim.spans)
    fig, ax = _axes(ax, (9, 0.6 + 0.55 * n_ranks))
    rows = {r: [(s, e, a.kind, a.mb, a.stage) for s, e, a in rank] for r, rank in enumerate(sim.spans)}
    _boxes(ax, rows, sim.n_microbatches, width_for_text=sim.makespan / 45 if sim.makespan else 1)
    default = f"ideal: bubble {sim.bubble:.1%}, peak in-flight activations {sim.peak_inflight}"
    _finish(ax, n_ranks, "time (units of one forward)", title if title is not None else default)
    if sim.error is not None:
        _mark_error(ax, sim, schedules.parse_schedule(schedule))
        what = str(sim.error).splitlines()[0] + (" (red: where each rank waits)" if sim.stuck else "")
        ax.set_title(("" if title is None else title + "\n") + "WRONG: " + what, fontsize=10, color="red")
    return fig


def _mark_error(ax, sim, actions):
    """Mark the simulation's first error: where the stuck ranks of a deadlock wait, or the first wrong action."""
    if sim.stuck:
        end = sim.makespan * 1.15 + 1
        for rank, (t, op) in sim.stuck.items():
            ax.broken_barh([(t, end - t)], (rank - 0.12, 0.24), facecolors="red", alpha=0.35)
            arrow = "<-" if op.kind in schedules.RECVS else "->"
            ax.annotate(f"waits in {op}{arrow}{op.peer}", (t, rank + 0.12), xytext=(3, -1),
                        textcoords="offset points", color="red", fontsize=8, fontweight="bold", va="top")
        ax.set_xlim(right=end)
        return
    err = sim.error
    if err.rank is None:
        return
    if err.index is not None:
        target = actions[err.rank][err.index]
        for start, end, a in sim.spans[err.rank]:
            if a == target:
                _mark(ax, err.rank, start, end, "first error")
                return
    ax.get_yticklabels()[err.rank].set_color("red")
    ax.annotate(str(err).split(": ", 1)[-1][:70], (0, err.rank + 0.45), color="red", fontsize=8, va="bottom")


def plot_schedule_vs_timeline(schedule, spans, t_b_over_t_f: float = 2.0, name: str = "", unit: str = "ms"):
    """The schedule's ideal grid (left) and the measured run (right), bubbles compared in the title.

    Both sides draw wrong input too: the left marks the schedule's first error, the right
    the first measured action out of the schedule's order on each rank.
    """
    sim = schedules.simulate(schedule, 1.0, t_b_over_t_f, strict=False)
    p, m, v = len(sim.spans), sim.n_microbatches, max(1, sim.n_stages // max(1, len(sim.spans)))
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 0.9 + 0.55 * p))
    plot_schedule(schedule, 1.0, t_b_over_t_f, ax=left, title=f"ideal {name} (bubble {sim.bubble:.1%})")
    in_order = not _out_of_order(spans, schedule)
    plot_timeline(spans, ax=right, unit=unit, comm=True, schedule=schedule,
                  title=f"measured (bubble {tlmod.bubble_fraction(spans):.1%})" if in_order else None)
    formula = "(p-1)/(m+p-1)" if v == 1 else f"(p-1)/(vm+p-1), v={v}"
    theory = f"theory {formula} = {schedules.theoretical_bubble(p, m, v):.1%}"
    if schedules.lower(schedule).split:  # zero-bubble: no closed form, compare with 1F1B's
        theory = f"ideal {sim.bubble:.1%} (1F1B's {formula} = {schedules.theoretical_bubble(p, m, v):.1%})"
    fig.suptitle(f"{name} p={p} m={m}: {theory}, measured {tlmod.bubble_fraction(spans):.1%}", fontsize=11)
    fig.tight_layout()
    return fig


def plot_lines(x, ys: dict, ax=None, xlabel: str = "", ylabel: str = "", title: str = "",
               logx: bool = False, logy: bool = False, marker: str = "o"):
    """One line per entry of ``ys`` (name -> values over ``x``)."""
    fig, ax = _axes(ax, (6, 3.5))
    for name, values in ys.items():
        ax.plot(x, values, marker=marker, label=name)
    ax.set_xscale("log" if logx else "linear")
    ax.set_yscale("log" if logy else "linear")
    if logx and len(x) <= 16:  # label the measured points, not powers of ten
        ax.set_xticks(list(x), [f"{v:g}" for v in x])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if len(ys) > 1:
        ax.legend()
    return fig


def plot_bars(values: dict, ax=None, ylabel: str = "", title: str = "", fmt: str = "{:.3g}"):
    """One bar per entry of ``values`` (name -> number), the number written on top."""
    fig, ax = _axes(ax, (6, 3.5))
    bars = ax.bar(list(values), list(values.values()), color=[f"C{i}" for i in range(len(values))])
    for bar, v in zip(bars, values.values()):
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), fmt.format(v), ha="center", va="bottom")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    return fig


def plot_loss(curves: dict, ax=None, title: str = "training loss", xlabel: str = "step"):
    """Loss curves: name -> list of losses (one per step) or (steps, losses)."""
    fig, ax = _axes(ax, (6, 3.5))
    for name, c in curves.items():
        steps, losses = c if isinstance(c, tuple) else (range(len(c)), c)
        ax.plot(list(steps), [float(v) for v in losses], label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("loss")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def schedule_explorer(schedule_fns: dict, max_stages: int = 8, max_microbatches: int = 16):
    """ipywidgets explorer: stages x micro-batches x schedule -> picture, bubble, peak memory.

    ``schedule_fns``: name -> f(n_stages, n_microbatches) returning action lists, e.g. the
    `gpipe_schedule` and `one_f_one_b_schedule` of the pipeline exercise. Returns the widget.
    """
    import ipywidgets as w
    from IPython.display import display

    stages = w.IntSlider(4, min=1, max=max_stages, description="stages p")
    mbs = w.IntSlider(4, min=1, max=max_microbatches, description="micro-batches m")
    which = w.Dropdown(options=list(schedule_fns), description="schedule")
    ratio = w.FloatSlider(2.0, min=0.5, max=3.0, step=0.5, description="t_B / t_F")
    out = w.Output()

    def draw(*_):
        out.clear_output(wait=True)
        with out:
            p, m = stages.value, mbs.value
            try:
                sched = schedule_fns[which.value](p, m)
                sim = schedules.simulate(sched, 1.0, ratio.value, strict=False)  # a wrong one is drawn too
            except (NotImplementedError, ValueError) as err:
                print(f"{which.value}({p}, {m}): {err}")
                return
            fig = plot_schedule(sched, 1.0, ratio.value)
            display(fig)
            plt.close(fig)
            if sim.error is not None:
                print(f"WRONG: {sim.error}")
            print(f"bubble: simulated {sim.bubble:.1%}, (p-1)/(m+p-1) = {schedules.theoretical_bubble(p, m):.1%}")
            print(f"peak in-flight activations per rank: {sim.peak_inflight}")

    for widget in (stages, mbs, which, ratio):
        widget.observe(draw, names="value")
    draw()
    box = w.VBox([w.HBox([stages, mbs]), w.HBox([which, ratio]), out])
    display(box)
    return box
