"""Context parallelism's traffic: each CP method's bytes per attention layer, their items per direction with the
level, kind and size that price them, which of them hide behind attention, and the K/V heads each method moves
(notebooks 11, 14 and 15; labkit.scale.traffic adds them to a step's other axes).
"""
from __future__ import annotations

import math


CP_METHODS = ("ring", "allgather", "ulysses", "hybrid")
# how the ring's K/V reach every rank (Layout.kv_rotation): hop by hop (the lab's ring) or torch's context_parallel
# default, one all-gather launched at the ring's first step and waited for at its second (_AllGatherRotater)
KV_ROTATIONS = ("p2p", "allgather")


def cp_attention_bytes(method: str, cp: int, q_bytes: float, kv_bytes: float, local: int = 1) -> dict:
    """Bytes ONE rank sends for one attention layer, forward and backward, by context-parallel method and pattern.

    q_bytes: this rank's q (= its output, its dq, its dout) before any swap, b (s/cp) H hd x value bytes;
    kv_bytes: its k (= v, dk, dv), the same with the K/V heads (fewer under GQA). The lab's code
    (solutions/ring_attention.py, solutions/cp_methods.py), as labkit.comm counts it (a collective's wire bytes,
    a point-to-point message's payload), the shape agreement of a few int64 left out:
        ring        {"p2p": 2 kv (3cp - 2)}: K,V sent cp-1 times forward, cp-1 times backward, dK,dV cp times
                    (the last hop brings them home; `axis_traffic` counts it too, via `cp_layer_traffic`)
        allgather   {"all_gather": 2 kv (cp-1), "reduce_scatter": 2 kv (cp-1)}: K,V gathered, dK,dV scattered
        ulysses     {"all_to_all": 4 (q + kv) (cp-1)/cp}: q, k, v in and out back forward; dout in, dq, dk, dv
                    back backward (needs the heads, and the K/V heads, divisible by cp)
        hybrid      {"all_to_all": 4 (q + kv) (l-1)/l, "p2p": 2 kv (3o - 2) if o > 1}: Ulysses inside groups of
                    l = `local` cp ranks (a node), the ring across o = cp/l groups on K,V blocks of l x the
                    positions and 1/l of the heads (the same bytes as before the swap)
    """
    if method not in CP_METHODS:
        raise ValueError(f"method={method!r} is not a context-parallel method: choose one of {', '.join(CP_METHODS)}")
    if cp < 1 or local < 1 or cp % local:
        raise ValueError(f"local={local} must divide cp={cp} (groups of local cp ranks, a ring across them)")
    if cp == 1:
        return {}
    if method == "ring":
        return {"p2p": 2 * kv_bytes * (3 * cp - 2)}
    if method == "allgather":
        return {"all_gather": 2 * kv_bytes * (cp - 1), "reduce_scatter": 2 * kv_bytes * (cp - 1)}
    if method == "ulysses":
        return {"all_to_all": 4 * (q_bytes + kv_bytes) * (cp - 1) / cp}
    nodes = cp // local
    out = {"all_to_all": 4 * (q_bytes + kv_bytes) * (local - 1) / local}
    if nodes > 1:
        out["p2p"] = 2 * kv_bytes * (3 * nodes - 2)
    return out


def cp_kv_heads(method: str, kv_heads: int, cp: int, local: int = 1) -> int:
    """K/V heads per tp rank as the method moves and holds them: the all-to-all of Ulysses (over cp) and of the
    hybrid (over `local`) needs a multiple of its ranks, so GQA's fewer K/V heads are replicated up to
    lcm(kv_heads, ranks) (solutions/cp_methods.py's docstring: "each K/V head replicated on c/n_kv ranks");
    the ring and the all-gather move them as they are."""
    ranks = {"ulysses": cp, "hybrid": local}.get(method, 1)
    return math.lcm(kv_heads, ranks)


def cp_exposed(total_s: float, hideable_s: float, first_step_s: float, attention_s: float, cp: int) -> float:
    """Seconds of cp's traffic left on the critical path, by `cp_layer_traffic`'s hideable marks: the ring's hops
    hide behind all of attention, its K/V all-gather ("first") behind the first step's, attention / cp; the rest
    is paid whole. Both cost models use it (labkit.scale.cost.step_time, labkit.scale.cost_kernels)."""
    first_window = attention_s / cp if cp > 1 else 0.0
    return (max(0.0, hideable_s - attention_s) + max(0.0, first_step_s - first_window)
            + max(0.0, total_s - hideable_s - first_step_s))


