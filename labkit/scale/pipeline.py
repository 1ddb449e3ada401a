"""A pipelined step through the lab's own schedule simulator, fed each stage's op times (notebook 15).

One model of pipelines in the lab: the schedule's action lists (`labkit.parallel.schedules`) lowered
and simulated (`simulate`, non-blocking sends) with each stage's own forward and backward seconds
per micro-batch (uneven stages: the embedding on the first, the head and loss on the last, a stage
with one block fewer) and each message's seconds (`t_msg`: the activation or gradient send, hidden
where the schedule leaves room). The step's pipelined time is the simulated makespan.

Schedules: "1f1b" (`one_f_one_b`, below: p - r - 1 warm-up forwards on rank r), "interleaved"
(`interleaved_schedule`, v stages per rank, m a multiple of p), "zb" (`zero_bubble_schedule`,
B and W split, W a third of the backward: its two weight GEMMs of six; 1F1B's memory).

The stage split: `stage_layers(layout, n_layers)` (blocks per stage, in order, across virtual
stages) and `stage_roles` (which stage holds the embedding, which the loss) come from the Layout
when it has them; until then the even split below: stages get floor(L / S) blocks, the first
L mod S one more, the embedding on stage 0 and the loss on stage S - 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from labkit.parallel.schedule_actions import lower
from labkit.parallel.schedule_sim import simulate
from labkit.parallel.schedule_variants import interleaved_schedule, zero_bubble_schedule


def n_stages(layout) -> int:
    return layout.pp * (layout.virtual_stages if layout.schedule == "interleaved" else 1)


def stage_layers(layout, n_layers: int) -> list[int]:
    """Blocks per stage, in stage order (stage s on rank s mod pp): the Layout's split if it gives one."""
    if hasattr(layout, "stage_layers"):
        return list(layout.stage_layers(n_layers))
    stages = n_stages(layout)
    base, extra = divmod(n_layers, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


def stage_roles(layout, n_layers: int) -> dict:
    """{"embedding": stage, "loss": stage}: the Layout's roles if it gives them, else the two ends."""
    if hasattr(layout, "stage_roles"):
        return dict(layout.stage_roles(n_layers))
    return {"embedding": 0, "loss": n_stages(layout) - 1}


def one_f_one_b(p: int, m: int) -> list[list[str]]:
    """1F1B: rank r runs min(p - r - 1, m) warm-up forwards, then one forward one backward, then the rest."""
    out = []
    for r in range(p):
        warm = min(p - r - 1, m)
        acts = [f"{r}F{i}" for i in range(warm)]
        for i in range(m - warm):
            acts += [f"{r}F{warm + i}", f"{r}B{i}"]
        out.append(acts + [f"{r}B{i}" for i in range(m - warm, m)])
    return out


def schedule_actions(layout, n_micro: int) -> list[list[str]]:
    """The action lists of `layout.schedule` for its pp ranks and `n_micro` micro-batches; ValueError
    (before any arithmetic) for a schedule that does not fit them."""
    return [list(acts) for acts in _actions(layout.pp, layout.schedule, layout.virtual_stages, n_micro)]


@lru_cache(maxsize=1024)
def _actions(p: int, name: str, virtual_stages: int, n_micro: int) -> tuple:
    """schedule_actions' lists, made once per schedule (a search asks for the same ones many times)."""
    if name == "1f1b":
        out = one_f_one_b(p, n_micro)
    elif name == "interleaved":
        if n_micro % p:
            raise ValueError(f"schedule='interleaved' runs micro-batches in groups of pp={p}: {n_micro} micro-batches "
                             f"are not a multiple of it; use a micro-batch count that is, or schedule='1f1b'")
        out = interleaved_schedule(p, virtual_stages, n_micro)
    elif name == "zb":
        out = zero_bubble_schedule(p, n_micro)
    else:
        raise ValueError(f"schedule={name!r}: the simulator knows '1f1b', 'interleaved' and 'zb'")
    return tuple(tuple(acts) for acts in out)


@dataclass(frozen=True)
class _Schedule:
    pp: int
    schedule: str
    virtual_stages: int


@lru_cache(maxsize=1024)
def lowered_schedule(pp: int, schedule: str, virtual_stages: int, n_micro: int):
    """`schedule_actions` lowered once (labkit.parallel.schedule_actions.lower): a search simulates the same
    schedule with many stage times, and lowering costs more than the simulation (labkit.scale.ranking)."""
    return lower(schedule_actions(_Schedule(pp, schedule, virtual_stages), n_micro))


def pipeline_time(layout, n_micro: int, forward_s: list[float], backward_s: list[float], message_s: float,
                  actions: list | None = None) -> dict:
    """{"makespan", "busy" (the busiest rank's compute), "bubble" (makespan - busy)} of one step.

    forward_s, backward_s: per stage, one micro-batch's seconds; message_s: one send's seconds;
    actions: `schedule_actions(layout, n_micro)` when the caller has them already (they are the layout's
    schedule: the lowered copy of it, `lowered_schedule`, is what runs)."""
    if actions is None:
        schedule_actions(layout, n_micro)  # ValueError for a schedule that does not fit, before any arithmetic
    actions = lowered_schedule(layout.pp, layout.schedule, layout.virtual_stages, n_micro)
    t_w = [b / 3 for b in backward_s] if layout.schedule == "zb" else None
    sim = simulate(actions, list(forward_s), list(backward_s), t_w=t_w, t_msg=message_s)
    busy = max(sim.busy)
    return {"makespan": sim.makespan, "busy": busy, "bubble": sim.makespan - busy}
