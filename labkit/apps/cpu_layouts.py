"""Predict, then measure, on this CPU: small layouts of the lab's parallel steps (notebook 15, bench/scale_cpu.py).

    from labkit.apps.cpu_layouts import fit_cpu, predict_layout, run_layout, LAYOUTS
    fit = fit_cpu()                       # this machine as a "cluster": FLOP rate, alpha-beta per world size
    predict_layout("dp2 x pp2", fit)      # labkit.scale.cost's step time for it
    run_layout("dp2 x pp2")               # the same layout run for real (labkit.launch, gloo)

The fit, from your own measurements only:
    rate    FLOP/s of one process (one thread, as every launched rank) running the model's whole
            training step (forward, backward, AdamW): notebook 01's tokens/s x (6N + 12 L d s).
            It is the CPU's "peak x efficiency": it includes everything a step does that is not a
            matmul, at this model's size. Measured twice: one process alone on the global batch
            ("rate"), and one process per core at once, each on its share of the batch ("busy":
            cores that run together share caches, memory bandwidth and clock, and the vCPUs of a
            cloud machine may share physical cores: 2 busy ranks are far from 2 x one alone)
    cores   ranks beyond the cores share them: each of W > 1 ranks computes at busy x min(1, cores / W)
    links   notebook 03's alpha-beta: labkit.links.bandwidth.measure_link on W ranks (one ring step,
            all links busy: alpha from 4 bytes, beta from 4 MiB), for each world size used
    step_alpha  the alpha a collective pays INSIDE a step (`step_alpha`): the mean cost of an
            all-reduce of 4 KiB, 64 KiB and 1 MiB issued after a short compute
            (labkit.links.bandwidth.collective_cost_in_a_step), less its bytes at beta, per ring step.
            The ranks reach it from their own work, not together after a barrier, and a peer
            that is not on a core must be woken: on this sandbox 0.2-0.5 ms on 2 ranks against the
            ring step's 0.1-0.15 ms, 0.9-1.2 ms on 4 ranks sharing 2 cores. The prediction uses it.
The prediction is labkit.scale.cost.predict with that cluster, fp32 values on the wire
(value_bytes=4), and overlap=False: the lab's steps communicate after their compute. One rule is the
CPU's own: with more ranks than cores, a rank that waits (in the pipeline's bubble) sleeps and
gives its core to another, so the bubble is not lost time. Then step = max(W / cores x compute,
compute + bubble) + communication, compute at one core's busy rate: the cores' total work, or
one rank's critical path, whichever is longer. One rule is notebook 08's: its TP ("tp" runner) keeps
the output head replicated, so every TP rank also computes the head's 6 d V FLOPs per token on the
tokens that labkit.scale splits over TP (the part "replicated_head"); the composed step's head is
vocabulary-parallel, as labkit.scale assumes.

`LAYOUTS` is the registry: name -> (labkit.scale Layout, runner). A runner is the rank function of
one of the lab's parallel steps (through `impl`, so your exercises run): "hybrid" (notebook 07's
hybrid_step: DP, PP with 1F1B, DP x PP), "zero1" (notebook 09's ZeroAdamW), "tp" (notebook 08's
parallelize_model), "cp" (notebook 11's ContextParallel with ring attention), "composed" (notebook 14's
labkit.compose step: any of dp, pp, cp, tp at once, TP with sequence parallelism and a vocabulary-
parallel head, which is what labkit.scale's cost model assumes).
The machine is shared: a step's time is the slowest rank's, and a layout's time the minimum over
the steps after a warm-up (the run least disturbed by other processes); with the calibration, the
step whose layout and calibration times sum least (the pair least disturbed, measured back to back).
"""
from __future__ import annotations

import math
import os
import time

from labkit.scale.cluster import Cluster
from labkit.scale.layout import Layout

