"""The process groups of `labkit.mesh.Mesh`: made once, asked for by axis names.

Creating a process group is collective over the whole world (``dist.new_group``): every
rank must create every group, in the same order. `Mesh` does that in its constructor (when
a process group is initialised and ``groups=True``), for every single axis in `AXES`
order and then for each axis set in ``combined``; each rank keeps the groups it belongs to.
Without a process group it is the layout only (pass ``rank=``): ``group()`` then raises; so is
``groups=False`` with ``rank=`` given (any rank's layout, inside launched ranks too).

`MeshGroups` is the part of `Mesh` that touches torch.distributed (the rest of the Mesh is the layout, answered
without a process group): `group(axes)`, `add_group(axes, group)` for groups made by hand (notebook 07), and the
collective creation the constructor runs. A group is keyed by the atoms its names span (`Mesh._key`), so two
names for the same ranks share one group.
"""
from __future__ import annotations

import math


class MeshGroups:
    """Process groups of a Mesh (mixed into `labkit.mesh.Mesh`, which supplies the layout: `_key`,
    `_all_ranks`, `_atom_sizes`, `ranks`, `_axis_set`, and fills `_groups` in its constructor)."""

    def group(self, axes):
        """This rank's process group along ``axes`` (created by the constructor, or `add_group`).

        An axis set that spans the whole world gives the default group even without ``groups``.
        """
        import torch.distributed as dist

        key = self._key(axes)
        if key not in self._groups and math.prod(self._atom_sizes[a] for a in key) == self.world_size \
                and dist.is_initialized():
            return dist.group.WORLD
        if key not in self._groups:
            if not self._groups:
                raise ValueError("this Mesh has no process groups: it was built without an initialised "
                                 "process group (or with groups=False)")
            raise ValueError(f"no group for axes {self._axis_set(axes)}: pass combined=[{self._axis_set(axes)}] "
                             "to Mesh(...) so that every rank creates it")
        return self._groups[key]

    def add_group(self, axes, group) -> None:
        """Use ``group`` (made by hand with ``dist.new_group``) as this rank's group along ``axes``.

        For a mesh built with ``groups=False`` whose groups its user creates (notebook 07).
        Raises ValueError when the group's ranks are not this rank's slice of the grid along ``axes``.
        """
        import torch.distributed as dist

        names = self._axis_set(axes)
        got, want = dist.get_process_group_ranks(group), self.ranks(names)
        if sorted(got) != want:
            raise ValueError(f"the group given for {'/'.join(names)} holds ranks {sorted(got)}, but rank "
                             f"{self.rank}'s group along {'/'.join(names)} is {want}: the ranks whose other "
                             f"coordinates equal its own {self.coords()} in arange({self.world_size})"
                             f".view({', '.join(f'{a}={n}' for a, n in self.sizes.items())})")
        self._groups[self._key(names)] = group

    def _create_groups(self, key):
        import torch.distributed as dist

        every = self._all_ranks(key)
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
