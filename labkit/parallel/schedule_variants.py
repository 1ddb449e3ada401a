"""Pipeline schedule variants given as worked examples, not exercises: interleaved 1F1B (Megatron-LM's
virtual stages) and a greedy zero-bubble-style schedule. ZB-V and DualPipeV: `labkit.parallel.v_schedules`.
"""
from __future__ import annotations


def interleaved_schedule(n_ranks: int, n_chunks: int, n_microbatches: int) -> list[list[str]]:
    """Interleaved 1F1B (Megatron-LM's virtual stages), given as a worked example (not an exercise).

    The model is cut into ``n_ranks * n_chunks`` stages and rank r holds stages
    r, r + p, r + 2p, ...: each micro-batch goes round the ranks ``n_chunks`` times. Every
    rank walks its (chunk, micro-batch) pairs in groups of p micro-batches, chunk after
    chunk, forwards in chunk order and backwards in reverse chunk order, with
    ``2 (p - r - 1) + (v - 1) p`` warm-up forwards. With stages 1/v as long, the bubble
    shrinks to (p-1)/(v m + p - 1), at the price of more messages and more activations
    in flight. Needs n_microbatches to be a multiple of n_ranks.
    """
    p, v, m = n_ranks, n_chunks, n_microbatches
    if p < 1 or v < 1 or m < 1 or m % p:
        raise ValueError(f"interleaved 1F1B needs n_microbatches ({m}) to be a positive multiple of "
                         f"n_ranks ({p}), and n_chunks >= 1 (got {v})")
    out = []
    for r in range(p):
        def action(k, kind):
            chunk = (k % (p * v)) // p
            chunk = chunk if kind == "F" else v - 1 - chunk
            return f"{chunk * p + r}{kind}{(k // (p * v)) * p + k % p}"

        total, w = m * v, min(2 * (p - r - 1) + (v - 1) * p, m * v)
        actions = [action(k, "F") for k in range(w)]
        for k in range(total - w):
            actions += [action(k + w, "F"), action(k, "B")]
        out.append(actions + [action(k, "B") for k in range(total - w, total)])
    return out


def zero_bubble_schedule(n_stages: int, n_microbatches: int, max_inflight=None) -> list[list[str]]:
    """A greedy zero-bubble-style schedule (not an exercise, and not the paper's ZB-H1 / ZB-H2).

    Every backward is split into B (the input gradient, which the previous stage waits
    for) and W (the weight gradient, which nobody waits for). In unit time (F = B = W = 1)
    each rank starts, as soon as it is free: a B if one is ready, else an F if it holds
    fewer than ``max_inflight`` micro-batches (held from F until W; default p - stage,
    1F1B's memory), else its oldest pending W. For m >= p the idle time per rank drops
    from 1F1B's 3(p-1) units to 2(p-1) with 1F1B's memory; with
    ``max_inflight=n_microbatches`` every W can wait and it drops to p-1, at GPipe's memory.
    Qi et al. (2024) do better by hand: their ZB-H1 keeps 1F1B's peak memory and reaches an
    idle time of (p-1)(F + B - W) per rank, B being the input-gradient part (p-1 units
    here, a third of 1F1B's); ZB-H2 holds more micro-batches (about 2p) to remove the
    bubble altogether. Simulate it with ``simulate(schedule, t_w=...)``.
    """
    p, m = n_stages, n_microbatches
    if p < 1 or m < 1:
        raise ValueError(f"need n_stages >= 1 and n_microbatches >= 1, got {p}, {m}")
    limit = [p - s if max_inflight is None else max_inflight for s in range(p)]
    done = {}  # (kind, stage, mb) -> finish time
    nxt_f, nxt_b, pending_w = [0] * p, [0] * p, [[] for _ in range(p)]
    held, free_at, out = [0] * p, [0] * p, [[] for _ in range(p)]
    t = 0
    while any(len(acts) < 3 * m for acts in out):
        for s in range(p):
            if free_at[s] > t:
                continue
            b, f = nxt_b[s], nxt_f[s]
            grad_ready = done.get(("F", s, b) if s == p - 1 else ("B", s + 1, b), t + 1) <= t
            act_ready = s == 0 or done.get(("F", s - 1, f), t + 1) <= t
            if b < f and grad_ready:
                kind, mb = "B", b
                nxt_b[s] += 1
                pending_w[s].append(b)
            elif f < m and act_ready and held[s] < limit[s]:
                kind, mb = "F", f
                nxt_f[s] += 1
                held[s] += 1
            elif pending_w[s]:
                kind, mb = "W", pending_w[s].pop(0)
                held[s] -= 1
            else:
                continue
            done[kind, s, mb] = t + 1
            free_at[s] = t + 1
            out[s].append(f"{s}{kind}{mb}")
        t += 1
    return out
