"""Grading tests for notebook 14_everything: the placement table and each rank's data.

Run: pytest tests/grading/test_placement.py   (add --impl=solutions for the reference)
- placement: every parameter of the dense and the MoE model, on layout-only Meshes (no process): ep
  borrowed from dp, ep folded over dp x cp and over dp x cp x tp, with HSDP; against the rule below,
  compared as the grid slices the names span (so ("dp", "ep") and "batch" are one answer where ep is a grid
  axis); the first wrong parameter is named with its class and the group it needed.
- local_batch: every rank of several layouts (layout-only meshes, folded ones included), against rows and
  zigzag positions computed here from the definitions (rows over the batch ranks, pieces r and 2c-1-r
  over cp, the same over tp, x on the first stage only, y on the last only).
- the composed step with your table and your data split, 3 AdamW steps in float64, equal to one process:
  on 4 ranks dp2 ep2 tp2 (ep borrowed from dp; all three parameter classes), on 2 ranks cp2 with ep2
  folded over cp (about 15 s).

The rule (each rank backpropagates its SHARE of the one loss; a gradient is summed over the ranks
holding a replica):
    class        sharded over   summed over
    tp_shard     tp             batch, cp        (complete over tp: the matmul saw the gathered sequence)
    sp_replica   -              batch, cp, tp    (norms, router: each tp rank saw its s/tp positions)
    expert       ep             dp_replicate, efsdp, and cp, tp where ep is not folded over them
                                                 (the all-to-all already brought its EP group's tokens)
"""
import pytest
import torch

from labkit.grading import impl
from labkit.grading.cases import launch_timeout
from labkit.mesh import Mesh
from labkit.model import build_model, get_config

SHARDED = {"tp_shard": ("tp",), "sp_replica": (), "expert": ("ep",)}
DPCP, DPCPTP = ("dp", "cp"), ("dp", "cp", "tp")
MESHES = [  # every atom of the grid > 1 in one of them: a missing name cannot hide behind a size of 1
    dict(world_size=32, dp=2, pp=2, ep=2, cp=2, tp=2),                       # ep borrowed from dp
    dict(world_size=16, dp=4, cp=2, tp=2, ep=2, ep_over=DPCP, dp_replicate=2),  # ep inside cp, HSDP
    dict(world_size=16, dp=4, cp=2, tp=2, ep=4, ep_over=DPCPTP, dp_replicate=2),  # ep = cp x tp, HSDP
    dict(world_size=16, dp=8, cp=2, ep=4, ep_over=DPCP)]                      # ep across dp_shard and cp
WHAT = {"tp_shard": "a tensor-parallel slice (attention, dense MLP, vocab-parallel embedding and head)",
        "sp_replica": "a full copy on every tp rank applied to its own s/tp positions (RMSNorm weights, MoE router)",
        "expert": "a MoE expert, held by one ep rank of each EP group"}


def config(moe):
    if moe:
        return get_config("tiny-moe", d_model=32, n_heads=4, hidden_dim=32, vocab_size=128, context=64,
                          capacity_factor=2.0)
    return get_config("tiny", d_model=32, n_heads=4, n_layers=4, hidden_dim=64, vocab_size=128, context=64)


def axes_of(value, what, name, mesh):
    if isinstance(value, str):
        raise AssertionError(f"placement({name!r}).{what} is {value!r}: give a tuple of names, such as ({value!r},)")
    try:
        axes = tuple(value)
    except TypeError:
        raise AssertionError(f"placement({name!r}).{what} is {value!r}: give a tuple of mesh axis names") from None
    bad = [a for a in axes if a not in mesh.names]
    assert not bad, f"placement({name!r}).{what} holds {bad}: the mesh's names are {', '.join(mesh.names)}"
    return axes


def describe(mesh) -> str:
    folded = "ep borrowed from dp" if "ep" in mesh.grid_axes else f"ep folded over {' x '.join(mesh.ep_over)}"
    sizes = " ".join(f"{a}{n}" for a, n in mesh.sizes.items() if n > 1)
    return f"{sizes} ({folded}" + (f", dp_replicate={mesh.dp_replicate})" if mesh.dp_replicate > 1 else ")")


