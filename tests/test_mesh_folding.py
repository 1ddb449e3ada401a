"""The Mesh's folded names against their definitions, by brute force (labkit/mesh_folding.py).

For every layout of up to 16 ranks (dp, pp, cp, tp; dp_replicate dividing dp; ep folded over dp, dp x cp or
dp x cp x tp) and every rank, from the definition alone: the grid is arange(world).view(dp, pp, cp, tp), HSDP
splits dp's coordinate d into replica d // S and shard d % S, and the folded ranks (the shard, cp, tp among
ep_over) are flattened in grid order into f and reshaped into (efsdp, ep), ep innermost (torchtitan's
[dp_replicate, efsdp, ep]): ep index f % E, efsdp index f // E. Then
    ep        the ranks with the same pp, replica, unfolded coordinates and efsdp index
    efsdp     the ranks with the same pp, replica, unfolded coordinates and ep index
    batch     the ranks with the same pp, cp, tp
    dp_replicate / dp_shard   the same pp, cp, tp and shard / replica
and mesh.coord("ep") is the ep index. Layouts where ep cuts across an axis are refused (ValueError); there
the definition still holds but the groups are no grid slices, which the lab does not build.
Also: labkit.scale's layout (notebook 15) borrows ep from dp x cp, cp's ranks first: its expert-gradient
group (traffic.py: dp x cp / ep ranks) and its ep link span agree with the Mesh folded over dp x cp.
"""
from __future__ import annotations

import itertools

import pytest

from labkit.mesh import Mesh

FOLDINGS = (("dp",), ("dp", "cp"), ("dp", "cp", "tp"))


def layouts(max_world=16):
    for dp, pp, cp, tp in itertools.product((1, 2, 3, 4), (1, 2), (1, 2, 3, 4), (1, 2)):
        world = dp * pp * cp * tp
        if world > max_world:
            continue
        for R in (r for r in (1, 2, 3, 4) if dp % r == 0):
            for over in FOLDINGS:
                folded = (dp // R) * (cp if "cp" in over else 1) * (tp if "tp" in over else 1)
                for ep in (e for e in range(2, folded + 1) if folded % e == 0):
                    yield dict(dp=dp, pp=pp, cp=cp, tp=tp, ep=ep, ep_over=over, dp_replicate=R)


def definition(rank, dp, pp, cp, tp, ep, ep_over, dp_replicate):
    d, p, c, t = rank // (pp * cp * tp), rank // (cp * tp) % pp, rank // tp % cp, rank % tp
    S = dp // dp_replicate
    replica, shard = d // S, d % S
    f = 0
    for coord, size, axis in ((shard, S, "dp"), (c, cp, "cp"), (t, tp, "tp")):
        if axis in ep_over:
            f = f * size + coord
    unfolded = tuple(coord for coord, axis in ((c, "cp"), (t, "tp")) if axis not in ep_over)
    return dict(p=p, c=c, t=t, replica=replica, shard=shard, ep=f % ep, efsdp=f // ep, unfolded=unfolded)


def cuts_across(dp, cp, tp, ep, ep_over, dp_replicate, **_):
    """Whether the reshape cuts more than one axis (ep neither divides nor is a multiple-and-divisor chain)."""
    rest = ep
    for size in reversed([n for n, a in ((dp // dp_replicate, "dp"), (cp, "cp"), (tp, "tp")) if a in ep_over]):
        if rest == 1:
            return False
        if rest % size == 0:
            rest //= size
        elif size % rest == 0:
            return False
        else:
            return True
    return rest != 1


CASES = list(layouts())


def test_folded_groups_match_the_definition_by_brute_force():
    keys = {"ep": ("p", "replica", "unfolded", "efsdp"), "efsdp": ("p", "replica", "unfolded", "ep"),
            "batch": ("p", "c", "t"), "dp_replicate": ("p", "c", "t", "shard"), "dp_shard": ("p", "c", "t", "replica")}
    checked = refused = 0
    for sizes in CASES:
        world = sizes["dp"] * sizes["pp"] * sizes["cp"] * sizes["tp"]
        if cuts_across(**sizes):
            with pytest.raises(ValueError, match="cuts across the folded axes"):
                Mesh(world, rank=0, groups=False, **sizes)
            refused += 1
            continue
        defs = [definition(r, **sizes) for r in range(world)]
        for rank in range(world):
            mesh = Mesh(world, rank=rank, groups=False, **sizes)
            assert mesh.coord("ep") == defs[rank]["ep"], (sizes, rank)
            for name, same in keys.items():
                want = [r for r in range(world) if all(defs[r][k] == defs[rank][k] for k in same)]
                assert mesh.ranks(name) == want, (sizes, rank, name, mesh.ranks(name), want)
        checked += 1
    assert checked > 100 and refused > 0, (checked, refused)


def test_scale_layout_folds_ep_as_the_mesh_over_dp_x_cp():
    """traffic.py sums expert gradients over dp x cp / ep ranks and places ep's link by its span: both equal
    the Mesh folded over dp x cp (ep innermost: cp's ranks first)."""
    from labkit.scale.layout import Layout

    compared = 0
    for sizes in CASES:
        if sizes["ep_over"] != ("dp", "cp") or sizes["dp_replicate"] != 1 or cuts_across(**sizes):
            continue
        world = sizes["dp"] * sizes["pp"] * sizes["cp"] * sizes["tp"]
        layout = Layout(**{a: sizes[a] for a in ("dp", "pp", "cp", "tp", "ep")})
        groups = []
        for rank in range(world):
            mesh = Mesh(world, rank=rank, groups=False, **sizes)
            assert mesh.size(("efsdp", "tp")) // sizes["tp"] == layout.dp * layout.cp // layout.ep, sizes
            groups.append(mesh.ranks("ep"))
        for gpus in (2, 4, 8, 16):  # "node": every rank's ep group inside one node (on whole nodes)
            if world % gpus and world > gpus:
                continue
            inside = all(min(g) // gpus == max(g) // gpus for g in groups)
            assert inside == (layout.level("ep", gpus) == "node"), (sizes, gpus, groups)
        compared += 1
    assert compared > 10, compared
