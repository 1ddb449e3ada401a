"""labkit.compose.trace: every call of a composed step lands on the right mesh axes, and the measured
parameters and bytes per axis equal their closed forms exactly (notebook 14's per-rank table)."""
import torch

from labkit import launch
from labkit.compose.dims import ParallelDims
from labkit.compose.trace import AxisSpans, axis_colour, axis_sets, bytes_by_axes, params_by_axes
from labkit.comm.intercept import intercept
from labkit.mesh import Mesh
from labkit.model import build_model, get_config

DIMS = ParallelDims(pp=2, cp=2, tp=2, microbatches=2)  # 8 ranks, 4 layers: 2 per stage


def test_a_group_is_named_by_the_live_axes_it_spans():
    sets = axis_sets(Mesh(8, pp=2, cp=2, tp=2, rank=5, groups=False))  # rank 5 = pp 1, cp 0, tp 1
    assert sets == {(1, 5): ("pp",), (4, 5): ("tp",), (5, 7): ("cp",), (1, 3, 5, 7): ("pp", "cp"),
                    (0, 1, 4, 5): ("pp", "tp"), (4, 5, 6, 7): ("cp", "tp"), tuple(range(8)): ("pp", "cp", "tp")}
    assert [axis_colour(a) for a in (("tp",), ("cp",), ("pp",), ("ep",), ("dp", "ep"), ("cp", "tp"))] == \
        ["tp", "cp", "pp", "ep", "dp", "dp"]


def _config():
    return get_config("tiny", d_model=32, n_heads=4, n_layers=4, hidden_dim=64, vocab_size=128, context=64)


def _one_step(rank, world):
    from labkit.compose.model import parallelize
    from labkit.compose.step import ComposedOptimizer, train_step
    mesh = DIMS.build_mesh(world)
    model = build_model(_config(), seed=0).double()
    stage = parallelize(model, mesh=mesh)
    opt = ComposedOptimizer(stage, mesh=mesh)
    tokens = torch.randint(0, 128, (8, 17), generator=torch.Generator().manual_seed(0))
    swapped_spans = AxisSpans(Mesh(world, dp=1, pp=2, ep=1, cp=2, tp=2, groups=False))
    swapped_spans.sets = {ranks: tuple({"cp": "tp", "tp": "cp"}.get(a, a) for a in axes)
                          for ranks, axes in swapped_spans.sets.items()}
    with intercept(AxisSpans(mesh)) as spans, intercept(swapped_spans):
        train_step(stage, opt, tokens[:, :-1], tokens[:, 1:], mesh=mesh, microbatches=2)
    held = sum(p.numel() for p in stage.parameters())
    return (mesh.coords(), spans.ops_by_axes(), spans.payload_by_axes(), swapped_spans.ops_by_axes(), held,
            params_by_axes(model, DIMS, mesh.coords()),
            bytes_by_axes(model, DIMS, mesh.coords(), batch=8, seq_len=16, element=8))


def test_every_call_of_a_step_lands_on_its_axes_and_the_bytes_equal_the_formula(monkeypatch):
    monkeypatch.setenv("LABKIT_IMPL", "solutions")  # the composed step runs the reference pieces (ranks inherit it)
    for coords, ops, payload, swapped, held, params, formula in launch(_one_step, 8, timeout=240):
        last = coords["pp"] == 1
        m, layers = 2, 2
        tp_big = m * (4 * layers + 1)  # SP all-gathers (= reduce-scatters): 4 per layer, and the embedding or the head
        want = {("tp",): {"all_gather_single": tp_big, "reduce_scatter_single": tp_big, **({"all_reduce": 3 * m} if last else {})},
                ("cp",): {"all_gather": m * layers, "isend": m * layers * 4, "irecv": m * layers * 4, "all_reduce": 1},
                ("pp",): {"isend": m, "irecv": m},
                ("cp", "tp"): {"all_reduce": 1},
                ("pp", "cp", "tp"): {"all_reduce": 1}}
        assert {a: dict(sorted(o.items())) for a, o in ops.items()} == {a: dict(sorted(o.items())) for a, o in want.items()}, coords
        assert swapped != ops  # the planted cp/tp swap is caught by the counts above
        assert held == sum(params.values())
        assert payload == formula, (coords, payload, formula)


