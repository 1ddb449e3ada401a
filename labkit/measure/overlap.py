"""When communication hides behind compute: the arithmetic, from the alpha-beta fit and a FLOP rate.

    t_msg = message_seconds(nbytes, alpha, beta)          # alpha + bytes / beta
    pipeline_exposed_seconds(p, t_msg)                   # 2 (p - 1) t_msg per step, whatever m
    zero3_prefetch(layer_params, n_ranks, tokens, flop_rate, alpha, beta)
    pipeline_costs(spans); bubble_with_costs(schedule, spans)   # a measured step, its own costs
    prefetch_exposures(spans); check_prefetch(prediction, spans, *more_steps)  # ZeRO-3's gathers on a timeline
    two_batch_overlap(a2a_s, compute_s); a2a_exposures(spans); check_two_batch(prediction, spans)  # EP's all-to-all

Two cases from the lab:

**Pipeline send/recv (notebook 06).** A message hides whenever its sender finishes it at
least t_msg before the receiver needs it. On the critical path the receiver is waiting:
GPipe runs its forwards back to back, so only the p - 1 hops of the ramp-up and the p - 1
of the ramp-down are exposed, 2 (p - 1) t_msg per step. 1F1B's steady state has no slack
(each F waits for its neighbour's F, each B for its neighbour's B), so every cycle pays
its messages and the excess grows with m: `labkit.parallel.schedules.simulate(..., t_msg=)`
models any schedule.

**ZeRO-3 prefetch (notebook 09).** While layer i computes, the all-gather of layer i+1's
parameters runs. Ring all-gather of S bytes on N ranks: (N - 1) (alpha + S / (N beta)).
Layer i's forward on `tokens` tokens: 2 x params x tokens FLOPs (its backward twice
that). The gather hides when it is no longer than the compute; the smallest batch that
hides it is `min_tokens`. On the learner's timeline (solutions/fsdp.py's ZeRO3 records each
unit's "allgather" from issue to the end of its wait, and each block's "F"), the exposed part
of block i's gather is the time it ends after block i-1's forward (and after the last rank
issued it): `prefetch_exposures`;
`check_prefetch` sets it against the prediction.

**Expert parallelism's two-micro-batch overlap (notebook 12).** solutions/moe_overlap.py
cuts a rank's batch in halves A and B and issues each all-to-all asynchronously: B's dispatch
flies while A's experts compute, A's combine while B's experts compute (backward: the mirror
image). A pairwise all-to-all of a rank's S input bytes over N ranks sends N - 1 messages of
S/N: (N - 1) (alpha + S / (N beta)), the all-gather's formula. Per layer and direction, of the
four all-to-alls two can hide, each exposed max(0, t_a2a - t_compute_other_half); the other
two (A's dispatch, B's combine) have nothing of the other half to hide behind: t_a2a each.
On the timeline (spans "dispatch", "combine", "dispatch_grad", "combine_grad" from issue to
end of wait, stage = layer, mb = half; "F"/"B" per half; "wait" for the time in wait()), an
all-to-all's exposed part is the time its rank sat waiting for it after the last rank issued
it: `a2a_exposures`; `check_two_batch` sets it against the prediction.

**Measured costs (notebook 06, bench/pipeline.py).** On a shared CPU the ideal bubble
(p-1)/(m+p-1) assumes free messages and no work between computes. `pipeline_costs` reads
off a measured step's timeline what each action really cost: the mean F, B, W spans, the
mean gap between two computes of a rank with no receive between them (the executor's own
work), and the mean time a receive adds, counted from the later of the rank's previous
compute and the sender's compute: gloo moves a message only once its receiver has posted
the receive (gloo/transport/tcp/pair.cc: "sends cannot execute until the remote side is
ready to receive"), which the executor does just before the compute that reads it, so a
receive costs about the same whether its message was sent long before or not.
`bubble_with_costs` runs `simulate` with those costs: the theory with measured costs.
"""
from __future__ import annotations

from collections import defaultdict
from statistics import mean, median


def message_seconds(nbytes: float, alpha: float, beta: float) -> float:
    """One point-to-point message: latency alpha (s) plus nbytes at beta bytes/s."""
    if nbytes < 0 or alpha < 0 or beta <= 0:
        raise ValueError(f"need nbytes >= 0, alpha >= 0 and beta > 0, got {nbytes}, {alpha}, {beta}")
    return alpha + nbytes / beta


