"""Grading tests for notebook 11_long_sequences: GatherSequence and ScatterSequence (Megatron-SP).

Run: pytest tests/grading/test_sequence_parallel.py   (add --impl=solutions for the reference)

The block with sequence parallelism (its norms and residuals on s/t positions per rank, heads
and hidden units split as in notebook 08) is compared with the unsharded labkit block in float64
(the sharded matmuls and the collectives add in another order than one process: float64 with
assert_close's tolerances is tight). One launch per TP size (2, 4); about 20 s on 2 cores.
"""
import pytest
import torch

from labkit.grading.cases import expect_case, launch_cases, run_cases
from labkit.comm.traffic import count_traffic
from labkit.grading import impl

F64 = torch.float64


def check_pair(rank, t):
    """The two functions alone: forward values and backward = their conjugate collectives."""
    sp = impl("sequence_parallel")
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(2, 4 * t, 3, generator=g, dtype=F64) for _ in range(t)]  # every rank's tensor, known to all
    mine = full[rank].chunk(t, dim=1)[rank].clone().requires_grad_()
    gathered = sp.gather_sequence(mine)
    expected = torch.cat([f.chunk(t, dim=1)[r] for r, f in enumerate(full)], dim=1)
    torch.testing.assert_close(gathered, expected)
    gathered.backward(full[rank])  # each rank's upstream gradient: d/dmine = sum over ranks of my block
    torch.testing.assert_close(mine.grad, sum(f.chunk(t, dim=1)[rank] for f in full))
    partial = full[rank].clone().requires_grad_()
    scattered = sp.scatter_sequence(partial)
    torch.testing.assert_close(scattered, sum(full).chunk(t, dim=1)[rank])
    scattered.backward(torch.full_like(scattered, rank + 1.0))
    ones = torch.cat([torch.full((2, 4, 3), r + 1.0, dtype=F64) for r in range(t)], dim=1)
    torch.testing.assert_close(partial.grad, ones)


def check_block(rank, t, s):
    """SP block == unsharded block forward and backward; same bytes as TP, 4 collectives each way."""
    from labkit.model import build_model
    sp = impl("sequence_parallel")
    model = build_model("tiny", seed=0).double()
    block = model.layers[1]
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(2, s, 64, generator=g, dtype=F64), torch.randn(2, s, 64, generator=g, dtype=F64)
    xr = x.clone().requires_grad_()
    y_ref = block(xr, model.rope)
    y_ref.backward(dy)
    pb = sp.ParallelBlock(block, sequence_parallel=True)
    xs = x.chunk(t, dim=1)[rank].clone().requires_grad_()
    with count_traffic() as forward:
        y = pb(xs, model.rope)
    with count_traffic() as backward:
        y.backward(dy.chunk(t, dim=1)[rank])
    pb.sync_gradients()
    torch.testing.assert_close(y, y_ref.chunk(t, dim=1)[rank])
    torch.testing.assert_close(xs.grad, xr.grad.chunk(t, dim=1)[rank])
    for name in ("attention_norm", "ffn_norm"):
        torch.testing.assert_close(getattr(pb, name).weight.grad, getattr(block, name).weight.grad)
    for name, parent, dim in (("wq", "attention", 0), ("wo", "attention", 1), ("w1", "feed_forward", 0),
                              ("w2", "feed_forward", 1)):
        full_grad = getattr(getattr(block, parent), name).weight.grad
        torch.testing.assert_close(getattr(pb, name).grad, full_grad.chunk(t, dim=dim)[rank])
    size = 2 * s * 64 * 8  # bytes of the full [B, s, d] float64 activation: S of each collective
    assert forward.log() == [("all_gather_single", size), ("reduce_scatter_single", size)] * 2
    assert backward.log() == [("all_gather_single", size), ("reduce_scatter_single", size)] * 2
    regather = sp.ParallelBlock(block, sequence_parallel=True, regather=True)  # Megatron: gather again in backward
    xg = x.chunk(t, dim=1)[rank].clone().requires_grad_()
    with count_traffic() as regather_log:
        y = regather(xg, model.rope)
        y.backward(dy.chunk(t, dim=1)[rank])
    torch.testing.assert_close(y, y_ref.chunk(t, dim=1)[rank])
    torch.testing.assert_close(xg.grad, xr.grad.chunk(t, dim=1)[rank])
    torch.testing.assert_close(regather.w3.grad, block.feed_forward.w3.weight.grad.chunk(t, dim=0)[rank])
    assert sorted(regather_log.log()) == sorted(forward.log() + backward.log() + [("all_gather_single", size)] * 2)
    tp_block = sp.ParallelBlock(block, sequence_parallel=False)
    with count_traffic() as tp_traffic:
        tp_block(x.clone().requires_grad_(), model.rope).backward(dy)
    assert tp_traffic.log() == [("all_reduce", size)] * 4
    assert forward.wire() + backward.wire() == tp_traffic.wire()  # SP sends what TP sends (exact Fractions)


def check_not_divisible(rank, t):
    sp = impl("sequence_parallel")
    sp.scatter_sequence(torch.zeros(1, 2 * t, 2))  # divisible: must work
    try:
        sp.scatter_sequence(torch.zeros(1, 2 * t + 1, 2))
    except ValueError as error:
        assert f"sequence length s={2 * t + 1}" in str(error), str(error)
    else:
        raise AssertionError("no ValueError for a sequence that does not split over the TP group")


def run_all(rank, t):
    return run_cases({"pair": lambda: check_pair(rank, t), "block": lambda: check_block(rank, t, 4 * t),
                      "block_longer": lambda: check_block(rank, t, 12 * t),
                      "not_divisible": lambda: check_not_divisible(rank, t)})


TP_SIZES = [2, 4]


@pytest.mark.exercise("GatherSequence", "ScatterSequence")
@pytest.mark.parametrize("t", TP_SIZES)
def test_gather_and_scatter_sequence_forward_and_conjugate_backward(t):
    expect_case(launch_cases(run_all, t, 120), "pair", f"t={t}")


@pytest.mark.exercise("GatherSequence", "ScatterSequence")
@pytest.mark.parametrize("case", ["block", "block_longer"])
@pytest.mark.parametrize("t", TP_SIZES)
def test_sequence_parallel_block_equals_unsharded_with_tp_communication_volume(t, case):
    expect_case(launch_cases(run_all, t, 120), case, f"t={t} {case}")


@pytest.mark.exercise("ScatterSequence")
@pytest.mark.parametrize("t", TP_SIZES)
def test_scatter_sequence_length_not_divisible_by_tp_size_raises_value_error(t):
    expect_case(launch_cases(run_all, t, 120), "not_divisible", f"t={t}")
