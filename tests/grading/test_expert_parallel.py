"""Grading tests for notebook 12_experts: expert parallelism (dispatch, compute_experts,
combine) and EP x DP (sync_gradients).

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

from labkit.model import moe
from labkit.grading.diagnose import average_mismatch, rank_tag
from labkit.grading.cases import expect_case, launch_cases, run_cases
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
        n_tokens = x.shape[0] * x.shape[1]
        want = moe.unpermute(rows, toks, routing.gate.reshape(-1)[picks], n_tokens)
        if y.numel() != want.numel():
            raise AssertionError(f"combine returned shape {tuple(y.shape)}, expected [{n_tokens}, D]: one row per token")
        y = y.reshape(want.shape)
        if torch.allclose(y, want, **TOL):
            continue
        unweighted = moe.unpermute(rows, toks, torch.ones(len(picks), dtype=x.dtype), n_tokens)
        hint = ("the outputs are not weighted by their gates (routing.gate.reshape(-1)[plan.picks])"
                if torch.allclose(y, unweighted, **TOL) else
                "send the rows back with dispatch's sizes swapped (in_splits=plan.recv_splits, "
                "out_splits=plan.send_splits), then unpermute(rows, plan.tokens, gates, N)")
        token = int((y - want).abs().amax(1).argmax())
        raise AssertionError(f"combine on rank {r} (each expert's output is 2x + its rank): token {token} differs "
                             f"first, max abs diff {(y - want).abs().max().item():.3g}; {hint}")


def model_case(r, n, E, cf):
    """ep = n ranks: same dropped tokens, logits and every gradient as one device."""
    ep = impl("expert_parallel")
    mesh = Mesh(n, ep=n, combined=[("dp", "ep")])
    cfg = get_config("tiny-moe", n_experts=E, capacity_factor=cf)
    ref = build_model(cfg, seed=3).double()
    model = ep.build_ep_model(cfg, mesh=mesh, seed=3, dtype=torch.float64)
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
    model = ep.build_ep_model(cfg, mesh=mesh, seed=5, dtype=torch.float64)
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
        ep.sync_gradients(model, mesh=mesh)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        torch.testing.assert_close(mean / n, ref_loss.detach(), **TOL)
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), want[name].detach(), **TOL, msg=lambda m: f"{name}: {m}")


def allreduce_ep_gradients_case(r, n, no_grad=None):
    """Right after the call: each gradient is the sum of its group's rank tags (16**r) / world.

    dp=2 x ep=2 on 4 ranks: grid [[0, 1], [2, 3]], so a dp group is {0, 2} or {1, 3}
    (not [0..k)). `no_grad`: {parameter name: ranks where it has no gradient} (frozen or unused
    there), which counts as 0 but must still take part in the all-reduce.
    """
    ep = impl("expert_parallel")
    mesh = Mesh(n, dp=2, ep=2, combined=[("dp", "ep")])
    model = ep.build_ep_model(get_config("tiny-moe", n_layers=1), mesh=mesh, seed=0, dtype=torch.float64)
    skipped = lambda name, rank: rank in (no_grad or {}).get(name, ())  # noqa: E731
    for name, p in model.named_parameters():
        p.grad = None if skipped(name, r) else torch.full_like(p, rank_tag(r))
    ep.sync_gradients(model, mesh=mesh)
    for name, p in model.named_parameters():
        expert = ep.is_expert_parameter(name)
        axes = ("dp",) if expert else ("dp", "ep")
        members = [m for m in mesh.ranks(axes) if not skipped(name, m)]
        kind = "expert parameter" if expert else "replicated parameter"
        if p.grad is None:
            raise AssertionError(f"sync_gradients: {kind} `{name}` has no gradient after the call on rank "
                                 f"{r}; a parameter without gradient counts as 0 (set p.grad to zeros), and every "
                                 "rank must still take part in its all-reduce")
        wrong = average_mismatch(p.grad, r, members, n, n)
        if wrong:
            rule = (f"experts average over dp only (the ranks holding the same experts: {mesh.ranks('dp')})"
                    if expert else f"replicated parameters average over every rank {mesh.ranks(('dp', 'ep'))}")
            raise AssertionError(
                f"sync_gradients: {kind} `{name}` on rank {r}, right after the call (each rank r set "
                f"its gradient to 16**r): {wrong}. Expected the sum of ranks {members} / {n}: {rule}, "
                "and every average divides by mesh.world_size (each rank's loss is a mean over 1/world of the batch)")


def bad_input_case(r, n, make_mesh, E, words):
    ep = impl("expert_parallel")
    good = Mesh(n, ep=n, combined=[("dp", "ep")])
    model = ep.build_ep_model(get_config("tiny-moe", n_layers=1), mesh=good, seed=0)
    model(tokens(1, 0)[0])  # must work on good input first
    mesh = make_mesh()
    try:
        ep.build_ep_model(get_config("tiny-moe", n_layers=1, n_experts=E), mesh=mesh, seed=0)
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
        out["allreduce_ep_gradients"] = allreduce_ep_gradients_case
        out["allreduce_ep_gradients_no_grad_on_some_ranks"] = functools.partial(
            allreduce_ep_gradients_case, no_grad={"layers.0.attention.wq.weight": (1, 3),
                                                  "layers.0.feed_forward.experts.1.w1.weight": (3,)})
        out["ep_dp_training"] = ep_dp_training_case
        out["E_not_divisible_by_ep_raises"] = functools.partial(
            bad_input_case, make_mesh=lambda: Mesh(4, ep=4, combined=[("dp", "ep")]), E=6, words=("divide",))
        out["mesh_with_other_axes_raises"] = functools.partial(
            bad_input_case, make_mesh=lambda: Mesh(4, ep=2, tp=2, combined=[("dp", "ep")]), E=4, words=("tp",))
    return out


def run_all(rank, world_size):
    torch.manual_seed(0)
    return run_cases({name: functools.partial(body, rank, world_size) for name, body in cases(world_size).items()})


WHAT = {"allreduce_ep_gradients_no_grad_on_some_ranks":
        " (`layers.0.attention.wq.weight` has no gradient on ranks 1 and 3, `...experts.1.w1.weight` none on "
        "rank 3: a missing gradient counts as 0, and those ranks must still join its all-reduce, or the ranks' "
        "collectives no longer pair up)"}


def expect_ok(case, world_size):
    expect_case(launch_cases(run_all, world_size, timeout=120), case,
                f"expert parallelism on {world_size} ranks, case {case}{WHAT.get(case, '')}")


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
    source = torch.arange(ep).repeat_interleave(recv_counts.sum(1))  # rank each row came from
    want = torch.stack([experts[e](received[i:i + 1])[0] for i, e in enumerate(owner.tolist())]) \
        if len(owner) else received
    wrong = compute_experts_mismatch(out, want, received, experts, owner, source)
    assert wrong is None, f"compute_experts (ep={ep}, L={L}, recv_counts={recv_counts.tolist()}): {wrong}"


def compute_experts_mismatch(out, want, received, experts, owner, source):
    """None if out equals want; else the first wrong row, in words: which expert's output it holds."""
    if out.shape != want.shape:
        return f"the output has shape {tuple(out.shape)}, expected {tuple(want.shape)} (one row per received row)"
    close = lambda a, b: torch.allclose(a, b, **TOL)  # noqa: E731
    bad = [i for i in range(len(want)) if not close(out[i], want[i])]
    if not bad:
        return None
    i = bad[0]
    s, e = int(source[i]), int(owner[i])
    head = (f"row {i} (from source rank {s}, for local expert {e}) is wrong, and {len(bad) - 1} more rows; "
            "rows arrive grouped by source rank, then by local expert (recv_counts[s, e] rows each), and the "
            "outputs must come back in that same order")
    other = [k for k in range(len(experts)) if k != e and close(out[i], experts[k](received[i:i + 1])[0])]
    if other:
        return f"{head}: it holds expert {other[0]}'s output on this row instead of expert {e}'s"
    moved = [j for j in range(len(want)) if j != i and close(out[i], want[j])]
    if moved:
        return f"{head}: it holds the right output of row {moved[0]} (outputs put back out of order)"
    return f"{head}: {(out[i] - want[i]).abs().max().item():.3g} max abs difference, no expert's output of this row"


@pytest.mark.exercise("dispatch", "compute_experts", "combine", needs=("all_to_all_single",))
@pytest.mark.parametrize("E", [4, 8])
@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_equals_single_device_same_drops_logits_every_gradient(ep, E):
    expect_ok(f"model_E{E}", ep)


@pytest.mark.exercise("expert_parallel.sync_gradients")
@pytest.mark.parametrize("case", ["allreduce_ep_gradients", "allreduce_ep_gradients_no_grad_on_some_ranks"])
def test_allreduce_ep_gradients_averages_experts_over_dp_and_the_rest_over_every_rank(case):
    expect_ok(case, 4)


@pytest.mark.exercise("expert_parallel.sync_gradients", needs=("dispatch", "compute_experts", "combine", "all_to_all_single"))
def test_ep_x_dp_k_adamw_steps_equal_one_process():
    expect_ok("ep_dp_training", 4)


@pytest.mark.exercise("dispatch", "compute_experts", "combine", needs=("all_to_all_single",))
@pytest.mark.parametrize("case", ["E_not_divisible_by_ep_raises", "mesh_with_other_axes_raises"])
def test_expert_parallel_bad_input_raises(case):
    expect_ok(case, 4)
