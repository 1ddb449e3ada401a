"""The real moves of an all-reduce, recorded on real ranks and drawn (notebook 03).

- `record_moves(world_size, function)`: runs an all-reduce (yours or the reference) on
  real ranks and records every message it sends: (step, src, dst, chunk, contributors).
  Each rank starts from the int64 value 16**rank (1 << 4*rank: a hexadecimal digit per
  rank), so the value of any sum names the ranks that contributed to it, and how many
  times: what is drawn is read off the real messages and the real tensors.
- `draw_ring(moves)`: the ring step by step from those records, a wrong ring too, its first
  message that differs from the textbook ring (`ring_errors`) outlined in red;
  `draw_traffic`: bytes in and out per rank, naive against ring.
"""
from __future__ import annotations

import bisect

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from labkit.apps.rank_grid import COLORS, LETTERS, draw_grid


def _contents(value, world_size):
    """The ranks whose values `value` holds, a rank repeated when counted more than once."""
    from labkit.grading.diagnose import decode

    counts = decode(int(value), world_size)
    return None if counts is None else [r for r, c in sorted(counts.items()) for _ in range(c)]


def _record_rank(rank, world_size, topic, function, numel, fn=None):
    """Run impl(topic).function on rank_tag(rank) (16**rank), recording every message it sends.

    Returns (sends, final): each send with what its rank held at that moment (per chunk),
    and what each chunk holds at the end. Nothing is asserted: a wrong all-reduce is recorded
    as it ran, so that it can be drawn and its first wrong message marked.
    """
    import torch.distributed as dist

    from labkit.comm.intercept import Hook, intercept
    from labkit.grading.diagnose import tagged
    from labkit.grading import impl

    module = impl(topic)
    fn, chunk_bounds = fn or getattr(module, function), module.chunk_bounds  # the ring's own chunk arithmetic
    tensor = tagged(rank, numel)
    base, bounds = tensor.data_ptr(), chunk_bounds(numel, world_size)
    sends = []

    def held():
        return [_contents(tensor[bounds[c]], world_size) if bounds[c + 1] > bounds[c] else []
                for c in range(world_size)]

    class Recorder(Hook):
        """Records each send/isend before it runs, with what its rank holds at that moment."""

        def before(self, call):
            if call.op not in ("send", "isend"):
                return
            t, a = call.arguments["tensor"], call.arguments
            group = a.get("group") or dist.group.WORLD
            peer = a["group_dst"] if a.get("group_dst") is not None else dist.get_group_rank(group, a["dst"])
            offset = (t.data_ptr() - base) // t.element_size()
            inside = 0 <= offset < numel and t.numel() > 0
            chunk = bisect.bisect_right(bounds, offset) - 1 if inside and t.numel() < numel else None
            sends.append(dict(src=rank, dst=peer, chunk=chunk, numel=t.numel(), bytes=call.payload,
                              ranks=_contents(t.reshape(-1)[0], world_size) if t.numel() else [],
                              held=held()))

    with intercept(Recorder()):
        fn(tensor)
    for step, send in enumerate(sends):
        send["step"] = step
    return sends, held()


class Moves(list):
    """The recorded messages (a list of dicts), with `final`: what each rank's chunks hold at the end."""

    final = None


def record_moves(world_size: int = 4, function: str = "ring_allreduce", numel: int | None = None,
                 topic: str = "allreduce", timeout: float = 60, fn=None):
    """Every message sent by impl(topic).function on `world_size` real ranks, as dicts:
    step (the k-th send of its rank), src, dst, chunk (None when not a chunk), bytes, ranks
    (whose values the message carries, a rank repeated if counted twice), held (what the
    sender's chunks held when it sent). Rank r starts from 16**r, one hexadecimal digit per
    rank. `.final[rank][chunk]`: what each chunk holds at the end. Works on wrong code too.
    Uses the current LABKIT_IMPL; `fn(tensor)`: record that all-reduce instead (e.g. a
    deliberately wrong one)."""
    from labkit.launching.launcher import launch

    per_rank = launch(_record_rank, world_size, topic, function, numel or 2 * world_size, fn, timeout=timeout)
    moves = Moves(send for sends, _ in per_rank for send in sends)
    moves.final = [[None if c is None else tuple(c) for c in final] for _, final in per_rank]
    return moves


def _cell(ranks):
    return None if ranks is None else tuple(sorted(ranks))


