"""Grading tests for notebook 12_experts: the two-micro-batch overlap (solutions/moe_overlap.py, TwoBatchEPMoE).

Run: pytest tests/grading/test_moe_overlap.py   (add --impl=solutions for the reference)

- The proof: tiny-moe with its experts over ep in {2, 4} ranks, every MoE layer overlapped, against
  the non-overlapped EPMoE model and one process: the same dropped tokens, loss, logits and every
  gradient, in float64 (tolerance as tests/grading/test_expert_parallel.py: the halves sum the same
  terms in another order, each exact to ~1e-16; 1e-9 leaves orders of margin and is far below a
  wrong row's error).
- The overlap itself, as the order of events on the timeline (never durations, so it holds on a
  busy machine): in every layer B's dispatch was issued before A's experts started and waited for
  after they ended, A's combine issued before B's experts and waited for after them; in backward
  the mirror image (A's combine gradient in flight across B's expert backward, B's dispatch gradient
  across A's). A sequential schedule passes the proof and fails this.
- Bytes per step under labkit.comm.count_traffic, EQUAL to the closed form: per MoE layer, the
  rows' all-to-alls (torch's all_to_all_single, async) carry input payloads
      dispatch M + combine R (forward), combine's gradient M + dispatch's gradient R (backward),
  so 2 (M + R) D s bytes, M the kept picks of this rank's tokens, R the rows it received
  (sum of what every rank sent to its experts), D = d_model, s = 8 (float64); the counts travel
  in ONE exchange per layer through your all_to_all_single: (ep - 1) isends of 2 L int64 (both
  halves' counts for the L local experts), (ep - 1) 2 L 8 bytes.
- Bad input: a rank with fewer than 2 sequences (nothing to cut in halves) raises ValueError.

ONE launch per world size (2, 4) runs every case. About 15 s on 2 cores.
"""
import functools

import pytest
import torch
import torch.distributed as dist

from labkit.comm.traffic import count_traffic
from labkit.grading import impl
from labkit.grading.cases import expect_case, launch_cases, run_cases
from labkit.measure.timeline import Timeline
from labkit.mesh import Mesh, shard_rows
from labkit.model import build_model, get_config, moe

TOL = dict(rtol=1e-9, atol=1e-12)  # float64, see the module docstring
SEQ = 16


def tokens(rows, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4096, (rows, SEQ), generator=g), torch.randint(0, 4096, (rows, SEQ), generator=g)


def _patched(forward):
    """The class under test: the learner's, or (tests/test_moe_overlap.py) one with a planted forward."""
    cls = impl("moe_overlap").TwoBatchEPMoE
    if forward is not None:
        cls.forward = forward
    return cls


def equal_case(r, n, E, cf, forward=None, dp=1):
    """Overlapped == EPMoE == one process: drops, loss, logits, every gradient (float64).

    dp > 1: the expert group is ep = n / dp ranks, not the world (Mesh(n, dp=, ep=)): code that sizes or runs
    its all-to-alls on the default group fails. The experts' gradients are then compared with EPMoE's only
    (one process would need them summed over the dp replicas too)."""
    _patched(forward)
    ov, ep = impl("moe_overlap"), impl("expert_parallel")
    mesh = Mesh(n, dp=dp, ep=n // dp, combined=[("dp", "ep")])
    cfg = get_config("tiny-moe", n_experts=E, capacity_factor=cf)
    ref = build_model(cfg, seed=3).double()
    plain = ep.build_ep_model(cfg, mesh=mesh, seed=3, dtype=torch.float64)
    model = ov.build_overlapped_ep_model(cfg, mesh=mesh, seed=3, dtype=torch.float64)
    x, y = tokens(3 * n, seed=E)  # 3 sequences per rank: halves of 1 and 2 (uneven on purpose)
    shards = [shard_rows((x, y), s, n) for s in range(n)]
    ref_losses = [ref(xs, ys) for xs, ys in shards]
    torch.stack(ref_losses).sum().backward()
    with torch.no_grad():
        ref_logits = ref(shards[r][0])
        ref_keep = [m.routing.keep for m in moe.moe_layers(ref)]
    plain(*shards[r]).backward()
    loss = model(*shards[r])
    keep = [m.routing.keep for m in moe.moe_layers(model)]
    assert all(torch.equal(a, b) for a, b in zip(keep, ref_keep)), "the overlapped model dropped other tokens"
    torch.testing.assert_close(loss, ref_losses[r], **TOL,
                               msg=lambda m: f"TwoBatchEPMoE's loss differs from one process (check that the halves "
                                             f"are put back in order, A first, and weighted by their own gates): {m}")
    loss.backward()
    with torch.no_grad():
        torch.testing.assert_close(model(shards[r][0]), ref_logits, **TOL)
    want, same = dict(ref.named_parameters()), dict(plain.named_parameters())
    names = [name for name, _ in model.named_parameters()]
    assert names == list(same), "the overlapped model must keep EPMoE's parameter names"
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} has no gradient: is every half's output part of the result?"
        torch.testing.assert_close(p.grad, same[name].grad, **TOL, msg=lambda m: f"{name} (against EPMoE): {m}")
        grad = p.grad.clone()
        if ep.is_expert_parameter(name) and dp > 1:
            continue
        if not ep.is_expert_parameter(name):
            dist.all_reduce(grad)
        torch.testing.assert_close(grad, want[name].grad, **TOL, msg=lambda m: f"{name} (against one process): {m}")


