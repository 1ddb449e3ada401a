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

from labkit.grading.cases import expect_case, launch_cases, run_cases
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
        torch.testing.assert_close(lse, full_lse, msg=lambda m: "merge_partials: lse over both blocks must be "
                                   f"log(e^lse1 + e^lse2) (torch.logaddexp)\n{m}")
        if torch.allclose(out, o1 + o2):
            raise AssertionError("merge_partials: the partial outputs were added as they are; each must be weighted "
                                 "by its share of the softmax denominator, e^(lse_i - lse)")
        torch.testing.assert_close(out, full_out, msg=lambda m: "merge_partials: each partial output must be "
                                   f"weighted by its share of the denominator, e^(lse_i - lse)\n{m}")
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
    torch.testing.assert_close(lse, full_lse, msg=lambda m: f"merge_partials: lse over both blocks must be "
                               f"log(e^lse1 + e^lse2) (torch.logaddexp), -inf where neither block has a key\n{m}")
    torch.testing.assert_close(out, full_out, msg=lambda m: "merge_partials: each partial output must be weighted "
                               f"by its share of the denominator, e^(lse_i - lse) (0 where lse_i = -inf)\n{m}")
    nobody = q_pos < 3
    assert torch.isneginf(lse[..., nobody]).all() and (out[..., nobody, :] == 0).all()
    empty_out, empty_lse = torch.zeros_like(o1), torch.full_like(l1, float("-inf"))  # the ring's start
    out, lse = ra.merge_partials(empty_out, empty_lse, o1, l1)
    torch.testing.assert_close(out, o1)
    torch.testing.assert_close(lse, l1)


# ----------------------------------------------------------------------------- on c ranks

def check_ring(rank, c, split, mask, s, mesh=None):
    """Forward rows, lse and the gradients of q, k, v equal full attention on one process.

    With a mesh, the ring is its cp axis (of size c) and this rank's place in it mesh.coord("cp")."""
    ra, cpm = impl("ring_attention"), impl("context_parallel")
    rank = rank if mesh is None else mesh.coord("cp")
    q, k, v, dout = qkv(s, seed=s + c)
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qf, kf, vf, is_causal=mask == "causal")
    ref.backward(dout)
    pieces = cpm.SPLITS[split](s, c, rank)
    mine = [cpm.take(t, pieces) for t in (q, k, v)]
    out, lse, ring = ra.ring_attention_forward(*mine, mesh=mesh, split=split, mask=mask, seq_len=s)
    wrong = ring_mismatch(out, q, k, v, [cpm.SPLITS[split](s, c, r) for r in range(c)], rank, mask)
    assert wrong is None, f"ring_attention_forward on rank {rank} of {c} ({split} split, mask={mask}): {wrong}"
    torch.testing.assert_close(out, cpm.take(ref.detach(), pieces))
    scores = (q @ k.transpose(-1, -2)) / 2.0  # hd = 4
    if mask == "causal":
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, cpm.take(torch.logsumexp(scores, -1), pieces, dim=-1))
    assert sum(ring.work) == cpm.attention_work(s, c, split, mask)[rank]
    leaves = [t.clone().requires_grad_() for t in mine]
    ra.ring_attention(*leaves, mesh=mesh, split=split, mask=mask).backward(cpm.take(dout, pieces))
    for leaf, full in zip(leaves, (qf, kf, vf)):
        torch.testing.assert_close(leaf.grad, cpm.take(full.grad, pieces))


def attention_over(q, k, v, q_pos, k_pos, mask):
    """Rows q_pos of softmax attention over the keys at k_pos only (0 where none is visible)."""
    scores = q[..., q_pos, :] @ k[..., k_pos, :].transpose(-1, -2) / q.shape[-1] ** 0.5
    if mask == "causal":
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    weights = torch.softmax(scores, -1).nan_to_num(0.0)  # a row with no visible key: 0
    return weights @ v[..., k_pos, :]


