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

Questions the parallelisms ask of it (layout only, no process group needed):

    mesh.coord("pp"), mesh.size("pp")         # this rank's stage, the number of stages
    mesh.prev_rank("pp"), mesh.next_rank("pp") # GLOBAL ranks of the neighbouring stages, None at the ends
    mesh.next_rank("cp", wrap=True)            # a ring: the last rank's next is the first
    mesh.is_first("pp"), mesh.is_last("pp")

Neighbours are global ranks along the axis, not rank +/- 1: in ``Mesh(4, pp=2, tp=2)`` stage 0
on rank 0 sends to stage 1 on rank 2.

Two vocabularies of axis names, one per mesh: the parallelism axes `AXES` above, or the two
levels of a cluster `LEVELS` = (node, local) for the hierarchical all-reduce of notebook 03:
``Mesh(world, node=n_nodes, local=node_size)`` puts ranks node by node (local inner: ranks
of one node are neighbours), ``group("local")`` is this rank's node and ``group("node")`` the
ranks with its local index on every node. (Physical levels are not a parallelism: they get
their own names instead of borrowing dp/tp.)

Notebook 07's learner builds the 2-D (dp, pp) groups by hand (`solutions/hybrid.make_mesh`)
and hands them to a ``Mesh(..., groups=False)`` with `Mesh.add_group`, which checks them.
"""
from __future__ import annotations

import itertools
import math

from labkit.renames import renamed_attribute

AXES = ("dp", "pp", "ep", "cp", "tp")  # outermost first
LEVELS = ("node", "local")  # a cluster's two levels, outermost first (the other vocabulary)


class Mesh:
    """A rank's place in the grid ``arange(world_size).view(dp, pp, ep, cp, tp)``.

    ``Mesh(world_size, dp=1, pp=1, ep=1, cp=1, tp=1, rank=None, groups=True, combined=())``,
    or ``Mesh(world_size, node=n, local=l, ...)`` (the `LEVELS` vocabulary; one or the other).
    Unnamed axes have size 1; ``mesh.axes`` is the vocabulary in use. Raises ValueError (before any group is created) when a size
    is not a positive int, an axis is unknown, the sizes' product is not ``world_size``,
    ``rank`` is out of range, or they disagree with the initialised process group.
    """
    # hybrid.Mesh's fields and properties before it became this class, for one release (labkit/renames.py)
    is_first_stage = renamed_attribute("Mesh.is_first_stage")
    is_last_stage = renamed_attribute("Mesh.is_last_stage")
    dp_rank = renamed_attribute("Mesh.dp_rank")
    pp_rank = renamed_attribute("Mesh.pp_rank")
    dp = renamed_attribute("Mesh.dp")
    pp = renamed_attribute("Mesh.pp")
    dp_group = renamed_attribute("Mesh.dp_group")
    pp_group = renamed_attribute("Mesh.pp_group")
    dp_ranks = renamed_attribute("Mesh.dp_ranks")
    pipeline_ranks = renamed_attribute("Mesh.pipeline_ranks")


    def __init__(self, world_size: int, *, rank: int | None = None, groups: bool = True,
                 combined=(), **sizes):
        import torch.distributed as dist

        self.axes = LEVELS if set(sizes) & set(LEVELS) else AXES
        unknown = sorted(set(sizes) - set(self.axes))
        if unknown:
            raise ValueError(f"unknown mesh axis {unknown}: the axes are {AXES}, or {LEVELS} for a "
                             "cluster's levels (not both in one mesh)")
        for axis, size in sizes.items():
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{axis}={size!r}: every axis size must be an int >= 1")
        self.sizes = {axis: sizes.get(axis, 1) for axis in self.axes}
        product = math.prod(self.sizes.values())
        if world_size != product:
            shape = " x ".join(f"{a}={s}" for a, s in self.sizes.items() if s > 1 or a in sizes) or "1"
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
        # row-major strides of the grid: the layout is plain integer arithmetic, so that it works the
        # same under torch's FakeTensorMode (labkit.scale simulates a rank with fake tensors)
        self._strides = {a: math.prod(list(self.sizes.values())[i + 1:]) for i, a in enumerate(self.axes)}
        axis_sets = [(a,) for a in self.axes] + [self._axis_set(c) for c in combined]
        self._groups: dict[tuple, object] = {}
        if initialised and groups:
            for axes in dict.fromkeys(axis_sets):  # the same order on every rank
                self._groups[axes] = self._create_groups(axes)

    # -- layout (no process group needed)

    def coords(self, rank: int | None = None) -> dict:
        """{axis: index} of ``rank`` (default: this rank), every axis in ``self.axes`` order."""
        rank = self.rank if rank is None else rank
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is not in range({self.world_size})")
        return {a: rank // self._strides[a] % self.sizes[a] for a in self.axes}

    @property
    def grid(self):
        """The grid ``torch.arange(world_size).view(*sizes)`` (for display; the layout does not need it)."""
        import torch
        return torch.arange(self.world_size).view(*self.sizes.values())

    def rank_of(self, **coords) -> int:
        """The global rank at these coordinates; axes left out are this rank's own."""
        unknown = sorted(set(coords) - set(self.axes))
        if unknown:
            raise ValueError(f"unknown mesh axis {unknown}: the axes are {self.axes}")
        where = {**self.coords(), **coords}
        for axis, index in where.items():
            if not 0 <= index < self.sizes[axis]:
                raise ValueError(f"{axis}={index} is outside the mesh ({axis} has size {self.sizes[axis]})")
        return sum(where[a] * self._strides[a] for a in self.axes)

    def ranks(self, axes, rank: int | None = None) -> list[int]:
        """The global ranks of ``rank``'s group along ``axes`` (one axis or a tuple), in grid order."""
        axes = self._axis_set(axes)
        mine = self.coords(rank)
        base = sum(mine[a] * self._strides[a] for a in self.axes if a not in axes)
        return [base + sum(i * self._strides[a] for a, i in zip(axes, index))  # grid order: row-major
                for index in itertools.product(*(range(self.sizes[a]) for a in axes))]

    def all_ranks(self, axes) -> list[list[int]]:
        """Every group along ``axes``, as lists of global ranks, in the order they are created."""
        axes = self._axis_set(axes)
        others = [a for a in self.axes if a not in axes]
        groups = []
        for fixed in itertools.product(*(range(self.sizes[a]) for a in others)):
            first = sum(i * self._strides[a] for a, i in zip(others, fixed))
            groups.append(self.ranks(axes, first))
        return groups

    def index(self, axes) -> int:
        """This rank's position inside its group along ``axes`` (its group rank there)."""
        return self.ranks(axes).index(self.rank)

    def size(self, axes) -> int:
        """How many ranks a group along ``axes`` holds."""
        return math.prod(self.sizes[a] for a in self._axis_set(axes))

    def coord(self, axis: str) -> int:
        """This rank's index along one axis (its stage along ``"pp"``, its replica along ``"dp"``)."""
        return self.coords()[self._one_axis(axis)]

    def is_first(self, axis: str) -> bool:
        """Whether this rank is at index 0 along ``axis`` (the first pipeline stage along ``"pp"``)."""
        return self.coord(axis) == 0

    def is_last(self, axis: str) -> bool:
        """Whether this rank is at the last index along ``axis``."""
        return self.coord(axis) == self.sizes[self._one_axis(axis)] - 1

    def prev_rank(self, axis: str, *, wrap: bool = False) -> int | None:
        """GLOBAL rank one step back along ``axis``; None on the first, unless ``wrap`` (a ring)."""
        return self._step(axis, -1, wrap)

    def next_rank(self, axis: str, *, wrap: bool = False) -> int | None:
        """GLOBAL rank one step on along ``axis``; None on the last, unless ``wrap`` (a ring)."""
        return self._step(axis, +1, wrap)

    def _step(self, axis, delta, wrap):
        axis = self._one_axis(axis)
        n, at = self.sizes[axis], self.coord(axis) + delta
        if not 0 <= at < n and not wrap:
            return None
        return self.rank_of(**{axis: at % n})

    # -- process groups

    def group(self, axes):
        """This rank's process group along ``axes`` (created by the constructor, or `add_group`).

        An axis set that spans the whole world gives the default group even without ``groups``.
        """
        import torch.distributed as dist

        axes = self._axis_set(axes)
        if axes not in self._groups and self.size(axes) == self.world_size and dist.is_initialized():
            return dist.group.WORLD
        if axes not in self._groups:
            if not self._groups:
                raise ValueError("this Mesh has no process groups: it was built without an initialised "
                                 "process group (or with groups=False)")
            raise ValueError(f"no group for axes {axes}: pass combined=[{axes}] to Mesh(...) so that "
                             "every rank creates it")
        return self._groups[axes]

    def add_group(self, axes, group) -> None:
        """Use ``group`` (made by hand with ``dist.new_group``) as this rank's group along ``axes``.

        For a mesh built with ``groups=False`` whose groups its user creates (notebook 07).
        Raises ValueError when the group's ranks are not this rank's slice of the grid along ``axes``.
        """
        import torch.distributed as dist

        axes = self._axis_set(axes)
        got, want = dist.get_process_group_ranks(group), self.ranks(axes)
        if sorted(got) != want:
            raise ValueError(f"the group given for {'/'.join(axes)} holds ranks {sorted(got)}, but rank "
                             f"{self.rank}'s group along {'/'.join(axes)} is {want}: the ranks whose other "
                             f"coordinates equal its own {self.coords()} in arange({self.world_size})"
                             f".view({', '.join(f'{a}={n}' for a, n in self.sizes.items())})")
        self._groups[axes] = group

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
        unknown = sorted(set(axes) - set(self.axes))
        if unknown or not axes:
            raise ValueError(f"unknown mesh axis {unknown or axes}: the axes are {self.axes}")
        return tuple(a for a in self.axes if a in axes)  # canonical order

    def _one_axis(self, axis) -> str:
        if not isinstance(axis, str):
            raise ValueError(f"{axis!r}: name one axis, such as 'pp'")
        return self._axis_set(axis)[0]

    def __repr__(self) -> str:
        shape = ", ".join(f"{a}={s}" for a, s in self.sizes.items())
        return f"Mesh({self.world_size}, {shape}; rank {self.rank} at {self.coords()})"


# The one sharding rule lives in labkit.parallel.sharding; kept importable from here.
from labkit.parallel.sharding import shard_rows  # noqa: E402,F401
