"""Grading tests for notebook 12_experts: expert parallelism (dispatch, compute_experts,
combine) and EP x DP (allreduce_ep_gradients).

Run: pytest tests/grading/test_expert_parallel.py   (add --impl=solutions for the reference)

- dispatch and combine are checked exactly against what every rank can compute alone from
  every rank's (seeded) tokens; compute_experts against each expert run row by row.
- The proof: the tiny-moe model with its experts sharded over ep in {2, 4} ranks, E in
  {4, 8}, drops the same tokens as the single-device model and gives the same logits and
  every gradient (router, experts, attention, embeddings...). EP x DP (dp=2 x ep=2) trains
  K=3 AdamW steps equal to one process on the whole batch.
- Bad input: E not divisible by ep, a mesh with other axes or without the ("dp", "ep") group.

The proofs run in float64: EP sums the same numbers in another order (an all-reduce of
per-rank partial sums against one sum over the batch), each term exact to ~1e-16; the
tolerance 1e-9 leaves many orders of margin, and is far below float32's 1e-7 rounding, so
a wrong gradient (a missing 1/world, a token sent to the wrong expert) cannot pass.
ONE launch per world size (2, 4) runs every case. About 20 s on 2 cores.
"""
import functools

import pytest
import torch
import torch.distributed as dist

from labkit import moe
from labkit.cases import expect_case, launch_cases, run_cases
from labkit.grading import impl
from labkit.mesh import Mesh, shard_rows
from labkit.model import build_model, get_config

TOL = dict(rtol=1e-9, atol=1e-12)  # float64, see the module docstring
SEQ = 16


def tokens(rows, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4096, (rows, SEQ), generator=g), torch.randint(0, 4096, (rows, SEQ), generator=g)


