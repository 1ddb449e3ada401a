"""Predict, then measure, on this CPU: labkit.scale's cost model against the lab's parallel steps run for real.

    python bench/scale_cpu.py [--quick] [--impl solutions|exercises] [--steps N] [--layouts NAME ...]

Fits this machine as a "cluster" from its own measurements (labkit/apps/cpu_layouts.py): notebook 03's
alpha-beta of a ring step on 2, 4 and 8 gloo ranks, the alpha an all-reduce pays inside a step (after
compute, the mean: `step_alpha`, which the prediction uses), and each rank's FLOP/s on the whole model's training
step (no communication) measured in the same launch as the layout, interleaved with its steps (the
baseline of this bench: the machine's load, shared with other work, hits both alike; GFLOP/s column). Then, for every layout of the registry (DP, ZeRO-1, TP, PP 1F1B,
DP x PP, CP ring attention, notebook 14's composed step, up to 8 ranks; the seed model, global batch 8 x 128 tokens), predicts its
step time with labkit.scale.cost.predict (fp32 on the wire, no overlap: the lab's steps communicate
after their compute) and runs it with labkit.launch (gloo). The machine's 2 cores are shared with
other work: a step's time is the slowest rank's, a layout's the minimum over the steps after one
warm-up. Prints the table (error = predicted / measured - 1; the goal is within 25%), then one JSON
object as its last line with every row and the fit.
--quick: 3 layouts (dp2, tp2, pp2 1f1b m4), 3 steps; default: every layout, 5 steps.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--impl", default=os.environ.get("LABKIT_IMPL", "solutions"), choices=["solutions", "exercises"])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--layouts", nargs="*", default=None)
    args = parser.parse_args()
    os.environ["LABKIT_IMPL"] = args.impl

    from labkit.apps.cpu_layouts import (GLOBAL_BATCH, LAYOUTS, MODEL, QUICK_LAYOUTS, SEQ_LEN, fit_cpu,
                                         format_rows, predict_then_measure)

    names = args.layouts or (list(QUICK_LAYOUTS) if args.quick else list(LAYOUTS))
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layouts {unknown}: choose among {list(LAYOUTS)}")
    steps = args.steps or (3 if args.quick else 5)
    start = time.perf_counter()
    worlds = sorted({LAYOUTS[n][0].world_size for n in names} - {1})
    fit = fit_cpu(worlds=worlds)
    print(f"this CPU ({fit['cores']} cores): one process {fit['rate'] / 1e9:.1f} GFLOP/s alone, "
          f"{fit['busy'] / 1e9:.1f} GFLOP/s each with every core busy")
    for w, (alpha, beta) in fit["links"].items():
        print(f"  ring step on {w} gloo ranks: alpha {alpha * 1e6:,.0f} us, beta {beta / 1e9:.2f} GB/s; inside a step "
              f"(all-reduces after compute, mean): alpha {fit['step_alpha'][w] * 1e6:,.0f} us, used by the prediction")
    rows = predict_then_measure(names, fit, steps=steps)
    print(f"\n{MODEL} model, global batch {GLOBAL_BATCH} x {SEQ_LEN} tokens, min over {steps} steps; "
          "error = predicted / measured - 1\n")
    print(format_rows(rows))
    worst = max(abs(r["error"]) for r in rows)
    within = sum(abs(r["error"]) <= 0.25 for r in rows)
    print(f"\n{within} of {len(rows)} rows within 25%, worst {worst:.1%}; {time.perf_counter() - start:.0f} s")
    print(json.dumps(dict(bench="scale_cpu", model=MODEL, global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, steps=steps,
                          fit=dict(rate=fit["rate"], busy=fit["busy"], cores=fit["cores"],
                                   links={str(w): dict(alpha_s=a, beta_bytes_per_s=b, step_alpha_s=fit["step_alpha"][w])
                                          for w, (a, b) in fit["links"].items()}),
                          rows=[dict(layout=r["layout"], ranks=r["ranks"], predicted_s=round(r["predicted_s"], 4),
                                     measured_s=round(r["measured_s"], 4), rate=round(r["rate"]), error=round(r["error"], 4)) for r in rows],
                          worst_error=round(worst, 4), within_25=within)))


if __name__ == "__main__":
    main()
