"""Resharding checkpoints (labkit.compose.dcp, issue 24 item 5): train K steps on one layout, save with
torch.distributed.checkpoint, resume on ANOTHER layout (more ranks, fewer ranks, another split of the
axes, one process, another EP split, ZeRO on either side) and end equal to the uninterrupted run of one
process: every loss and every gathered weight.

Tolerance (float64): the composed run sums gradients in other orders than one process (over ranks,
pieces of the sequence, micro-batches), each sum off by at most n x eps = 1e3 x 1.1e-16 ~ 1e-13
relative. AdamW's update lr m / (sqrt(v) + eps) is a ratio of such sums, so over 4 steps a weight moves
off by ~4 lr 1e-13 ~ 1e-14 (measured: ~1e-14), a loss by as little. atol = rtol = 1e-9 sits five orders
above that and seven below a misplaced piece (a weight of another row, ~1e-1, or one AdamW step's
lr = 1e-2, which a lost optimizer state shifts every weight by).
"""
from __future__ import annotations

import functools

import pytest
import torch

from labkit import launch
from labkit.compose import dcp as ckpt
from labkit.compose.dims import ParallelDims
from labkit.compose.model import parallelize
from labkit.compose.state import full_state, merge
from labkit.compose.step import ADAMW, ComposedOptimizer, train_step
from labkit.model import build_model, get_config

K, STEPS, BATCH, SEQ = 2, 4, 8, 16  # save after K steps, resume for STEPS - K more
TOL = dict(atol=1e-9, rtol=1e-9)  # derived in the module docstring
TIMEOUT = 180

@pytest.fixture(scope="module", autouse=True)
def solutions_impl():
    """Checkpoints are labkit's, not an exercise: the composed model runs the reference pieces."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LABKIT_IMPL", "solutions")
        yield


def config(moe: bool):
    if moe:
        return get_config("tiny-moe", d_model=32, n_heads=4, hidden_dim=32, vocab_size=128, context=64,
                          capacity_factor=2.0)  # dropless: cp x tp > 1 needs it
    return get_config("tiny", d_model=32, n_heads=4, n_layers=4, hidden_dim=64, vocab_size=128, context=64)


def batches(cfg):
    g = torch.Generator().manual_seed(1)
    t = torch.randint(0, cfg.vocab_size, (STEPS, BATCH, SEQ + 1), generator=g)
    return t[..., :-1], t[..., 1:]


def single_steps(model, opt, cfg, steps) -> list:
    X, Y = batches(cfg)
    losses = []
    for k in steps:
        opt.zero_grad()
        loss = model(X[k], Y[k])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@functools.lru_cache(maxsize=None)
def reference(moe: bool):
    """The uninterrupted run: one process, STEPS AdamW steps. (losses, {name: weight})."""
    cfg = config(moe)
    model = build_model(cfg, seed=0).double()
    losses = single_steps(model, torch.optim.AdamW(model.parameters(), **ADAMW), cfg, range(STEPS))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def check_bridge(mesh):
    """The DeviceMesh is the lab's Mesh: the same grid, names, and each axis's group the Mesh's own."""
    import torch.distributed as dist
    dm = ckpt.to_device_mesh(mesh)
    assert ckpt.to_device_mesh(mesh) is dm  # cached: built once per Mesh
    # the grid's axes (a folded ep is a slice of dp, cp or tp, not a grid dim: no DTensor is placed on it)
    assert dm.mesh.flatten().tolist() == mesh.grid.flatten().tolist() and dm.mesh_dim_names == mesh.grid_axes
    for axis in mesh.grid_axes:
        assert dm.get_group(axis) is mesh.group(axis), axis
    sm = ckpt.stage_mesh(mesh)  # this stage's ranks: the grid at this rank's pp coordinate
    assert sm.mesh.flatten().tolist() == mesh.ranks(tuple(a for a in mesh.grid_axes if a != "pp"))
    assert all(dist.get_process_group_ranks(sm.get_group(a)) == mesh.ranks(a) for a in sm.mesh_dim_names)


