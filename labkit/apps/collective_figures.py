"""Figures for notebooks 02 and 03: what each collective does, and the ring's actual moves.

    python -m labkit.apps.collective_figures        # rewrites the PNGs in imgs/

- `draw_collective(name)`: every rank's data before and after one collective, from
  the collective's definition (`COLLECTIVES`). Cell labels name the data's origin:
  A1 is element 1 of rank 0 (ranks A, B, C, D...), A+C a partial sum (of the column's
  element), S1 the sum of every rank's element 1.
- the ring's actual moves (`record_moves`, `draw_ring`, `draw_traffic`): `labkit.apps.ring_moves`;
  the grid of ranks' cells both draw: `labkit.apps.rank_grid`.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

if __name__ == "__main__":
    matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

from labkit.apps.rank_grid import COLORS, LETTERS, draw_grid  # noqa: E402,F401 - public here too

IMGS = Path(__file__).resolve().parents[2] / "imgs"
# --- what each collective does: cells are (frozenset of contributing ranks, element) or None
def _own(r, k):
    return [(frozenset([r]), i) for i in range(k)]


def _sum(cells):
    return (frozenset().union(*(c[0] for c in cells)), cells[0][1])


COLLECTIVES = {  # name: (title, before(n), after(n)); root is rank 0
    "all_reduce": ("all_reduce: every rank gets the sum",
                   lambda n: [_own(r, n) for r in range(n)],
                   lambda n: [[_sum([(frozenset([q]), i) for q in range(n)]) for i in range(n)] for _ in range(n)]),
    "reduce": ("reduce(dst=0): the sum lands on one rank",
               lambda n: [_own(r, n) for r in range(n)],
               lambda n: [[_sum([(frozenset([q]), i) for q in range(n)]) for i in range(n)]]
               + [_own(r, n) for r in range(1, n)]),
    "broadcast": ("broadcast(src=0): one rank's tensor everywhere",
                  lambda n: [_own(r, n) for r in range(n)],
                  lambda n: [_own(0, n) for _ in range(n)]),
    "all_gather": ("all_gather: every rank gets every rank's piece",
                   lambda n: [[(frozenset([r]), 0)] + [None] * (n - 1) for r in range(n)],
                   lambda n: [[(frozenset([q]), 0) for q in range(n)] for _ in range(n)]),
    "gather": ("gather(dst=0): every rank's piece on one rank",
               lambda n: [[(frozenset([r]), 0)] + [None] * (n - 1) for r in range(n)],
               lambda n: [[(frozenset([q]), 0) for q in range(n)]] + [[(frozenset([r]), 0)] + [None] * (n - 1)
                                                                      for r in range(1, n)]),
    "scatter": ("scatter(src=0): piece i of one rank goes to rank i",
                lambda n: [_own(0, n)] + [[None] * n for _ in range(1, n)],
                lambda n: [[(frozenset([0]), r)] + [None] * (n - 1) for r in range(n)]),
    "reduce_scatter": ("reduce_scatter: rank i gets the sum of everyone's piece i",
                       lambda n: [_own(r, n) for r in range(n)],
                       lambda n: [[_sum([(frozenset([q]), r) for q in range(n)])] + [None] * (n - 1)
                                  for r in range(n)]),
}


def draw_collective(name: str, world_size: int = 4):
    """Before/after figure of one collective (a key of COLLECTIVES)."""
    title, before, after = COLLECTIVES[name]
    fig, axes = plt.subplots(1, 2, figsize=(8.4, 2.2 + 0.45 * world_size))
    draw_grid(axes[0], before(world_size), world_size, "before", col_label=None)
    draw_grid(axes[1], after(world_size), world_size, "after", col_label=None)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def draw_point_to_point():
    """send/recv between two ranks: the receiver's buffer is overwritten."""
    fig, ax = plt.subplots(figsize=(6, 1.9))
    for y, name in ((1.2, "rank 0: dist.send(x, dst=1)"), (0, "rank 1: dist.recv(y, src=0)")):
        ax.text(-0.1, y + 0.35, name, ha="right", va="center", fontsize=9, family="monospace")
    for i in range(3):
        ax.add_patch(Rectangle((i, 1.2), 0.9, 0.7, facecolor=COLORS[0], edgecolor="black"))
        ax.text(i + 0.45, 1.55, f"A{i}", ha="center", va="center", color="white", fontweight="bold")
        ax.add_patch(Rectangle((i + 4.5, 0), 0.9, 0.7, facecolor=COLORS[0], edgecolor="black"))
        ax.text(i + 4.95, 0.35, f"A{i}", ha="center", va="center", color="white", fontweight="bold")
    ax.add_patch(FancyArrowPatch((2.95, 1.5), (4.45, 0.4), arrowstyle="-|>", mutation_scale=18, lw=1.5))
    ax.text(3.9, 1.15, "the bytes of x", fontsize=8)
    ax.set_xlim(-4.6, 7.6)
    ax.set_ylim(-0.2, 2.1)
    ax.axis("off")
    fig.tight_layout()
    return fig


def main():
    import os

    os.environ.setdefault("LABKIT_IMPL", "solutions")
    IMGS.mkdir(exist_ok=True)
    written = []

    def save(fig, name):
        path = IMGS / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    save(draw_point_to_point(), "point_to_point.png")
    for name in COLLECTIVES:
        save(draw_collective(name), f"collective_{name}.png")
    from labkit.apps.ring_moves import draw_ring, draw_traffic, record_moves

    n, numel = 4, 8
    ring = record_moves(n, "ring_allreduce", numel)
    naive = record_moves(n, "naive_allreduce", numel)
    save(draw_ring(ring, n), "ring_allreduce_steps.png")
    save(draw_traffic(naive, ring, n, numel * 8), "allreduce_traffic.png")
    for path in written:
        print(path.relative_to(IMGS.parent))


if __name__ == "__main__":
    main()
