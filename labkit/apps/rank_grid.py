"""A grid of ranks' cells, labeled by their data's origin: the drawing that notebooks 02 and 03's figures share
(`labkit.apps.collective_figures`, what each collective does; `labkit.apps.ring_moves`, the ring's moves).

A cell is (frozenset of the ranks whose data it sums, element) or None (nothing there yet). Its label
names the origin: A1 is element 1 of rank 0 (ranks A, B, C, D...), A+C a partial sum (of the column's
element), S1 the sum of every rank's element 1; its colour mixes its ranks' colours.
"""
from __future__ import annotations

import matplotlib
from matplotlib.patches import Rectangle

LETTERS = "ABCDEFGH"
COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]


def _complete(ranks, n):
    return n > 1 and sorted(ranks) == list(range(n))


def _label(cell, n):
    ranks, i = cell
    if _complete(ranks, n):
        return f"S{i}"
    if not ranks:
        return "0"
    if len(ranks) == 1:
        return f"{LETTERS[min(ranks)]}{i}"
    return "+".join(LETTERS[r] for r in sorted(ranks))  # a partial sum: its column says which element


def _color(cell, n):
    ranks = sorted(cell[0])
    if _complete(ranks, n):
        return "#2F3B4C"  # complete sums: one dark colour, easy to follow
    if not ranks:
        return "#BBBBBB"
    rgb = [sum(matplotlib.colors.to_rgb(COLORS[r])[k] for r in ranks) / len(ranks) for k in range(3)]
    return rgb if len(ranks) == 1 else [0.35 + 0.5 * c for c in rgb]


def draw_grid(ax, rows, n, title, highlight=None, col_label="element"):
    """Rows of cells, one row per rank; `highlight`: {(rank, column)} drawn with a thick edge."""
    width = max(len(row) for row in rows)
    for r, row in enumerate(rows):
        y = len(rows) - 1 - r
        ax.text(-0.15, y + 0.5, f"rank {r}", ha="right", va="center", fontsize=9)
        for c, cell in enumerate(row):
            thick = highlight and (r, c) in highlight
            face = "white" if cell is None else _color(cell, n)
            ax.add_patch(Rectangle((c + 0.05, y + 0.08), 0.9, 0.84, facecolor=face,
                                   edgecolor="black", linewidth=2.5 if thick else 0.6,
                                   linestyle="-" if cell is not None else ":"))
            if cell is not None:
                label = _label(cell, n)
                ax.text(c + 0.5, y + 0.5, label, ha="center", va="center", color="white",
                        fontsize=9 if len(label) < 6 else 7, fontweight="bold")
    if col_label:
        for c in range(width):
            ax.text(c + 0.5, len(rows) + 0.05, f"{col_label} {c}", ha="center", va="bottom", fontsize=7)
    ax.set_xlim(-1.1, width + 0.1)
    ax.set_ylim(-0.1, len(rows) + 0.45)
    ax.set_title(title, fontsize=10)
    ax.set_aspect("equal")
    ax.axis("off")
