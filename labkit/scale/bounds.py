"""Lower bounds on the step of a group of layouts: what labkit.scale.ranking prunes its search by (stage 1 of its
docstring). A group is the layouts that share (dp, pp, cp, tp, schedule); `group_bounds` gives one bound per
(micro_batch, recompute), below the step of every cp_method, ZeRO stage and dp_replicate: the flat model's in
closed form, the kernel model's (`kernel_bound`) through the pipeline's critical path. tests/test_scale_ranking.py
checks the kernel bound against every layout of a small space.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import replace
from functools import lru_cache

from labkit.scale.cost import EFFICIENCY
from labkit.scale.gpu import load_gpu
from labkit.scale.float8 import tp_gather_bytes
from labkit.scale.layer_ops import Options, Shape, block_ops, end_ops, float8_recipe, seconds
from labkit.scale.layout import CP_METHODS, RECOMPUTE, Layout, LayoutError, check_layout
from labkit.scale.pipeline import schedule_actions, stage_roles
from labkit.scale.traffic import BF16, axis_traffic, tp_pass_seconds

_ACTION = re.compile(r"(\d+)([FBW])(\d+)")  # a schedule's action: stage, kind, micro-batch


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@lru_cache(maxsize=4096)
def _ends(pp: int, schedule: str, virtual_stages: int, n_micro: int) -> tuple:
    """Per pipeline rank: the stage of its first action, the stage and kind ("F", "B", "W") of its last."""
    lists = schedule_actions(Layout(pp=pp, schedule=schedule, virtual_stages=virtual_stages), n_micro)
    ends = [(_ACTION.match(acts[0]).groups(), _ACTION.match(acts[-1]).groups()) for acts in lists]
    return tuple((int(first[0]), int(last[0]), last[1]) for first, last in ends)


@lru_cache(maxsize=65536)
def _pass_seconds(model, shape: Shape, opts: Options, gpu, which: str) -> tuple:
    """(forward, backward) seconds of one micro-batch through a block ("block"), the embedding or the head."""
    ops = block_ops(model, shape, opts, gpu) if which == "block" else end_ops(model, shape, opts, gpu, which)
    return seconds(ops["forward"]), seconds(ops["backward"])


def kernel_bound(model, lay: Layout, methods: list, seq: int, n_micro: int, options: dict, gpu, tp: dict):
    """A lower bound on the kernel model's step for every cp_method (of `methods`: those check_layout accepts),
    ZeRO stage and dp_replicate of `lay` (None when no cp_method's kernels can run): each stage's forward f_s and backward b_s per micro-batch from its blocks' kernels (the
    cheapest cp_method's forward and backward), its TP time (0 under async TP, which may hide it) and the
    embedding's and head's ops; then the pipeline: rank r cannot start before the forwards of the stages ahead of
    its first action have run, does its own n_micro x (f_s + b_s) of work, and after a last backward of stage k the
    backwards of stages 0..k-1 still run (each b_s less its weight-gradient part W under ZB):
        step >= max over ranks r of [ sum f_s (s < first stage of r) + work_r + sum (b_s - w_s) (s < last stage of r) ]
    which is the 1F1B makespan with equal stages and no message time. Messages, exposed cp / ep / dp and the
    optimizer only add to the step (labkit.scale.cost's rules), so they are left out."""
    impl = options.get("attention") or ("fa2" if "fa2" in gpu.attention else "unfused")
    # float8 all-gather's casts (cheaper) wherever the option is on: the bound holds for every ZeRO stage of `lay`
    opts = Options(options["compile"], options["float8"], impl, lay.recompute, options.get("float8_all_gather", False),
                   options.get("compiled_loss"))
    fwd, bwd, shape = [], [], None
    for method in methods:
        try:
            shape = Shape(lay.micro_batch, seq, lay.tp, lay.cp, 1, lay.sequence_parallel, method, lay.expert_tp)
            f_s, b_s = _pass_seconds(model, shape, opts, gpu, "block")
        except ValueError:
            continue
        fwd.append(f_s), bwd.append(b_s)
    if not fwd:
        return None
    # TP per block and micro-batch, split by pass as kernel_step splits it (tp: axis_traffic's entry)
    tp_f, tp_b = (0.0, 0.0) if options.get("async_tp") else tp_pass_seconds(tp, lay.recompute, lay.sequence_parallel)
    f_block, b_block = min(fwd) + tp_f, min(bwd) + tp_b
    layers, roles = lay.stage_layers(model.n_layers), stage_roles(lay, model.n_layers)
    f = [count * f_block for count in layers]
    b = [count * b_block for count in layers]
    for role, which in (("embedding", "embedding"), ("loss", "head")):
        f_s, b_s = _pass_seconds(model, shape, opts, gpu, which)
        f[roles[role]] += f_s
        b[roles[role]] += b_s
    if lay.pp == 1:
        return n_micro * (f[0] + b[0])
    b_only = [x * 2 / 3 for x in b] if lay.schedule == "zb" else b  # labkit.scale.pipeline: W is a third of it
    ahead, behind = [0.0, *itertools.accumulate(f)], [0.0, *itertools.accumulate(b_only)]  # sums over stages < k
    work = [0.0] * lay.pp
    for stage, (f_s, b_s) in enumerate(zip(f, b)):
        work[stage % lay.pp] += f_s + b_s
    return max(ahead[first] + n_micro * work[r] + (behind[last] if last_kind == "B" else 0.0)
               for r, (first, last, last_kind) in enumerate(_ends(lay.pp, lay.schedule, lay.virtual_stages, n_micro)))


def group_bounds(model, base: Layout, cluster, batch, seq, n, options, recomputes=RECOMPUTE, cp_methods=CP_METHODS) -> dict:
    """Lower bounds on the step of every layout with base's axes and schedule: {(micro_batch, recompute): seconds}
    for the pairs check_layout accepts (labkit.scale.ranking's docstring, stage 1), over the space's recompute
    policies and cp methods (labkit.scale.space)."""
    kernel = options.get("efficiency", EFFICIENCY) is None
    gpu = load_gpu(cluster.gpu) if kernel else None
    out, methods = {}, None
    for mb, rc in itertools.product(divisors(batch // base.dp), recomputes):
        lay = replace(base, micro_batch=mb, recompute=rc)
        try:
            n_micro = check_layout(model, lay, n, cluster.gpus_per_node, batch, seq)
        except LayoutError:
            continue
        if methods is None:  # the cp methods this group can run (Ulysses needs the heads to split over cp): the
            methods = []     # checks that read cp_method read only cp, tp, the heads and the node, not mb or rc
            for method in cp_methods if lay.cp > 1 else ("ring",):
                try:
                    check_layout(model, replace(lay, cp_method=method), n, cluster.gpus_per_node, batch, seq)
                    methods.append(method)
                except LayoutError:
                    pass
        L = lay.layers_per_rank(model.n_layers)
        # under the kernel model TP's all-gathers move what they move in kernel_step (float8 tensorwise: 1 byte)
        gather = tp_gather_bytes(float8_recipe(options.get("float8")), BF16) if kernel else None
        tp = axis_traffic(model, lay, cluster, n_micro, seq, {"dense": 0.0, "experts": 0.0}, BF16, gather).get("tp", {})
        if kernel:
            bound = kernel_bound(model, lay, methods, seq, n_micro, options, gpu, tp)
            if bound is not None:
                out[mb, rc] = bound
        else:  # compute (recompute included), its bubble, TP's bytes at the link's bandwidth
            try:
                again = model.recompute_flops_per_token(seq, rc)
            except ValueError:
                again = 0.0
            flops = (model.flops_per_token(seq) + again) * batch * seq / n
            flops *= L * lay.pp / model.n_layers if lay.pp > 1 else 1.0
            compute = flops / (cluster.peak_bf16_flops * options.get("efficiency", EFFICIENCY))
            v = lay.virtual_stages if lay.schedule == "interleaved" else 1
            bubble = (lay.pp - 1) / (v * n_micro) * compute if lay.pp > 1 else 0.0
            beta = cluster.fastest_busbw(lay.level("tp", cluster.gpus_per_node))  # no kind is faster: a bound
            out[mb, rc] = compute + bubble + tp.get("bytes", 0.0) / beta
    return out