def layer_inputs(rank, E, D=8, seed=0):
    """Rank `rank`'s tokens [2, SEQ, D] and their routing (router weight shared by all ranks)."""
    x = torch.randn(2, SEQ, D, generator=torch.Generator().manual_seed(seed * 100 + rank), dtype=torch.float64)
    w = torch.randn(E, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return x, moe.route(x, w, top_k=2, capacity_factor=0.75)


def expected_exchange(r, n, E, seed):
    """What rank r must receive, and the Plan every rank must build, computed from every rank's data."""
    L = E // n
    received, recv_counts = [], []
    for s in range(n):
        x, routing = layer_inputs(s, E, seed=seed)
        toks, picks, counts = moe.sort_by_expert(routing)
        chunks = x.reshape(-1, x.shape[-1])[toks].split(counts.tolist())
        received += chunks[r * L:(r + 1) * L]
        recv_counts.append(counts[r * L:(r + 1) * L])
        if s == r:
            mine = (toks, picks, counts.view(n, L).sum(1).tolist())
    recv_counts = torch.stack(recv_counts)
    return torch.cat(received), recv_counts, mine


def dispatch_case(r, n, E):
    ep = impl("expert_parallel")
    for seed in range(3):
        x, routing = layer_inputs(r, E, seed=seed)
        received, plan = ep.dispatch(x, routing)
        want, recv_counts, (toks, picks, send_splits) = expected_exchange(r, n, E, seed)
        assert torch.equal(plan.recv_counts, recv_counts), f"recv_counts {plan.recv_counts} != {recv_counts}"
        assert plan.send_splits == send_splits and plan.recv_splits == recv_counts.sum(1).tolist()
        assert torch.equal(plan.tokens, toks) and torch.equal(plan.picks, picks)
        assert torch.equal(received, want), "received rows differ (order: source rank, then local expert)"


def combine_case(r, n, E):
    """Each expert "computes" 2x + (its rank): combine must bring it back, unpermute and weight by gates."""
    ep = impl("expert_parallel")
    L = E // n
    for seed in range(3):
        x, routing = layer_inputs(r, E, seed=seed)
        received, recv_counts, (toks, picks, send_splits) = expected_exchange(r, n, E, seed)
        plan = ep.Plan(toks, picks, send_splits, recv_counts.sum(1).tolist(), recv_counts)
        y = ep.combine(2 * received + r, plan, routing)
        owner = routing.expert.reshape(-1)[picks] // L
        rows = 2 * x.reshape(-1, x.shape[-1])[toks] + owner[:, None].double()
        want = moe.unpermute(rows, toks, routing.gate.reshape(-1)[picks], x.shape[0] * x.shape[1])
        torch.testing.assert_close(y.reshape(want.shape), want, **TOL)


def model_case(r, n, E, cf):
    """ep = n ranks: same dropped tokens, logits and every gradient as one device."""
    ep = impl("expert_parallel")
    mesh = Mesh(n, ep=n, combined=[("dp", "ep")])
    cfg = get_config("tiny-moe", n_experts=E, capacity_factor=cf)
    ref = build_model(cfg, seed=3).double()
    model = ep.build_ep_model(cfg, mesh, seed=3, dtype=torch.float64)
    x, y = tokens(2 * n, seed=E)
    shards = [shard_rows((x, y), s, n) for s in range(n)]
    # reference: one process runs every rank's rows; the sum of their losses (each a mean over its rows)
    ref_losses = [ref(xs, ys) for xs, ys in shards]
    torch.stack(ref_losses).sum().backward()
    with torch.no_grad():
        ref_logits = ref(shards[r][0])
        ref_keep = [layer.routing.keep for layer in moe.moe_layers(ref)]
    loss = model(*shards[r])
    keep = [layer.routing.keep for layer in moe.moe_layers(model)]
    assert all(torch.equal(a, b) for a, b in zip(keep, ref_keep)), "EP dropped other tokens than one device"
    dropped = torch.tensor([sum(int((~k).sum()) for k in keep)])
    dist.all_reduce(dropped)
    assert dropped.item() > 0, "this case is meant to drop tokens"
    torch.testing.assert_close(loss, ref_losses[r], **TOL)
    loss.backward()
    with torch.no_grad():
        torch.testing.assert_close(model(shards[r][0]), ref_logits, **TOL)
    want = dict(ref.named_parameters())
    names = [name for name, _ in model.named_parameters()]
    assert len(names) == len(want) - cfg.n_layers * (E - E // n) * 3, "each rank holds E/ep experts per layer"
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        if not ep.is_expert_parameter(name):  # replicated: this rank has its own rows' share only
            dist.all_reduce(grad)
        torch.testing.assert_close(grad, want[name].grad, **TOL, msg=lambda m: f"{name}: {m}")


def ep_dp_training_case(r, n, steps=3):
    """dp=2 x ep=2: K AdamW steps on every rank's rows equal one process on the whole batch."""
    ep = impl("expert_parallel")
    mesh = Mesh(n, dp=2, ep=2, combined=[("dp", "ep")])
    cfg = get_config("tiny-moe", capacity_factor=1.0)
    ref = build_model(cfg, seed=5).double()
    model = ep.build_ep_model(cfg, mesh, seed=5, dtype=torch.float64)
    groups = ep.gradient_groups(model)
    assert all(groups[k] == (("dp",) if ".experts." in k else ("dp", "ep")) for k in groups), groups
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(steps):
        x, y = tokens(2 * n, seed=100 + step)
        ref_loss = ref(x, y)
        ref_loss.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        loss = model(*shard_rows((x, y), mesh.index(("dp", "ep")), n))
        loss.backward()
        ep.allreduce_ep_gradients(model, mesh)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        torch.testing.assert_close(mean / n, ref_loss.detach(), **TOL)
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), want[name].detach(), **TOL, msg=lambda m: f"{name}: {m}")


def bad_input_case(r, n, make_mesh, E, words):
    ep = impl("expert_parallel")
    good = Mesh(n, ep=n, combined=[("dp", "ep")])
    model = ep.build_ep_model(get_config("tiny-moe", n_layers=1), good, seed=0)
    model(tokens(1, 0)[0])  # must work on good input first
    mesh = make_mesh()
    try:
        ep.build_ep_model(get_config("tiny-moe", n_layers=1, n_experts=E), mesh, seed=0)
    except ValueError as e:
        assert any(w in str(e) for w in words), f"the error should say what is wrong: {e}"
    else:
        raise AssertionError("no ValueError")


