"""One step's time from kernels, collectives and the schedule simulator: `labkit.scale.cost`'s kernel model.

The rules are stated once, in `labkit.scale.cost`'s docstring; this module applies them:
    kernel_step(...) -> {"step_s", "parts_s", "bound_s", "traffic"}
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from labkit.measure.overlap import two_batch_overlap
from labkit.scale import async_tp as atp
from labkit.scale import deepspeed_zero3 as ds
from labkit.scale.gpu import load_gpu
from labkit.scale.float8 import fsdp_gather_bytes, tp_gather_bytes
from labkit.scale.layer_ops import Options, Shape, block_ops, by_bound, end_ops, float8_recipe, seconds
from labkit.scale.kernels import fsdp_copies, optimizer_step, roofline
from labkit.scale.pace import paced
from labkit.scale.layout import LayoutError
from labkit.scale.pipeline import n_stages, pipeline_time, schedule_actions, stage_layers, stage_roles
from labkit.scale.cp_traffic import cp_exposed
from labkit.scale.traffic import axis_traffic, call_seconds, tp_call_seconds, tp_pass_seconds
from labkit.scale.zero_calls import ZERO3_GRAD_BYTES, dp_calls


def params_per_gpu(model, layout) -> dict:
    """Parameters this GPU holds before ZeRO (its stage, its tp shard): dense and experts."""
    m = model
    layers = layout.layers_per_rank(m.n_layers)
    head = max(m.embedding_params, m.stage_head_params(first=False))  # the heavier end stage
    dense = layers * m.layer_dense_params + (head if layout.pp > 1 else m.embedding_params + m.head_params)
    return {"dense": dense / layout.tp,
            "experts": layers * m.expert_params * m.n_experts / (layout.expert_tp * layout.ep)}


@dataclass(frozen=True)
class _Schedule:
    """What the schedule simulator reads of a Layout (so that layouts differing only in ZeRO stage or replicas,
    which feed it the same stage times, share one simulation: labkit.scale.ranking predicts many of them)."""
    pp: int
    schedule: str
    virtual_stages: int


@lru_cache(maxsize=4096)
def _actions(pp: int, schedule: str, virtual_stages: int, n_micro: int):
    return schedule_actions(_Schedule(pp, schedule, virtual_stages), n_micro)


@lru_cache(maxsize=65536)
def _makespan(pp, schedule, virtual_stages, n_micro, fwd: tuple, bwd: tuple, message: float) -> float:
    lay = _Schedule(pp, schedule, virtual_stages)
    return pipeline_time(lay, n_micro, list(fwd), list(bwd), message, _actions(pp, schedule, virtual_stages, n_micro))["makespan"]


def two_batch_exposed(ep_s: float, experts_s: float, layers: int, n_micro: int) -> float:
    """EP's exposed all-to-all time per step under the two-micro-batch overlap: ep_s is the time of the
    8 half all-to-alls per layer and micro-batch (axis_traffic's count: dispatch and combine of two halves,
    forward and backward), each t = ep_s / (8 L m); a half's experts take c = experts_s / (6 L m) forward
    and 2c backward. Per layer and micro-batch: two_batch_overlap(t, c) + two_batch_overlap(t, 2c)'s
    layer_exposed_s (with c = 0: 8t, all of it)."""
    t = ep_s / (8 * layers * n_micro)
    c = experts_s / (6 * layers * n_micro)
    per_layer = two_batch_overlap(t, c)["layer_exposed_s"] + two_batch_overlap(t, 2 * c)["layer_exposed_s"]
    return layers * n_micro * per_layer


def contention(traffic_s: float, exposed_s: float, slowdown: float) -> float:
    """Seconds a collective overlapped with compute costs beyond its exposed part: while it runs, the compute
    beside it runs `slowdown` slower (GPU.overlap_slowdown: the collective's kernels share the SMs and memory).
    With C = traffic_s and W the compute window it hides behind (W = C - exposed_s when some is exposed; at least
    C when none is), the pair takes max(C, W + k min(C, W (1 + slowdown))), k = slowdown / (1 + slowdown): the
    collective's C seconds of wall time do C / (1 + slowdown) of the compute's work, until the compute, slowed
    all through, outlasts it. Beyond max(C, W): max(0, k min(C, W (1 + slowdown)) - exposed_s)."""
    if traffic_s <= 0 or slowdown <= 0:
        return 0.0
    window = traffic_s - exposed_s if exposed_s > 0 else traffic_s
    return max(0.0, slowdown / (1.0 + slowdown) * min(traffic_s, window * (1.0 + slowdown)) - exposed_s)


def _block_comm(blk, traffic, layout, per_block: float, async_tp: bool, chunk_blk: dict | None = None,
                slowdown: float = 0.0, reduce_s: float = 0.0) -> dict:
    """Exposed seconds of one block's tp, cp and ep traffic for one micro-batch, forward and backward, and
    "contention": what the hidden part costs the compute beside it (`contention`), split evenly over the passes.
    async_tp: each TP collective decomposed into tp chunks behind the matmuls it feeds (labkit.scale.async_tp),
    chunk_blk: the block's ops on one chunk of T / tp rows; reduce_s: async TP's closing sum of one reduce-scatter."""
    def share(axis, key="seconds"):
        return traffic.get(axis, {}).get(key, 0.0) / per_block

    tp = traffic.get("tp", {})  # each kind at its own time: float8 tensorwise TP gathers 1-byte values
    tp_f, tp_b = tp_pass_seconds(tp, layout.recompute, layout.sequence_parallel)
    if async_tp and share("tp"):  # each collective in tp chunks, beside the matmuls it feeds
        gather, scatter = tp_call_seconds(tp, layout.sequence_parallel)
        tp_f, tp_b = atp.exposed(blk, chunk_blk, gather, scatter, layout.tp, layout.recompute, reduce_s)
    attn = sum(op.seconds for op in blk["forward"] + blk["backward"] if op.kind == "attention")
    ring, first = share("cp", "hideable_seconds"), share("cp", "first_step_seconds")
    cp = cp_exposed(share("cp"), ring, first, attn, layout.cp)
    first_window = attn / layout.cp if layout.cp > 1 else 0.0  # what hides the K/V all-gather (kv_rotation)
    ep = share("ep")
    if layout.ep_overlap and ep:
        experts = sum(op.seconds for op in blk["forward"] + blk["backward"] if op.name.split()[0] in ("w1", "w2", "w3"))
        ep = two_batch_exposed(ep, experts, 1, 1)
    # NCCL's kernels beside the compute: the ring's hops, EP's overlapped all-to-alls (plain TP is all exposed;
    # async TP's transfers run on the copy engines, not the SMs)
    slow = contention(ring, max(0.0, ring - attn), slowdown) + contention(first, max(0.0, first - first_window), slowdown)
    slow += contention(share("ep"), ep, slowdown) if layout.ep_overlap else 0.0
    return {"tp": tp_f + tp_b, "cp": cp, "ep": ep, "contention": slow, "forward": tp_f + cp / 2 + ep / 2 + slow / 2,
            "backward": tp_b + cp / 2 + ep / 2 + slow / 2}


def _deepspeed_dp(model, layout, cluster, n_micro, blk, emb, head, comm, makespan, slowdown, L, value_bytes
                  ) -> tuple[float, float]:
    """(exposed_dp, contention_dp) of DeepSpeed's ZeRO-3 (zero3_unit="module", no pipeline): its uses of each weight
    run on the host, GPU and network clocks (labkit.scale.deepspeed_zero3.zero3_step), with each use's kernels (the
    block's ops by submodule, the ends' ops, the block's exposed tp and cp shared by its submodules) and each weight's
    gather and fp16 reduce-scatter at the dp group's link (traffic.call_seconds); what the clocks take beyond the
    kernels (`makespan`) is the contention they met first, then the wait on the network."""
    seg = ds.segments(blk)
    nums = ds.numels(model, layout)
    subs = ds.submodules(model, layout.tp)
    share = {n: v / sum(subs.values()) for n, v in subs.items()}
    full = layout.recompute == "full"  # a replayed forward of its own (its weights fetched again); any other
    if not full:                        # policy's replay runs inside the backward's uses
        seg["backward"] = {n: seg["backward"].get(n, 0.0) + seg["recompute"].get(n, 0.0) for n in share}
    passes = {"f": ("forward", comm["forward"]), "r": ("recompute", 0.0), "b": ("backward", comm["backward"])}
    secs = {ph: {n: seg[key].get(n, 0.0) + extra * share[n] for n in share} for ph, (key, extra) in passes.items()}
    for ph, which in (("f", "forward"), ("b", "backward")):
        secs[ph]["embedding"], secs[ph]["head"] = seconds(emb[which]), seconds(head[which])
    n = layout.dp * layout.cp
    gather = {k: call_seconds(layout, cluster, "dp", "all_gather", value_bytes * v, n)[1] for k, v in nums.items()}
    scatter = {k: call_seconds(layout, cluster, "dp", "reduce_scatter", ds.GRAD_BYTES * v, n)[1] for k, v in nums.items()}
    run = ds.zero3_step(nums, secs, gather, scatter, L, n_micro, full, slowdown=slowdown)
    beyond = max(0.0, run["step_s"] - makespan)
    contention_dp = min(beyond, run["contention_s"])
    return beyond - contention_dp, contention_dp


def kernel_step(model, layout, cluster, global_batch, seq_len, n_gpus, n_micro, value_bytes, options) -> dict:
    gpu = paced(load_gpu(cluster.gpu), min(n_gpus, cluster.gpus_per_node))  # the step waits for its slowest GPU
    impl = options.get("attention") or ("fa2" if "fa2" in gpu.attention else "unfused")
    shape = Shape(layout.micro_batch, seq_len, layout.tp, layout.cp, layout.ep, layout.sequence_parallel,
                  layout.cp_method, layout.expert_tp, layout.cp_local(cluster.gpus_per_node))
    try:  # a schedule that does not fit, an unknown recompute policy, fp8 on a GPU without it: before any arithmetic
        actions = _actions(layout.pp, layout.schedule, layout.virtual_stages, n_micro) if layout.pp > 1 else None
        recipe = float8_recipe(options.get("float8", False))
        # torchao's float8 all-gather acts where FSDP2 gathers (torchtitan: only with dp_shard > 1), elsewhere nothing
        fsdp = layout.zero == "zero3" and layout.zero3_unit == "block"
        fp8_gather = bool(options.get("float8_all_gather", False))
        held = params_per_gpu(model, layout)
        fsdp_bytes = fsdp_gather_bytes(model, layout, held["dense"], value_bytes, recipe, fp8_gather)
        opts = Options(options.get("compile", False), options.get("float8", False), impl, layout.recompute,
                       fp8_gather and fsdp, options.get("compiled_loss"))
        blk = block_ops(model, shape, opts, gpu)
        gather_bytes = tp_gather_bytes(recipe, value_bytes)
    except ValueError as err:
        raise LayoutError(str(err)) from None
    emb, head = end_ops(model, shape, opts, gpu, "embedding"), end_ops(model, shape, opts, gpu, "head")
    L = layout.layers_per_rank(model.n_layers)
    traffic = axis_traffic(model, layout, cluster, n_micro, seq_len, held, value_bytes, gather_bytes,
                           fsdp_gather_bytes=fsdp_bytes)
    async_tp = options.get("async_tp", False) and layout.tp > 1
    # one chunk: T / tp rows (at least one row per cp rank, so that a tiny layout's chunk is not empty)
    chunk_seq = max(shape.cp, shape.seq_len // layout.tp)
    chunk = block_ops(model, replace(shape, seq_len=chunk_seq), opts, gpu) if async_tp else None
    # async TP's sum closing each reduce-scatter: the stacked partials, T x d (bf16), read; T / tp x d written
    rows = layout.micro_batch * seq_len // layout.cp
    stacked = value_bytes * rows * model.d_model
    summed = stacked * (1 + 1 / layout.tp)
    reduce_s = roofline("async-tp sum", "elementwise", 0.0, summed, 1, gpu).seconds if async_tp else 0.0
    slowdown = gpu.overlap_slowdown
    comm = _block_comm(blk, traffic, layout, L * n_micro, async_tp, chunk, slowdown, reduce_s)
    layers, roles = stage_layers(layout, model.n_layers), stage_roles(layout, model.n_layers)
    f_block, b_block = seconds(blk["forward"]), seconds(blk["backward"])
    fwd, bwd, kern = [], [], []
    for s, count in enumerate(layers):
        f = count * (f_block + comm["forward"])
        b = count * (b_block + comm["backward"])
        k = count * (f_block + b_block)
        if s == roles["embedding"]:
            f, b, k = f + seconds(emb["forward"]), b + seconds(emb["backward"]), k + seconds(emb["forward"]) + seconds(emb["backward"])
        if s == roles["loss"]:
            f, b, k = f + seconds(head["forward"]), b + seconds(head["backward"]), k + seconds(head["forward"]) + seconds(head["backward"])
        fwd.append(f), bwd.append(b), kern.append(k)
    # the busiest pipeline rank: it holds stages r, r + pp, ...
    ranks = [list(range(r, n_stages(layout), layout.pp)) for r in range(layout.pp)]
    busiest = max(ranks, key=lambda st: sum(fwd[s] + bwd[s] for s in st))
    work = n_micro * sum(fwd[s] + bwd[s] for s in busiest)
    compute = n_micro * sum(kern[s] for s in busiest)
    blocks = sum(layers[s] for s in busiest)
    if layout.pp > 1:
        pp = traffic.get("pp", {})
        message = pp["seconds"] / pp["count"] if pp.get("count") else 0.0
        makespan = _makespan(layout.pp, layout.schedule, layout.virtual_stages, n_micro, tuple(fwd), tuple(bwd), message)
    else:
        makespan = work
    backward = n_micro * sum(bwd[s] for s in busiest)
    copies = 0.0
    fsdp1_zero2 = layout.zero == "zero2" and layout.zero3_unit == "flat" and layout.pp == 1  # SHARD_GRAD_OP
    if (layout.zero == "zero3" and layout.zero3_unit in ("block", "flat")) or fsdp1_zero2:  # FSDP's copies around its
        # collectives: kernels on the compute stream, one per gather and scatter (dp_calls), on this rank's critical
        # path; FSDP1 gathers its flat parameter in place (no copy-out) but casts each gradient before its reduce-scatter
        gathers, scatters = dp_calls(layout.zero, layout.pp, n_micro)
        calls = (0 if layout.zero3_unit == "flat" else gathers, scatters)
        total = sum(held.values())  # the experts gather value_bytes (float8.fsdp_gather_bytes: the dense only)
        moved = (fsdp_bytes * held["dense"] + value_bytes * held["experts"]) / total
        copies = seconds([fsdp_copies(total, blocks, gpu, value_bytes, ZERO3_GRAD_BYTES, *calls, gather_bytes=moved)])
    t_dp = traffic.get("dp", {}).get("seconds", 0.0)
    # ZeRO-3 prefetches behind the step's compute (DeepSpeed's, use by use on its own clocks); ZeRO-2 without a
    # pipeline reduces each micro-batch's gradient in its backward (dp_calls); plain DP / ZeRO-1 (and ZeRO-2 in a
    # pipeline) accumulate every micro-batch's gradient locally (DDP's no_sync, Megatron's buffers) and reduce in
    # the last one's backward, or after it
    if layout.zero == "zero3" and layout.zero3_unit == "module":
        exposed_dp, contention_dp = _deepspeed_dp(model, layout, cluster, n_micro, blk, emb, head, comm, makespan,
                                                  slowdown, L, value_bytes)
    else:
        if layout.zero != "zero3" and layout.grad_reduce == "after":  # all of it waits, after the backward
            hide, exposed_dp = 0.0, t_dp
        else:  # hidden up to the window; the last bucket, one layer's, waits for its backward
            by_micro = layout.zero == "zero2" and dp_calls("zero2", layout.pp, n_micro)
            hide = compute + copies if layout.zero == "zero3" else backward if by_micro else backward / n_micro
            exposed_dp = max(0.0, t_dp - hide) + t_dp / max(1, L) if t_dp else 0.0
        contention_dp = contention(t_dp, max(0.0, t_dp - hide), slowdown)
    shards = layout.dp * layout.cp if layout.zero != "dp" else 1
    params = sum(params_per_gpu(model, layout).values()) / shards
    optimizer = seconds([optimizer_step(params, 9 * L + 3, gpu)])
    parts = {"compute": compute, "exposed_tp": n_micro * blocks * comm["tp"], "exposed_cp": n_micro * blocks * comm["cp"],
             "exposed_ep": n_micro * blocks * comm["ep"], "bubble": makespan - work, "exposed_dp": exposed_dp,
             "exposed_pp": 0.0, "optimizer": optimizer}
    parts["contention"] = n_micro * blocks * comm["contention"]  # the blocks' (cp ring, ep), inside the passes
    parts["contention_dp"] = contention_dp
    parts["fsdp_copies"] = copies
    f_bound, b_bound = by_bound(blk["forward"]), by_bound(blk["backward"])  # each pass a stretch, as timed above
    bound = {k: f_bound[k] + b_bound[k] for k in f_bound}
    return {"step_s": makespan + copies + exposed_dp + contention_dp + optimizer, "parts_s": parts, "bound_s": bound,
            "traffic": traffic}
