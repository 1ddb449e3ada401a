"""Bytes each GPU sends per step, per axis, in closed form, and their alpha-beta time (notebook 15).

Ring algorithms over a group of n (nccl-tests' bus factors): an all-gather or a reduce-scatter
of a full tensor of B bytes sends (n-1)/n x B from each rank in n-1 steps; an all-reduce twice
that in 2(n-1) steps; an all-to-all (n-1)/n x B in n-1 exchanges; a send is B in one step.
Time of one collective: steps x alpha + bytes sent / beta, where (alpha, beta) is the link of
the group's level (`Layout.level`, `Cluster.link`): inside a node the measured nccl-tests bus
bandwidth where the cluster file gives one (`node_busbw_gbytes_per_s`; the collective kind's own,
at the call's size, where `busbw_by_kind` gives one), else NVLink's datasheet rate; across nodes one NIC
per rank of the group in each node for its all-gathers, reduce-scatters and all-reduces (NCCL's channels cross
between nodes on every GPU's NIC: `Layout.ranks_per_node`, `Cluster.link`'s per_node), never above the same
collective inside the node, and the rank's own NIC for its all-to-alls and sends. Each call's time is
labkit.scale.collectives' (`ring_link`, `ring_time`), the lab's one model of a collective.

Per step (all micro-batches), for one GPU, with T = its tokens per micro-batch = mb x s / cp
(b s d-sized activations in bf16: A = 2 mb s d):
    tp   with SP, per block: forward 2 all-gathers + 2 reduce-scatters of A, backward the same
         (without SP: 2 all-reduces each way, the same bytes), plus the forward's collectives the
         recompute policy runs again in the backward (`tp_collectives`): full recompute all four,
         torchtitan's op policy its 2 all-gathers (2 all-reduces without SP), Megatron's none.
         Under torchao's float8 tensorwise TP the all-gathers move float8 values (`tp_gather_bytes`)
    cp   per layer and micro-batch, `cp_layer_traffic` by `layout.cp_method`: the bytes of
         `cp_attention_bytes` (the lab's code as labkit.comm counts it) with q = T d / tp and
         kv = T d_kv / tp values (this tp rank's heads; Ulysses and the hybrid replicate K/V heads
         to lcm(n_kv / tp, c) when there are fewer than the all-to-all's c ranks, GQA's price),
         split into forward and backward; full recompute repeats the forward's. The ring's
         sends (across nodes for the hybrid) overlap attention; the all-gather's and the
         all-to-alls' are on the critical path (cost.step_time)
    ep   dispatch and combine all-to-alls of top_k x T tokens of d (bf16), forward and backward;
         with `ep_overlap` each micro-batch's are two halves' (half the bytes each, twice the
         calls: the same bytes, twice the latency terms). The group follows the Layout's expert
         mesh (`Layout.level("ep")`): folded over dp_shard x cp, or, when ep does not divide that,
         over dp_shard x cp x tp as torchtitan's [pp, dp_replicate, efsdp, ep] (`Layout.ep_over_tp`).
         Per GPU per step, with T/tp tokens per tp rank (SP), E the experts' parameters per GPU
         (E_all L_rank / (etp ep), etp = `Layout.expert_tp`: tp, or 1 when folded over tp) and
         n_e = `Layout.efsdp` (dp_shard cp / ep, or dp_shard cp tp / ep folded), m micro-batches:
             ep bytes   = 4 L_rank m x (ep-1)/ep x 2 top_k (mb s / cp / tp) d
             experts' dp bytes (ZeRO-3) = (n_e - 1)/n_e x (2 + 2 + 4) E, (plain DP, ZeRO-1/2) 2 (n_e - 1)/n_e x 2 E;
             under HSDP `hsdp_traffic` with S = n_e, R = dp_replicate
    pp   each micro-batch's activation forward and its gradient backward: A/(tp if SP) each way,
         v times with an interleaved schedule of v virtual stages per rank (each micro-batch goes
         round the ranks v times: "the amount of communication also increases by v", Narayanan
         et al. 2021, arXiv 2104.04473, section 2.2.2)
    dp   plain DP / ZeRO-1 (and ZeRO-2 in a pipeline): the gradients (the states' gradient bytes),
         reduced once per step (all-reduce; ZeRO-1/2: reduce-scatter + all-gather of the parameters,
         the same bytes). ZeRO-2 without a pipeline: a reduce-scatter of the bf16 gradients per
         micro-batch, one all-gather of the parameters. ZeRO-3: all-gather bf16 parameters in forward
         and again in backward, reduce-scatter fp32 gradients (FSDP2 as torchtitan: 2 + 2 + 4 bytes
         per parameter), per micro-batch without a pipeline, once inside one (labkit.scale.zero_calls)
    hsdp `hsdp_traffic`: dp split into R replicas x S shards (torchtitan's dp_replicate x dp_shard);
         the dp terms above inside the shard group, plus an all-reduce of the 1/S gradient shard
         (fp32 under ZeRO-3) across the replicas: 2 (R-1)/R x 4 P/S, on the network. In
         `axis_traffic` when layout.dp_replicate > 1: R = dp_replicate, S = dp_shard x cp
         (experts: / ep), the shard group's level from its span dp_shard x pp x cp x tp
"""
from __future__ import annotations