def wrong_placement(name, got, mesh) -> str | None:
    from labkit.compose.dims import summed_axes
    kind = impl("placement").param_class(name)
    sharded, summed = SHARDED[kind], summed_axes(kind, mesh)
    got_sharded = axes_of(got.sharded_over, "sharded_over", name, mesh)
    got_summed = axes_of(got.summed_over, "summed_over", name, mesh)
    if mesh.atoms(got_summed) != mesh.atoms(summed):  # the same grid slice, however it is spelled
        why = []
        if "pp" in got_summed:
            why.append("nothing is summed across pp: each stage owns its layers")
        if kind == "expert" and "ep" in got_summed:
            why.append("the ep ranks hold DIFFERENT experts")
        if kind != "expert" and "ep" in got_summed and mesh.ep_over != ("dp",):
            why.append(f"ep is folded over {mesh.ep_over} here: the data ranks are 'batch'")
        if kind == "expert" and mesh.ep_over != ("dp",):
            why.append("ask mesh.ep_over: along the folded axes only efsdp holds the same experts")
        return (f"{name} is {WHAT[kind]} (class {kind}): on the mesh {describe(mesh)}, rank {mesh.rank}'s "
                f"gradient must be summed over {summed} = ranks {mesh.ranks(summed)}; yours over "
                f"{tuple(got.summed_over)} = ranks {mesh.ranks(got_summed)}" + (": " + "; ".join(why) if why else ""))
    got_sharded = set(got_sharded)
    if got_sharded != set(sharded):
        return (f"{name} is {WHAT[kind]} (class {kind}): it is sharded over {sharded or 'no axis'}, yours says "
                f"{tuple(got.sharded_over) or 'no axis'}")
    return None


@pytest.mark.exercise("placement")
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("layout", range(len(MESHES)), ids=lambda i: f"mesh{i}")
def test_placement_of_every_parameter(moe, layout):
    """Every parameter's class, in the model's order, on each mesh; the first wrong one is named."""
    mesh = Mesh(**MESHES[layout], rank=5, groups=False)
    for name, _ in build_model(config(moe), seed=0).named_parameters():
        problem = wrong_placement(name, impl("placement").placement(name, mesh=mesh), mesh)
        if problem:
            raise AssertionError("first wrong parameter: " + problem)


@pytest.mark.exercise("placement")
def test_placement_ignores_axis_sizes():
    """Edge case: a size-1 axis still belongs to the answer (the mesh has nothing to sum there)."""
    mesh = Mesh(2, tp=2, rank=1, groups=False)
    for name in ("layers.0.attention.wq.weight", "norm.weight", "layers.1.feed_forward.experts.3.w2.weight"):
        problem = wrong_placement(name, impl("placement").placement(name, mesh=mesh), mesh)
        if problem:
            raise AssertionError("with dp = ep = cp = 1: " + problem)


def expected_batch(tokens, targets, sizes, coords):
    """Rows, positions and stages from the definitions (no helper of the lab): the batch ranks are dp, and
    ep's where ep is a grid axis (ep inner to dp: "dp_ep" = dp * ep + ep's coordinate)."""
    count = sizes["dp"] * sizes.get("ep", 1)
    index = coords["dp"] * sizes.get("ep", 1) + coords.get("ep", 0)
    rows = torch.arange(tokens.shape[0]).view(count, -1)[index]
    s, c, r = tokens.shape[1], sizes["cp"], coords["cp"]
    if c == 1:
        cols = torch.arange(s)
    else:
        chunk = torch.arange(s).view(2 * c, -1)
        cols = torch.cat([chunk[r], chunk[2 * c - 1 - r]])
    pick = lambda t: t[rows][:, cols]  # noqa: E731
    return (pick(tokens) if coords["pp"] == 0 else None, pick(targets) if coords["pp"] == sizes["pp"] - 1 else None)


LAYOUTS = [dict(dp=2, pp=2, ep=2, cp=2, tp=2), dict(dp=4, cp=2), dict(pp=3, tp=2), dict(ep=2, cp=4), dict(dp=1),
           dict(dp=2, pp=2, cp=2, ep=2, ep_over=DPCP, dp_replicate=2), dict(dp=2, cp=2, tp=2, ep=4, ep_over=DPCPTP)]


