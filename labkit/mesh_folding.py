"""The folded names of `labkit.mesh.Mesh`: HSDP's split of dp and EP folded over dp, cp, tp, as grid atoms.

A mesh's grid is ``arange(world).view(*sizes)``. HSDP cuts its dp axis into (dp_replicate, dp_shard), replicas
outermost; a folded ep flattens the folded axes (dp_shard, cp, tp among ``ep_over``) in grid order and reshapes
them into (efsdp, ep), ep innermost, as torchtitan's ParallelDims builds its expert mesh
[pp, dp_replicate, efsdp, ep] (torchtitan/distributed/parallel_dims.py). Both only cut axes: the pieces are
"atoms" (an axis, or its outer or inner part), and every name is a product of atoms, so each group is still a
slice of the one grid. For the reshape to cut at most one axis, ep must divide the innermost folded axis or be
it (and the axes inside) times a divisor of the next one: `fold_ep` says so otherwise (with power-of-two sizes
it always holds). Atoms are named after their axis: "dp.r" / "dp.s" (replicas / shards), "cp.o" / "cp.i"
(outer / inner part of a cut axis).
"""
from __future__ import annotations

import math

FOLDED = ("batch", "dp_replicate", "dp_shard", "efsdp")  # names of grid slices beside AXES (see above)
FOLDABLE = ("dp", "cp", "tp")  # the axes EP may be folded over: each rank holds different tokens there


def fold_ep(folded: list, ep: int) -> tuple[list, int | None]:
    """Which atoms make ep: `folded` [(atom, size)] in grid order; returns (ep's atoms, innermost first
    taken whole, and at most one split), and the size of ep's part of the split atom (None: no split).
    ValueError naming the fix when ep does not divide the folded ranks or cuts across an axis."""
    folded = [({"dp.s": "dp_shard"}.get(a, a), n) for a, n in folded]  # the user's names in messages
    total = math.prod(n for _, n in folded)
    if ep < 1 or total % ep:
        raise ValueError(f"ep={ep} does not divide the {total} ranks it is folded over "
                         f"({' x '.join(f'{a}={n}' for a, n in folded) or 'none'}): choose ep among the "
                         f"divisors of {total}, or fold it over more axes")
    atoms, rest = [], ep
    for atom, n in reversed(folded):
        if rest == 1:
            break
        if rest % n == 0:
            atoms.insert(0, {"dp_shard": "dp.s"}.get(atom, atom))
            rest //= n
        elif n % rest == 0:
            atoms.insert(0, {"dp_shard": "dp.s"}.get(atom, atom))
            return atoms, rest
        else:
            raise ValueError(f"ep={ep} cuts across the folded axes {[a for a, _ in folded]} (sizes "
                             f"{[n for _, n in folded]}): ep must divide the innermost folded axis, or be it times "
                             "a divisor of the next one (ep innermost, as torchtitan reshapes); change ep or a size")
    return atoms, None


def build_atoms(axes: tuple, grid: dict, ep: int, ep_over, dp_replicate: int, *, parallelism: bool):
    """([(atom, size)] in grid order, {name: its atoms}): the grid's `axes` as "atoms" (an axis cut in two
    where HSDP or the folded ep cuts it), and every name the mesh answers for as a tuple of atoms.
    `parallelism`: the AXES vocabulary (dp, pp, ep, cp, tp), where HSDP and folding apply; `grid`: the
    grid's sizes (a folded ep has size 1 there); `ep`: ep's size. Plain integers: it works the same under
    torch's FakeTensorMode (labkit.scale simulates a rank with fake tensors)."""
    atoms, names = [], {}
    for a in axes:
        if a == "dp" and parallelism:  # HSDP: replicas outermost, shards inside (torchtitan's order)
            atoms += [("dp.r", dp_replicate), ("dp.s", grid["dp"] // dp_replicate)]
            names["dp"] = ("dp.r", "dp.s")
        elif not (a == "ep" and ep_over):
            atoms.append((a, grid[a]))
            names[a] = (a,)
    if parallelism:
        names["dp_replicate"] = ("dp.r",)
        if ep_over:  # torchtitan: [dp_replicate, efsdp, ep] from (dp_shard, cp, tp); replicas are never folded
            folded = [(a, n) for a, n in atoms if {"dp.s": "dp"}.get(a, a) in ep_over]
            ep_atoms, split = fold_ep(folded, ep)
            if split is not None:  # cut one atom: (outer, inner), ep takes the inner part
                cut, n = ep_atoms[0], dict(atoms)[ep_atoms[0]]
                i = [a for a, _ in atoms].index(cut)
                atoms[i:i + 1] = [(cut + ".o", n // split), (cut + ".i", split)]
                names = {k: tuple(x for a in v for x in ((cut + ".o", cut + ".i") if a == cut else (a,)))
                         for k, v in names.items()}
                folded_atoms = [x for a, _ in folded for x in ((cut + ".o", cut + ".i") if a == cut else (a,))]
                ep_atoms[0] = cut + ".i"
            else:
                folded_atoms = [a for a, _ in folded]
            names["ep"] = tuple(ep_atoms)
            names["efsdp"] = tuple(a for a in folded_atoms if a not in ep_atoms)
        else:  # ep a grid axis of its own, carved out of the data ranks: folded over dp
            names["efsdp"] = ("dp.s",)
        shard = set(names["dp"]) - {"dp.r"} | ({"ep"} if not ep_over else set())
        names["dp_shard"] = tuple(a for a, _ in atoms if a in shard)
        names["batch"] = ("dp.r",) + names["dp_shard"]
    return atoms, names
