"""The given helpers of notebook 09 (solutions/zero.py, copied unchanged into exercises/ by stubgen):
`reduce_scatter_mean` and `all_gather_flat`. Not graded: they are not exercises, so they pass on the
untouched stubs; tested here so that a learner who relies on them relies on something proven.
"""
import pytest
import torch

from labkit.grading.cases import launch_timeout
from labkit.grading import impl
from labkit.launching.launcher import launch

TIMEOUT = launch_timeout(20)


def _collectives(rank, world):
    zero = impl("zero", "solutions")
    torch.manual_seed(rank)
    flat = torch.randn(4 * world)
    total = flat.clone()
    torch.distributed.all_reduce(total)
    mine = total.chunk(world)[rank] / world
    # float32, 3 ranks: the sums may be ordered differently; a sum of 3 values of size ~1 differs
    # by at most a few ulps (~1e-7), far inside assert_close's float32 atol of 1e-5
    torch.testing.assert_close(zero.reduce_scatter_mean(flat), mine)
    torch.testing.assert_close(zero.reduce_scatter_mean(flat, via_allreduce=True), mine)
    torch.testing.assert_close(zero.all_gather_flat(total.chunk(world)[rank]), total)
    return True


def test_reduce_scatter_mean_and_all_gather_equal_torch_all_reduce():
    assert launch(_collectives, 3, timeout=TIMEOUT) == [True] * 3


def _bad_length(rank, world):
    impl("zero", "solutions").reduce_scatter_mean(torch.ones(3))


def test_reduce_scatter_mean_length_not_divisible_raises():
    with pytest.raises(Exception, match="ValueError.*pad it first"):
        launch(_bad_length, 2, timeout=TIMEOUT)
