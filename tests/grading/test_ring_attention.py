"""Grading tests for notebook 11_long_sequences: merge_partials, ring_attention_forward (and with
zigzag_split, the whole model with context parallelism).

Run: pytest tests/grading/test_ring_attention.py   (add --impl=solutions for the reference)

Ring attention sums the softmax over key blocks in another order than one process does, so
every equality with full attention is proven in float64 with assert_close's float64
tolerances (rtol 1e-7, atol 1e-7: about 1e9 times the rounding of a few dozen float64 terms,
far below any real mistake such as a wrong mask or a lost block). One launch per CP size (2, 4)
runs every multi-rank case. About 40 s on 2 cores.
"""
import pytest
import torch
import torch.nn.functional as F

from labkit.cases import expect_case, launch_cases, run_cases
from labkit.grading import impl

F64 = torch.float64


def raises_value_error(fn, pattern):
    """Like pytest.raises, for inside a rank (pytest's failure is not an Exception: run_cases would miss it)."""
    import re
    try:
        fn()
    except ValueError as error:
        assert re.search(pattern, str(error)), f"the message {str(error)!r} does not match {pattern!r}"
        return
    raise AssertionError(f"no ValueError (expected one matching {pattern!r})")


def qkv(s, seed=0, shape=(2, 3), hd=4):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, s, hd, generator=g, dtype=F64) for _ in range(4)]  # q, k, v, dout


# ----------------------------------------------------------------------------- one process

@pytest.mark.exercise("merge_partials")
@pytest.mark.parametrize("cut", [1, 5, 9])
def test_merge_partials_of_two_key_blocks_equals_attention_over_both(cut):
    ra, cpm = impl("ring_attention"), impl("context_parallel")
    q, k, v, _ = qkv(10)
    q = q[..., :7, :]
    full_out, full_lse = ra.block_attention(q, k, v)
    o1, l1 = ra.block_attention(q, k[..., :cut, :], v[..., :cut, :])
    o2, l2 = ra.block_attention(q, k[..., cut:, :], v[..., cut:, :])
    for out, lse in (ra.merge_partials(o1, l1, o2, l2), ra.merge_partials(o2, l2, o1, l1)):
        torch.testing.assert_close(out, full_out)
        torch.testing.assert_close(lse, full_lse)
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))


@pytest.mark.exercise("merge_partials")
def test_merge_partials_fully_masked_rows_in_one_block_and_in_both():
    ra, cpm = impl("ring_attention"), impl("context_parallel")
    q, k, v, _ = qkv(8)
    q_pos, k_pos = torch.tensor([0, 1, 5, 6, 7, 2, 3, 4]), torch.arange(8) + 3  # query 0..2 see no key at all
    full_out, full_lse = ra.block_attention(q, k, v, q_pos, k_pos)
    o1, l1 = ra.block_attention(q, k[..., :3, :], v[..., :3, :], q_pos, k_pos[:3])
    o2, l2 = ra.block_attention(q, k[..., 3:, :], v[..., 3:, :], q_pos, k_pos[3:])
    hidden = q_pos < 6  # the second block's keys start at 6: 6 of the 8 rows see none of them
    assert torch.isneginf(l2[..., hidden]).all() and hidden.sum() == 6
    out, lse = ra.merge_partials(o1, l1, o2, l2)
    assert not out.isnan().any() and not lse.isnan().any(), "a fully masked row must not give NaN"
    torch.testing.assert_close(out, full_out)
    torch.testing.assert_close(lse, full_lse)
    nobody = q_pos < 3
    assert torch.isneginf(lse[..., nobody]).all() and (out[..., nobody, :] == 0).all()
    empty_out, empty_lse = torch.zeros_like(o1), torch.full_like(l1, float("-inf"))  # the ring's start
    out, lse = ra.merge_partials(empty_out, empty_lse, o1, l1)
    torch.testing.assert_close(out, o1)
    torch.testing.assert_close(lse, l1)


# ----------------------------------------------------------------------------- on c ranks

def check_ring(rank, c, split, mask, s):
    """Forward rows, lse and the gradients of q, k, v equal full attention on one process."""
    ra, cpm = impl("ring_attention"), impl("context_parallel")
    q, k, v, dout = qkv(s, seed=s + c)
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qf, kf, vf, is_causal=mask == "causal")
    ref.backward(dout)
    pieces = cpm.SPLITS[split](s, c, rank)
    mine = [cpm.take(t, pieces) for t in (q, k, v)]
    out, lse, ring = ra.ring_attention_forward(*mine, split=split, mask=mask, seq_len=s)
    torch.testing.assert_close(out, cpm.take(ref.detach(), pieces))
    scores = (q @ k.transpose(-1, -2)) / 2.0  # hd = 4
    if mask == "causal":
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, cpm.take(torch.logsumexp(scores, -1), pieces, dim=-1))
    assert sum(ring.work) == cpm.attention_work(s, c, split, mask)[rank]
    leaves = [t.clone().requires_grad_() for t in mine]
    ra.ring_attention(*leaves, split=split, mask=mask).backward(cpm.take(dout, pieces))
    for leaf, full in zip(leaves, (qf, kf, vf)):
        torch.testing.assert_close(leaf.grad, cpm.take(full.grad, pieces))


def check_overlap_timeline(rank, c):
    """The block in hand is computed while the next one travels: one F span per step, c-1 recvs."""
    from labkit.timeline import Timeline
    ra, cpm = impl("ring_attention"), impl("context_parallel")
    tl = Timeline()
    q, k, v, _ = qkv(4 * c)
    ra.ring_attention_forward(*(cpm.take(t, cpm.zigzag_split(4 * c, c, rank)) for t in (q, k, v)), timeline=tl)
    assert [s.mb for s in tl.spans if s.kind == "F"] == list(range(c))
    recvs = [s for s in tl.spans if s.kind == "recv"]
    computes = {s.mb: s for s in tl.spans if s.kind == "F"}
    assert len(recvs) == c - 1
    for r in recvs:  # issued before the step's compute began, completed after it ended
        assert r.start <= computes[r.mb].start and r.end >= computes[r.mb].end


