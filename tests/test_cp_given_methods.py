"""The given context-parallel methods (solutions/cp_methods.py, built from labkit/parallel/context_methods.py):
all-gather K/V proven equal to one process, the bytes of all four methods against their closed forms, and planted mistakes that the checks catch.

Run on the solutions (the learner's Ulysses swaps are graded by tests/grading/test_cp_methods.py). Float64,
assert_close's float64 tolerances: the all-gather method's softmax sums the same keys in another order (keys
in cp-rank order, not position order), ~1e-16 relative per operation. One launch per CP size; about 10 s.

Closed forms per call (forward and backward), X = B H n hd x 8 bytes (one of q, k, v on a rank, float64),
c = cp ranks; each call also all-gathers its shapes once (5 int64 per rank: payload 40 c, wire 40 (c-1)):
    ring        isend and irecv: 3c-2 calls of K,V (2X): c-1 forward, c-1 + c (dK,dV) backward
    all-gather  one all_gather_single (payload 2Xc, wire 2X (c-1)), one reduce_scatter_single (the same)
The Ulysses and hybrid forms are checked by the grading tests (they run the learner's swaps).
"""
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F

from labkit import launch
from labkit.grading.cases import launch_timeout

F64 = torch.float64


def full_qkv(s, seed=0, B=2, H=4, hd=4):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, s, hd, generator=g, dtype=F64) for _ in range(4)]


def allgather_error(rank, c, mask, split):
    """None, or what differs from one process (forward rows, dq, dk, dv) for all-gather K/V."""
    from labkit.grading import impl
    from labkit.mesh import Mesh
    cm, cpm = impl("cp_methods"), impl("context_parallel")
    s = 8 * c
    q, k, v, dout = full_qkv(s, seed=s)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=mask == "causal")
    ref.backward(dout)
    pieces = cpm.SPLITS[split](s, c, rank)
    leaves = [cpm.take(t, pieces).clone().requires_grad_() for t in (q, k, v)]
    out = cm.allgather_attention(*leaves, mesh=Mesh(c, cp=c), split=split, mask=mask, seq_len=s)
    out.backward(cpm.take(dout, pieces))
    for what, got, want in [("out", out, ref)] + [(f"d{n}", leaf.grad, f.grad) for n, leaf, f in zip("qkv", leaves, full)]:
        want = cpm.take(want.detach(), pieces)
        if not torch.allclose(got, want, rtol=1e-7, atol=1e-7):
            return f"{what} differs by {(got - want).abs().max().item():.3g}"
    return None


def traffic_of(rank, c, method):
    """{op: (calls, payload, wire)} of one call, forward and backward."""
    from labkit.comm.traffic import count_traffic
    from labkit.grading import impl
    from labkit.mesh import Mesh
    cm, cpm, ra = impl("cp_methods"), impl("context_parallel"), impl("ring_attention")
    s, mesh = 8 * c, Mesh(c, cp=c)
    leaves = [cpm.take(t, cpm.zigzag_split(s, c, rank)).clone().requires_grad_() for t in full_qkv(s)[:3]]
    attend = {"ring": ra.ring_attention, "allgather": cm.allgather_attention, "ulysses": cm.ulysses_attention}[method]
    with count_traffic() as traffic:
        out = attend(*leaves, mesh=mesh)
        out.backward(torch.ones_like(out))
    return {op: (traffic.calls(op), traffic.payload(op), traffic.wire(op)) for op in traffic.by_op()}, leaves[0].numel() * 8


def closed_form(method, c, X):
    shapes = {"all_gather": (1, 40 * c, Fraction(40 * (c - 1)))}
    if method == "ring":
        p2p = (3 * c - 2, 2 * X * (3 * c - 2), Fraction(2 * X * (3 * c - 2)))
        return {"all_gather": shapes["all_gather"], "isend": p2p, "irecv": p2p}
    if method == "allgather":
        one = (1, 2 * X * c, Fraction(2 * X * (c - 1)))
        return {**shapes, "all_gather_single": one, "reduce_scatter_single": one}
    return {"all_to_all_single": (8, 8 * X, Fraction(8 * X * (c - 1), c)), **shapes}


# ---- mistakes planted INSIDE the ranks (they are forked from a zygote, not from pytest)
def plant(mistake):
    from labkit.grading import impl
    cm = impl("cp_methods")
    if mistake == "allgather backward keeps its own gradient":  # no reduce-scatter: other ranks' dK, dV lost
        import torch.distributed as dist

        def backward(ctx, grad):
            return grad[dist.get_rank(ctx.group)].clone(), None
        cm.GatherKV.backward = staticmethod(backward)  # labkit.parallel.context_methods' class: restored by run_all
    elif mistake == "allgather mask by local index":  # the mask read from local indices, not global positions
        cm.attend_at_positions = lambda q, k, v, q_pos, k_pos, mask: F.scaled_dot_product_attention(
            q, k, v, attn_mask=torch.arange(k.shape[-2])[None, :] <= torch.arange(q.shape[-2])[:, None])
    elif mistake == "ulysses k and v swapped twice":  # one all-to-all too many: the bytes show it
        swap = cm.seq_to_heads
        cm.seq_to_heads = lambda x, *, group=None: swap(cm.heads_to_seq(swap(x, group=group), group=group), group=group)
    else:
        raise ValueError(mistake)