def ring_mismatch(out, q, k, v, pieces, rank, mask):
    """None if out is right; else the first wrong row, and which ranks' key blocks it holds, in words."""
    import itertools

    from labkit.grading import impl
    positions = impl("context_parallel").positions
    c, q_pos = len(pieces), positions(pieces[rank])
    want = attention_over(q, k, v, q_pos, torch.arange(k.shape[-2]), mask)
    if out.shape != want.shape:
        return f"the output has shape {tuple(out.shape)}, expected {tuple(want.shape)}"
    bad = (out - want).abs().amax(dim=(0, 1, 3)) > 1e-9
    if not bad.any():
        return None
    row = int(bad.nonzero()[0])
    head = f"output row {row} (global position {int(q_pos[row])}) is wrong, and {int(bad.sum()) - 1} more rows"
    step = lambda holder: (rank - holder) % c  # noqa: E731  the step at which this rank holds that block
    for size in range(c - 1, 0, -1):
        for held in itertools.combinations(range(c), size):
            keys = torch.sort(torch.cat([positions(pieces[h]) for h in held])).values
            part = attention_over(q, k, v, q_pos[row:row + 1], keys, mask)
            if torch.allclose(out[..., row:row + 1, :], part, rtol=1e-9, atol=1e-12):
                missing = sorted(set(range(c)) - set(held))
                return (f"{head}: it is attention over the key blocks of ranks {list(held)} only, missing the blocks "
                        f"of ranks {missing} (held at steps {[step(h) for h in missing]}); every step's block must "
                        "be merged in (merge_partials), and a received block used only after its request.wait()")
    return (f"{head}: it is not attention over any subset of the ranks' key blocks (max abs diff "
            f"{(out - want).abs().max().item():.3g}): a received block used before its request.wait() (the buffer "
            "is not filled yet), or partials merged with the wrong weights (merge_partials)?")


def check_overlap_timeline(rank, c):
    """The block in hand is computed while the next one travels: one F span per step, c-1 recvs."""
    from labkit.measure.timeline import Timeline
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
    shorter = [t[..., :-1, :] if rank == c - 1 else t for t in mine]  # the last rank holds one position fewer
    raises_value_error(lambda: ra.ring_attention_forward(*shorter), r"same local shapes on every rank")


def check_model(rank, c, split):
    """The tiny model with CP, trained 3 AdamW steps in float64, equals one process."""
    from labkit.mesh import Mesh
    from labkit.model import build_model
    ra, cpm = impl("ring_attention"), impl("context_parallel")
    ref, mine = build_model("tiny", seed=0).double(), build_model("tiny", seed=0).double()
    cp = cpm.ContextParallel(mine, mesh=Mesh(c, cp=c), split=split)
    opt_ref, opt = torch.optim.AdamW(ref.parameters(), lr=1e-2), torch.optim.AdamW(mine.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randint(0, 4096, (2, 8 * c), generator=g), torch.randint(0, 4096, (2, 8 * c), generator=g)
        loss_ref = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())  # float64 throughout
        loss_ref.backward()
        share = cp(x, y)
        share.backward()
        cp.sync_gradients()
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
    raises_value_error(lambda: cpm.ContextParallel(mine, mesh=Mesh(c, tp=c)), r"cp axis")


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
    if c == 4:  # two rings of 2 in Mesh(4, cp=2, tp=2): cp is not innermost, the rings are ranks 0-2 and 1-3
        from labkit.mesh import Mesh
        cases["ring_cp_not_innermost"] = lambda: check_ring(rank, 2, "zigzag", "causal", 16, Mesh(4, cp=2, tp=2))
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


@pytest.mark.exercise("ring_attention_forward", needs=("merge_partials", "zigzag_split"))
def test_ring_attention_on_a_mesh_whose_cp_axis_is_not_innermost():
    # Mesh(4, cp=2, tp=2): the ring's neighbours are global ranks 0 <-> 2 and 1 <-> 3, not rank +/- 1
    expect_case(launch_cases(run_all, 4, 120), "ring_cp_not_innermost", "Mesh(4, cp=2, tp=2) ring")