def _spans_by_key(spans, rank):
    out = {}
    for s in spans:
        if s.rank == rank:
            out.setdefault((s.kind, s.stage, s.mb), s)
    return out


def overlap_order_problems(spans, rank, layers):
    """Words for the first event out of order on this rank's timeline, or None. Each rule: (the all-to-all in
    flight, the compute it must span: issued before the compute starts, waited for after it ends)."""
    k = _spans_by_key(spans, rank)
    rules = [("dispatch", 1, "F", 0, "half B's dispatch must be issued before half A's experts run, and waited for after"),
             ("combine", 0, "F", 1, "half A's combine must be issued before half B's experts run, and waited for after"),
             ("combine_grad", 0, "B", 1, "in backward, half A's combine gradient must be in flight across half B's "
                                         "expert backward (issue A's combine before B's wait in forward)"),
             ("dispatch_grad", 1, "B", 0, "in backward, half B's dispatch gradient must be in flight across half A's "
                                          "expert backward")]
    for layer in layers:
        for a2a, half, comp, other, words in rules:
            s, c = k.get((a2a, layer, half)), k.get((comp, layer, other))
            if s is None or c is None:
                missing = a2a if s is None else comp
                return (f"layer {layer}: no '{missing}' span for half {half if s is None else other} on the timeline: "
                        "issue the all-to-alls with start_all_to_all(..., timeline=tl, kind=..., layer=self.layer, half=h) "
                        "and run the experts inside tl.span('F', stage=self.layer, mb=h) through timed_backward")
            if not (s.start <= c.start and s.end >= c.end):
                return (f"layer {layer}: {words}; on rank {rank} '{a2a}' of half {half} ran "
                        f"[{s.start * 1e3:.2f}, {s.end * 1e3:.2f}] ms and '{comp}' of half {other} "
                        f"[{c.start * 1e3:.2f}, {c.end * 1e3:.2f}] ms")
    return None


def order_case(r, n, forward=None):
    """The all-to-alls overlap the other half's experts, forward and backward (order of events only)."""
    _patched(forward)
    ov = impl("moe_overlap")
    mesh = Mesh(n, ep=n, combined=[("dp", "ep")])
    tl = Timeline()
    model = ov.build_overlapped_ep_model("tiny-moe", mesh=mesh, seed=0, timeline=tl)
    x, y = shard_rows(tokens(4 * n, seed=1), r, n)
    tl.sync()
    model(x, y).backward()
    spans = tl.all_gather()
    problem = overlap_order_problems(spans, r, range(model.config.n_layers))
    assert problem is None, f"TwoBatchEPMoE does not overlap: {problem}"


