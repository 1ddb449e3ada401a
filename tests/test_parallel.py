"""labkit.parallel: the one flatten / write-back, bucketing and sharding rule the parallelisms share."""
import pytest
import torch
import torch.distributed as dist

from labkit.launch import launch
from labkit.parallel.flat import allreduce_mean_, bucket_parameters, flatten, write_back
from labkit.parallel.sharding import local_shard, shard_rows, shard_size


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


def _mean(rank, world_size):
    g = torch.Generator().manual_seed(rank)
    mine = [torch.randn(3, 2, generator=g, dtype=torch.float64), torch.randn(4, generator=g, dtype=torch.float64)]
    expected = []
    for t in mine:
        every = [torch.empty_like(t) for _ in range(world_size)]
        dist.all_gather(every, t)
        expected.append(torch.stack(every).mean(0))
    allreduce_mean_(mine)
    return [(m, e) for m, e in zip(mine, expected)]


def test_allreduce_mean_equals_the_mean_of_every_rank_tensor():
    for pairs in launch(_mean, 2, timeout=60):
        for mine, expected in pairs:  # float64: a sum of two terms then /2 is exact in both orders
            torch.testing.assert_close(mine, expected, rtol=0, atol=1e-15)
