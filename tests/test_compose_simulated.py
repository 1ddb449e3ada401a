"""The composed step (notebook 14) on a simulated rank sends exactly what it sends on real ranks (notebook 15).

labkit.apps.sim_roles.composed_step runs labkit.compose's step as one rank of a fake world (FakeTensorMode,
the fake process group). Its bytes per (op, group size), counted by the one communication layer, must equal
those of the same rank in a real gloo run of the same layout: the simulator may not invent or lose a
collective. float32 in both (bytes depend on the dtype, not the values). About 10 s.
"""
import pytest
import torch

from labkit import launch
from labkit.compose.dims import ParallelDims
from labkit.grading.cases import launch_timeout
from labkit.model import get_config

CFG = get_config("tiny", d_model=32, n_heads=4, n_layers=4, hidden_dim=64, vocab_size=128, context=64)
DIMS = ParallelDims(dp=2, pp=2, cp=2, tp=2, zero=1)
BATCH, SEQ = 4, 16


def _real(rank, world):
    from labkit.compose.model import parallelize
    from labkit.compose.step import ComposedOptimizer, train_step
    from labkit.model import build_model
    from labkit.scale.simulate import count_collectives

    mesh = DIMS.build_mesh(world)
    stage = parallelize(build_model(CFG), mesh=mesh)
    opt = ComposedOptimizer(stage, mesh=mesh, zero=DIMS.zero)
    tokens = torch.randint(0, CFG.vocab_size, (BATCH, SEQ))
    with count_collectives() as sent:
        train_step(stage, opt, tokens, tokens, mesh=mesh)
    return dict(sent)


@pytest.fixture(scope="module")
def real(monkeypatch_module=None):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LABKIT_IMPL", "solutions")
        return launch(_real, DIMS.world_size, timeout=launch_timeout(90))


@pytest.mark.parametrize("rank", [0, 15], ids=["first-stage", "last-stage"])
def test_simulated_rank_sends_what_the_real_rank_sends(rank, real, monkeypatch):
    from labkit.apps.sim_roles import composed_step
    from labkit.scale.simulate import measure_step

    monkeypatch.setenv("LABKIT_IMPL", "solutions")
    simulated = measure_step(composed_step(CFG, DIMS, BATCH, SEQ), world_size=DIMS.world_size, rank=rank)
    assert simulated["bytes"] == real[rank]
    assert simulated["flops"] > 0


def test_moe_and_microbatches_are_refused_with_the_reason():
    from labkit.apps.sim_roles import composed_step

    with pytest.raises(ValueError, match="routing"):
        composed_step(get_config("tiny-moe", capacity_factor=2.0), ParallelDims(dp=2, ep=2), 4, 16)
    with pytest.raises(ValueError, match="MemTracker"):
        composed_step(CFG, ParallelDims(pp=2, microbatches=2), 4, 16)
