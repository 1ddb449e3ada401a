"""The V-shaped zero-bubble schedules, as data: ZB-V (Qi et al., 2024) and DualPipeV (DeepSeek-V3).

Both cut the model into 2p stages on p ranks in a V: rank r holds stage r (going down)
and stage 2p-1-r (coming back up), so stage 0 and the last stage both live on rank 0
and the hand-off between stage p-1 and stage p stays on rank p-1 (no message). Both
split backwards into B (input gradient) and W (weight gradient), written in the lab's
notation (`labkit.parallel.schedules`): ``"{stage}F{mb}"``, ``"{stage}B{mb}"``, ``"{stage}W{mb}"``;
a B without a W is a full backward.

These are given, not exercises. They follow the constructions of PyTorch 2.13
(``torch.distributed.pipelining.schedules.ScheduleZBVZeroBubble`` and
``ScheduleDualPipeV``, after https://github.com/deepseek-ai/DualPipe) and
``tests/test_v_schedules.py`` checks them action for action against torch's own lists.
DualPipeV's "overlapped F and B" (one micro-batch's forward on one stage run together
with another's backward on the other, to hide the all-to-all of expert parallelism
behind compute) is written as the two actions one after the other: on a CPU and
without experts there is nothing to overlap.

Qi et al.: "Zero Bubble Pipeline Parallelism", ICLR 2024, https://arxiv.org/abs/2401.10241
DeepSeek-AI: "DeepSeek-V3 Technical Report", 2024, https://arxiv.org/abs/2412.19437
"""
from __future__ import annotations

from labkit.parallel.schedules import parse_action


def v_stages(n_ranks: int, rank: int) -> tuple[int, int]:
    """The two stages rank ``rank`` holds in a V: (rank, 2 n_ranks - 1 - rank)."""
    return rank, 2 * n_ranks - 1 - rank


def zbv_schedule(n_ranks: int, n_microbatches: int) -> list[list[str]]:
    """ZB-V: 2 stages per rank in a V, B and W split, W used to fill what would be bubbles.

    Each rank warms up with forwards of its first stage, then alternates
    F / B / W of its two stages. With F = B = W and m >= 2p - 1 the bubble is (nearly) zero
    at 1F1B's peak activation memory. Fewer micro-batches: the schedule for 2p - 1 with
    the missing micro-batches left out.
    """
    p, m = n_ranks, n_microbatches
    if p < 1 or m < 1:
        raise ValueError(f"need n_ranks >= 1 and n_microbatches >= 1, got {p}, {m}")
    out = []
    for r in range(p):
        s0, s1 = v_stages(p, r)
        n = max(2 * p - 1, m)
        acts, f0, f1, b0, b1 = [], 0, 0, 0, 0
        for _ in range(2 * (p - r) - 1):  # warm-up: forwards of the first stage
            acts.append(f"{s0}F{f0}")
            f0 += 1
        for _ in range(r):  # then forwards of both stages
            acts += [f"{s1}F{f1}", f"{s0}F{f0}"]
            f1, f0 = f1 + 1, f0 + 1
        for _ in range(p - r):  # the second stage starts its backwards
            acts += [f"{s1}F{f1}", f"{s1}B{b1}", f"{s1}W{b1}"]
            f1, b1 = f1 + 1, b1 + 1
        while f1 < f0 or f0 < n:  # steady state: F B W on each stage in turn
            if f0 < n:
                acts.append(f"{s0}F{f0}")
                f0 += 1
            acts += [f"{s0}B{b0}", f"{s0}W{b0}", f"{s1}F{f1}", f"{s1}B{b1}", f"{s1}W{b1}"]
            b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
        w0, w1 = b0, b1
        for _ in range(r):  # cool-down: input gradients first, weights later
            acts += [f"{s0}B{b0}", f"{s1}B{b1}"]
            b0, b1 = b0 + 1, b1 + 1
        for _ in range(p - r):
            acts += [f"{s0}B{b0}", f"{s0}W{w0}"]
            b0, w0 = b0 + 1, w0 + 1
        acts += [f"{s1}W{i}" for i in range(w1, b1)] + [f"{s0}W{i}" for i in range(w0, b0)]
        out.append([a for a in acts if parse_action(a).mb < m])  # built for 2p - 1, keep the first m
    return out


def dualpipev_schedule(n_ranks: int, n_microbatches: int) -> list[list[str]]:
    """DualPipeV: DeepSeek's DualPipe folded into a V, 2 stages per rank; needs m >= 2p.

    Eight phases per rank (the comments below); in the middle one the forward of one
    stage and the (full) backward of the other run as a pair, which on GPUs overlaps the
    communication of one with the computation of the other. Near the ends, B and W are
    split (zero-bubble style) to fill the pipeline's ramps with weight gradients.
    """
    p, m = n_ranks, n_microbatches
    if p < 1 or m < 2 * p:
        raise ValueError(f"DualPipeV needs n_microbatches >= 2 x n_ranks ({2 * p}), got {m} and {p} ranks")
    return [_dualpipev_rank(p, m, r) for r in range(p)]


def _dualpipev_rank(p: int, m: int, r: int) -> list[str]:
    s0, s1 = v_stages(p, r)
    acts, nxt, weights = [], {}, []  # nxt[(stage, kind)]: next micro-batch; weights: pending W

    def add(stage, kind, split=False):  # kind F or B; a split B queues its W
        mb = nxt.get((stage, kind), 0)
        nxt[stage, kind] = mb + 1
        acts.append(f"{stage}{kind}{mb}")
        if split:
            weights.append(f"{stage}W{mb}")

    def pending_w():
        if weights:
            acts.append(weights.pop(0))

    for _ in range(2 * (p - r - 1)):  # 1: forwards of the first stage
        add(s0, "F")
    for _ in range(r + 1):  # 2: forwards of both stages
        add(s0, "F")
        add(s1, "F")
    for _ in range(p - r - 1):  # 3: B and W of the second stage, zero-bubble style
        add(s1, "B", split=True)
        pending_w()
        add(s1, "F")
    for _ in range(m - 2 * p + r + 1):  # 4: main phase, F of one stage paired with B of the other
        add(s0, "F")
        add(s1, "B")
        add(s1, "F")
        add(s0, "B")
    for _ in range(p - r - 1):  # 5: B of the second stage, F paired with B
        add(s1, "B")
        add(s1, "F")
        add(s0, "B")
    split = False
    for i in range(r + 1):  # 6: backwards of both stages; the second half split
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        add(s1, "B", split)
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        add(s0, "B", split)
    for _ in range(p - r - 1):  # 7: pending weights, backwards of the first stage
        pending_w()
        add(s0, "B", split)
    for _ in range(r + 1):  # 8: the remaining weights
        pending_w()
    return acts