from labkit.scale import deepspeed_zero3 as ds
from labkit.scale.collectives import ring_link, ring_time
from labkit.scale.cp_traffic import (CP_METHODS, KV_ROTATIONS, cp_attention_bytes, cp_exposed,  # noqa: F401
                                     cp_kv_heads, cp_layer_traffic)  # (CP's own module; re-exported here)
from labkit.scale.zero_calls import ZERO3_GRAD_BYTES, dp_calls, zero3_calls

BF16 = 2


# The forward's TP collectives a block's backward runs again, per recompute policy: (all-gathers,
# reduce-scatters) with SP, all-reduces without. A selective policy replays the forward, hands back the
# saved outputs of the ops it lists and runs every other op again, collectives included. torchtitan's op
# policy lists reduce_scatter_tensor, not all_gather_into_tensor nor all_reduce (`_save_list` in
# torchtitan/models/llama3/infra/parallelize.py, June 2025; today `_COMM_OPS` in torchtitan/distributed/
# activation_checkpoint.py, "Communication ops whose outputs should be saved to avoid re-communication"):
# its 2 all-gathers run again (they feed wk and w3, recomputed). Full: all four; Megatron's (attention core)
# and none: no collective.
TP_RECOMPUTED = {"none": (0, 0, 0), "selective-attn": (0, 0, 0), "selective-op": (2, 0, 2), "full": (2, 2, 2)}


def tp_collectives(recompute: str, sequence_parallel: bool = True) -> dict:
    """One block's TP collectives per micro-batch: {"forward", "backward", "recomputed"} counts (the backward's
    own, and the forward's run again by the recompute policy), and by kind: with SP {"all_gather",
    "reduce_scatter"} = 2 + 2 + what is recomputed of each; without SP {"all_reduce"} = 2 + 2 + recomputed."""
    if recompute not in TP_RECOMPUTED:
        raise ValueError(f"recompute={recompute!r} is not a policy the model knows: choose one of {sorted(TP_RECOMPUTED)}")
    gathers, scatters, reduces = TP_RECOMPUTED[recompute]
    if sequence_parallel:
        return {"forward": 4, "backward": 4, "recomputed": gathers + scatters,
                "all_gather": 4 + gathers, "reduce_scatter": 4 + scatters}
    return {"forward": 2, "backward": 2, "recomputed": reduces, "all_reduce": 4 + reduces}


def call_seconds(layout, cluster, axis: str, kind: str, nbytes: float, n: int, message: float | None = None
                 ) -> tuple[float, float]:
    """(bytes sent, seconds) of one `kind` collective of a full tensor of nbytes over n ranks of `axis`'s group: the
    link of the group's level at the size each call moves (`message`, where a count folds several: FSDP's per-block
    gathers), ring_time's alpha-beta."""
    # the data-parallel group is dp x cp: it stays in a node only if its dp part does
    where = "cp" if axis == "dp" and layout.dp == 1 else axis
    gpn = cluster.gpus_per_node
    per_node = min(n, layout.ranks_per_node("dpcp" if axis == "dp" else axis, gpn))  # the NICs a ring spreads over
    alpha, beta = ring_link(cluster, layout.level(where, gpn), kind, message or nbytes, n, per_node)
    calls = nbytes / message if message else 1.0  # a count that folds several collectives pays each one's latency
    sent, secs = ring_time(kind, nbytes / calls, n, alpha, beta)
    return sent * calls, secs * calls


def tp_call_seconds(entry: dict, sequence_parallel: bool) -> tuple[float, float]:
    """(one all-gather, one reduce-scatter) of a block's TP collectives for one micro-batch, seconds (without SP
    both are the all-reduce's), from the "calls" axis_traffic records in its "tp" entry."""
    calls = entry.get("calls", {})
    if sequence_parallel:
        return calls.get("all_gather", 0.0), calls.get("reduce_scatter", 0.0)
    return calls.get("all_reduce", 0.0), calls.get("all_reduce", 0.0)


