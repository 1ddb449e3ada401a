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

Process groups: `labkit.mesh_groups` (creating them is collective: every rank creates every group).

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

**Folded axes** (notebook 14's composition; torchtitan's ``ParallelDims.build_mesh``). Besides the grid's
axes, a mesh answers for names that are slices of the SAME grid:
``batch``        the data-parallel ranks (different rows): torchtitan's "batch", dp_replicate x dp_shard;
``dp_replicate`` / ``dp_shard``  HSDP's split of the data ranks (``dp_replicate=R``: replicas outermost,
                 shards inside), torchtitan's names; without HSDP dp_replicate has size 1;
``efsdp``        the ranks that hold the SAME experts among those EP is folded over (torchtitan's name).
``Mesh(world, dp=D, pp=P, cp=C, tp=T, ep=E, ep_over=("dp", "cp"))`` folds EP over data and context ranks
as torchtitan does: the ranks of the folded axes (dp_shard, cp, tp among ``ep_over``) are flattened in
grid order and reshaped into (efsdp, ep), ep innermost, so world_size = D P C T and ep is NOT a grid
axis. Without ``ep_over``, ``ep`` is a grid axis of its own (world_size = D P E C T): EP borrowing from
the data ranks, ``ep_over == ("dp",)``, the batch ranks ``("dp", "ep")``. Internally every name is a
product of "atoms": the grid's axes, one of them split in two where ep (or HSDP) cuts it; a group is
the ranks that differ only along its names' atoms, so two names for the same ranks share one group.
ep must therefore be a divisor of the innermost folded axis, or that axis times a divisor of the next
(ValueError otherwise: with power-of-two sizes it always is).

Notebook 07's learner builds the 2-D (dp, pp) groups by hand (`solutions/hybrid.make_mesh`)
and hands them to a ``Mesh(..., groups=False)`` with `Mesh.add_group`, which checks them.
"""
from __future__ import annotations

import itertools
import math

from labkit.renames import renamed_attribute

AXES = ("dp", "pp", "ep", "cp", "tp")  # outermost first
LEVELS = ("node", "local")  # a cluster's two levels, outermost first (the other vocabulary)
from labkit.mesh_folding import FOLDABLE, FOLDED, build_atoms, fold_ep  # noqa: E402,F401 (folded names)
from labkit.mesh_groups import MeshGroups  # noqa: E402


class Mesh(MeshGroups):
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
                 combined=(), ep_over=None, dp_replicate: int = 1, **sizes):
        import torch.distributed as dist

        self.axes = LEVELS if set(sizes) & set(LEVELS) else AXES
        unknown = sorted(set(sizes) - set(self.axes))
        if unknown:
            raise ValueError(f"unknown mesh axis {unknown}: the axes are {AXES}, or {LEVELS} for a "
                             "cluster's levels (not both in one mesh)")
        for axis, size in {**sizes, "dp_replicate": dp_replicate}.items():
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{axis}={size!r}: every axis size must be an int >= 1")
        self.sizes = {axis: sizes.get(axis, 1) for axis in self.axes}
        grid = dict(self.sizes)
        if ep_over is not None or dp_replicate > 1:
            if self.axes != AXES:
                raise ValueError("ep_over= and dp_replicate= are for the parallelism axes, not a cluster's levels")
        if ep_over is not None:
            ep_over = (ep_over,) if isinstance(ep_over, str) else tuple(ep_over)
            if not ep_over or len(set(ep_over)) != len(ep_over) or set(ep_over) - set(FOLDABLE):
                raise ValueError(f"ep_over={ep_over!r}: name the axes EP is folded over, among {FOLDABLE} "
                                 "(the ranks that hold different tokens), such as ('dp', 'cp')")
            ep_over = tuple(a for a in FOLDABLE if a in ep_over)
            grid["ep"] = 1  # folded: ep is a slice of the folded axes, not an axis of the grid
        if grid.get("dp", 1) % dp_replicate:
            raise ValueError(f"dp_replicate={dp_replicate} does not divide the mesh's dp={grid['dp']}: "
                             "HSDP splits the data-parallel ranks into replicas x shards")
        product = math.prod(grid.values())
        if world_size != product:
            shape = " x ".join(f"{a}={s}" for a, s in grid.items() if s > 1 or a in sizes) or "1"
            folded = f" (ep={self.sizes['ep']} folded over {ep_over}: not in the product)" if ep_over else ""
            raise ValueError(f"the mesh {shape} holds {product} ranks but world_size={world_size}{folded}: "
                             "choose axis sizes whose product is the number of ranks")
        initialised = dist.is_available() and dist.is_initialized()
        if not groups and rank is not None:
            initialised = False  # the layout of any rank, in any process: nothing to agree with
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
        self.ep_over = (ep_over or ("dp",)) if self.axes == AXES else None
        self.dp_replicate = dp_replicate
        self.grid_axes = tuple(a for a in self.axes if not (a == "ep" and ep_over))  # a folded ep is no grid axis
        self._grid_sizes = grid
        self._build_atoms(grid, ep_over, dp_replicate)
        axis_sets = [(a,) for a in self.axes] + list(combined)
        self._groups: dict[tuple, object] = {}
        if initialised and groups:
            for key in dict.fromkeys(self._key(axes) for axes in axis_sets):  # the same order on every rank
                self._groups[key] = self._create_groups(key)

    def _build_atoms(self, grid: dict, ep_over, dp_replicate: int) -> None:
        """The atoms, their row-major strides, and every name as atoms (`labkit.mesh_folding.build_atoms`)."""
        atoms, self._names = build_atoms(self.axes, grid, self.sizes.get("ep", 1), ep_over, dp_replicate,
                                         parallelism=self.axes == AXES)
        self._atom_sizes = dict(atoms)
        self._atoms = [a for a, _ in atoms]
        self._strides = {a: math.prod(n for _, n in atoms[i + 1:]) for i, (a, _) in enumerate(atoms)}

    # -- layout (no process group needed)

    @property
    def names(self) -> tuple:
        """Every name this mesh answers for: its axes, then the folded names (batch, dp_replicate, dp_shard, efsdp)."""
        return tuple(self.axes) + tuple(n for n in FOLDED if n in self._names)

    def atoms(self, axes) -> tuple:
        """The grid atoms (axes, or their outer/inner parts where HSDP or a folded ep cuts one) that the
        names ``axes`` span, in grid order. Two axis sets with the same atoms have the same groups."""
        return self._key(axes, live=False)

    def coords(self, rank: int | None = None) -> dict:
        """{axis: index} of ``rank`` (default: this rank), every axis in ``self.axes`` order."""
        rank = self.rank if rank is None else rank
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is not in range({self.world_size})")
        return {a: self._coord(a, rank) for a in self.axes}

    def _coord(self, name: str, rank: int) -> int:
        index = 0
        for atom in self._names.get(name, (name,)):
            index = index * self._atom_sizes[atom] + rank // self._strides[atom] % self._atom_sizes[atom]
        return index

    @property
    def grid(self):
        """The grid ``torch.arange(world_size).view(*sizes)`` (for display; the layout does not need it).
        A folded ep is not a grid axis: its size there is 1."""
        import torch
        return torch.arange(self.world_size).view(*self._grid_sizes.values())

    def rank_of(self, **coords) -> int:
        """The global rank at these coordinates (any names of ``self.names``); those left out are this rank's own."""
        unknown = sorted(set(coords) - set(self.names))
        if unknown:
            raise ValueError(f"unknown mesh axis {unknown}: the axes are {self.names}")
        at = {a: self.rank // self._strides[a] % n for a, n in self._atom_sizes.items()}
        for name, index in coords.items():
            if not 0 <= index < self.size(name):
                raise ValueError(f"{name}={index} is outside the mesh ({name} has size {self.size(name)})")
            for atom in reversed(self._names[name]):  # row-major: the last atom varies fastest
                index, at[atom] = divmod(index, self._atom_sizes[atom])
        return sum(at[a] * self._strides[a] for a in self._atoms)

    def ranks(self, axes, rank: int | None = None) -> list[int]:
        """The global ranks of ``rank``'s group along ``axes`` (one axis or a tuple), in grid order."""
        rank = self.rank if rank is None else rank
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is not in range({self.world_size})")
        return self._ranks(self._key(axes), rank)

    def _ranks(self, key: tuple, rank: int) -> list[int]:
        base = sum(rank // self._strides[a] % self._atom_sizes[a] * self._strides[a] for a in self._atoms if a not in key)
        return [base + sum(i * self._strides[a] for a, i in zip(key, index))  # grid order: row-major
                for index in itertools.product(*(range(self._atom_sizes[a]) for a in key))]

    def all_ranks(self, axes) -> list[list[int]]:
        """Every group along ``axes``, as lists of global ranks, in the order they are created."""
        return self._all_ranks(self._key(axes))

    def _all_ranks(self, key: tuple) -> list[list[int]]:
        others = [a for a in self._atoms if a not in key]
        groups = []
        for fixed in itertools.product(*(range(self._atom_sizes[a]) for a in others)):
            first = sum(i * self._strides[a] for a, i in zip(others, fixed))
            groups.append(self._ranks(key, first))
        return groups

    def index(self, axes) -> int:
        """This rank's position inside its group along ``axes`` (its group rank there)."""
        return self.ranks(axes).index(self.rank)

    def size(self, axes) -> int:
        """How many ranks a group along ``axes`` holds."""
        return math.prod(self._atom_sizes[a] for a in self._key(axes))

    def coord(self, axis: str) -> int:
        """This rank's index along one axis (its stage along ``"pp"``, its replica along ``"dp"``)."""
        return self._coord(self._one_axis(axis), self.rank)

    def is_first(self, axis: str) -> bool:
        """Whether this rank is at index 0 along ``axis`` (the first pipeline stage along ``"pp"``)."""
        return self.coord(axis) == 0

    def is_last(self, axis: str) -> bool:
        """Whether this rank is at the last index along ``axis``."""
        return self.coord(axis) == self.size(axis) - 1

    def prev_rank(self, axis: str, *, wrap: bool = False) -> int | None:
        """GLOBAL rank one step back along ``axis``; None on the first, unless ``wrap`` (a ring)."""
        return self._step(axis, -1, wrap)

    def next_rank(self, axis: str, *, wrap: bool = False) -> int | None:
        """GLOBAL rank one step on along ``axis``; None on the last, unless ``wrap`` (a ring)."""
        return self._step(axis, +1, wrap)

    def _step(self, axis, delta, wrap):
        axis = self._one_axis(axis)
        n, at = self.size(axis), self.coord(axis) + delta
        if not 0 <= at < n and not wrap:
            return None
        return self.rank_of(**{axis: at % n})

    def _axis_set(self, axes) -> tuple:
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        unknown = sorted(a for a in set(axes) if a not in self._names and a not in self._atom_sizes)
        if unknown:  # () is allowed: the group of this rank alone
            raise ValueError(f"unknown mesh axis {unknown}: the axes are {self.names}")
        order = list(self.names) + self._atoms
        return tuple(sorted(dict.fromkeys(axes), key=order.index))  # canonical order

    def _key(self, axes, live: bool = True) -> tuple:
        """The atoms ``axes`` span, in grid order (``live``: those of size > 1 only, the group's identity)."""
        spanned = {x for a in self._axis_set(axes) for x in self._names.get(a, (a,))}
        return tuple(a for a in self._atoms if a in spanned and (self._atom_sizes[a] > 1 or not live))

    def _one_axis(self, axis) -> str:
        if not isinstance(axis, str):
            raise ValueError(f"{axis!r}: name one axis, such as 'pp'")
        return self._axis_set(axis)[0]

    def __repr__(self) -> str:
        shape = ", ".join(f"{a}={s}" for a, s in self.sizes.items())
        return f"Mesh({self.world_size}, {shape}; rank {self.rank} at {self.coords()})"


# The one sharding rule lives in labkit.parallel.sharding; kept importable from here.
from labkit.parallel.sharding import shard_rows  # noqa: E402,F401
