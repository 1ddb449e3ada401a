"""`%ranks timeline`: a session's timeline, gathered by the kernel and drawn as a launch's is.

In a launch, the ranks record spans on a `labkit.measure.timeline.Timeline`, rank 0 gathers them
(`Timeline.gather`) and returns them, and the notebook draws them (`labkit.measure.viz.plot_timeline`).
In a session the ranks keep their Timeline between cells, so the kernel fetches it instead: each rank's
recorded spans (``tl`` in its namespace, or the name given), merged by `merge_spans` (the one merge that
`Timeline.gather` uses too) and drawn by the same `plot_timeline`. No collective runs, so a timeline can
be read after a cell that ran on some ranks (``--targets``), or that failed.

    %%ranks
    tl = Timeline(); tl.sync()            # a collective, as in a launch: one clock, t = 0 now
    with tl.span("F", mb=0): ...
    ---
    spans = %ranks timeline               # or: %ranks timeline my_timeline
"""
from __future__ import annotations

from labkit.measure import viz
from labkit.measure.timeline import merge_spans


def recorded_spans(name: str) -> list[dict]:
    """Inside an engine: the spans of the Timeline ``name`` in its namespace, as dicts (they travel)."""
    from dataclasses import asdict

    from IPython import get_ipython

    namespace = get_ipython().user_ns
    timeline = namespace.get(name)
    if timeline is None or not hasattr(timeline, "spans"):
        raise LookupError(f"rank {namespace.get('rank')} has no Timeline named {name!r}: record one in a %%ranks "
                          f"cell (`{name} = Timeline(); {name}.sync()`, then `with {name}.span('F'): ...`), or "
                          "name yours: `%ranks timeline <name>`")
    return [asdict(s) for s in timeline.spans]


def session_timeline(session, name: str = "tl", draw: bool = True, title: str | None = None):
    """Every rank's spans from the Timeline ``name`` of its namespace, merged; drawn by `viz.plot_timeline`."""
    client = session.engines.client
    per_rank = []
    for rank in range(session.world_size):
        try:
            per_rank.append(client[session.engine_of[rank]].apply_sync(recorded_spans, name))
        except Exception as err:  # ipyparallel's RemoteError: the engine's LookupError
            raise LookupError(getattr(err, "evalue", None) or str(err)) from None
    spans = merge_spans(per_rank)
    if draw and spans:
        viz.plot_timeline(spans, title=title)
    return spans