def ring_states(moves, world_size, steps=None):
    """States before each step and after the last: states[k][rank][chunk] = contributors (a sorted tuple).

    Recorded moves carry what each sender held when it sent (`held`) and the final state:
    the states are those, as they were (a rank that sends nothing more holds its final
    state). Moves without them (written by hand) are replayed: a received chunk is ADDED
    when its contributors are new to the receiver (reduce-scatter), and REPLACES the
    receiver's when they overlap (all-gather). `steps`: at least that many steps (a ring
    that stopped early is drawn up to where it should have gone).
    """
    n = world_size
    steps = max(max((m["step"] for m in moves), default=-1) + 1, steps or 0)
    if moves and all("held" in m for m in moves) and getattr(moves, "final", None) is not None:
        final = [list(row) for row in moves.final]
        held = {(m["src"], m["step"]): [_cell(c) for c in m["held"]] for m in moves}
        last_send = {r: max((k for q, k in held if q == r), default=-1) for r in range(n)}
        states, previous = [], [[(r,) for _ in range(n)] for r in range(n)]
        for k in range(steps):
            state = [held.get((r, k)) or (final[r] if k > last_send[r] else previous[r]) for r in range(n)]
            states.append(state)
            previous = state
        states.append(final)
        return states
    state = [[(r,) for _ in range(n)] for r in range(n)]
    states = [state]
    for step in range(steps):
        new = [row[:] for row in state]
        for m in (m for m in moves if m["step"] == step and m["chunk"] is not None):
            carried = _cell(m["ranks"])
            own = state[m["dst"]][m["chunk"]]
            if carried is None or own is None:
                new[m["dst"]][m["chunk"]] = None
            else:
                new[m["dst"]][m["chunk"]] = tuple(sorted(own + carried)) if not set(own) & set(carried) else carried
        state = new
        states.append(state)
    return states


def _names(ranks):
    return "nothing" if not ranks else "+".join(LETTERS[r] for r in ranks)


def ring_errors(moves, world_size):
    """The messages that differ from the textbook ring, first one first (by step, then sender).

    The ring (notebook 03): at reduce-scatter step s (s < N-1) rank r sends chunk r-s,
    holding ranks r-s..r, to rank r+1; at all-gather step s rank r sends chunk r+1-s, complete.
    Each error: dict(step, src, move (None for a message never sent), chunk (the chunk sent, or
    the one the ring sends there), reason). Assumes numel >= N (no empty chunk is skipped).
    """
    n = world_size
    errors = []
    sent = {(m["src"], m["step"]): m for m in moves}
    for step in range(2 * (n - 1)):
        for r in range(n):
            gather = step >= n - 1
            chunk = (r + 1 - (step - (n - 1))) % n if gather else (r - step) % n
            want = tuple(range(n)) if gather else tuple(sorted((r - j) % n for j in range(step + 1)))
            phase = f"all-gather step {step - n + 2}" if gather else f"reduce-scatter step {step + 1}"
            where = f"{phase} of {n - 1}: rank {r}"
            m = sent.get((r, step))
            if m is None:
                errors.append(dict(step=step, src=r, move=None, chunk=chunk, reason=f"{where} sent nothing; the "
                                   f"ring sends chunk {chunk} ({_names(want)}) to rank {(r + 1) % n}"))
                continue
            got = _cell(m["ranks"])
            problems = []
            if m["dst"] != (r + 1) % n:
                problems.append(f"to rank {m['dst']} instead of rank {(r + 1) % n}")
            if m["chunk"] != chunk:
                problems.append(f"chunk {m['chunk']} instead of chunk {chunk}")
            if got != want:
                missing = sorted(set(want) - set(got or ()))
                extra = "" if not missing else f", missing {_names(missing)}"
                problems.append(f"holding {_names(got) if got is not None else 'a value that is no sum'} instead of "
                                f"{_names(want)}{extra}")
            if problems:
                errors.append(dict(step=step, src=r, move=m, chunk=m["chunk"] if m["chunk"] is not None else chunk,
                                   reason=f"{where} sent " + ", ".join(problems)))
    extra_moves = [m for m in moves if m["step"] >= 2 * (n - 1)]
    errors += [dict(step=m["step"], src=m["src"], move=m, chunk=m["chunk"], reason=f"rank {m['src']} sent a message "
                    f"#{m['step'] + 1}: the ring sends {2 * (n - 1)} per rank") for m in extra_moves]
    return sorted(errors, key=lambda e: (e["step"], e["src"]))


