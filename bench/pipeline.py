"""Pipeline schedules on synthetic stages: measured bubble vs (p-1)/(m+p-1), activation memory.

    python bench/pipeline.py [--quick] [--impl solutions|exercises] [--t-f SECONDS]

4 ranks (labkit.launch), one stage each (two for interleaved 1F1B). Every stage is a
`SyntheticStage`: its forward sleeps t_F and its backward t_B = 2 t_F, so the ranks do
not compete for CPU cores and what is measured is the schedule plus the messages. For
GPipe, 1F1B, interleaved 1F1B (v = 2) and the greedy zero-bubble schedule, and m in
{4, 8, 16} micro-batches of one global batch (16 rows x 64 positions x d_model 288, the
seed model's width, so a micro-batch is 16/m rows), each configuration runs one warm-up
step (it also opens the gloo connections) and then a few measured steps; the reported
step is the one with the SMALLEST bubble: on 2 cores shared with other work a step can
only be slowed down by the load, never sped up, so the minimum is the robust estimate. Columns:

    bubble      measured idle fraction of the step (labkit.measure.timeline.bubble_fraction)
    theory      (p-1)/(m+p-1), or (p-1)/(vm+p-1) for interleaved 1F1B with v = 2 stages
                per rank (each t_F/2 + t_B/2 long), or for ZB (labkit.parallel.schedules.
                zero_bubble_schedule, B and W t_B/2 each) its unit-time simulation; abs.err = measured - theory (percentage points),
                rel.err = measured / theory - 1
    step        measured step time; ideal = (m+p-1)(t_F+t_B), interleaved (vm+p-1)(t_F+t_B)/v
    in-flight   peak micro-batches whose activations a rank holds (rank 0, the most;
                interleaved: counted per stage, each stage half a rank's layers)
    act MiB     peak bytes autograd saved for backward on rank 0 (a synthetic stage saves
                the same bytes whatever share of the layers it stands for, so the
                interleaved figure counts each half-size stage as a full one: divide by v)

    F / B ms    the measured mean compute spans (the sleeps plus autograd's bookkeeping; B: a full
                backward, or a split one's B + W)
    gap / recv  measured per-action costs (labkit.measure.overlap.pipeline_costs): gap, the mean
                idle time between two computes of a rank with no receive between them (the
                executor's own work); recv, the mean idle time a receive adds, from the later of
                the rank's previous compute and the sender's compute. gloo moves a message only
                once its receiver has posted the receive, and the executor posts it just before
                the compute that reads it: every receive costs this, hidden or not.
    t_msg       one activation's message time from the lab's alpha-beta fit (labkit.links.bandwidth.
                measure_link: latency + bytes / bandwidth, point to point), for comparison with recv
    +costs / rel.err   the theory with the measured costs: labkit.parallel.schedules.simulate with each
                compute its measured mean + gap and each receive recv - gap more
                (labkit.measure.overlap.bubble_with_costs), and the measured error against it.

The last line is one JSON object: per configuration figures, the largest absolute and
relative bubble errors against the plain theory and against the theory with measured costs,
and rank 0's peak activation memory of GPipe over 1F1B for each m.
The excess over the plain theory is the receives and the executor's gaps (about 0.1-1 ms
each, more on a busy machine): every receive on the critical path adds its cost, so the
excess grows with the number of hops (v times more for interleaved and V schedules) while
the bubble shrinks with m. A longer t_F makes it relatively smaller (route 1: at t_F = 100 ms
GPipe and 1F1B are within 5% of the plain theory at m = 16); the theory with the measured
costs accounts for it at any t_F (route 2). It uses mean costs: on a machine loaded beyond its
cores, single stalls on the critical path cost more than the mean says, and the smallest
bubbles (3-6% for ZB-H1, ZB-V and DualPipeV at m = 16, where 5% is 0.15-0.3 points) miss
by more, the more so at --quick's t_F = 30 ms: read the load average in the header.
--quick: t_F = 30 ms, 2 measured steps per configuration (full: t_F = 100 ms, 3 steps).
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

P, MS, BATCH, SEQ, D_MODEL = 4, (4, 8, 16), 16, 64, 288
SCHEDULES = {"GPipe": "gpipe_schedule", "1F1B": "one_f_one_b_schedule", "interl.2": "interleaved_schedule",
             "ZB": "zero_bubble_schedule", "ZB-H1": "zb_h1_schedule", "ZB-V": "zbv_schedule",
             "DualPipeV": "dualpipev_schedule"}
V = 2  # stages per rank of the interleaved and V schedules, each t_F / V long
SPLIT = ("ZB", "ZB-H1", "ZB-V", "DualPipeV")  # B and W split: theory from the unit-time simulation


def build(label, p, m):
    """(schedule, stages per rank, this rank's stages) for one row of the table; None if it needs more m."""
    from labkit.parallel import schedules
    from labkit.grading import impl
    from labkit.parallel import v_schedules

    fn = SCHEDULES[label]
    if label == "DualPipeV" and m < 2 * p:
        return None
    if label in ("ZB-V", "DualPipeV"):
        return getattr(v_schedules, fn)(p, m), V, lambda r: v_schedules.v_stages(p, r)
    if label == "interl.2":
        return schedules.interleaved_schedule(p, V, m), V, lambda r: [c * p + r for c in range(V)]
    module = schedules if label == "ZB" else impl("zero_bubble") if label == "ZB-H1" else impl("pipeline")
    return getattr(module, fn)(p, m), 1, lambda r: [r]


def run_rank(rank, world_size, t_f, steps):
    import torch

    from labkit.grading import impl
    from labkit.mesh import Mesh
    from labkit.measure.timeline import Timeline

    from labkit.links.bandwidth import measure_link

    pl = impl("pipeline")
    tl, out, mesh = Timeline(), {}, Mesh(world_size, pp=world_size)
    for m in MS:  # one activation's message time, this run's link: for the theory with messages
        link = measure_link(BATCH // m * SEQ * D_MODEL * 4, iters=7)
        out["t_msg", m] = link["single_latency"] + BATCH // m * SEQ * D_MODEL * 4 / link["single_bandwidth"]
    for label in SCHEDULES:
        for m in MS:
            built = build(label, world_size, m)
            if built is None:
                continue
            schedule, v, own = built
            act = pl.activation_shape(type("Cfg", (), {"d_model": D_MODEL}), BATCH, SEQ, m)
            tokens = torch.zeros(BATCH, SEQ, dtype=torch.long)
            # floating-point inputs give stage 0's split B an input gradient to compute
            inputs = torch.zeros(BATCH, SEQ, D_MODEL) if label in SPLIT else tokens
            runs = []
            for _ in range(1 + steps):  # the first is a warm-up, dropped below
                stage = {s: pl.SyntheticStage(s, world_size * v, act, t_f=t_f / v) for s in own(rank)}
                stats = {}
                tl.sync()
                pl.run_schedule(stage, schedule, inputs, tokens, mesh=mesh, act_shape=act, timeline=tl, stats=stats)
                runs.append((tl.gather(), stats))
            out[label, m] = runs[1:]
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="t_F = 30 ms, 2 measured steps per configuration")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per configuration (the smallest bubble is reported)")
    parser.add_argument("--impl", default=os.environ.get("LABKIT_IMPL", "solutions"),
                        choices=["solutions", "exercises"], help="whose schedules and steps (default: solutions)")
    parser.add_argument("--t-f", type=float, default=None, help="synthetic forward time in seconds")
    args = parser.parse_args()
    os.environ["LABKIT_IMPL"] = args.impl

    import warnings

    from labkit.launching.launcher import OversubscriptionWarning, launch
    from labkit.parallel.schedules import simulate, theoretical_bubble
    from labkit.measure.timeline import bubble_fraction, window
    from labkit.measure.overlap import bubble_with_costs, pipeline_costs

    warnings.simplefilter("ignore", OversubscriptionWarning)  # the stages sleep: cores are not the limit
    t_f = args.t_f or (0.03 if args.quick else 0.1)
    steps = args.steps or (2 if args.quick else 3)
    start = time.time()
    results = launch(run_rank, P, t_f, steps, timeout=600)

    rows = []
    for label in SCHEDULES:
        for m in MS:
            if (label, m) not in results[0]:
                continue
            measured = []
            for i, (spans, _) in enumerate(results[0][label, m]):
                t0, t1 = window(spans)
                measured.append((bubble_fraction(spans), t1 - t0, i))
            bubble, step_s, i = min(measured)  # load only ever slows a step down: the least idle one
            spans, stats0 = results[0][label, m][i]
            schedule, v, _ = build(label, P, m)
            t_msg = results[0]["t_msg", m]
            costs = pipeline_costs(spans)
            with_costs = bubble_with_costs(schedule, spans, costs)
            theory = theoretical_bubble(P, m, v)
            ideal_ms = (v * m + P - 1) * 3 * t_f / v * 1e3
            if label in SPLIT:  # the unit-time simulation's ideal (W = B = t_B / 2; per stage / v)
                sim = simulate(schedule, t_f / v, 2 * t_f / v)
                theory, ideal_ms = sim.bubble, sim.makespan * 1e3
            rows.append({"schedule": label, "m": m, "bubble": round(bubble, 4), "theory": round(theory, 4),
                         "abs_error_pp": round(100 * (bubble - theory), 2), "rel_error": round(bubble / theory - 1, 4),
                         "t_f_measured_ms": round(costs["F"] * 1e3, 2), "t_b_measured_ms": round((costs["B"] or costs["B_input"] + costs["W"]) * 1e3, 2),
                         "gap_ms": round(costs["gap"] * 1e3, 3), "recv_ms": round(costs["recv"] * 1e3, 3),
                         "t_msg_alpha_beta_ms": round(t_msg * 1e3, 3), "theory_with_costs": round(with_costs, 4),
                         "rel_error_with_costs": round(bubble / with_costs - 1, 4), "step_ms": round(step_s * 1e3, 1),
                         "ideal_step_ms": round(ideal_ms, 1),
                         "peak_inflight_rank0": stats0["peak_inflight"],
                         "peak_act_mib_rank0": round(stats0["peak_activation_bytes"] / 2**20, 3),
                         "peak_inflight_per_rank": [results[r][label, m][i][1]["peak_inflight"] for r in range(P)]})

    print(f"pipeline schedules, p={P}, synthetic stages t_F={t_f * 1e3:.0f} ms, t_B=2 t_F, "
          f"batch {BATCH}x{SEQ}x{D_MODEL}, impl={args.impl}, smallest bubble of {steps} steps, {time.time() - start:.0f} s, "
          f"load average {os.getloadavg()[0]:.1f} (1 min) on {os.cpu_count()} cores")
    head = f"{'schedule':8s} {'m':>3s} {'bubble':>8s} {'theory':>8s} {'abs.err':>8s} {'rel.err':>8s} {'step ms':>9s} " \
           f"{'ideal ms':>9s} {'F ms':>6s} {'B ms':>6s} {'gap ms':>6s} {'recv ms':>7s} {'t_msg ms':>8s} {'+costs':>7s} " \
           f"{'rel.err':>8s} {'in-flight':>10s} {'act MiB':>8s}  in-flight per rank"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['schedule']:8s} {r['m']:3d} {r['bubble']:8.1%} {r['theory']:8.1%} {r['abs_error_pp']:+7.1f}pp {r['rel_error']:+8.1%} "
              f"{r['step_ms']:9.1f} {r['ideal_step_ms']:9.1f} {r['t_f_measured_ms']:6.1f} {r['t_b_measured_ms']:6.1f} "
              f"{r['gap_ms']:6.3f} {r['recv_ms']:7.3f} {r['t_msg_alpha_beta_ms']:8.3f} {r['theory_with_costs']:7.1%} "
              f"{r['rel_error_with_costs']:+8.1%} {r['peak_inflight_rank0']:10d} "
              f"{r['peak_act_mib_rank0']:8.3f}  {r['peak_inflight_per_rank']}")
    mem = {str(m): round(next(r["peak_act_mib_rank0"] for r in rows if r["schedule"] == "GPipe" and r["m"] == m)
                         / next(r["peak_act_mib_rank0"] for r in rows if r["schedule"] == "1F1B" and r["m"] == m), 3)
           for m in MS}
    worst = {label: max(abs(r["rel_error"]) for r in rows if r["schedule"] == label) for label in SCHEDULES}
    worst_costs = {label: max(abs(r["rel_error_with_costs"]) for r in rows if r["schedule"] == label) for label in SCHEDULES}
    print(json.dumps({"bench": "pipeline", "p": P, "t_f_ms": t_f * 1e3, "steps": steps, "impl": args.impl, "results": rows,
                      "max_abs_bubble_error_pp": max(abs(r["abs_error_pp"]) for r in rows),
                      "max_rel_bubble_error": max(worst.values()),
                      "max_rel_bubble_error_with_costs": max(worst_costs.values()),
                      "max_rel_bubble_error_by_schedule": worst, "max_rel_bubble_error_with_costs_by_schedule": worst_costs,
                      "load_average_1min": round(os.getloadavg()[0], 2),
                      "act_mem_ratio_gpipe_over_1f1b_rank0": mem}))


if __name__ == "__main__":
    main()
