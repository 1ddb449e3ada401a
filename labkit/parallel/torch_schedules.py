"""PyTorch's own pipeline schedules, as the lab's action lists, built without any process.

    torch_schedule("ZBVZeroBubble", n_ranks=4, n_microbatches=8)   # [["0F0", "0F1", ...], ...]

``torch.distributed.pipelining`` computes every rank's order (``pipeline_order``) in the
schedule's constructor, from the stages' indices and the group's size only. As torch's
own ``_schedule_visualizer.get_schedule_ops`` does, a stand-in stage (``mock``) supplies
those, so the lists can be compared with the lab's, action for action, in a test.
Translation: FORWARD -> F, BACKWARD_INPUT -> B (followed by its W), BACKWARD_WEIGHT -> W,
FULL_BACKWARD -> B (no W); DualPipeV's OVERLAP_F_B -> its forward, then its backward;
the empty steps torch pads with (None) are dropped. This reads torch's internals
(``_Action``, ``pipeline_order``): it is a test aid pinned to torch 2.13, not an API.
"""
from __future__ import annotations

from unittest import mock

_KIND = {"F": "F", "I": "B", "W": "W", "B": "B"}  # torch's _ComputationType values -> the lab's


def torch_schedule(name: str, n_ranks: int, n_microbatches: int, stages_per_rank: int | None = None) -> list[list[str]]:
    """Rank by rank, the compute actions torch's schedule ``name`` runs (see the module docstring).

    name: a multi-stage schedule of ``torch.distributed.pipelining.schedules.get_schedule_class``:
    "Interleaved1F1B", "InterleavedZeroBubble" (with ``stages_per_rank=1``: ZB-H1),
    "ZBVZeroBubble", "DualPipeV". stages_per_rank: default 2. (GPipe's and 1F1B's
    ``pipeline_order`` is only a drawing in torch 2.13, not what they execute;
    ``tests/test_schedules.py`` compares those with the order their step runs.)
    Raises ValueError for a single-stage schedule, and whatever torch raises for a
    combination it refuses (e.g. InterleavedZeroBubble with m not a multiple of m // p).
    """
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
    from torch.distributed.pipelining.stage import PipelineStage

    cls = get_schedule_class(name)
    if issubclass(cls, PipelineScheduleSingle):
        raise ValueError(f"{name} is a single-stage schedule: its pipeline_order is not what it runs (see docstring)")
    v = stages_per_rank or 2
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod, stage.num_stages = 0, n_ranks, None, v * n_ranks
    order = cls([stage] * v, n_microbatches).pipeline_order
    return [_actions(order[rank]) for rank in range(n_ranks)]


def _actions(torch_actions) -> list[str]:
    out = []
    for a in torch_actions:
        if a is None:
            continue
        for sub in (a.sub_actions or ()) if a.computation_type.value == "OVERLAP_F_B" else (a,):
            out.append(f"{sub.stage_index}{_KIND[sub.computation_type.value]}{sub.microbatch_index}")
    return out