def pipeline_exposed_seconds(n_stages: int, t_msg: float) -> float:
    """Message time GPipe cannot hide: 2 (p - 1) t_msg, its ramp-up's and ramp-down's hops (a lower bound for 1F1B)."""
    if n_stages < 1:
        raise ValueError(f"need n_stages >= 1, got {n_stages}")
    return 2 * (n_stages - 1) * t_msg


def all_gather_seconds(nbytes: float, n_ranks: int, alpha: float, beta: float) -> float:
    """Ring all-gather of a tensor of nbytes (its full size) over n_ranks: (N-1) (alpha + nbytes / (N beta))."""
    if n_ranks < 1:
        raise ValueError(f"need n_ranks >= 1, got {n_ranks}")
    return (n_ranks - 1) * message_seconds(nbytes / n_ranks, alpha, beta)


def zero3_prefetch(layer_params: int, n_ranks: int, tokens: int, flop_rate: float, alpha: float, beta: float,
                   bytes_per_param: int = 4) -> dict:
    """Does the gather of layer i+1 hide behind the forward of layer i? Returns the figures.

    gather_s: the all-gather of one layer's parameters; compute_s: one layer's forward on
    ``tokens`` tokens (2 x params x tokens / flop_rate); hidden: gather_s <= compute_s;
    exposed_s: max(0, gather_s - compute_s) per layer; min_tokens: the smallest token
    count per rank whose forward hides the gather.
    """
    gather = all_gather_seconds(layer_params * bytes_per_param, n_ranks, alpha, beta)
    compute = 2 * layer_params * tokens / flop_rate
    return dict(gather_s=gather, compute_s=compute, hidden=gather <= compute, exposed_s=max(0.0, gather - compute),
                min_tokens=gather * flop_rate / (2 * layer_params))


def _sender(spans_by_key, s):
    """The compute whose message this compute receives: F of stage - 1, or B of stage + 1 (None for W)."""
    if s.kind == "F":
        return spans_by_key.get(("F", s.stage - 1, s.mb))
    return spans_by_key.get(("B", s.stage + 1, s.mb)) if s.kind == "B" else None


def pipeline_costs(spans) -> dict:
    """Per-action costs of a measured pipeline step (seconds), read off its timeline's spans.

    F, W: mean compute span per kind; B: mean full backward, B_input: mean split backward (one
    a W of the same stage and micro-batch completes), 0.0 for a kind absent; gap: mean idle time between
    two consecutive computes of a rank with no receive between them; recv: mean idle time
    before a compute that a receive from another rank precedes, counted from the later of
    the rank's previous compute end and the sender's compute end; n_recv, n_gap: how many.
    """
    compute = [s for s in spans if s.kind in ("F", "B", "W")]
    if not compute:
        raise ValueError("no F/B/W spans: pass a pipeline step's timeline (Timeline.gather())")
    by_key = {(s.kind, s.stage, s.mb): s for s in compute}
    by_rank = defaultdict(list)
    for s in sorted(spans, key=lambda s: (s.start, s.end)):
        by_rank[s.rank].append(s)
    gaps, recvs = [], []
    for rank, ordered in by_rank.items():
        prev, received = None, False
        for s in ordered:
            if s.kind == "recv":
                received = True
            elif s.kind in ("F", "B", "W"):
                src = _sender(by_key, s)
                if prev is not None and not received:
                    gaps.append(s.start - prev.end)
                elif prev is not None and src is not None and src.rank != rank:
                    recvs.append(s.start - max(prev.end, src.end))
                prev, received = s, False
    split = {(s.stage, s.mb) for s in compute if s.kind == "W"}
    kind = {id(s): "B_input" if s.kind == "B" and (s.stage, s.mb) in split else s.kind for s in compute}
    costs = {k: mean([s.duration for s in compute if kind[id(s)] == k] or [0.0]) for k in ("F", "B", "B_input", "W")}
    return dict(costs, gap=mean(gaps or [0.0]), recv=mean(recvs or [0.0]), n_gap=len(gaps), n_recv=len(recvs))