MODEL, GLOBAL_BATCH, SEQ_LEN = "seed", 8, 128
_PLAIN = dict(zero="dp", recompute="none")
LAYOUTS = {
    "dp2": (Layout(dp=2, micro_batch=4, **_PLAIN), "hybrid"),
    "dp4": (Layout(dp=4, micro_batch=2, **_PLAIN), "hybrid"),
    "zero1 dp2": (Layout(dp=2, micro_batch=4, zero="zero1", recompute="none"), "zero1"),
    "tp2": (Layout(tp=2, micro_batch=8, sequence_parallel=False, **_PLAIN), "tp"),
    "pp2 1f1b m4": (Layout(pp=2, micro_batch=2, **_PLAIN), "hybrid"),
    "dp2 x pp2": (Layout(dp=2, pp=2, micro_batch=2, **_PLAIN), "hybrid"),
    "cp2 ring": (Layout(cp=2, micro_batch=8, **_PLAIN), "cp"),
    "dp8": (Layout(dp=8, micro_batch=1, **_PLAIN), "hybrid"),
    # notebook 14's composed step (labkit.compose): TP with SP and a vocabulary-parallel head, as labkit.scale models it
    "composed dp2 x tp2": (Layout(dp=2, tp=2, micro_batch=4, **_PLAIN), "composed"),
    "composed pp2 x tp2 m4": (Layout(pp=2, tp=2, micro_batch=2, **_PLAIN), "composed"),
    "composed cp2 x tp2": (Layout(cp=2, tp=2, micro_batch=8, **_PLAIN), "composed"),
}
QUICK_LAYOUTS = ("dp2", "tp2", "pp2 1f1b m4")
REPLICATED_HEAD = {"tp"}  # notebook 08's TP keeps the embedding and the output head whole on every rank


def _lookup(layout):
    """(Layout, runner) of a LAYOUTS name or of a (Layout, runner) pair; ValueError naming the choices."""
    if isinstance(layout, str):
        if layout not in LAYOUTS:
            raise ValueError(f"no layout named {layout!r}: choose one of {list(LAYOUTS)}, or pass (Layout, runner)")
        return LAYOUTS[layout]
    return layout


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _config():
    from labkit.model import get_config

    return get_config(MODEL, context=SEQ_LEN)


