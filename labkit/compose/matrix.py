"""The composed proof matrix: every layout tests/test_compose.py proves equal to one process (notebook 14).

One list, read by the test (one test per layout, one launch per world size) and by notebook 14, which prints
how many layouts are proven and which, so that the count it shows cannot drift from what is tested.
`LAYOUTS[world]` holds (ParallelDims, moe) pairs: moe True trains the MoE model, else the dense one.
"""
from __future__ import annotations

from labkit.compose.dims import ParallelDims

DPCP, DPCPTP = ("dp", "cp"), ("dp", "cp", "tp")


def L(moe: bool = False, **sizes) -> tuple:
    return (ParallelDims(**sizes), moe)


LAYOUTS = {
    2: [L(dp=2), L(pp=2), L(cp=2), L(tp=2), L(True, dp=2, ep=2),
        L(True, cp=2, ep=2, ep_over=DPCP), L(True, tp=2, ep=2, ep_over=DPCPTP), L(dp=2, dp_replicate=2, zero=1),
        L(True, dp=2, ep=2, ep_overlap=True)],
    4: [L(dp=2, pp=2, microbatches=2), L(dp=2, cp=2), L(dp=2, tp=2), L(pp=2, cp=2, microbatches=2),
        L(pp=2, tp=2, microbatches=2), L(cp=2, tp=2),
        L(True, dp=4, ep=2), L(True, dp=2, ep=2, pp=2, microbatches=2), L(True, dp=2, ep=2, cp=2),
        L(True, dp=2, ep=2, tp=2),
        L(dp=2, tp=2, zero=1), L(dp=2, pp=2, zero=2, microbatches=2), L(dp=2, cp=2, zero=3),
        L(True, dp=2, ep=2, tp=2, zero=1), L(dp=4, zero=3, microbatches=2),
        L(True, dp=2, cp=2, ep=4, ep_over=DPCP), L(dp=4, dp_replicate=2, zero=2),
        L(True, dp=4, ep=2, dp_replicate=2, zero=1),
        L(cp=2, tp=2, cp_method="allgather"), L(cp=2, tp=2, cp_method="ulysses")],
    8: [L(dp=2, pp=2, tp=2, microbatches=2), L(pp=2, cp=2, tp=2, microbatches=2), L(dp=2, cp=2, tp=2, zero=2),
        L(True, dp=2, ep=2, pp=2, tp=2, microbatches=2, zero=3),
        L(True, dp=2, pp=2, cp=2, ep=4, ep_over=DPCP, microbatches=2, zero=1),
        L(True, pp=2, cp=2, tp=2, ep=2, ep_over=DPCP, microbatches=2), L(cp=4, tp=2, cp_method="hybrid")],
    16: [L(dp=2, pp=2, cp=2, tp=2, microbatches=2, zero=1), L(True, dp=2, ep=2, pp=2, cp=2, tp=2, microbatches=2),
         L(True, dp=2, pp=2, cp=2, tp=2, ep=4, ep_over=DPCP, microbatches=2)],
}


def name(layout) -> str:
    dims, moe = layout
    return f"{dims.short()}{' moe' if moe else ''}"


def summary() -> str:
    """How many layouts are proven, per world size, with their names (notebook 14 prints it)."""
    total = sum(len(v) for v in LAYOUTS.values())
    lines = [f"{total} layouts proven equal to one process in float64 (tests/test_compose.py):"]
    for world, layouts in LAYOUTS.items():
        lines.append(f"  {world:2} ranks ({len(layouts)}): " + ", ".join(name(lay) for lay in layouts))
    return "\n".join(lines)