def cases(n):
    out = {"dispatch": functools.partial(dispatch_case, E=2 * n), "combine": functools.partial(combine_case, E=2 * n)}
    out["dispatch_one_expert_per_rank"] = functools.partial(dispatch_case, E=n)
    for E in (4, 8):
        out[f"model_E{E}"] = functools.partial(model_case, E=E, cf=0.75 if E == 4 else 1.0)
    if n == 4:
        out["ep_dp_training"] = ep_dp_training_case
        out["E_not_divisible_by_ep_raises"] = functools.partial(
            bad_input_case, make_mesh=lambda: Mesh(4, ep=4, combined=[("dp", "ep")]), E=6, words=("divide",))
        out["mesh_with_other_axes_raises"] = functools.partial(
            bad_input_case, make_mesh=lambda: Mesh(4, ep=2, tp=2, combined=[("dp", "ep")]), E=4, words=("tp",))
        out["mesh_without_dp_ep_group_raises"] = functools.partial(
            bad_input_case, make_mesh=lambda: Mesh(4, dp=2, ep=2), E=4, words=("combined",))
    return out


def run_all(rank, world_size):
    torch.manual_seed(0)
    return run_cases({name: functools.partial(body, rank, world_size) for name, body in cases(world_size).items()})


def expect_ok(case, world_size):
    expect_case(launch_cases(run_all, world_size, timeout=120), case, f"expert parallelism on {world_size} ranks, case {case}")


@pytest.mark.exercise("dispatch", needs=("all_to_all_single",))
@pytest.mark.parametrize("case", ["dispatch", "dispatch_one_expert_per_rank"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_dispatch_sends_each_token_to_its_experts_rank(case, world_size):
    expect_ok(case, world_size)


@pytest.mark.exercise("combine", needs=("all_to_all_single",))
@pytest.mark.parametrize("world_size", [2, 4])
def test_combine_brings_outputs_back_weighted_by_gates(world_size):
    expect_ok("combine", world_size)


@pytest.mark.exercise("compute_experts")
@pytest.mark.parametrize("ep,L", [(1, 4), (2, 2), (4, 2), (3, 1)])
def test_compute_experts_runs_each_expert_on_its_rows_including_empty_blocks(ep, L):
    g = torch.Generator().manual_seed(ep * 10 + L)
    torch.manual_seed(0)
    experts = [moe.Expert(6, 10).double() for _ in range(L)]
    recv_counts = torch.randint(0, 4, (ep, L), generator=g)
    recv_counts[0, 0] = 0  # an empty block
    received = torch.randn(int(recv_counts.sum()), 6, generator=g, dtype=torch.float64)
    out = impl("expert_parallel").compute_experts(experts, received, recv_counts)
    owner = torch.arange(L).repeat(ep).repeat_interleave(recv_counts.flatten())  # expert of each row
    want = torch.stack([experts[e](received[i:i + 1])[0] for i, e in enumerate(owner.tolist())]) \
        if len(owner) else received
    torch.testing.assert_close(out, want, **TOL)


@pytest.mark.exercise("dispatch", "compute_experts", "combine", needs=("all_to_all_single",))
@pytest.mark.parametrize("E", [4, 8])
@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_equals_single_device_same_drops_logits_every_gradient(ep, E):
    expect_ok(f"model_E{E}", ep)


@pytest.mark.exercise("allreduce_ep_gradients", needs=("dispatch", "compute_experts", "combine", "all_to_all_single"))
def test_ep_x_dp_k_adamw_steps_equal_one_process():
    expect_ok("ep_dp_training", 4)


@pytest.mark.exercise("dispatch", "compute_experts", "combine", needs=("all_to_all_single",))
@pytest.mark.parametrize("case", ["E_not_divisible_by_ep_raises", "mesh_with_other_axes_raises",
                                  "mesh_without_dp_ep_group_raises"])
def test_expert_parallel_bad_input_raises(case):
    expect_ok(case, 4)