def draw_ring(moves, world_size):
    """The ring all-reduce step by step, from recorded moves (`record_moves`), wrong ones included.

    The first message that differs from the textbook ring (`ring_errors`) is outlined in red
    and explained under the figure; the figure's `first_wrong` attribute holds that error
    (None for a correct ring) and `marked` its (step, sender, chunk).
    """
    n = world_size
    states = ring_states(moves, n, steps=2 * (n - 1))
    errors = ring_errors(moves, n)
    first = errors[0] if errors else None
    steps = len(states) - 1
    cols = min(steps + 1, n)
    rows_of_panels = -(-(steps + 1) // cols)
    fig, axes = plt.subplots(rows_of_panels, cols, figsize=(3.3 * cols, (0.55 * n + 0.9) * rows_of_panels + 0.5))
    axes = list(getattr(axes, "flat", [axes]))
    fig.first_wrong, fig.marked = first, None
    for k, ax in enumerate(axes):
        if k > steps:
            ax.axis("off")
            continue
        sent = [m for m in moves if m["step"] == k and m["chunk"] is not None]
        rows = [[None if state is None else (state, c) for c, state in enumerate(row)] for row in states[k]]
        if k == steps:
            complete = sum(cell == tuple(range(n)) for row in states[k] for cell in row)
            title = ("done: every rank has every sum" if complete == n * n
                     else f"done: {n * n - complete} of {n * n} chunks are NOT the full sum")
        else:
            phase = "reduce-scatter" if k < n - 1 else "all-gather"
            title = f"{phase}, step {k % (n - 1) + 1} of {n - 1}" if k < 2 * (n - 1) else f"extra step {k + 1}"
        draw_grid(ax, rows, n, title, highlight={(m["src"], m["chunk"]) for m in sent}, col_label="chunk")
        if first is not None and first["step"] == k:
            chunk = first["chunk"]
            y = n - 1 - first["src"]
            x, width = (chunk, 1) if chunk is not None else (0, n)  # no chunk: the whole row
            ax.add_patch(Rectangle((x - 0.02, y + 0.02), width + 0.04, 0.96, fill=False, edgecolor="red",
                                   linewidth=3, gid="first-wrong"))
            ax.set_title(title + "\nFIRST WRONG MESSAGE (red)", fontsize=10, color="red")
            fig.marked = (k, first["src"], chunk)
    fig.suptitle(f"ring all-reduce on {n} ranks, drawn from the messages it sent; thick: the chunk "
                 f"each rank sends to its right neighbour at this step", fontsize=11)
    if first is not None:
        more = f" ({len(errors) - 1} later messages differ too)" if len(errors) > 1 else ""
        fig.text(0.5, 0.005, f"first wrong message, red: {first['reason']}{more}", ha="center", va="bottom",
                 color="red", fontsize=10, wrap=True)
    fig.tight_layout(rect=(0, 0.04 if first is not None else 0, 1, 1))
    return fig


def traffic(moves, world_size):
    """(bytes sent, bytes received) per rank."""
    sent, received = [0] * world_size, [0] * world_size
    for m in moves:
        sent[m["src"]] += m["bytes"]
        received[m["dst"]] += m["bytes"]
    return sent, received


def draw_traffic(naive_moves, ring_moves, world_size, tensor_bytes):
    """Bytes in + out per rank, in units of the tensor size S, for both all-reduces."""
    fig, ax = plt.subplots(figsize=(6.4, 3))
    width = 0.38
    for j, (name, moves) in enumerate((("naive (via rank 0)", naive_moves), ("ring", ring_moves))):
        sent, received = traffic(moves, world_size)
        xs = [r + (j - 0.5) * width for r in range(world_size)]
        ax.bar(xs, [(s + q) / tensor_bytes for s, q in zip(sent, received)], width, label=name,
               color=COLORS[j])
    n = world_size
    ax.axhline(2 * (n - 1), color=COLORS[0], ls=":", lw=1)
    ax.axhline(2 * (n - 1) / n * 2, color=COLORS[1], ls=":", lw=1)
    ax.set_xticks(range(n), [f"rank {r}" for r in range(n)])
    ax.set_ylabel("bytes in + out  (x S)")
    ax.set_title(f"traffic per rank, all-reduce of S bytes on {n} ranks (recorded)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
