"""Grading tests for notebook 11_long_sequences: Ulysses' two all-to-alls (seq_to_heads, heads_to_seq), and
the methods built on them (Ulysses attention, the a2a+p2p hybrid) proven equal to one process.

Run: pytest tests/grading/test_cp_methods.py   (add --impl=solutions for the reference)

The swaps only move values, so they are compared with torch.equal against the same tensor cut from the
full one. Attention is compared in float64 with assert_close's float64 tolerances (rtol 1e-7, atol 1e-7):
Ulysses computes the same sums as one process (observed: bit-equal), the hybrid's ring merges partial
softmaxes by their log-sum-exp, rounding ~1e-16 per operation, far below a lost block or a wrong mask.
Bytes per call equal the closed forms of solutions/cp_methods.py (labkit.comm counts them). One launch per
CP size (2, 4); about 15 s on 2 cores.
"""
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F

from labkit.grading import impl
from labkit.grading.cases import expect_case, launch_cases, run_cases

F64 = torch.float64


def full_qkv(s, seed=0, B=2, H=4, hd=4):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, s, hd, generator=g, dtype=F64) for _ in range(4)]  # q, k, v, dout


def raises_value_error(fn, pattern):
    import re
    try:
        fn()
    except ValueError as error:
        assert re.search(pattern, str(error)), f"the message {str(error)!r} does not match {pattern!r}"
        return
    raise AssertionError(f"no ValueError (expected one matching {pattern!r})")


