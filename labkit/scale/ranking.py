"""Where each published layout ranks in the search over its own space (issue 34 item 5; bench/scale.py).

For a published run (labkit/scale/published_runs.json: model, cluster, global batch, sequence length, GPU
count, its layout), `rank_published` searches the space that contains its layout and says where the
published layout falls: its rank among the layouts that fit (1 = the model's own pick), the top layout, the
gap between their predicted tokens/s per GPU, and, where the search prefers another layout, why in the
model's own numbers (`why`: each step term, compute, exposed traffic per axis, bubble, optimizer, and the
memory, of the published layout against the top one). The criterion of issue 34 (`meets`): the published
layout is in the top 5, or within 5% of the top prediction. The rows validate; nothing is tuned to them.

The space (the search exercise's, solutions/scale_search.py, for a dense model, as every published row is):
    dp, pp, cp, tp    every product equal to the GPU count that check_layout accepts
    micro_batch       every size that splits a dp rank's share of the global batch
    zero, recompute   every ZeRO stage and recompute policy (check_layout refuses what a model cannot run)
    dp_replicate      every R whose replicas are whole nodes; cp_method: each of the four when cp > 1
    schedule          1F1B and, where the published row pipelines another way (interleaved, ends-alone
                      stages), that way too; sequence parallelism as the row runs it
Each layout is predicted by the row's cost model ("flat" or "kernels", with its compile / float8 / async TP),
ranked by labkit.scale.cost.rank_key. The space holds up to about 600,000 layouts (Megatron's 145B on 1,536
GPUs), so it is pruned, exactly: a layout can outrank the published one only if its step is no longer, and
    1. per (dp, pp, cp, tp, schedule, micro_batch, recompute): a lower bound on the step of every cp_method,
       ZeRO stage and dp_replicate: flat model, compute x (1 + bubble (pp-1)/(v m)) plus TP's bytes at the
       link's bandwidth (exposed in full); kernel model, the busiest rank's block kernels (the cheapest
       cp_method's) plus TP's time unless async TP hides it. Groups run in ascending bound; one above the
       published step (while fewer than CAP layouts beat it) and the best step found is skipped; so is a
       (..., cp_method) whose first stage's activations alone do not fit the GPU (every ZeRO stage and
       replica holds the same activations).
    2. per (... , micro_batch, recompute, cp_method): one prediction gives the step less its exposed dp and
       optimizer terms, which are all that ZeRO stage and dp_replicate change (tests/test_scale_ranking.py
       checks it): above the published step, its ZeRO stages and replicas are skipped.
Every layout left is predicted. `rank_published(..., prune=False)` enumerates everything (the tests' brute force).
Ranks are exact up to CAP (the criterion needs the top 5); past it the search only needs the top, which
prunes harder. Cost (2 shared cores): the 47 rows in 74 s under the flat model; under the kernel model a
large row takes minutes (405B on 512 GPUs: 15,000 layouts predicted, 215 s).
"""
from __future__ import annotations

import itertools
from dataclasses import replace

from labkit.scale.cluster import load_cluster
from labkit.scale.cost import EFFICIENCY, predict, rank_key
from labkit.scale.layer_ops import Options, Shape, block_ops, seconds
from labkit.scale.footprint import stage_memory
from labkit.scale.gpu import load_gpu
from labkit.scale.layout import CP_METHODS, RECOMPUTE, ZERO_STAGES, Layout, LayoutError, check_layout
from labkit.scale.specs import MODELS
from labkit.scale.traffic import axis_traffic
from labkit.scale.validation import layout_of, model_options

TOP, WITHIN = 5, 0.05
CAP = 25  # ranks are counted exactly up to here; beyond, "more than 25" (the criterion needs the top 5)  # issue 34: "in the search's top 5, or within 5% of the top prediction"
_SEARCHED: dict = {}  # rank_published's searches, by everything they read
TERMS = ("compute", "bubble", "exposed_tp", "exposed_cp", "exposed_ep", "exposed_pp", "exposed_dp", "optimizer")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def schedules_of(published: Layout) -> list[dict]:
    """The pipelining choices of the space: plain 1F1B, and the published row's own when it differs."""
    plain = dict(schedule="1f1b", virtual_stages=1, first_stage_embedding_only=False, last_stage_loss_only=False)
    own = {k: getattr(published, k) for k in plain}
    return [plain] if own == plain else [plain, own]


