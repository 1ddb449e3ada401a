"""One N-D device mesh with named axes: the whole topology from one grid tensor.

    from labkit.mesh import Mesh
    mesh = Mesh(8, dp=2, pp=2, tp=2)          # inside launched ranks: builds the groups
    mesh.coords()                              # {'dp': 1, 'pp': 0, 'tp': 1} for rank 5
    mesh.ranks("tp")                           # [4, 5]: this rank's tensor-parallel group
    mesh.group("dp")                           # its process group (all ranks created all groups)
    mesh.rank_of(dp=0, pp=1, tp=0)             # 2

The grid is ``torch.arange(world_size).view(*sizes)`` with the axes in the fixed order
`AXES` = (dp, pp, ep, cp, tp): ``dp`` is the outermost (slowest-varying) axis and ``tp``
the innermost, so tensor-parallel peers are neighbouring ranks (on a GPU node, GPUs joined
by the fastest links), as in Megatron-LM and picotron. Every process group is a slice of
that grid: the group along an axis is the set of ranks whose other coordinates are equal
to this rank's. Several axes at once (``mesh.group(("dp", "ep"))``) give the ranks that
differ only along those axes, e.g. every replica of a non-expert parameter in EP x DP.

Creating a process group is collective over the whole world (``dist.new_group``): every
rank must create every group, in the same order. `Mesh` does that in its constructor (when
a process group is initialised and ``groups=True``), for every single axis in `AXES`
order and then for each axis set in ``combined``; each rank keeps the groups it belongs to.
Without a process group it is the layout only (pass ``rank=``): ``group()`` then raises.

Notebook 07's learner builds the 2-D (dp, pp) case by hand (`solutions/hybrid.make_mesh`);
this is the general one that `labkit.apps.train` and the later notebooks use.
"""
from __future__ import annotations

import itertools
import math

AXES = ("dp", "pp", "ep", "cp", "tp")  # outermost first