def bytes_case(r, n, forward=None):
    """count_traffic's payloads per op equal the closed form of the module docstring."""
    _patched(forward)
    ov = impl("moe_overlap")
    mesh = Mesh(n, ep=n, combined=[("dp", "ep")])
    cfg = get_config("tiny-moe", capacity_factor=1.0)
    model = ov.build_overlapped_ep_model(cfg, mesh=mesh, seed=0, dtype=torch.float64)
    x, y = shard_rows(tokens(4 * n, seed=2), r, n)
    with count_traffic() as traffic:
        model(x, y).backward()
    L, D = cfg.n_experts // n, cfg.d_model
    kept = torch.stack([m.routing.kept_counts() for m in moe.moe_layers(model)])  # [layers, E]
    every = [torch.empty_like(kept) for _ in range(n)]
    dist.all_gather(every, kept)
    M = int(kept.sum())                                                            # over the layers
    R = sum(int(e[:, r * L:(r + 1) * L].sum()) for e in every)
    want_a2a = 2 * (M + R) * D * 8
    got_a2a = traffic.payload(op="all_to_all_single")
    assert got_a2a == want_a2a, (f"the rows' all-to-alls carried {got_a2a} bytes, the closed form 2 (M + R) D s = "
                                 f"2 ({M} + {R}) {D} 8 = {want_a2a}: every row goes out once and its gradient back once")
    want_counts = cfg.n_layers * (n - 1) * 2 * L * 8
    got_counts = traffic.payload(op="isend")
    assert got_counts == want_counts, (f"the counts' exchange sent {got_counts} bytes, expected one exchange per layer "
                                       f"of both halves' counts, n_layers (ep-1) 2 L 8 = {want_counts}")


def bad_input_case(r, n):
    ov = impl("moe_overlap")
    mesh = Mesh(n, ep=n, combined=[("dp", "ep")])
    model = ov.build_overlapped_ep_model(get_config("tiny-moe", n_layers=1), mesh=mesh, seed=0)
    model(tokens(2, 0)[0])  # must work on good input first
    try:
        model(tokens(1, 0)[0])
    except ValueError as e:
        assert "2" in str(e), f"the error should say a rank needs at least 2 sequences: {e}"
    else:
        raise AssertionError("no ValueError for 1 sequence per rank")


def cases(n):
    out = {"equal_E4": functools.partial(equal_case, E=4, cf=0.75), "order": order_case, "bytes": bytes_case}
    if n == 4:
        out["equal_E8"] = functools.partial(equal_case, E=8, cf=1.0)
        out["one_sequence_raises"] = bad_input_case
        out["equal_E4_dp2_ep2"] = functools.partial(equal_case, E=4, cf=0.75, dp=2)
    return out


def run_all(rank, world_size):
    torch.manual_seed(0)
    return run_cases({name: functools.partial(body, rank, world_size) for name, body in cases(world_size).items()})


def expect_ok(case, world_size):
    expect_case(launch_cases(run_all, world_size, timeout=120), case,
                f"the two-micro-batch overlap on {world_size} ranks, case {case}")


@pytest.mark.exercise("TwoBatchEPMoE", needs=("dispatch", "compute_experts", "combine", "all_to_all_single"))
@pytest.mark.parametrize("world_size", [2, 4])
def test_two_batch_overlap_equals_epmoe_and_one_process_forward_and_every_gradient(world_size):
    expect_ok("equal_E4", world_size)


@pytest.mark.exercise("TwoBatchEPMoE", needs=("dispatch", "compute_experts", "combine", "all_to_all_single"))
def test_two_batch_overlap_eight_experts_on_four_ranks():
    expect_ok("equal_E8", 4)


@pytest.mark.exercise("TwoBatchEPMoE", needs=("compute_experts", "all_to_all_single"))
@pytest.mark.parametrize("world_size", [2, 4])
def test_two_batch_all_to_alls_are_in_flight_across_the_other_halfs_experts(world_size):
    expect_ok("order", world_size)


@pytest.mark.exercise("TwoBatchEPMoE", needs=("compute_experts", "all_to_all_single"))
@pytest.mark.parametrize("world_size", [2, 4])
def test_two_batch_bytes_per_step_equal_the_closed_form(world_size):
    expect_ok("bytes", world_size)


@pytest.mark.exercise("TwoBatchEPMoE", needs=("compute_experts", "all_to_all_single"))
def test_two_batch_one_sequence_per_rank_raises():
    expect_ok("one_sequence_raises", 4)


@pytest.mark.exercise("TwoBatchEPMoE", needs=("dispatch", "compute_experts", "combine", "all_to_all_single"))
def test_two_batch_overlap_expert_group_smaller_than_the_world_dp2_ep2():
    expect_ok("equal_E4_dp2_ep2", 4)
