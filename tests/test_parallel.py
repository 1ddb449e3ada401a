"""labkit.parallel: the one flatten / write-back, bucketing and sharding rule the parallelisms share."""
import pytest
import torch
import torch.distributed as dist

from labkit.launching.launcher import launch
from labkit.parallel.flat import allreduce_mean_, bucket_parameters, flatten, write_back
from labkit.parallel.sharding import all_gather_flat, local_shard, reduce_scatter_mean, shard_rows, shard_size


def test_flatten_pads_with_zeros_and_write_back_restores_every_tensor_exactly():
    a, b = torch.randn(2, 3, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    flat = flatten([a, b], total=12)
    assert torch.equal(flat, torch.cat([a.reshape(-1), b, torch.zeros(1, dtype=torch.float64)]))
    c, d = torch.empty_like(a), torch.empty_like(b)
    write_back(flat, [c, d])
    assert torch.equal(c, a) and torch.equal(d, b)
    with pytest.raises(ValueError, match="smaller than the 11 elements"):
        flatten([a, b], total=10)


def test_flat_shards_are_ceil_sized_disjoint_and_cover_the_padded_vector():
    flat = flatten([torch.arange(10.0)], total=shard_size(10, 4) * 4)  # 10 -> 12
    pieces = [local_shard(flat, r, 4) for r in range(4)]
    assert [p.tolist() for p in pieces] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 0, 0]]
    with pytest.raises(ValueError, match="pad it first"):
        local_shard(torch.arange(10.0), 0, 4)
    assert torch.equal(shard_rows(torch.arange(6), 1, 3), torch.tensor([2, 3]))


def test_buckets_are_reversed_bounded_and_a_large_parameter_gets_its_own():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (256, 256, 1024, 256)]  # floats: 1, 1, 4, 1 KiB
    buckets = bucket_parameters(params, bucket_size_mb=2 / 1024)  # 2 KiB
    assert [[p.numel() for p in b] for b in buckets] == [[256], [1024], [256, 256]]
    assert [p for b in buckets for p in b] == params[::-1]
    with pytest.raises(ValueError, match="must be positive"):
        bucket_parameters(params, 0)


def _collectives(rank, world_size):
    """One launch for every collective of labkit.parallel, against torch's own all-reduce / all-gather."""
    g = torch.Generator().manual_seed(rank)
    mine = [torch.randn(3, 2, generator=g, dtype=torch.float64), torch.randn(4, generator=g, dtype=torch.float64)]
    expected = []
    for t in mine:
        every = [torch.empty_like(t) for _ in range(world_size)]
        dist.all_gather(every, t)
        expected.append(torch.stack(every).sum(0) / world_size)
    allreduce_mean_(mine)
    flat = torch.randn(4 * world_size, generator=g)
    total = flat.clone()
    dist.all_reduce(total)
    try:
        reduce_scatter_mean(torch.ones(world_size + 1))
        refused = None
    except ValueError as error:
        refused = str(error)
    return dict(mean=list(zip(mine, expected)), shard=total.chunk(world_size)[rank] / world_size,
                rs=reduce_scatter_mean(flat), rs_via=reduce_scatter_mean(flat, via_allreduce=True),
                gathered=all_gather_flat(total.chunk(world_size)[rank]), total=total, refused=refused)


def test_allreduce_mean_reduce_scatter_mean_and_all_gather_flat_equal_torch_collectives():
    for out in launch(_collectives, 3, timeout=60):
        for mine, expected in out["mean"]:  # float64, the same ranks' values summed: rounding only (~1e-16)
            torch.testing.assert_close(mine, expected, rtol=0, atol=1e-14)
        # float32, 3 ranks: the sums may be ordered differently; a sum of 3 values of size ~1 differs
        # by at most a few ulps (~1e-7), far inside assert_close's float32 atol of 1e-5
        torch.testing.assert_close(out["rs"], out["shard"])
        torch.testing.assert_close(out["rs_via"], out["shard"])
        assert torch.equal(out["gathered"], out["total"])
        assert out["refused"] is not None and "pad it first" in out["refused"]