def bubble_with_costs(schedule, spans, costs: dict | None = None) -> float:
    """The bubble `simulate` predicts for ``schedule`` with the costs measured on ``spans``.

    Every compute takes its measured mean plus the executor's gap; every receive adds
    recv - gap (its measured cost beyond that gap) to its receiver, from the later of
    the receiver's and the sender's arrival (`simulate(t_recv=)`). The ranks are busy
    only in their computes, as in `labkit.measure.timeline.bubble_fraction`.
    """
    from labkit.parallel.schedules import lower, simulate

    c = costs or pipeline_costs(spans)
    g, lowered = c["gap"], lower(schedule)
    n_split = len(lowered.split)
    n = {k: sum(a.kind == k for ops in lowered.ops for a in ops) for k in ("F", "B", "W")}
    # simulate takes one full backward t_b and one t_w (a split B costs t_b - t_w): a schedule
    # with only split backwards gets t_b = B_input + W; a mixed one keeps its full B's measured
    # cost and its W's, so its split B's cost B - W there (measured: B_input, within a gap or so)
    full_b = c["B"] if n["B"] > n_split else c["B_input"] + c["W"] + g
    sim = simulate(lowered, c["F"] + g, full_b + g, t_w=c["W"] + g, t_recv=max(0.0, c["recv"] - g))
    busy = n["F"] * c["F"] + (n["B"] - n_split) * c["B"] + n_split * c["B_input"] + n["W"] * c["W"]
    window = sim.makespan - g  # the measured window ends with the last compute, not with the gap after it
    return 1.0 - busy / (len(lowered.ops) * window)


def prefetch_exposures(spans) -> list[float]:
    """Measured exposed time of each block's forward gather (blocks 1, 2, ...; every rank), seconds.

    Block i's forward gather is the first "allgather" span with ``mb == i`` on its rank (the
    second one is the backward's). Its exposed part is the time it ends after block i-1's "F"
    and after the LAST rank issued it (a collective starts only once every rank has joined it:
    a late peer's delay is load imbalance, not the gather's cost). With prefetch the gather was
    issued before block i-1's forward and only its tail (if any) is waited for; without, all of
    it. Block 0's gather has no forward before it to hide behind and is left out.
    """
    gathers, forwards = {}, {}
    for s in sorted(spans, key=lambda s: s.start):
        if s.kind == "allgather" and s.mb is not None:
            gathers.setdefault((s.rank, s.mb), s)  # the first: the forward's
        elif s.kind == "F":
            forwards.setdefault((s.rank, s.mb), s)
    issued = {}  # block -> when the last rank issued its forward gather
    for (rank, i), g in gathers.items():
        issued[i] = max(issued.get(i, g.start), g.start)
    out = []
    for (rank, i), g in sorted(gathers.items()):
        if i >= 1 and (rank, i - 1) in forwards:
            out.append(max(0.0, g.end - max(issued[i], forwards[rank, i - 1].end)))
    if not out:
        raise ValueError("no block gather with a forward before it: pass the spans of a ZeRO-3 step "
                         "recorded with ZeRO3(..., timeline=tl) (kinds 'allgather' and 'F', mb = block)")
    return out


def check_prefetch(prediction: dict, spans, *more_steps) -> dict:
    """Set `zero3_prefetch`'s prediction against the exposures measured on ``spans`` (one step's), and on
    the spans of ``more_steps`` if given (each another step's).

    measured_exposed_s: the median over the steps of each step's median of `prefetch_exposures` (on
    a shared machine other programs stall a gather now and then, and a few such stalls would
    dominate a mean; a busy core can stall a whole step's gathers, which the median of steps
    outvotes and a pooled median of gathers may not); margin_s: half the predicted gather;
    agree: the measured exposure is within the margin of the predicted one (so a predicted
    "hidden" means less than half a gather measured exposed). Why half a gather: on a few
    shared CPU cores the alpha-beta fit itself moves by about that much from run to run, so
    a narrower margin would judge the machine's load, not the arithmetic.
    """
    per_step = [prefetch_exposures(step) for step in (spans, *more_steps)]
    exposures = [e for step in per_step for e in step]
    measured = median(median(step) for step in per_step)
    margin = prediction["gather_s"] / 2
    return dict(measured_exposed_s=measured, predicted_exposed_s=prediction["exposed_s"], margin_s=margin,
                predicted_hidden=prediction["hidden"], measured_hidden=measured <= margin, n=len(exposures),
                agree=abs(measured - prediction["exposed_s"]) <= margin)


A2A_KINDS = ("dispatch", "combine", "dispatch_grad", "combine_grad")


def all_to_all_seconds(nbytes: float, n_ranks: int, alpha: float, beta: float) -> float:
    """Pairwise all-to-all of a rank's nbytes input over n_ranks (N-1 messages of nbytes/N): (N-1) (alpha + nbytes / (N beta))."""
    return all_gather_seconds(nbytes, n_ranks, alpha, beta)


