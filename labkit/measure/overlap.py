"""When communication hides behind compute: the arithmetic, from the alpha-beta fit and a FLOP rate.

    t_msg = message_seconds(nbytes, alpha, beta)          # alpha + bytes / beta
    pipeline_exposed_seconds(p, t_msg)                   # 2 (p - 1) t_msg per step, whatever m
    zero3_prefetch(layer_params, n_ranks, tokens, flop_rate, alpha, beta)

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
hides it is `min_tokens`.
"""
from __future__ import annotations


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