class Mesh:
    """A rank's place in the grid ``arange(world_size).view(dp, pp, ep, cp, tp)``.

    ``Mesh(world_size, dp=1, pp=1, ep=1, cp=1, tp=1, rank=None, groups=True, combined=())``.
    Unnamed axes have size 1. Raises ValueError (before any group is created) when a size
    is not a positive int, an axis is unknown, the sizes' product is not ``world_size``,
    ``rank`` is out of range, or they disagree with the initialised process group.
    """

    def __init__(self, world_size: int, *, rank: int | None = None, groups: bool = True,
                 combined=(), **sizes):
        import torch
        import torch.distributed as dist

        unknown = sorted(set(sizes) - set(AXES))
        if unknown:
            raise ValueError(f"unknown mesh axis {unknown}: the axes are {AXES}")
        for axis, size in sizes.items():
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{axis}={size!r}: every axis size must be an int >= 1")
        self.sizes = {axis: sizes.get(axis, 1) for axis in AXES}
        product = math.prod(self.sizes.values())
        if world_size != product:
            shape = " x ".join(f"{a}={s}" for a, s in self.sizes.items() if s > 1) or "1"
            raise ValueError(f"the mesh {shape} holds {product} ranks but world_size={world_size}: "
                             "choose axis sizes whose product is the number of ranks")
        initialised = dist.is_available() and dist.is_initialized()
        if initialised:
            if dist.get_world_size() != world_size:
                raise ValueError(f"world_size={world_size} but the process group has "
                                 f"{dist.get_world_size()} ranks")
            if rank is None:
                rank = dist.get_rank()
            elif rank != dist.get_rank():
                raise ValueError(f"rank={rank} but this process is rank {dist.get_rank()}: "
                                 "leave rank=None inside a launched rank")
        elif rank is None:
            raise ValueError("no process group is initialised: pass rank=... for the layout only")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank!r} is not in range({world_size})")
        self.world_size, self.rank = world_size, rank
        self.grid = torch.arange(world_size).view(*self.sizes.values())
        axis_sets = [(a,) for a in AXES] + [self._axis_set(c) for c in combined]
        self._groups: dict[tuple, object] = {}
        if initialised and groups:
            for axes in dict.fromkeys(axis_sets):  # the same order on every rank
                self._groups[axes] = self._create_groups(axes)

    # -- layout (no process group needed)

    def coords(self, rank: int | None = None) -> dict:
        """{axis: index} of ``rank`` (default: this rank), every axis in `AXES` order."""
        rank = self.rank if rank is None else rank
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is not in range({self.world_size})")
        position = [int(i) for i in (self.grid == rank).nonzero()[0]]
        return dict(zip(AXES, position))

    def rank_of(self, **coords) -> int:
        """The global rank at these coordinates; axes left out are this rank's own."""
        unknown = sorted(set(coords) - set(AXES))
        if unknown:
            raise ValueError(f"unknown mesh axis {unknown}: the axes are {AXES}")
        where = {**self.coords(), **coords}
        for axis, index in where.items():
            if not 0 <= index < self.sizes[axis]:
                raise ValueError(f"{axis}={index} is outside the mesh ({axis} has size {self.sizes[axis]})")
        return int(self.grid[tuple(where[a] for a in AXES)])

    def ranks(self, axes, rank: int | None = None) -> list[int]:
        """The global ranks of ``rank``'s group along ``axes`` (one axis or a tuple), in grid order."""
        axes = self._axis_set(axes)
        mine = self.coords(rank)
        index = tuple(slice(None) if a in axes else mine[a] for a in AXES)
        return self.grid[index].flatten().tolist()

    def all_ranks(self, axes) -> list[list[int]]:
        """Every group along ``axes``, as lists of global ranks, in the order they are created."""
        axes = self._axis_set(axes)
        others = [range(self.sizes[a]) for a in AXES if a not in axes]
        groups = []
        for fixed in itertools.product(*others):
            it = iter(fixed)
            index = tuple(slice(None) if a in axes else next(it) for a in AXES)
            groups.append(self.grid[index].flatten().tolist())
        return groups

    def index(self, axes) -> int:
        """This rank's position inside its group along ``axes`` (its group rank there)."""
        return self.ranks(axes).index(self.rank)

    def size(self, axes) -> int:
        """How many ranks a group along ``axes`` holds."""
        return math.prod(self.sizes[a] for a in self._axis_set(axes))

    # -- process groups

    def group(self, axes):
        """This rank's process group along ``axes`` (created by the constructor)."""
        axes = self._axis_set(axes)
        if axes not in self._groups:
            if not self._groups:
                raise ValueError("this Mesh has no process groups: it was built without an initialised "
                                 "process group (or with groups=False)")
            raise ValueError(f"no group for axes {axes}: pass combined=[{axes}] to Mesh(...) so that "
                             "every rank creates it")
        return self._groups[axes]

    def _create_groups(self, axes):
        import torch.distributed as dist

        every = self.all_ranks(axes)
        if len(every) == 1:  # the axis spans the world: no new group needed
            return dist.group.WORLD
        if len(every[0]) == 1:  # a group of one per rank: each rank makes its own, no rendezvous
            return dist.new_group([self.rank], use_local_synchronization=True)
        mine = None
        for ranks in every:  # collective: all ranks, all groups, same order
            group = dist.new_group(ranks)
            if self.rank in ranks:
                mine = group
        return mine

    def _axis_set(self, axes) -> tuple:
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        unknown = sorted(set(axes) - set(AXES))
        if unknown or not axes:
            raise ValueError(f"unknown mesh axis {unknown or axes}: the axes are {AXES}")
        return tuple(a for a in AXES if a in axes)  # canonical order

    def __repr__(self) -> str:
        shape = ", ".join(f"{a}={s}" for a, s in self.sizes.items())
        return f"Mesh({self.world_size}, {shape}; rank {self.rank} at {self.coords()})"


# The one sharding rule lives in labkit.parallel.sharding; kept importable from here.
from labkit.parallel.sharding import shard_rows  # noqa: E402,F401