def two_batch_overlap(a2a_s: float, compute_s: float) -> dict:
    """One MoE layer's forward (or backward) under the two-micro-batch overlap, predicted.

    a2a_s: one half's all-to-all (dispatch or combine: the same rows, both ways); compute_s:
    one half's experts. hideable_exposed_s = max(0, a2a_s - compute_s): B's dispatch behind A's
    experts, A's combine behind B's; hidden: it is 0; layer_exposed_s = 2 a2a_s (A's dispatch,
    B's combine: nothing to hide behind) + 2 hideable_exposed_s; sequential_s = 4 a2a_s, what
    the same halves expose without overlap (EPMoE on the whole batch: 2 all-to-alls of twice
    the rows, the same bytes).
    """
    if a2a_s < 0 or compute_s < 0:
        raise ValueError(f"need a2a_s >= 0 and compute_s >= 0 seconds, got {a2a_s}, {compute_s}")
    hideable = max(0.0, a2a_s - compute_s)
    return dict(a2a_s=a2a_s, compute_s=compute_s, hideable_exposed_s=hideable, hidden=hideable == 0.0,
                layer_exposed_s=2 * a2a_s + 2 * hideable, sequential_s=4 * a2a_s)


def a2a_exposures(spans) -> list[dict]:
    """Every all-to-all of a two-batch step, measured: one dict per span of kind in A2A_KINDS.

    rank, kind, layer (stage), half (mb); hideable: a compute span ("F" or "B") of the same
    rank and layer ran between its issue and its end (the other half's experts);
    exposed_s: the time the rank sat in its wait() (its "wait" span: same rank, stage, mb and
    end) after the LAST rank issued the same all-to-all (a collective cannot finish before every
    rank joined it: waiting for a late peer is load imbalance, not the all-to-all's cost).
    The wait, not "the end of the compute before it": on a shared CPU the rank itself can stall
    for milliseconds between two calls, and that is no time spent on the all-to-all.
    """
    a2a = [s for s in spans if s.kind in A2A_KINDS]
    if not a2a:
        raise ValueError("no all-to-all spans: pass the spans of a step of solutions/moe_overlap.py's "
                         f"TwoBatchEPMoE recorded on a Timeline (kinds {A2A_KINDS}, stage = layer, mb = half)")
    last_issue = {}
    for s in a2a:
        key = (s.kind, s.stage, s.mb)
        last_issue[key] = max(last_issue.get(key, s.start), s.start)
    waits = {(w.rank, w.stage, w.mb, w.end): w for w in spans if w.kind == "wait"}
    compute = [s for s in spans if s.kind in ("F", "B")]
    out = []
    for s in sorted(a2a, key=lambda s: (s.rank, s.start)):
        wait = waits.get((s.rank, s.stage, s.mb, s.end))
        if wait is None:
            raise ValueError(f"the {s.kind} span of layer {s.stage}, half {s.mb} on rank {s.rank} has no 'wait' span "
                             "ending with it: record the spans with solutions/moe_overlap.py's start_all_to_all")
        inside = [c for c in compute if c.rank == s.rank and c.stage == s.stage and c.start >= s.start
                  and c.end <= s.end]
        out.append(dict(rank=s.rank, kind=s.kind, layer=s.stage, half=s.mb, hideable=bool(inside),
                        exposed_s=max(0.0, s.end - max(wait.start, last_issue[s.kind, s.stage, s.mb]))))
    return out


def check_two_batch(prediction: dict, spans, backward: bool = False) -> dict:
    """Set `two_batch_overlap`'s prediction against the hideable all-to-alls measured on ``spans``.

    Forward all-to-alls ("dispatch", "combine"), or the backward's with backward=True.
    measured_exposed_s: the median exposure of the hideable ones; ends_exposed_s: the median of
    the others (predicted: a2a_s each); margin_s: half the predicted all-to-all, as
    `check_prefetch` (the alpha-beta fit itself moves by about that much between runs on a
    few shared cores); agree: the hideable median is within the margin of the prediction.
    """
    kinds = ("dispatch_grad", "combine_grad") if backward else ("dispatch", "combine")
    rows = [r for r in a2a_exposures(spans) if r["kind"] in kinds]
    hideable = [r["exposed_s"] for r in rows if r["hideable"]]
    ends = [r["exposed_s"] for r in rows if not r["hideable"]]
    if not hideable:
        raise ValueError(f"no {'/'.join(kinds)} span had the other half's compute inside it: was the step overlapped?")
    measured, margin = median(hideable), prediction["a2a_s"] / 2
    return dict(measured_exposed_s=measured, predicted_exposed_s=prediction["hideable_exposed_s"], margin_s=margin,
                ends_exposed_s=median(ends) if ends else 0.0, n=len(hideable), predicted_hidden=prediction["hidden"],
                measured_hidden=measured <= margin, agree=abs(measured - prediction["hideable_exposed_s"]) <= margin)