def cp_layer_traffic(method: str, cp: int, q_bytes: float, kv_bytes: float, local: int = 1,
                     rotation: str = "p2p") -> dict:
    """One attention layer's context-parallel traffic for one micro-batch, by direction:
    {"forward": [...], "backward": [...]}, items (where, bytes sent, alpha steps, calls, hideable, kind,
    message, ranks): kind, message (one call's whole tensor, nccl-tests' S) and ranks choose its bus bandwidth
    (`Cluster.link`).

    where: "cp" (the cp group's own level), "node" (the hybrid's all-to-alls among the cp ranks of a
    node) or "network" (its ring across the o = cp / local nodes). hideable: True for the ring's K/V blocks,
    which flow while attention computes on the previous block (Liu et al. 2023); "first" for the ring's K/V
    all-gather under rotation="allgather" (torch's _templated_ring_attention launches it before its first step
    and waits for it before its second: only that step, 1/cp of the attention, hides it); False for the
    all-gather, the all-to-alls and the dK/dV reduce-scatter, on the critical path ("the all-gather communication
    latency is exposed in the critical path", Dubey et al. 2024, arXiv 2407.21783, section 3.3.2).
    Per direction (c = cp, l = local, kv = one of K, V; the two directions add up to `cp_attention_bytes`):
        ring       forward c-1 hops of K,V (2 kv each); backward 2c-1 (K,V c-1, dK,dV c: home included);
                   rotation="allgather": the K,V hops of each direction are one all-gather (2 kv (c-1), c-1
                   steps), the same bytes; dK,dV still hop
        allgather  forward one all-gather (wire 2 kv (c-1), c-1 steps); backward one reduce-scatter, the same
        ulysses    forward 4 all-to-alls (q, k, v in, out back: 2 (q + kv) (c-1)/c, c-1 steps each);
                   backward 4 (dout in; dq, dk, dv back), the same
        hybrid     the Ulysses terms over l ranks ("node"), and the ring's over o ("network")
    """
    if method not in CP_METHODS:
        raise ValueError(f"method={method!r} is not a context-parallel method: choose one of {', '.join(CP_METHODS)}")
    if rotation not in KV_ROTATIONS:
        raise ValueError(f"rotation={rotation!r}: how the ring's K/V move, one of {', '.join(KV_ROTATIONS)}")

    def ring(n, where):  # (forward, backward) of a ring of n: hops of one K,V pair, each one alpha
        if n <= 1:
            return [], []
        return ([(where, 2 * kv_bytes * (n - 1), n - 1, n - 1, True, "send", 2 * kv_bytes, 2)],
                [(where, 2 * kv_bytes * (2 * n - 1), 2 * n - 1, 2 * n - 1, True, "send", 2 * kv_bytes, 2)])

    def swaps(n, where):  # one direction's 4 all-to-alls over n ranks (one of q, k, v, out: (q + kv) / 2 on average)
        return [] if n <= 1 else [(where, 2 * (q_bytes + kv_bytes) * (n - 1) / n, 4 * (n - 1), 4, False,
                                   "all_to_all", (q_bytes + kv_bytes) / 2, n)]

    if method == "ring" and rotation == "allgather" and cp > 1:
        gather = ("cp", 2 * kv_bytes * (cp - 1), cp - 1, 1, "first", "all_gather", 2 * kv_bytes * cp, cp)
        forward, backward = [gather], [gather, ("cp", 2 * kv_bytes * cp, cp, cp, True, "send", 2 * kv_bytes, 2)]
    elif method == "ring":
        forward, backward = ring(cp, "cp")
    elif method == "allgather":  # K,V gathered (S = 2 kv cp) forward, dK,dV reduce-scattered backward
        forward = [("cp", 2 * kv_bytes * (cp - 1), cp - 1, 1, False, "all_gather", 2 * kv_bytes * cp, cp)] if cp > 1 else []
        backward = [("cp", 2 * kv_bytes * (cp - 1), cp - 1, 1, False, "reduce_scatter", 2 * kv_bytes * cp, cp)] if cp > 1 else []
    elif method == "ulysses":
        forward = backward = swaps(cp, "cp")
    else:
        across_forward, across_backward = ring(cp // local, "network")
        forward, backward = swaps(local, "node") + across_forward, swaps(local, "node") + across_backward
    return {"forward": forward, "backward": backward}