@pytest.mark.exercise("local_batch", needs=("zigzag_split",))
@pytest.mark.parametrize("sizes", LAYOUTS, ids=lambda s: "-".join(f"{a}{n}" for a, n in s.items()))
def test_local_batch_on_every_rank(sizes):
    """Rows over dp x ep, zigzag over cp, the same over tp, x on the first stage and y on the last only;
    edge cases: a middle stage (pp=3) gets neither, cp=1 keeps the whole sequence, one rank keeps all."""
    world = 1
    for a, n in sizes.items():
        world *= n if a in ("dp", "pp", "cp", "tp") or (a == "ep" and "ep_over" not in sizes) else 1
    B, s = 16, 32
    tokens = torch.arange(B * s).view(B, s)
    targets = tokens + 10_000
    for rank in range(world):
        mesh = Mesh(world, rank=rank, groups=False, **sizes)
        got = impl("placement").local_batch(tokens, targets, mesh=mesh)
        grid = {a: n for a, n in mesh.sizes.items() if a in mesh.grid_axes}  # a folded ep is no grid axis
        want = expected_batch(tokens, targets, grid, {a: c for a, c in mesh.coords().items() if a in grid})
        for what, g, w in zip(("x (tokens)", "y (targets)"), got, want):
            where = f"rank {rank} at {mesh.coords()}: {what}"
            if w is None:
                assert g is None, f"{where}: this stage does not read it, return None"
                continue
            assert g is not None, f"{where}: this stage needs it, got None"
            assert g.shape == w.shape, f"{where}: shape {tuple(g.shape)}, expected {tuple(w.shape)}"
            if not torch.equal(g, w):
                row = next(i for i in range(w.shape[0]) if not torch.equal(g[i], w[i]))
                if not torch.equal(g[row] // s, w[row] // s):  # token ids encode (batch row, position)
                    raise AssertionError(f"{where}: local row {row} is batch row {int(g[row, 0]) // s % B}, "
                                         f"expected batch row {int(w[row, 0]) // s} (rows over the batch ranks)")
                raise AssertionError(f"{where}: local row {row} holds positions {(g[row] % s).tolist()}, expected "
                                     f"{(w[row] % s).tolist()} (zigzag: chunks r and 2c-1-r of 2c)")


def _composed(rank, world, sizes):
    from labkit.compose.dims import ParallelDims
    from labkit.compose.model import parallelize
    from labkit.compose.state import full_state
    from labkit.compose.step import ComposedOptimizer, train_step

    dims, cfg = ParallelDims(**sizes), config(True)
    mesh = dims.build_mesh(world)
    stage = parallelize(build_model(cfg, seed=0).double(), mesh=mesh)
    opt = ComposedOptimizer(stage, mesh=mesh)
    tokens = torch.randint(0, cfg.vocab_size, (3, 8, 17), generator=torch.Generator().manual_seed(1))
    losses = [train_step(stage, opt, tokens[k, :, :-1], tokens[k, :, 1:], mesh=mesh) for k in range(3)]
    return losses, full_state(stage, mesh=mesh)


@pytest.mark.exercise("placement", "local_batch",
                      needs=("ColumnParallelLinear", "RowParallelLinear", "GatherSequence", "ScatterSequence",
                             "VocabParallelEmbedding", "VocabParallelCrossEntropy", "all_to_all_single", "dispatch",
                             "compute_experts", "combine", "one_f_one_b_schedule", "communicate", "forward_step",
                             "backward_step"))
@pytest.mark.parametrize("sizes", [dict(dp=2, ep=2, tp=2), dict(cp=2, ep=2, ep_over=DPCP)],
                         ids=["dp2-ep2-tp2", "cp2-ep2-folded-over-cp"])
def test_composed_step_equals_one_process(sizes):
    """On the MoE model, your table and data split: 3 AdamW steps in float64 equal one process (tolerance:
    see tests/test_compose.py; a gradient on a wrong group moves a weight by O(lr) = 1e-2)."""
    from labkit import launch
    from labkit.compose.state import merge
    from labkit.compose.step import ADAMW
    from labkit.grading.diagnose import assert_same_named

    from labkit.compose.dims import ParallelDims
    world = ParallelDims(**sizes).world_size
    per_rank = launch(_composed, world, sizes, timeout=launch_timeout(60))
    model = build_model(config(True), seed=0).double()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    tokens = torch.randint(0, 128, (3, 8, 17), generator=torch.Generator().manual_seed(1))
    want = []
    for k in range(3):
        opt.zero_grad()
        loss = model(tokens[k, :, :-1], tokens[k, :, 1:])
        loss.backward()
        opt.step()
        want.append(loss.item())
    ref = {n: p.detach() for n, p in model.named_parameters()}
    state = merge(s for _, s in per_rank)
    assert_same_named(state, ref, what="parameter after 3 AdamW steps",
                      where=f"{ParallelDims(**sizes).short()} (your placement table and local_batch)", rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(torch.tensor(per_rank[0][0]), torch.tensor(want), rtol=1e-7, atol=1e-9)