def check_bad_input(rank, c):
    ra, cpm = impl("ring_attention"), impl("context_parallel")
    q, k, v, _ = qkv(4 * c)
    mine = [cpm.take(t, cpm.zigzag_split(4 * c, c, rank)) for t in (q, k, v)]
    ra.ring_attention_forward(*mine)  # good input works first
    raises_value_error(lambda: ra.ring_attention_forward(*mine, mask="sliding"), r"mask='sliding'.*'causal'")
    raises_value_error(lambda: ra.ring_attention_forward(*mine, seq_len=4 * c * 2), rf"CP group has {c} ranks.*cp={c}")


def check_model(rank, c, split):
    """The tiny model with CP, trained 3 AdamW steps in float64, equals one process."""
    from labkit.mesh import Mesh
    from labkit.model import build_model
    ra, cpm = impl("ring_attention"), impl("context_parallel")
    ref, mine = build_model("tiny", seed=0).double(), build_model("tiny", seed=0).double()
    cp = cpm.ContextParallel(mine, Mesh(c, cp=c), split=split)
    opt_ref, opt = torch.optim.AdamW(ref.parameters(), lr=1e-2), torch.optim.AdamW(mine.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randint(0, 4096, (2, 8 * c), generator=g), torch.randint(0, 4096, (2, 8 * c), generator=g)
        loss_ref = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())  # float64 throughout
        loss_ref.backward()
        share = cp(x, y)
        share.backward()
        cp.allreduce_gradients()
        total = share.detach().clone()
        torch.distributed.all_reduce(total)
        torch.testing.assert_close(total, loss_ref.detach())
        for p, q in zip(ref.parameters(), mine.parameters()):
            torch.testing.assert_close(q.grad, p.grad)
        opt_ref.step(), opt.step(), opt_ref.zero_grad(), opt.zero_grad()
    for (name, p), q in zip(ref.named_parameters(), mine.parameters()):
        torch.testing.assert_close(q, p, msg=lambda m: f"{name}: {m}")
    odd, what = 4 * c + 1, ("2c" if split == "zigzag" else "c")
    raises_value_error(lambda: cp(x[:, :odd], y[:, :odd]), rf"s={odd} does not split into {what}=")
    raises_value_error(lambda: cpm.ContextParallel(mine, Mesh(c, tp=c)), r"cp axis")


def run_all(rank, c):
    cases = {}
    for split in ("zigzag", "contiguous"):
        for mask in ("causal", None):
            cases[f"ring_{split}_{mask}"] = lambda split=split, mask=mask: check_ring(rank, c, split, mask, 8 * c)
    cases["ring_zigzag_long_sequence"] = lambda: check_ring(rank, c, "zigzag", "causal", 64)
    cases["overlap"] = lambda: check_overlap_timeline(rank, c)
    cases["bad_input"] = lambda: check_bad_input(rank, c)
    cases["model_zigzag"] = lambda: check_model(rank, c, "zigzag")
    cases["model_contiguous"] = lambda: check_model(rank, c, "contiguous")
    return run_cases(cases)


CP_SIZES = [2, 4]


@pytest.mark.exercise("ring_attention_forward", needs=("merge_partials", "zigzag_split"))
@pytest.mark.parametrize("c", CP_SIZES)
@pytest.mark.parametrize("mask", ["causal", None])
def test_ring_attention_zigzag_forward_lse_and_grads_equal_full_attention(c, mask):
    expect_case(launch_cases(run_all, c, 120), f"ring_zigzag_{mask}", f"c={c} zigzag mask={mask}")


@pytest.mark.exercise("ring_attention_forward", needs=("merge_partials",))
@pytest.mark.parametrize("c", CP_SIZES)
@pytest.mark.parametrize("mask", ["causal", None])
def test_ring_attention_contiguous_split_equals_full_attention(c, mask):
    expect_case(launch_cases(run_all, c, 120), f"ring_contiguous_{mask}", f"c={c} contiguous mask={mask}")


@pytest.mark.exercise("ring_attention_forward", needs=("merge_partials", "zigzag_split"))
@pytest.mark.parametrize("c", CP_SIZES)
def test_ring_attention_longer_sequence_64_tokens(c):
    expect_case(launch_cases(run_all, c, 120), "ring_zigzag_long_sequence", f"c={c} s=64")


@pytest.mark.exercise("ring_attention_forward")
@pytest.mark.parametrize("c", CP_SIZES)
def test_ring_attention_forward_overlaps_each_recv_with_the_step_compute(c):
    expect_case(launch_cases(run_all, c, 120), "overlap", f"c={c} overlap")


@pytest.mark.exercise("ring_attention_forward")
@pytest.mark.parametrize("c", CP_SIZES)
def test_ring_attention_bad_mask_and_cp_size_not_matching_raise_value_error(c):
    expect_case(launch_cases(run_all, c, 120), "bad_input", f"c={c} bad input")


@pytest.mark.exercise("ring_attention_forward", needs=("merge_partials", "zigzag_split"))
@pytest.mark.parametrize("split", ["zigzag", "contiguous"])
@pytest.mark.parametrize("c", CP_SIZES)
def test_context_parallel_tiny_model_trained_3_steps_equals_one_process_float64(c, split):
    expect_case(launch_cases(run_all, c, 120), f"model_{split}", f"c={c} model {split}")