def swapped(x_full, c, rank, split="zigzag"):
    """What seq_to_heads must give rank `rank`: its head group, every rank's pieces in group-rank order."""
    cpm = impl("context_parallel")
    H, s = x_full.shape[1], x_full.shape[2]
    order = torch.cat([cpm.positions(cpm.SPLITS[split](s, c, r)) for r in range(c)])
    return x_full[:, rank * H // c:(rank + 1) * H // c][:, :, order].contiguous()


def first_wrong_block(got, want, c, what):
    """None, or the first (chunk, head group) of `got` that is wrong, and which block it holds instead, in words."""
    if got.shape != want.shape:
        return f"{what} has shape {tuple(got.shape)}, expected {tuple(want.shape)} ([B, H/c, c n, hd] after the swap)"
    n = want.shape[2] // c
    for i in range(c):
        g, w = got[:, :, i * n:(i + 1) * n], want[:, :, i * n:(i + 1) * n]
        if not torch.equal(g, w):
            for j in range(c):
                if torch.equal(g, want[:, :, j * n:(j + 1) * n]):
                    return (f"{what}: sequence chunk {i} holds what group rank {j} sent: the chunk received from "
                            f"rank i must go i-th along the sequence (all_to_all_single's output chunk i comes from rank i)")
            return (f"{what}: sequence chunk {i} (from group rank {i}) is wrong: rank i must send you ITS positions of "
                    "YOUR head group (its input chunk for you = heads [you H/c, (you+1) H/c)); stack the head groups "
                    "along dim 0 and make the tensor contiguous before the all-to-all")
    return None


def check_swaps(rank, c):
    cm, cpm = impl("cp_methods"), impl("context_parallel")
    x, *_ = full_qkv(8 * c, seed=c)
    mine = cpm.take(x, cpm.contiguous_split(8 * c, c, rank))  # given: no other exercise needed
    got = cm.seq_to_heads(mine)
    want = swapped(x, c, rank, "contiguous")
    wrong = first_wrong_block(got, want, c, f"seq_to_heads on rank {rank} of {c}")
    assert wrong is None, wrong
    assert torch.equal(got, want)
    return mine, got


def check_heads_to_seq(rank, c):
    cm, cpm = impl("cp_methods"), impl("context_parallel")
    x, *_ = full_qkv(8 * c, seed=c)
    mine = cpm.take(x, cpm.contiguous_split(8 * c, c, rank))
    back = cm.heads_to_seq(swapped(x, c, rank, "contiguous"))
    assert back.shape == mine.shape, f"heads_to_seq gave shape {tuple(back.shape)}, expected {tuple(mine.shape)}"
    H = x.shape[1]
    for j in range(c):
        heads = slice(j * H // c, (j + 1) * H // c)
        assert torch.equal(back[:, heads], mine[:, heads]), (
            f"heads_to_seq on rank {rank} of {c}: heads {heads.start}..{heads.stop - 1} (group rank {j}'s head group) "
            f"are wrong: what rank j sends you (your positions of its heads) goes j-th along the heads")


def check_attention(rank, c, method, mask="causal", split="zigzag", mesh=None):
    """Forward rows and the gradients of q, k, v equal full attention on one process (float64)."""
    from labkit.mesh import Mesh
    cm, cpm = impl("cp_methods"), impl("context_parallel")
    mesh = mesh or Mesh(c, cp=c)
    c, rank = mesh.size("cp"), mesh.coord("cp")
    s = 8 * c
    q, k, v, dout = full_qkv(s, seed=s + c)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=mask == "causal")
    ref.backward(dout)
    pieces = cpm.SPLITS[split](s, c, rank)
    leaves = [cpm.take(t, pieces).clone().requires_grad_() for t in (q, k, v)]
    if method == "hybrid":
        out = cm.hybrid_attention(*leaves, levels=cm.CPLevels(mesh, local=2), split=split, mask=mask, seq_len=s)
    else:
        out = cm.ulysses_attention(*leaves, mesh=mesh, split=split, mask=mask, seq_len=s)
    torch.testing.assert_close(out, cpm.take(ref.detach(), pieces),
                               msg=lambda m: f"{method} attention on rank {rank} of {c}, forward rows:\n{m}")
    out.backward(cpm.take(dout, pieces))
    for name, leaf, f in zip("qkv", leaves, full):
        torch.testing.assert_close(leaf.grad, cpm.take(f.grad, pieces),
                                   msg=lambda m: f"{method} attention, d{name} on rank {rank} of {c}:\n{m}")


def check_bytes(rank, c, method):
    """What one call (forward and backward) sends, counted by labkit.comm, equals the closed form."""
    from labkit.comm.traffic import count_traffic
    from labkit.mesh import Mesh
    cm, cpm = impl("cp_methods"), impl("context_parallel")
    mesh, s = Mesh(c, cp=c), 8 * c
    q, k, v, dout = (cpm.take(t, cpm.zigzag_split(s, c, rank)) for t in full_qkv(s))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with count_traffic() as traffic:
        if method == "hybrid":
            levels = cm.CPLevels(mesh, local=2)
            traffic.records.clear()  # the groups' creation is not the call's traffic
            out = cm.hybrid_attention(*leaves, levels=levels)
        else:
            out = cm.ulysses_attention(*leaves, mesh=mesh)
        out.backward(dout)
    X = q.numel() * 8  # one of q, k, v, out on this rank, float64
    shapes = {"all_gather": (1, 40 * c, Fraction(40 * (c - 1)))}  # the shape agreement: 5 int64 per rank
    if method == "ulysses":
        want = {"all_to_all_single": (8, 8 * X, Fraction(8 * X * (c - 1), c)), **shapes}
    else:
        local, nodes = 2, c // 2
        want = {"all_to_all_single": (8, 8 * X, Fraction(8 * X * (local - 1), local)), **shapes}
        if nodes > 1:
            p2p = 3 * nodes - 2
            want.update(isend=(p2p, 2 * X * p2p, Fraction(2 * X * p2p)), irecv=(p2p, 2 * X * p2p, Fraction(2 * X * p2p)))
    got = {op: (traffic.calls(op), traffic.payload(op), traffic.wire(op)) for op in traffic.by_op()}
    assert got == want, f"{method} on rank {rank} of {c}: (calls, payload, wire) per op {got}, closed form {want}"


def check_bad_input(rank, c):
    from labkit.mesh import Mesh
    cm = impl("cp_methods")
    check_swaps(rank, c)  # good input works first
    x = torch.zeros(1, 3, 4, 2, dtype=F64)  # 3 heads
    if c > 1 and 3 % c:
        raises_value_error(lambda: cm.seq_to_heads(x), rf"3 heads .* do not split over {c} ranks")
        raises_value_error(lambda: cm.ulysses_attention(x, x, x, mesh=Mesh(c, cp=c)), r"do not split")


def run_all(rank, c):
    cases = {
        "seq_to_heads": lambda: check_swaps(rank, c),
        "heads_to_seq": lambda: check_heads_to_seq(rank, c),
        "ulysses_causal": lambda: check_attention(rank, c, "ulysses"),
        "ulysses_no_mask_contiguous": lambda: check_attention(rank, c, "ulysses", mask=None, split="contiguous"),
        "ulysses_bytes": lambda: check_bytes(rank, c, "ulysses"),
        "bad_input": lambda: check_bad_input(rank, c),
    }
    if c == 4:
        from labkit.mesh import Mesh
        cases["hybrid_causal"] = lambda: check_attention(rank, c, "hybrid")
        cases["hybrid_no_mask"] = lambda: check_attention(rank, c, "hybrid", mask=None)
        cases["hybrid_bytes"] = lambda: check_bytes(rank, c, "hybrid")
        # Mesh(4, cp=2, tp=2): cp is not innermost, the all-to-all groups are ranks 0,2 and 1,3
        cases["ulysses_cp_not_innermost"] = lambda: check_attention(rank, 2, "ulysses", mesh=Mesh(4, cp=2, tp=2))
    return run_cases(cases)


CP_SIZES = [2, 4]


@pytest.mark.exercise("seq_to_heads")
@pytest.mark.parametrize("c", CP_SIZES)
def test_seq_to_heads_gives_each_rank_its_head_group_over_the_whole_sequence(c):
    expect_case(launch_cases(run_all, c, 120), "seq_to_heads", f"c={c} seq_to_heads")


@pytest.mark.exercise("heads_to_seq")
@pytest.mark.parametrize("c", CP_SIZES)
def test_heads_to_seq_gives_each_rank_back_its_positions_of_every_head(c):
    expect_case(launch_cases(run_all, c, 120), "heads_to_seq", f"c={c} heads_to_seq")


@pytest.mark.exercise("seq_to_heads", needs=("heads_to_seq", "zigzag_split"))
@pytest.mark.parametrize("c", CP_SIZES)
def test_ulysses_attention_forward_and_grads_equal_full_attention_float64(c):
    expect_case(launch_cases(run_all, c, 120), "ulysses_causal", f"c={c} Ulysses causal")


@pytest.mark.exercise("seq_to_heads", needs=("heads_to_seq",))
@pytest.mark.parametrize("c", CP_SIZES)
def test_ulysses_attention_without_mask_on_the_contiguous_split(c):
    expect_case(launch_cases(run_all, c, 120), "ulysses_no_mask_contiguous", f"c={c} Ulysses no mask")


@pytest.mark.exercise("seq_to_heads", needs=("heads_to_seq", "zigzag_split"))
@pytest.mark.parametrize("c", CP_SIZES)
def test_ulysses_bytes_per_call_equal_eight_all_to_alls_of_c_minus_1_over_c(c):
    expect_case(launch_cases(run_all, c, 120), "ulysses_bytes", f"c={c} Ulysses bytes")


@pytest.mark.exercise("seq_to_heads")
@pytest.mark.parametrize("c", [4])
def test_seq_to_heads_heads_not_divisible_by_cp_raise_value_error(c):
    expect_case(launch_cases(run_all, c, 120), "bad_input", f"c={c} bad input")


@pytest.mark.exercise("seq_to_heads", needs=("heads_to_seq", "zigzag_split"))
def test_ulysses_on_a_mesh_whose_cp_axis_is_not_innermost():
    expect_case(launch_cases(run_all, 4, 120), "ulysses_cp_not_innermost", "Mesh(4, cp=2, tp=2) Ulysses")


@pytest.mark.exercise("seq_to_heads", needs=("heads_to_seq", "zigzag_split", "merge_partials"))
@pytest.mark.parametrize("mask", ["causal", "no_mask"])
def test_hybrid_a2a_in_pairs_ring_across_equals_full_attention_float64(mask):
    expect_case(launch_cases(run_all, 4, 120), f"hybrid_{mask}", f"hybrid {mask}")


@pytest.mark.exercise("seq_to_heads", needs=("heads_to_seq", "zigzag_split", "merge_partials"))
def test_hybrid_bytes_per_call_equal_its_all_to_alls_and_ring_by_level():
    expect_case(launch_cases(run_all, 4, 120), "hybrid_bytes", "hybrid bytes")
