"""labkit.mesh: the N-D mesh against brute-force enumeration, and its groups on 8 real ranks."""
import itertools
import math

import pytest
import torch
import torch.distributed as dist

import labkit
from labkit.mesh import AXES, Mesh, shard_rows


def factorisations(n: int, parts: int = len(AXES)):
    """Every ordered way to write n as a product of `parts` positive ints."""
    if parts == 1:
        yield (n,)
        return
    for first in range(1, n + 1):
        if n % first == 0:
            for rest in factorisations(n // first, parts - 1):
                yield (first, *rest)


def brute_force(sizes):
    """rank -> coords by counting through the grid in row-major order, outermost axis first."""
    return {rank: dict(zip(AXES, coords))
            for rank, coords in enumerate(itertools.product(*(range(s) for s in sizes)))}


def test_every_factorisation_of_1_to_16_ranks_into_5_axes_matches_brute_force():
    checked = 0
    for world_size in range(1, 17):
        for sizes in factorisations(world_size):
            coords_of = brute_force(sizes)
            rank_at = {tuple(c.values()): r for r, c in coords_of.items()}
            for rank in range(world_size):
                mesh = Mesh(world_size, rank=rank, **dict(zip(AXES, sizes)))
                mine = coords_of[rank]
                assert mesh.coords() == mine
                assert mesh.rank_of(**mine) == rank
                for axis in AXES:  # the group along an axis: same coordinates elsewhere
                    expected = sorted(r for r, c in coords_of.items()
                                      if all(c[a] == mine[a] for a in AXES if a != axis))
                    assert mesh.ranks(axis) == expected, (sizes, rank, axis)
                    assert mesh.index(axis) == mine[axis] and mesh.size(axis) == len(expected)
                pair = ("dp", "ep")  # several axes at once: EP x DP's non-expert replicas
                expected = sorted(r for r, c in coords_of.items() if c["pp"] == mine["pp"]
                                  and c["cp"] == mine["cp"] and c["tp"] == mine["tp"])
                assert mesh.ranks(pair) == expected
                assert mesh.rank_of(**{a: 0 for a in AXES}) == rank_at[(0,) * len(AXES)] == 0
                checked += 1
            for axis in AXES:  # the groups along an axis partition the world
                groups = Mesh(world_size, rank=0, **dict(zip(AXES, sizes))).all_ranks(axis)
                assert sorted(r for g in groups for r in g) == list(range(world_size))
    assert checked == sum(n * sum(1 for _ in factorisations(n)) for n in range(1, 17))


@pytest.mark.parametrize("bad, match", [
    (dict(world_size=8, dp=3), "holds 3 ranks but world_size=8"),
    (dict(world_size=4, dp=0, pp=4), "int >= 1"),
    (dict(world_size=4, xp=4), "unknown mesh axis"),
    (dict(world_size=4, dp=4, rank=4), "not in range"),
    (dict(world_size=4, dp=4), "no process group is initialised"),
])
def test_bad_meshes_are_clear_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        Mesh(**bad)


def test_shard_rows_is_disjoint_and_covers_the_batch_and_refuses_uneven_splits():
    x, y = torch.arange(12).view(6, 2), torch.arange(6)
    shards = [shard_rows((x, y), i, 3) for i in range(3)]
    assert torch.equal(torch.cat([s[0] for s in shards]), x) and torch.equal(torch.cat([s[1] for s in shards]), y)
    assert torch.equal(shard_rows(x, 1, 2), x[3:])
    with pytest.raises(ValueError, match="does not split into 4 equal shards"):
        shard_rows(x, 0, 4)


def _groups_on_ranks(rank, world_size):
    mesh = Mesh(world_size, dp=2, pp=2, tp=2, combined=[("dp", "pp")])
    sums = {}
    for axes in ("dp", "pp", "tp", "cp", ("dp", "pp")):
        t = torch.tensor([float(1 << rank)])  # the sum says exactly which ranks took part
        dist.all_reduce(t, group=mesh.group(axes))
        sums[axes] = int(t.item())
    return sums


def test_groups_on_8_launched_ranks_sum_exactly_their_slices():
    results = labkit.launch(_groups_on_ranks, 8, timeout=120)
    layout = [Mesh(8, rank=r, dp=2, pp=2, tp=2) for r in range(8)]
    for rank, sums in enumerate(results):
        for axes, total in sums.items():
            assert total == sum(1 << r for r in layout[rank].ranks(axes)), (rank, axes)
    assert math.prod(layout[0].sizes.values()) == 8