def composed(rank, world, dims, moe, path, resume, plant=None):
    """One rank: train K steps from seed 0 and save, or load into a model of ANOTHER seed and finish.

    ``plant``: a function run in the rank first, to plant a mistake there (ranks share no memory with
    the test process, so a monkeypatch here would not reach them)."""
    if plant is not None:
        plant()
    cfg = config(moe)
    dims.check(cfg, batch=BATCH, seq_len=SEQ, world_size=world)
    mesh = dims.build_mesh(world)
    check_bridge(mesh)
    stage = parallelize(build_model(cfg, seed=1 if resume else 0).double(), mesh=mesh)
    opt = ComposedOptimizer(stage, mesh=mesh, zero=dims.zero)
    X, Y = batches(cfg)
    start = ckpt.load(path, stage, opt, mesh=mesh, config=cfg) if resume else 0
    losses = [train_step(stage, opt, X[k], Y[k], mesh=mesh, microbatches=dims.microbatches)
              for k in range(start, K if not resume else STEPS)]
    if not resume:
        ckpt.save(path, stage, opt, mesh=mesh, step=K, config=cfg)
        return losses, {}
    opt.begin_step()  # ZeRO-3: the parameters back from the shards
    return losses, full_state(stage, mesh=mesh)


def save_on(dims, moe, path) -> list:
    """Train K steps on `dims` (None: one process), save to `path`; the losses."""
    if dims is None:
        cfg = config(moe)
        model = build_model(cfg, seed=0).double()
        opt = torch.optim.AdamW(model.parameters(), **ADAMW)
        losses = single_steps(model, opt, cfg, range(K))
        ckpt.save(path, model, opt, mesh=None, step=K, config=cfg)
        return losses
    return launch(composed, dims.world_size, dims, moe, str(path), False, timeout=TIMEOUT)[0][0]


def resume_on(dims, moe, path, plant=None):
    """Load `path` on `dims` (None: one process), train to STEPS; (losses, gathered weights)."""
    if dims is None:
        cfg = config(moe)
        model = build_model(cfg, seed=1).double()
        opt = torch.optim.AdamW(model.parameters(), **ADAMW)
        start = ckpt.load(path, model, opt, mesh=None, config=cfg)
        return single_steps(model, opt, cfg, range(start, STEPS)), dict(model.named_parameters())
    out = launch(composed, dims.world_size, dims, moe, str(path), True, plant, timeout=TIMEOUT)
    return out[0][0], merge(o[1] for o in out)


def assert_equal_to_reference(losses, weights, moe):
    ref_losses, ref = reference(moe)
    assert set(weights) == set(ref), sorted(set(ref) ^ set(weights))
    for name, w in ref.items():  # the weights first: a failure names the first wrong parameter
        torch.testing.assert_close(weights[name].detach(), w, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses[-len(losses):]), **TOL)


def checkpoint_on(tmp_path_factory, dims, moe):
    """Save once per (layout, model) for every resume from it; check the K saved losses too."""
    path = tmp_path_factory.mktemp("ckpt") / "step2"
    losses = save_on(dims, moe, path)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference(moe)[0][:K]), **TOL)
    return path


@pytest.fixture(scope="module")
def dense_dp2(tmp_path_factory):
    return checkpoint_on(tmp_path_factory, ParallelDims(dp=2, zero=3), False)


@pytest.fixture(scope="module")
def dense_pp2_tp2(tmp_path_factory):
    return checkpoint_on(tmp_path_factory, ParallelDims(pp=2, tp=2), False)


@pytest.fixture(scope="module")
def moe_ep2(tmp_path_factory):
    return checkpoint_on(tmp_path_factory, ParallelDims(dp=2, ep=2, zero=1), True)


def test_checkpoint_holds_every_piece_once(dense_pp2_tp2):
    """DCP's de-duplication keeps every key: the full model's parameters and AdamW state, full shapes."""
    stored = ckpt.dcp.FileSystemReader(str(dense_pp2_tp2)).read_metadata().state_dict_metadata
    _, ref = reference(False)
    want = {f"model.{n}" for n in ref} | {f"optim.{n}.{k}" for n in ref for k in ("exp_avg", "exp_avg_sq", "step")}
    assert set(stored) == want
    for name, w in ref.items():
        assert tuple(stored[f"model.{name}"].size) == tuple(w.shape), name
        chunks = stored[f"model.{name}"].chunks  # the boxes written: they tile the tensor exactly once
        assert sum(torch.Size(c.sizes).numel() for c in chunks) == w.numel(), name


def test_more_ranks_dp2_zero3_to_dp2_tp2_zero3(dense_dp2):
    assert_equal_to_reference(*resume_on(ParallelDims(dp=2, tp=2, zero=3), False, dense_dp2), False)


def test_one_process(dense_dp2):
    assert_equal_to_reference(*resume_on(None, False, dense_dp2), False)