METHODS = [ParallelDims(cp=2, tp=2, cp_method=method) for method in ("allgather", "ulysses")]


def _one_step_per_method(rank, world):
    from labkit.compose.model import parallelize
    from labkit.compose.step import ComposedOptimizer, train_step
    out = []
    for dims in METHODS:
        mesh = dims.build_mesh(world)
        model = build_model(_config(), seed=0).double()
        stage = parallelize(model, mesh=mesh, cp_method=dims.cp_method, ep_overlap=dims.ep_overlap)
        opt = ComposedOptimizer(stage, mesh=mesh)
        tokens = torch.randint(0, 128, (8, 17), generator=torch.Generator().manual_seed(0))
        with intercept(AxisSpans(mesh)) as spans:
            train_step(stage, opt, tokens[:, :-1], tokens[:, 1:], mesh=mesh, microbatches=1)
        out.append((spans.ops_by_axes()[("cp",)], spans.payload_by_axes(),
                    bytes_by_axes(model, dims, mesh.coords(), batch=8, seq_len=16, element=8)))
    return out


def test_the_cp_methods_calls_and_bytes_per_axis_equal_the_formula(monkeypatch):
    """All-gather K/V and Ulysses in a 2 cp x 2 tp step: their calls on cp, and every axis's bytes, as the formula."""
    monkeypatch.setenv("LABKIT_IMPL", "solutions")
    for per_method in launch(_one_step_per_method, 4, timeout=240):
        layers = 4
        for dims, (cp_ops, payload, formula) in zip(METHODS, per_method):
            want = {"all_gather": layers, "all_reduce": 1, **({"all_gather_single": layers, "reduce_scatter_single": layers}
                    if dims.cp_method == "allgather" else {"all_to_all_single": 8 * layers})}
            assert cp_ops == want, (dims.cp_method, cp_ops)
            assert payload == formula, (dims.cp_method, payload, formula)
    import pytest
    with pytest.raises(ValueError, match="hybrid's all-to-all and ring run on sub-groups"):
        bytes_by_axes(build_model(_config()), ParallelDims(cp=4, tp=2, cp_method="hybrid"),
                      {"dp": 0, "pp": 0, "ep": 0, "cp": 0, "tp": 0}, batch=8, seq_len=16, element=8)


def test_parameters_per_rank_tile_the_moe_model_exactly():
    # pure arithmetic: over the ranks of one data-parallel replica (dp = cp = 0), the tp shards, the experts and
    # the stages of params_by_axes add up to the whole model, each replicated class counted once per tp rank
    from labkit.compose.model import param_class
    cfg = get_config("tiny-moe", d_model=32, n_heads=4, hidden_dim=32, vocab_size=128, context=64, capacity_factor=2.0)
    model = build_model(cfg, seed=0)
    dims = ParallelDims(dp=2, ep=2, pp=2, tp=2)
    mesh = Mesh(dims.world_size, **dims.mesh_sizes(), rank=0, groups=False)
    count = {kind: sum(p.numel() for n, p in model.named_parameters() if param_class(n) == kind)
             for kind in ("tp_shard", "sp_replica", "expert")}
    held = {}
    for rank in range(dims.world_size):
        c = mesh.coords(rank)
        if c["dp"] == 0 and c["cp"] == 0:
            for axes, n in params_by_axes(model, dims, c).items():
                held[axes] = held.get(axes, 0) + n
    # summed over: tp shards (dp, ep) -> ("ep",); norms and router (dp, ep, tp) -> ("ep", "tp"); experts (tp) -> ("tp",)
    assert held == {("ep",): count["tp_shard"] * dims.ep, ("ep", "tp"): count["sp_replica"] * dims.ep * dims.tp,
                    ("tp",): count["expert"] * dims.tp}