def _build(runner: str, layout: Layout, rank: int, world: int):
    """(step function, this rank's part of nothing else): the lab's step for `runner`, ready to call."""
    import torch

    from labkit.grading import impl
    from labkit.mesh import Mesh
    from labkit.model import build_model, make_stage

    cfg = _config()
    x = torch.randint(0, cfg.vocab_size, (GLOBAL_BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    model = build_model(cfg, seed=0)
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-4)
    if runner == "hybrid":
        hybrid = impl("hybrid")
        mesh = hybrid.make_mesh(world, layout.dp, layout.pp)
        stage = make_stage(model, mesh.coord("pp"), layout.pp)
        opt, n_micro = adamw(stage.parameters()), GLOBAL_BATCH // layout.dp // layout.micro_batch
        return lambda: hybrid.hybrid_step(stage, x, x, n_micro, opt, mesh=mesh)
    if runner == "zero1":
        rows = x[rank * GLOBAL_BATCH // world:(rank + 1) * GLOBAL_BATCH // world]
        opt = impl("zero").ZeroAdamW(model.parameters(), lr=1e-4)
        return lambda: (model(rows, rows).backward(), opt.step(), opt.zero_grad())
    if runner == "tp":
        mesh = Mesh(world, tp=world)
        tp_model = impl("tensor_parallel").parallelize_model(model, group=mesh.group("tp"))
        opt = adamw(tp_model.parameters())
        return lambda: (tp_model(x, x).backward(), opt.step(), opt.zero_grad())
    if runner == "cp":
        cp = impl("context_parallel").ContextParallel(model, mesh=Mesh(world, cp=world))
        opt = adamw(model.parameters())
        return lambda: (cp(x, x).backward(), cp.sync_gradients(), opt.step(), opt.zero_grad())
    if runner == "composed":
        from labkit.compose.dims import ParallelDims
        from labkit.compose.model import parallelize
        from labkit.compose.step import ComposedOptimizer, train_step

        m = GLOBAL_BATCH // layout.dp // layout.micro_batch
        dims = ParallelDims(dp=layout.dp, pp=layout.pp, cp=layout.cp, tp=layout.tp, microbatches=m,
                            zero={"dp": 0, "zero1": 1, "zero2": 2, "zero3": 3}[layout.zero])
        dims.check(cfg, batch=GLOBAL_BATCH, seq_len=SEQ_LEN, world_size=world)
        mesh = dims.build_mesh(world)
        stage = parallelize(model, mesh=mesh)
        opt = ComposedOptimizer(stage, mesh=mesh, zero=dims.zero, lr=1e-4)
        return lambda: train_step(stage, opt, x, x, mesh=mesh, microbatches=m)
    raise ValueError(f"unknown runner {runner!r}: one of hybrid, zero1, tp, cp, composed")


def _local_step(world: int):
    """(one training step of the whole model on this rank's GLOBAL_BATCH / world rows, no communication,
    its FLOPs): the calibration that runs beside a layout, under the same load."""
    import torch

    from labkit.model import build_model
    from labkit.scale.specs import spec_from_config

    cfg, rows = _config(), max(1, GLOBAL_BATCH // world)
    model, x = build_model(cfg, seed=0), torch.randint(0, cfg.vocab_size, (rows, SEQ_LEN))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = lambda: (model(x, x).backward(), opt.step(), opt.zero_grad())
    return step, spec_from_config(cfg).flops_per_token(SEQ_LEN) * rows * SEQ_LEN


def _time_rank(rank, world, layout, runner, steps, warmup, calibrate):
    """[(layout step seconds, calibration step seconds or None)] per step after the warm-up; the two
    interleaved, each after a barrier, so that the machine's load hits both alike."""
    import torch.distributed as dist

    step, times = _build(runner, layout, rank, world), []
    local, flops = _local_step(world) if calibrate else (None, 0)
    for i in range(warmup + steps):
        spent = []
        for fn in (step, local):
            if fn is None:
                spent.append(None)
                continue
            dist.barrier()
            start = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - start)
        times.append(tuple(spent))
    return dict(times=times[warmup:], flops=flops)


def _run(layout, steps, warmup, calibrate, timeout):
    from labkit import launch

    layout, runner = _lookup(layout)
    per_rank = launch(_time_rank, layout.world_size, layout, runner, steps, warmup, calibrate, backend="gloo",
                      timeout=timeout)
    # per step, the slowest rank's (layout, calibration) seconds
    steps_ = [(max(t[0] for t in step), max(t[1] for t in step) if calibrate else 0.0)
              for step in zip(*(r["times"] for r in per_rank))]
    if not calibrate:
        return min(t for t, _ in steps_), None
    # the least disturbed PAIR (both measured back to back): the machine's load is shared with others
    seconds, local = min(steps_, key=sum)
    return seconds, per_rank[0]["flops"] / local


def run_layout(layout, steps: int = 3, warmup: int = 1, timeout: float = 300.0) -> float:
    """Seconds of one training step of `layout` (a LAYOUTS name, or a (Layout, runner) pair) run for
    real on its ranks: the slowest rank's time per step, the minimum over `steps` after `warmup`."""
    return _run(layout, steps, warmup, False, timeout)[0]


def _rate_rank(rank, world, steps):
    """FLOP/s of this rank's whole training step on GLOBAL_BATCH / world rows (no communication)."""
    step, flops = _local_step(world)
    best = math.inf
    for _ in range(steps + 1):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return flops / best


def _link_rank(rank, world, iters, repeats=5):
    """(alpha, beta) of one ring step: the least disturbed of `repeats` measurements (min alpha, max beta)."""
    from labkit.links.bandwidth import measure_link

    runs = [measure_link(4 << 20, iters=iters) for _ in range(repeats)]
    return min(m["ring_latency"] for m in runs), max(m["ring_bandwidth"] for m in runs)


def fit_cpu(worlds=(2, 4, 8), steps: int = 3, iters: int = 5, timeout: float = 300.0) -> dict:
    """{"rate": FLOP/s of one process's training step alone, "busy": per process with every core busy,
    "cores", "links": {W: (alpha s, beta B/s)}}. A layout's own prediction uses the rate calibrated
    beside it (`predict_then_measure`); these two say what the machine gives when it is quiet."""
    from labkit import launch

    rate = launch(_rate_rank, 1, steps, backend="gloo", timeout=timeout)[0]
    busy = min(launch(_rate_rank, cores(), steps, backend="gloo", timeout=timeout))
    links = {w: launch(_link_rank, w, iters, backend="gloo", timeout=timeout)[0] for w in worlds}
    in_step = {w: launch(_in_step_rank, w, backend="gloo", timeout=timeout)[0] for w in worlds}
    return dict(rate=rate, busy=busy, cores=cores(), links=links, in_step=in_step,
                step_alpha={w: step_alpha(in_step[w], w, links[w][1]) for w in worlds})


def _in_step_rank(rank, world):
    from labkit.links.bandwidth import collective_cost_in_a_step

    return collective_cost_in_a_step()


def step_alpha(costs: dict, world: int, beta: float) -> float:
    """The alpha per ring step that the all-reduces timed inside a step imply: for each size S (bytes)
    with mean cost t, t / (2 (W - 1)) - S / (W beta) (the ring model's all-reduce solved for alpha);
    the median over the sizes, never below 0."""
    per_size = [t / (2 * (world - 1)) - nbytes / (world * beta) for nbytes, t in costs.items()]
    return max(0.0, sorted(per_size)[len(per_size) // 2]) if per_size and world > 1 else 0.0


def cpu_cluster(fit: dict, world: int, rate: float | None = None) -> Cluster:
    """This CPU as labkit.scale's Cluster for `world` ranks: one "node" holding them all, each rank
    computing at `rate` (default: the quiet machine's, shared when ranks outnumber cores). Built
    directly, not through load_cluster, whose plausible ranges are a GPU's."""
    w = min((w for w in fit["links"] if w >= world), default=max(fit["links"]))
    alpha, beta = fit["links"][w]
    alpha = fit.get("step_alpha", {}).get(w, alpha)  # what a collective pays inside a step, where measured
    if rate is None:
        rate = fit["rate"] if world == 1 else fit["busy"] * min(1.0, fit["cores"] / world)
    return Cluster(name=f"this CPU, {world} ranks", gpus_per_node=max(world, 1), peak_bf16_flops=rate,
                   memory_gib=1e3, nvlink_gbytes_per_s=beta / 1e9, network_gbits_per_s=beta * 8 / 1e9,
                   nvlink_latency_us=alpha * 1e6, network_latency_us=alpha * 1e6)


def predict_layout(layout, fit: dict, rate: float | None = None):
    """labkit.scale.cost.predict for `layout` (a LAYOUTS name or a (Layout, runner) pair) on this CPU;
    `rate`: each rank's FLOP/s while all of them compute (calibrated beside the run)."""
    from labkit.scale.cost import predict
    from labkit.scale.specs import spec_from_config

    layout, runner = _lookup(layout)
    world, cfg = layout.world_size, _config()
    cluster = cpu_cluster(fit, world, rate)
    p = predict(spec_from_config(cfg), layout, cluster, GLOBAL_BATCH, SEQ_LEN, efficiency=1.0, value_bytes=4,
                overlap=False)
    if runner in REPLICATED_HEAD and layout.tp > 1:  # each TP rank computes the whole head, not 1/tp of it
        head = 6 * cfg.d_model * cfg.vocab_size * GLOBAL_BATCH * SEQ_LEN / (layout.dp * layout.cp)
        p.parts_s["replicated_head"] = head * (1 - 1 / layout.tp) / cluster.peak_bf16_flops
        p.step_s += p.parts_s["replicated_head"]
    if world > fit["cores"]:  # a rank in its bubble sleeps and lends its core: the bubble shrinks
        compute, bubble = p.parts_s["compute"] + p.parts_s.get("replicated_head", 0.0), p.parts_s["bubble"]
        busy = max(compute, (compute + bubble) * fit["cores"] / world)
        p.step_s += busy - compute - bubble
        p.parts_s["bubble"] = busy - compute
    return p


def predict_then_measure(names=None, fit: dict | None = None, steps: int = 3) -> list[dict]:
    """One row per layout: predicted and measured step seconds, error = predicted / measured - 1. The
    prediction's FLOP rate is the calibration measured in the same launch (`_time_rank`)."""
    fit = fit or fit_cpu()
    rows = []
    for name in names or LAYOUTS:
        measured, rate = _run(name, steps, 1, True, 300.0)
        p = predict_layout(name, fit, rate)
        rows.append(dict(layout=name, ranks=LAYOUTS[name][0].world_size, predicted_s=p.step_s,
                         measured_s=measured, error=p.step_s / measured - 1, rate=rate,
                         parts={k: v for k, v in p.parts_s.items() if v}))
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'layout':14s} {'ranks':>5s} {'GFLOP/s':>7s} {'predicted s':>11s} {'measured s':>10s} {'error':>7s}  "
             "predicted parts (s)"]
    for r in rows:
        parts = ", ".join(f"{k.replace('exposed_', '')} {v:.3f}" for k, v in r["parts"].items())
        lines.append(f"{r['layout']:14s} {r['ranks']:5d} {r['rate'] / 1e9:7.1f} {r['predicted_s']:11.3f} {r['measured_s']:10.3f} "
                     f"{r['error']:+7.1%}  {parts}")
    return "\n".join(lines)