def tp_pass_seconds(entry: dict, recompute: str, sequence_parallel: bool) -> tuple[float, float]:
    """(forward, backward) seconds of one block's TP collectives for one micro-batch, each kind at its own time
    (`tp_call_seconds`); the backward holds what the recompute policy runs again (`TP_RECOMPUTED`)."""
    n = tp_collectives(recompute, sequence_parallel)  # refuses a policy it does not know, by name
    gather, scatter = tp_call_seconds(entry, sequence_parallel)
    if sequence_parallel:
        return 2 * gather + 2 * scatter, (n["all_gather"] - 2) * gather + (n["reduce_scatter"] - 2) * scatter
    return 2 * gather, (n["all_reduce"] - 2) * gather


def axis_traffic(model, layout, cluster, n_micro: int, seq_len: int, params_per_gpu: dict,
                 value_bytes: int = BF16, tp_gather_bytes: int | None = None, *,
                 fsdp_gather_bytes: float | None = None) -> dict:
    """{axis: {"bytes": sent per GPU per step, "seconds": alpha-beta time, "count": collectives}}; "tp" also holds
    "calls": {kind: one call's seconds}.

    params_per_gpu: {"dense": ..., "experts": ...} parameters this GPU holds before ZeRO
    (its stage, its tp shard), from the footprint. value_bytes: of the activations, parameters and
    gradients that travel (2: bf16, as on GPUs; 4: the lab's fp32 runs on the CPU). tp_gather_bytes: of the
    values TP's all-gathers move where that differs (torchao's float8 tensorwise TP gathers float8:
    `labkit.scale.float8.tp_gather_bytes`); its reduce-scatters keep value_bytes. fsdp_gather_bytes: per dense
    parameter, what FSDP2's all-gathers move (flat or HSDP's shard group) where that differs (torchao's float8
    all-gather: `labkit.scale.float8.fsdp_gather_bytes`); the experts' and DeepSpeed's gathers keep value_bytes.
    """
    BF16 = value_bytes  # noqa: N806 (the closed forms below read as the docstring's)
    m, L = model, layout.layers_per_rank(model.n_layers)
    mb, s = layout.micro_batch, seq_len // layout.cp
    act = BF16 * mb * s * m.d_model
    out = {}

    def add(axis, kind, nbytes, n, count, message=None):
        sent, secs = call_seconds(layout, cluster, axis, kind, nbytes, n, message)
        entry = out.setdefault(axis, {"bytes": 0.0, "seconds": 0.0, "count": 0})
        if sent:
            entry["bytes"] += sent * count
            entry["seconds"] += secs * count
            entry["count"] += count
        if axis == "tp":
            entry.setdefault("calls", {})[kind] = secs

    tp = tp_collectives(layout.recompute, layout.sequence_parallel)  # per block and micro-batch
    if layout.sequence_parallel:
        gathered = act if tp_gather_bytes is None else act * tp_gather_bytes / BF16
        add("tp", "all_gather", gathered, layout.tp, L * n_micro * tp["all_gather"])
        add("tp", "reduce_scatter", act, layout.tp, L * n_micro * tp["reduce_scatter"])
    else:
        add("tp", "all_reduce", act, layout.tp, L * n_micro * tp["all_reduce"])
    if layout.cp > 1:
        local = layout.cp_local(cluster.gpus_per_node)
        head_dim = m.d_model // m.n_heads
        q = BF16 * mb * s * m.d_model / layout.tp
        kv = BF16 * mb * s * head_dim * cp_kv_heads(layout.cp_method, m.attention_kv_heads // layout.tp, layout.cp, local)
        levels = {"cp": layout.level("cp", cluster.gpus_per_node), "node": "node", "network": "network"}
        entry = out.setdefault("cp", {"bytes": 0.0, "seconds": 0.0, "count": 0, "hideable_seconds": 0.0,
                                      "first_step_seconds": 0.0})
        passes = {"forward": 2 if layout.recompute == "full" else 1, "backward": 1}
        layer = cp_layer_traffic(layout.cp_method, layout.cp, q, kv, local, layout.kv_rotation)
        for direction, parts in layer.items():
            for where, sent, steps, calls, hideable, kind, message, ranks in parts:
                # the cp group's own ranks in a node where it spans nodes; the hybrid's cross-node ring has one
                per_node = min(ranks, layout.ranks_per_node("cp", cluster.gpus_per_node)) if where == "cp" else 1
                alpha, beta = ring_link(cluster, levels[where], kind, message, ranks, per_node)
                times = L * n_micro * passes[direction]
                secs = (steps * alpha + sent / beta) * times
                entry["bytes"] += sent * times
                entry["seconds"] += secs
                entry["count"] += calls * times
                entry["hideable_seconds"] += secs if hideable is True else 0.0
                entry["first_step_seconds"] += secs if hideable == "first" else 0.0
    if m.n_experts:
        tokens = BF16 * m.top_k * mb * s * m.d_model / (layout.tp if layout.sequence_parallel else 1)
        halves = 2 if layout.ep_overlap else 1  # two half micro-batches: half the bytes each, twice the calls
        add("ep", "all_to_all", tokens / halves, layout.ep, halves * 2 * 2 * L * n_micro)
    if layout.pp > 1:
        v = layout.virtual_stages if layout.schedule == "interleaved" else 1
        add("pp", "send", act / (layout.tp if layout.sequence_parallel else 1), 2, 2 * n_micro * v)
    calls = dp_calls(layout.zero, layout.pp, n_micro)
    gather = BF16 if fsdp_gather_bytes is None else fsdp_gather_bytes  # per dense parameter, FSDP2's all-gathers
    if layout.dp_replicate > 1:
        _add_hsdp(out, layout, cluster, params_per_gpu, BF16, blocks=L, calls=calls, dense_gather_bytes=gather)
        return out
    n_dp = layout.dp * layout.cp
    for axis_params, ranks in ((params_per_gpu["dense"], n_dp), (params_per_gpu["experts"], layout.efsdp)):
        if layout.zero == "zero3" and layout.zero3_unit == "module" and axis_params is params_per_gpu["dense"]:
            # DeepSpeed's ZeRO-3: each weight gathered as its trace's releases make it (labkit.scale.deepspeed_zero3)
            # and its fp16 gradient reduce-scattered once per micro-batch
            numels = ds.numels(model, layout)
            for name, gathers in ds.fetch_counts(numels, L, n_micro, layout.recompute == "full").items():
                add("dp", "all_gather", BF16 * numels[name], ranks, gathers)
                scatters = n_micro * (1 if name in ds.ENDS else L)
                add("dp", "reduce_scatter", ds.GRAD_BYTES * numels[name], ranks, scatters)
        elif layout.zero == "zero3":  # FSDP gathers and scatters block by block: busbw at one block's size
            gathers, scatters = calls
            per = gather if axis_params is params_per_gpu["dense"] else BF16
            add("dp", "all_gather", per * axis_params, ranks, gathers, message=per * axis_params / L)
            grads = ZERO3_GRAD_BYTES * axis_params
            add("dp", "reduce_scatter", grads, ranks, scatters, message=grads / L)
        elif calls:  # ZeRO-2 by micro-batch, no pipeline; FSDP1's SHARD_GRAD_OP ("flat") reduces fp32 gradients
            gathers, scatters = calls  # FSDP's ZeRO-2 (reshard_after_forward off) gathers and reduces block by block
            reduced = ZERO3_GRAD_BYTES if layout.zero3_unit == "flat" else BF16
            add("dp", "reduce_scatter", reduced * axis_params, ranks, scatters, message=reduced * axis_params / L)
            add("dp", "all_gather", BF16 * axis_params, ranks, gathers, message=BF16 * axis_params / L)
        else:
            add("dp", "all_reduce", BF16 * axis_params, ranks, 1)
    return out


def hsdp_traffic(params: float, replicate: int, shard: int, cluster, *, zero: str = "zero3",
                 shard_stride: int = 1, value_bytes: int = BF16, grad_bytes: int = ZERO3_GRAD_BYTES,
                 blocks: int = 1, calls: tuple[int, int] | None = None, gather_bytes: float | None = None,
                 fp32_reduce: bool = False) -> dict:
    """HSDP's data-parallel traffic by link level: {"shard": {...}, "replica": {...}}, each
    {"bytes": sent per GPU per step, "seconds": alpha-beta time, "count": collectives, "level": link}.

    params: the parameters each GPU's data-parallel group reduces (P); the W = replicate x shard
    data-parallel ranks are R replicas of S shards (solutions/hsdp.py, notebook 10). Shard group:
    S ranks `shard_stride` apart (the product of the axes inside dp_shard: tp, cp), on NVLink when
    S x shard_stride <= gpus_per_node, else the network; replica group: across nodes, the network
    (unless the whole dp group fits in a node). Per step, per GPU:
        zero="zero3" (FSDP2's HSDP): shard  all-gather value_bytes P g times + reduce-scatter grad_bytes P
                                            r times: (S-1)/S x (g value + r grad) P
                                     replica all-reduce of grad_bytes P / S after each reduce-scatter:
                                            r x 2 (R-1)/R x grad_bytes P/S
                                     (g, r) = `calls`: zero_calls.dp_calls; None: one micro-batch
                                     without a pipeline, (2, 1), the forward's and the backward's gathers
        otherwise (ZeRO-1/2 in the node, HSDPOptimizer): shard  reduce-scatter + all-gather of
                                     value_bytes P: 2 (S-1)/S x value P; replica 2 (R-1)/R x value P/S;
                                     ZeRO-2 by micro-batch (`calls` = dp_calls: (1, m)) reduce-scatters
                                     and all-reduces m times, gathers once; ZeRO-1 takes no `calls`
    The two levels of the ZeRO-1/2 form add up to a flat all-reduce's 2 (W-1)/W x value P.
    blocks: under ZeRO-3 FSDP gathers, scatters and all-reduces block by block, so each call's bus bandwidth is
    read at 1/blocks of the bytes (`Cluster.link`'s size); the bytes and the count are the step's.
    gather_bytes: per parameter, what ZeRO-3's shard all-gathers move where it is not value_bytes (torchao's
    float8 all-gather, `labkit.scale.float8.fsdp_gather_bytes`).
    """
    node = shard * shard_stride <= cluster.gpus_per_node
    levels = {"shard": "node" if node else "network",
              "replica": "node" if replicate * shard * shard_stride <= cluster.gpus_per_node else "network"}
    out = {name: {"bytes": 0.0, "seconds": 0.0, "count": 0, "level": level} for name, level in levels.items()}

    per_call = blocks if zero == "zero3" else 1
    gpn = cluster.gpus_per_node  # each group's ranks in a node: the NICs its rings spread over (Cluster.link)
    per_node = {"shard": min(shard, max(1, int(gpn // shard_stride))),
                "replica": min(replicate, max(1, int(gpn // (shard * shard_stride))))}

    def add(name, kind, nbytes, n, count):
        link = ring_link(cluster, levels[name], kind, nbytes / per_call, n, per_node[name])
        sent, secs = ring_time(kind, nbytes / per_call, n, *link)  # block by block: each call pays its latency
        sent, secs = sent * per_call, secs * per_call
        if sent:
            out[name]["bytes"] += sent * count
            out[name]["seconds"] += secs * count
            out[name]["count"] += count

    reduced = grad_bytes if zero == "zero3" or fp32_reduce else value_bytes  # FSDP1's ZeRO-2 reduces in fp32 too
    gathers, scatters = calls or (zero3_calls(1, 1) if zero == "zero3" else (1, 1))
    moved = value_bytes if gather_bytes is None or zero != "zero3" else gather_bytes
    add("shard", "all_gather", moved * params, shard, gathers)
    add("shard", "reduce_scatter", reduced * params, shard, scatters)
    add("replica", "all_reduce", reduced * params / shard, replicate, scatters)  # FSDP2: after each reduce-scatter
    return out


def _add_hsdp(out: dict, layout, cluster, params_per_gpu: dict, value_bytes: int, blocks: int = 1,
              calls: tuple[int, int] | None = None, dense_gather_bytes: float | None = None) -> None:
    """axis_traffic's "dp" entry under HSDP: `hsdp_traffic` of the dense parameters over S = dp_shard x cp and
    of the experts over S = `Layout.efsdp`, R = dp_replicate replicas; its bytes by level in "shard_bytes", "replica_bytes"."""
    span = layout.dp_shard * layout.pp * layout.cp * layout.tp if layout.dp_shard > 1 else layout.cp * layout.tp
    entry = out.setdefault("dp", {"bytes": 0.0, "seconds": 0.0, "count": 0})
    entry.update(shard_bytes=0.0, replica_bytes=0.0)
    shard = layout.dp_shard * layout.cp
    for params, ranks in ((params_per_gpu["dense"], shard), (params_per_gpu["experts"], layout.efsdp)):
        if params == 0:
            continue
        levels = hsdp_traffic(params, layout.dp_replicate, ranks, cluster, zero=layout.zero,
                              fp32_reduce=layout.zero3_unit == "flat",
                              shard_stride=span / ranks, value_bytes=value_bytes, blocks=blocks, calls=calls,
                              gather_bytes=dense_gather_bytes if params is params_per_gpu["dense"] else None)
        for name, level in levels.items():
            entry["bytes"] += level["bytes"]
            entry["seconds"] += level["seconds"]
            entry["count"] += level["count"]
            entry[f"{name}_bytes"] += level["bytes"]
