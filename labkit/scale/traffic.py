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
         ring, backward passes K, V and their gradients (twice that)
    ep   dispatch and combine all-to-alls of top_k x T tokens of d (bf16), forward and backward
    pp   each micro-batch's activation forward and its gradient backward: A/(tp if SP) each way,
         v times with an interleaved schedule of v virtual stages per rank (each micro-batch goes
         round the ranks v times: "the amount of communication also increases by v", Narayanan
         et al. 2021, arXiv 2104.04473, section 2.2.2)
    dp   plain DP / ZeRO-1 / ZeRO-2: the gradients (the states' gradient bytes), reduced once
         per step (all-reduce; ZeRO-1/2: reduce-scatter + all-gather of the parameters, the same
         bytes). ZeRO-3: all-gather bf16 parameters in forward and again in backward, reduce-scatter
         fp32 gradients (FSDP2 as torchtitan: 2 + 2 + 4 bytes per parameter)
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
