"""Bytes each GPU sends per step, per axis, in closed form, and their alpha-beta time (notebook 15).

Ring algorithms over a group of n (nccl-tests' bus factors): an all-gather or a reduce-scatter
of a full tensor of B bytes sends (n-1)/n x B from each rank in n-1 steps; an all-reduce twice
that in 2(n-1) steps; an all-to-all (n-1)/n x B in n-1 exchanges; a send is B in one step.
Time of one collective: steps x alpha + bytes sent / beta, where (alpha, beta) is the link of
the group's level (`Layout.level`): NVLink inside a node, the GPU's NIC across nodes.

Per step (all micro-batches), for one GPU, with T = its tokens per micro-batch = mb x s / cp
(b s d-sized activations in bf16: A = 2 mb s d):
    tp   with SP, per block: forward 2 all-gathers + 2 reduce-scatters of A, backward the same
         (without SP: 2 all-reduces each way, the same bytes); full recompute repeats forward's
    cp   ring attention: forward passes its K and V (2 x 2 T d_kv bytes) cp-1 times around the
         ring, backward passes K, V and their gradients (twice that); the other methods' bytes per
         layer (all-gather, Ulysses, the hybrid) are `cp_attention_bytes`, not yet in `axis_traffic`
    ep   dispatch and combine all-to-alls of top_k x T tokens of d (bf16), forward and backward
    pp   each micro-batch's activation forward and its gradient backward: A/(tp if SP) each way,
         v times with an interleaved schedule of v virtual stages per rank (each micro-batch goes
         round the ranks v times: "the amount of communication also increases by v", Narayanan
         et al. 2021, arXiv 2104.04473, section 2.2.2)
    dp   plain DP / ZeRO-1 / ZeRO-2: the gradients (the states' gradient bytes), reduced once
         per step (all-reduce; ZeRO-1/2: reduce-scatter + all-gather of the parameters, the same
         bytes). ZeRO-3: all-gather bf16 parameters in forward and again in backward, reduce-scatter
         fp32 gradients (FSDP2 as torchtitan: 2 + 2 + 4 bytes per parameter)
    hsdp `hsdp_traffic`: dp split into R replicas x S shards (torchtitan's dp_replicate x dp_shard);
         the dp terms above inside the shard group, plus an all-reduce of the 1/S gradient shard
         (fp32 under ZeRO-3) across the replicas: 2 (R-1)/R x 4 P/S, on the network
"""
from __future__ import annotations

BF16 = 2


def ring_time(kind: str, nbytes: float, n: int, alpha: float, beta: float) -> tuple[float, float]:
    """(bytes sent per rank, seconds) of one ring collective of a full tensor of `nbytes` over n ranks."""
    if n <= 1 or nbytes <= 0:
        return 0.0, 0.0
    factor, steps = {"all_gather": (1, 1), "reduce_scatter": (1, 1), "all_to_all": (1, 1),
                     "all_reduce": (2, 2), "send": (None, None)}[kind]
    if kind == "send":
        return nbytes, alpha + nbytes / beta
    sent = factor * (n - 1) / n * nbytes
    return sent, steps * (n - 1) * alpha + sent / beta