MISTAKES = ["allgather backward keeps its own gradient", "allgather mask by local index", "ulysses k and v swapped twice"]


def run_all(rank, c):
    out = {}
    for mask in ("causal", None):
        for split in ("zigzag", "contiguous"):
            out[("allgather", mask, split)] = allgather_error(rank, c, mask, split)
    for method in ("ring", "allgather", "ulysses"):
        got, X = traffic_of(rank, c, method)
        out[("bytes", method)] = (got, closed_form(method, c, X))
    from labkit.parallel.context_methods import GatherKV
    given_backward = GatherKV.__dict__["backward"]
    for mistake in MISTAKES:  # each planted in turn; the module is reloaded (and the given class restored) after each
        import importlib

        from labkit.grading import impl
        plant(mistake)
        if mistake.startswith("ulysses"):
            got, X = traffic_of(rank, c, "ulysses")
            out[("planted", mistake)] = got != closed_form("ulysses", c, X)
        else:
            out[("planted", mistake)] = allgather_error(rank, c, "causal", "zigzag") is not None
        importlib.reload(impl("cp_methods"))
        GatherKV.backward = given_backward
    return out


@pytest.fixture(scope="module")
def results():
    cache = {}

    def get(c):
        if c not in cache:
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("LABKIT_IMPL", "solutions")
                cache[c] = launch(run_all, c, timeout=launch_timeout(60))
        return cache[c]
    return get


@pytest.mark.parametrize("c", [2, 4])
@pytest.mark.parametrize("mask", ["causal", None])
@pytest.mark.parametrize("split", ["zigzag", "contiguous"])
def test_allgather_kv_forward_and_grads_equal_full_attention_float64(c, mask, split, results):
    for rank, per_rank in enumerate(results(c)):
        assert per_rank[("allgather", mask, split)] is None, f"rank {rank} of {c}: {per_rank[('allgather', mask, split)]}"


@pytest.mark.parametrize("c", [2, 4])
@pytest.mark.parametrize("method", ["ring", "allgather", "ulysses"])
def test_bytes_per_call_equal_the_closed_form(c, method, results):
    for rank, per_rank in enumerate(results(c)):
        got, want = per_rank[("bytes", method)]
        assert got == want, f"{method}, rank {rank} of {c}: (calls, payload, wire) {got}, closed form {want}"


@pytest.mark.parametrize("mistake", MISTAKES)
def test_a_planted_mistake_is_caught(mistake, results):
    assert all(per_rank[("planted", mistake)] for per_rank in results(4)), f"{mistake}: not caught"


@pytest.mark.parametrize("c", [2, 4])
@pytest.mark.parametrize("method", ["ring", "allgather", "ulysses"])
def test_the_cost_models_cp_bytes_equal_what_a_rank_sent(c, method, results):
    """labkit.scale.traffic.cp_attention_bytes (sent per rank: collectives' wire bytes, isend payloads; the shape
    agreement left out) equals the measured call."""
    from labkit.scale.traffic import cp_attention_bytes

    for rank, per_rank in enumerate(results(c)):
        got, _ = per_rank[("bytes", method)]
        sent = sum(wire for op, (_, _, wire) in got.items() if op.endswith("_single")) + \
            got.get("isend", (0, 0, 0))[1]
        X = 2 * 4 * 8 * 4 * 8  # B H n hd x 8 bytes: full_qkv(8c) cut to one rank, n = 8 positions
        assert sent == sum(cp_attention_bytes(method, c, X, X).values()), (rank, got)


def test_the_cost_models_cp_bytes_refuse_an_unknown_method_and_a_local_not_dividing_cp():
    from labkit.scale.traffic import cp_attention_bytes

    with pytest.raises(ValueError, match="choose one of ring, allgather, ulysses, hybrid"):
        cp_attention_bytes("tree", 4, 1, 1)
    with pytest.raises(ValueError, match="local=3 must divide cp=4"):
        cp_attention_bytes("hybrid", 4, 1, 1, local=3)
    assert cp_attention_bytes("hybrid", 4, 8, 8, local=4) == cp_attention_bytes("ulysses", 4, 8, 8)  # one node
    assert cp_attention_bytes("hybrid", 4, 8, 8, local=1) == {"all_to_all": 0, "p2p": cp_attention_bytes("ring", 4, 8, 8)["p2p"]}