def _axes(n: int):
    for tp in divisors(n):
        for pp in divisors(n // tp):
            for cp in divisors(n // (tp * pp)):
                yield n // (tp * pp * cp), pp, cp, tp


def _bounds(model, base: Layout, cluster, batch, seq, n, options) -> dict:
    """Lower bounds on the step of every layout with base's axes and schedule: {(micro_batch, recompute): seconds}
    for the pairs check_layout accepts (module docstring)."""
    kernel = options.get("efficiency", EFFICIENCY) is None
    gpu = load_gpu(cluster.gpu) if kernel else None
    out = {}
    for mb, rc in itertools.product(divisors(batch // base.dp), RECOMPUTE):
        lay = replace(base, micro_batch=mb, recompute=rc)
        try:
            n_micro = check_layout(model, lay, n, cluster.gpus_per_node, batch, seq)
        except LayoutError:
            continue
        L = lay.layers_per_rank(model.n_layers)
        tp = axis_traffic(model, lay, cluster, n_micro, seq, {"dense": 0.0, "experts": 0.0}).get("tp", {})
        if kernel:  # the busiest rank's block kernels, and its TP traffic unless async TP hides it
            impl = options.get("attention") or ("fa2" if "fa2" in gpu.attention else "unfused")
            blocks = []
            for method in CP_METHODS if lay.cp > 1 else ("ring",):
                try:  # only the methods this layout can run (Ulysses needs the heads to split over cp)
                    check_layout(model, replace(lay, cp_method=method), n, cluster.gpus_per_node, batch, seq)
                except LayoutError:
                    continue
                shape = Shape(mb, seq, lay.tp, lay.cp, 1, lay.sequence_parallel, method, lay.expert_tp)
                try:
                    blk = block_ops(model, shape, Options(options["compile"], options["float8"], impl, rc), gpu)
                except ValueError:
                    continue
                blocks.append(seconds(blk["forward"]) + seconds(blk["backward"]))
            if not blocks:
                continue
            out[mb, rc] = n_micro * L * min(blocks) + (0.0 if options.get("async_tp") else tp.get("seconds", 0.0))
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
            _, beta = cluster.link(lay.level("tp", cluster.gpus_per_node))
            out[mb, rc] = compute + bubble + tp.get("bytes", 0.0) / beta
    return out


def search_around(model, cluster, batch: int, seq: int, n: int, mine, options: dict, *, cap: int = CAP,
                  prune: bool = True) -> dict:
    """The top of the space around `mine` (the published layout's Prediction, or any layout of the space: the
    top does not depend on it) and how many fitting layouts outrank it: {"top" (None if nothing fits),
    "better" (exact up to `cap`; `cap` means at least that many), "predicted"}. The space's schedules are
    1F1B and mine's (`schedules_of`).
    Groups in ascending lower bound; a group is skipped once its bound exceeds the published step (while
    fewer than `cap` better layouts are known) and the best step found. prune=False: every layout."""
    slack = 1 + 1e-6  # rank_key rounds tokens/s to 1e-6: a tie may sit a hair above the step
    key, best, better, predicted = rank_key(mine), mine if mine.fits else None, 0, 0
    groups = []
    for (dp, pp, cp, tp), sched in itertools.product(_axes(n), schedules_of(mine.layout)):
        if batch % dp or (pp == 1 and sched["schedule"] != "1f1b"):
            continue
        base = Layout(dp=dp, pp=pp, cp=cp, tp=tp, sequence_parallel=mine.layout.sequence_parallel, **sched)
        bounds = _bounds(model, base, cluster, batch, seq, n, options)
        if bounds:
            groups.append((min(bounds.values()) if prune else 0.0, len(groups), base, bounds))
    groups.sort(key=lambda g: g[:2])

    def limit():
        if not prune:
            return float("inf")
        if best is None:  # nothing fits yet (the reference does not): no bound
            return float("inf")
        return max(best.step_s, mine.step_s if better < cap else 0.0) * slack

    for bound, _, base, bounds in groups:
        if bound > limit():
            break
        replicas = [r for r in divisors(base.dp) if r == 1 or (n // r) % cluster.gpus_per_node == 0]
        for (mb, rc), method in itertools.product(sorted(bounds, key=bounds.get),
                                                  CP_METHODS if base.cp > 1 else ("ring",)):
            if prune and bounds[mb, rc] > limit():
                continue
            group = replace(base, micro_batch=mb, recompute=rc, cp_method=method)
            if prune:  # stage 0's activations alone, the same for every ZeRO stage and replica, must fit
                try:
                    check_layout(model, group, n, cluster.gpus_per_node, batch, seq)
                except LayoutError:
                    continue
                held = stage_memory(model, group, 0, batch // base.dp // mb, seq, group.cp_local(cluster.gpus_per_node))
                if held["activations"] + held["logits"] > cluster.memory_bytes:
                    continue
            first = True
            for lay in (replace(group, zero=z, dp_replicate=r) for z in ZERO_STAGES for r in replicas):
                try:
                    p = predict(model, lay, cluster, batch, seq, n, **options)
                except LayoutError:
                    continue
                predicted += 1
                if first and prune:  # the step less what ZeRO and dp_replicate change: a floor for the group
                    first = False
                    if p.step_s - p.parts_s.get("exposed_dp", 0.0) - p.parts_s.get("optimizer", 0.0) > limit():
                        break
                if not p.fits or lay == mine.layout:
                    continue
                if best is None or rank_key(p) < rank_key(best):
                    best = p
                if rank_key(p) < key:
                    better += 1
    return dict(top=best, better=better, predicted=predicted)


def rank_published(row: dict, set_info: dict, model: str = "flat", *, prune: bool = True, cap: int = CAP) -> dict:
    """Where the row's published layout ranks in its space under `model` ("flat" or "kernels"): {id, rank (None
    when the model says it does not fit; cap + 1 means beyond cap), top (the first Prediction), published (its
    Prediction), gap (published / top tokens/s/GPU - 1), meets (rank <= 5 or gap >= -5%), why ({term:
    (published s, top s)}, "memory_gib"), predicted (layouts predicted in full)}."""
    cluster = load_cluster(set_info["cluster"])
    spec = MODELS[row["model"]]
    if row.get("fused_kernels"):
        spec = replace(spec, fused_kernels=True)
    if spec.n_experts:
        raise ValueError(f"row {row['id']}: rank_published searches dense models only (ep = 1)")
    layout = layout_of(row)
    batch, seq, n = row["global_batch"], row["seq_len"], layout.world_size
    options = model_options(row, model)
    mine = predict(spec, layout, cluster, batch, seq, n, **options)
    if not mine.fits:
        return dict(id=row["id"], rank=None, top=None, published=mine, gap=None, meets=False, why={}, predicted=0)
    # rows that differ only in what the cost model does not read (the 70B async-TP file repeats its runs) share one search
    memo = (set_info["cluster"], spec, batch, seq, layout, tuple(sorted(options.items())), cap, prune)
    if memo not in _SEARCHED:
        _SEARCHED[memo] = search_around(spec, cluster, batch, seq, n, mine, options, cap=cap, prune=prune)
    found = _SEARCHED[memo]
    top, rank = found["top"], 1 + min(found["better"], cap)
    gap = mine.tokens_per_s_per_gpu / top.tokens_per_s_per_gpu - 1
    why = {t: (mine.parts_s.get(t, 0.0), top.parts_s.get(t, 0.0)) for t in TERMS}
    why["memory_gib"] = (mine.peak_gib, top.peak_gib)
    return dict(id=row["id"], rank=rank, top=top, published=mine, gap=gap, meets=rank <= TOP or gap >= -WITHIN,
                why=why, predicted=found["predicted"])


def explain(result: dict) -> str:
    """Why the search prefers its top layout, in the model's numbers: the terms that differ most, seconds per step."""
    if result["rank"] is None:
        return f"the model says the published layout does not fit ({result['published'].peak_gib:.1f} GiB)"
    diffs = sorted(((mine - top, term) for term, (mine, top) in result["why"].items() if term != "memory_gib"),
                   reverse=True)
    step = result["published"].step_s
    parts = [f"{term} {mine - top:+.3f} s ({(mine - top) / step:+.0%})" for mine_top, term in diffs[:3]
             for mine, top in [result["why"][term]] if abs(mine_top) > 1e-4 * step]
    mem = result["why"]["memory_gib"]
    return (f"top {result['top'].layout.short()}: published step {step:.3f} s vs {result['top'].step_s:.3f} s; "
            f"published - top: {', '.join(parts) or 'no term'}; memory {mem[0]:.1f} vs {mem[1]:.1f} GiB")
