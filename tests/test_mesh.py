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
    by_hand = Mesh(world_size, dp=2, pp=2, tp=2, groups=False)  # notebook 07: groups made elsewhere
    by_hand.add_group("pp", mesh.group("pp"))
    assert by_hand.group("pp") is mesh.group("pp")
    try:
        by_hand.add_group("tp", mesh.group("pp"))  # the wrong slice: a clear error
    except ValueError as error:
        sums["wrong"] = str(error)
    return sums


def test_groups_on_8_launched_ranks_sum_exactly_their_slices():
    results = labkit.launch(_groups_on_ranks, 8, timeout=120)
    layout = [Mesh(8, rank=r, dp=2, pp=2, tp=2) for r in range(8)]
    for rank, sums in enumerate(results):
        assert f"rank {rank}'s group along tp is {layout[rank].ranks('tp')}" in sums.pop("wrong")
        for axes, total in sums.items():
            assert total == sum(1 << r for r in layout[rank].ranks(axes)), (rank, axes)
    assert math.prod(layout[0].sizes.values()) == 8


# ---------------------------------------------------------------- neighbours along an axis (layout only)
def neighbours(axis, world_size, wrap=False, **sizes):
    """[(prev, next)] of every rank along `axis`, and its (coord, first, last)."""
    out = []
    for rank in range(world_size):
        m = Mesh(world_size, rank=rank, **sizes)
        out.append((m.prev_rank(axis, wrap=wrap), m.next_rank(axis, wrap=wrap),
                    m.coord(axis), m.is_first(axis), m.is_last(axis)))
    return out


# Written out by hand from the grid arange(world).view(...) (outermost axis first).
@pytest.mark.parametrize("axis, world, sizes, wrap, expected", [
    # pp innermost: a pipeline of 4 is ranks 0..3, neighbours are rank -/+ 1
    ("pp", 4, dict(pp=4), False,
     [(None, 1, 0, True, False), (0, 2, 1, False, False), (1, 3, 2, False, False), (2, None, 3, False, True)]),
    # pp NOT innermost: Mesh(4, pp=2, tp=2) puts stage 1 of rank 0's pipeline on rank 2
    ("pp", 4, dict(pp=2, tp=2), False,
     [(None, 2, 0, True, False), (None, 3, 0, True, False), (0, None, 1, False, True), (1, None, 1, False, True)]),
    # pp outer of ep: Mesh(6, pp=3, ep=2) puts stage s on ranks 2s and 2s+1: neighbours are rank -/+ 2
    ("pp", 6, dict(pp=3, ep=2), False,
     [(None, 2, 0, True, False), (None, 3, 0, True, False), (0, 4, 1, False, False), (1, 5, 1, False, False),
      (2, None, 2, False, True), (3, None, 2, False, True)]),
    # dp x pp (notebook 07): rows are pipelines
    ("pp", 6, dict(dp=2, pp=3), False,
     [(None, 1, 0, True, False), (0, 2, 1, False, False), (1, None, 2, False, True),
      (None, 4, 0, True, False), (3, 5, 1, False, False), (4, None, 2, False, True)]),
    ("dp", 6, dict(dp=2, pp=3), False,
     [(None, 3, 0, True, False), (None, 4, 0, True, False), (None, 5, 0, True, False),
      (0, None, 1, False, True), (1, None, 1, False, True), (2, None, 1, False, True)]),
    # a ring along cp with tp inside: Mesh(8, cp=4, tp=2): the cp ring of rank 1 is 1 -> 3 -> 5 -> 7 -> 1
    ("cp", 8, dict(cp=4, tp=2), True,
     [(6, 2, 0, True, False), (7, 3, 0, True, False), (0, 4, 1, False, False), (1, 5, 1, False, False),
      (2, 6, 2, False, False), (3, 7, 2, False, False), (4, 0, 3, False, True), (5, 1, 3, False, True)]),
    # an axis of size 1: no neighbour, or itself in a ring
    ("pp", 2, dict(dp=2), False, [(None, None, 0, True, True)] * 2),
    ("pp", 2, dict(dp=2), True, [(0, 0, 0, True, True), (1, 1, 0, True, True)]),
    # the cluster's levels: 2 nodes of 3; along "node" the same local index on the other node
    ("node", 6, dict(node=2, local=3), False,
     [(None, 3, 0, True, False), (None, 4, 0, True, False), (None, 5, 0, True, False),
      (0, None, 1, False, True), (1, None, 1, False, True), (2, None, 1, False, True)]),
    ("local", 6, dict(node=2, local=3), True,
     [(2, 1, 0, True, False), (0, 2, 1, False, False), (1, 0, 2, False, True),
      (5, 4, 0, True, False), (3, 5, 1, False, False), (4, 3, 2, False, True)]),
])
def test_neighbours_along_an_axis_are_the_hand_written_ones(axis, world, sizes, wrap, expected):
    assert neighbours(axis, world, wrap=wrap, **sizes) == expected


def test_neighbours_against_brute_force_on_every_factorisation_of_12():
    for sizes in factorisations(12):
        coords_of = brute_force(sizes)
        rank_at = {tuple(c.values()): r for r, c in coords_of.items()}
        for rank in range(12):
            mesh = Mesh(12, rank=rank, **dict(zip(AXES, sizes)))
            for i, axis in enumerate(AXES):
                here = list(coords_of[rank].values())
                for delta, got in ((-1, mesh.prev_rank(axis, wrap=True)), (1, mesh.next_rank(axis, wrap=True))):
                    there = list(here)
                    there[i] = (here[i] + delta) % sizes[i]
                    assert got == rank_at[tuple(there)], (sizes, rank, axis, delta)


def test_cluster_levels_are_their_own_vocabulary():
    mesh = Mesh(8, node=2, local=4, rank=5)
    assert mesh.axes == ("node", "local") and mesh.coords() == {"node": 1, "local": 1}
    assert mesh.ranks("local") == [4, 5, 6, 7] and mesh.ranks("node") == [1, 5]
    with pytest.raises(ValueError, match="not both in one mesh"):
        Mesh(8, node=2, tp=4, rank=0)
    with pytest.raises(ValueError, match="unknown mesh axis"):
        Mesh(8, dp=2, tp=4, rank=0).coord("local")