def axis_traffic(model, layout, cluster, n_micro: int, seq_len: int, params_per_gpu: dict,
                 value_bytes: int = BF16) -> dict:
    """{axis: {"bytes": sent per GPU per step, "seconds": alpha-beta time, "count": collectives}}.

    params_per_gpu: {"dense": ..., "experts": ...} parameters this GPU holds before ZeRO
    (its stage, its tp shard), from the footprint. value_bytes: of the activations, parameters and
    gradients that travel (2: bf16, as on GPUs; 4: the lab's fp32 runs on the CPU).
    """
    BF16 = value_bytes  # noqa: N806 (the closed forms below read as the docstring's)
    m, L = model, layout.layers_per_rank(model.n_layers)
    mb, s = layout.micro_batch, seq_len // layout.cp
    act = BF16 * mb * s * m.d_model
    out = {}

    def add(axis, kind, nbytes, n, count):
        # the data-parallel group is dp x cp: it stays in a node only if its dp part does
        where = "cp" if axis == "dp" and layout.dp == 1 else axis
        alpha, beta = cluster.link(layout.level(where, cluster.gpus_per_node))
        sent, secs = ring_time(kind, nbytes, n, alpha, beta)
        entry = out.setdefault(axis, {"bytes": 0.0, "seconds": 0.0, "count": 0})
        if sent:
            entry["bytes"] += sent * count
            entry["seconds"] += secs * count
            entry["count"] += count

    passes = 3 if layout.recompute == "full" else 2  # forward, backward (+ forward again)
    per_block = 4 * L * n_micro * passes  # 2 (AG + RS) for attention, 2 for the MLP
    if layout.sequence_parallel:
        add("tp", "all_gather", act, layout.tp, per_block // 2)
        add("tp", "reduce_scatter", act, layout.tp, per_block // 2)
    else:
        add("tp", "all_reduce", act, layout.tp, per_block // 2)
    kv = 2 * BF16 * mb * s * m.kv_dim
    add("cp", "send", kv, layout.cp, L * n_micro * (layout.cp - 1) * (3 if layout.recompute != "full" else 4))
    if m.n_experts:
        tokens = BF16 * m.top_k * mb * s * m.d_model / (layout.tp if layout.sequence_parallel else 1)
        add("ep", "all_to_all", tokens, layout.ep, 2 * 2 * L * n_micro)
    if layout.pp > 1:
        v = layout.virtual_stages if layout.schedule == "interleaved" else 1
        add("pp", "send", act / (layout.tp if layout.sequence_parallel else 1), 2, 2 * n_micro * v)
    n_dp = layout.dp * layout.cp
    for axis_params, ranks in ((params_per_gpu["dense"], n_dp), (params_per_gpu["experts"], n_dp // layout.ep)):
        if layout.zero == "zero3":
            add("dp", "all_gather", BF16 * axis_params, ranks, 2)
            add("dp", "reduce_scatter", 4 * axis_params, ranks, 1)
        else:
            add("dp", "all_reduce", BF16 * axis_params, ranks, 1)
    return out


def hsdp_traffic(params: float, replicate: int, shard: int, cluster, *, zero: str = "zero3",
                 shard_stride: int = 1, value_bytes: int = BF16, grad_bytes: int = 4) -> dict:
    """HSDP's data-parallel traffic by link level: {"shard": {...}, "replica": {...}}, each
    {"bytes": sent per GPU per step, "seconds": alpha-beta time, "count": collectives, "level": link}.

    params: the parameters each GPU's data-parallel group reduces (P); the W = replicate x shard
    data-parallel ranks are R replicas of S shards (solutions/hsdp.py, notebook 10). Shard group:
    S ranks `shard_stride` apart (the product of the axes inside dp_shard: tp, cp), on NVLink when
    S x shard_stride <= gpus_per_node, else the network; replica group: across nodes, the network
    (unless the whole dp group fits in a node). Per step, per GPU:
        zero="zero3" (FSDP2's HSDP): shard  all-gather value_bytes P twice (forward, backward)
                                            + reduce-scatter grad_bytes P: (S-1)/S x (2 value + grad) P
                                     replica all-reduce of grad_bytes P / S: 2 (R-1)/R x grad_bytes P/S
        otherwise (ZeRO-1/2 in the node, HSDPOptimizer): shard  reduce-scatter + all-gather of
                                     value_bytes P: 2 (S-1)/S x value P; replica 2 (R-1)/R x value P/S
    The two levels of the ZeRO-1/2 form add up to a flat all-reduce's 2 (W-1)/W x value P.
    """
    node = shard * shard_stride <= cluster.gpus_per_node
    levels = {"shard": "node" if node else "network",
              "replica": "node" if replicate * shard * shard_stride <= cluster.gpus_per_node else "network"}
    out = {name: {"bytes": 0.0, "seconds": 0.0, "count": 0, "level": level} for name, level in levels.items()}

    def add(name, kind, nbytes, n, count):
        sent, secs = ring_time(kind, nbytes, n, *cluster.link(levels[name]))
        if sent:
            out[name]["bytes"] += sent * count
            out[name]["seconds"] += secs * count
            out[name]["count"] += count

    reduced = grad_bytes if zero == "zero3" else value_bytes
    if zero == "zero3":
        add("shard", "all_gather", value_bytes * params, shard, 2)
    else:
        add("shard", "all_gather", value_bytes * params, shard, 1)
    add("shard", "reduce_scatter", reduced * params, shard, 1)
    add("replica", "all_reduce", reduced * params / shard, replicate, 1)
    return out


CP_METHODS = ("ring", "allgather", "ulysses", "hybrid")


def cp_attention_bytes(method: str, cp: int, q_bytes: float, kv_bytes: float, local: int = 1) -> dict:
    """Bytes ONE rank sends for one attention layer, forward and backward, by context-parallel method and pattern.

    q_bytes: this rank's q (= its output, its dq, its dout) before any swap, b (s/cp) H hd x value bytes;
    kv_bytes: its k (= v, dk, dv), the same with the K/V heads (fewer under GQA). The lab's code
    (solutions/ring_attention.py, solutions/cp_methods.py), as labkit.comm counts it (a collective's wire bytes,
    a point-to-point message's payload), the shape agreement of a few int64 left out:
        ring        {"p2p": 2 kv (3cp - 2)}: K,V sent cp-1 times forward, cp-1 times backward, dK,dV cp times
                    (the last hop brings them home; `axis_traffic` above counts 3 (cp-1), without that hop)
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