def test_fewer_ranks_pp2_tp2_to_tp2(dense_pp2_tp2):
    assert_equal_to_reference(*resume_on(ParallelDims(tp=2), False, dense_pp2_tp2), False)


def test_another_split_pp2_tp2_to_dp2_cp2(dense_pp2_tp2):
    assert_equal_to_reference(*resume_on(ParallelDims(dp=2, cp=2, microbatches=2), False, dense_pp2_tp2), False)


def test_experts_dp2_ep2_zero1_to_pp2_tp2(moe_ep2):
    assert_equal_to_reference(*resume_on(ParallelDims(pp=2, tp=2), True, moe_ep2), True)


def test_hsdp_saved_and_resumed(tmp_path):
    """HSDP (dp=4 as 2 replicas x 2 shards, ZeRO-2 inside a replica): each replica's shard group gathers
    its flat AdamW state for the save (the replicas hold equal copies: DCP keeps one); resumed on the
    same layout, and on plain ZeRO-1 over dp x tp, it ends equal to the uninterrupted run."""
    hsdp = ParallelDims(dp=4, dp_replicate=2, zero=2)
    path = tmp_path / "hsdp"
    torch.testing.assert_close(torch.tensor(save_on(hsdp, False, path)), torch.tensor(reference(False)[0][:K]), **TOL)
    assert_equal_to_reference(*resume_on(hsdp, False, path), False)
    assert_equal_to_reference(*resume_on(ParallelDims(dp=2, tp=2, zero=1), False, path), False)


def test_ep_folded_over_cp_saved_and_resumed(tmp_path):
    """EP=4 folded over dp x cp (4 ranks, every rank its own experts, ZeRO-1): the DeviceMesh is the grid
    (dp, pp, cp, tp), experts plain tensors under their global names; resumed on the same layout, and on
    ep borrowed from dp (dp=2, ep=2), it ends equal to the uninterrupted run."""
    folded = ParallelDims(dp=2, cp=2, ep=4, ep_over=("dp", "cp"), zero=1)
    path = tmp_path / "folded"
    torch.testing.assert_close(torch.tensor(save_on(folded, True, path)), torch.tensor(reference(True)[0][:K]), **TOL)
    assert_equal_to_reference(*resume_on(folded, True, path), True)
    assert_equal_to_reference(*resume_on(ParallelDims(dp=2, ep=2, zero=2), True, path), True)


def test_one_process_to_ep2(tmp_path):
    path = tmp_path / "one"
    torch.testing.assert_close(torch.tensor(save_on(None, True, path)), torch.tensor(reference(True)[0][:K]), **TOL)
    assert_equal_to_reference(*resume_on(ParallelDims(dp=2, ep=2, zero=2), True, path), True)


def test_another_config_is_refused_before_any_tensor(dense_dp2, monkeypatch):
    cfg = config(False)
    other = get_config("tiny", d_model=32, n_heads=4, n_layers=4, hidden_dim=64, vocab_size=256, context=128)
    model = build_model(other, seed=0).double()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    monkeypatch.setattr(ckpt.dcp, "load", lambda *a, **k: pytest.fail("read tensors before checking the config"))
    with pytest.raises(ValueError, match=r"another model \(context: checkpoint 64, this model 128, "
                                         r"vocab_size: checkpoint 128, this model 256\)"):
        ckpt.load(dense_dp2, model, opt, mesh=None, config=other)
    assert cfg != other


def _tp_shards_placed_on_dp():
    """Planted in a rank: every tp shard labelled Shard(dim) on the dp mesh dim instead of tp."""
    from torch.distributed.tensor import Replicate, Shard
    from labkit.compose.model import param_class, shard_dim

    def on_dp(name, dm):
        out = [Replicate() for _ in dm.mesh_dim_names]
        if param_class(name) == "tp_shard":
            out[dm.mesh_dim_names.index("dp")] = Shard(shard_dim(name))
        return out

    ckpt.placements = on_dp


def test_a_shard_on_the_wrong_mesh_dim_is_caught(dense_pp2_tp2):
    """Planted: every tp shard labelled Shard(dim) on the dp mesh dim instead of tp (the same sizes here,
    so the same local shapes: DCP itself cannot notice). Rank (dp 1, tp 0) then loads tp rank 1's rows."""
    with pytest.raises(AssertionError, match=r"^tok_embeddings\.weight: Tensor-likes are not close"):
        assert_equal_to_reference(*resume_on(ParallelDims(dp=2, tp=2), False, dense_pp2_tp2,
                                             plant=_tp_shards_placed_on_dp), False)
