"""DP vs DiLoCo (H=8) vs PowerSGD on an emulated slow link, at two bandwidths: time to a target loss, bytes moved.

    python bench/slow_links.py [--quick] [--impl solutions|exercises] [--steps S]

Two ranks (labkit.launch) train the same small model on the same TinyStories batches with AdamW,
inside `labkit.links.shaper.SlowLink` (the in-process shaper: every collective sleeps latency + wire
bytes / bandwidth, and is counted). For each bandwidth: DP (one all-reduce of the gradients per
step), DiLoCo with H = 8 (inner AdamW, outer SGD-Nesterov) and PowerSGD rank 4 with error feedback.
The target is DP's final validation loss at that bandwidth (same run), so DP reaches it by
definition; the others reach it sooner, later or never. Validation loss is measured every 4 steps
with the clock stopped, on the model one would keep (for DiLoCo: the shared weights). Ratios are against DP in the same run.
Prints a table, then one JSON object as the last line.
--quick: 32 steps, batch 8 x 32 tokens; default: 96 steps, batch 16 x 32.
"""
import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BANDWIDTHS = (40e6, 4e6)  # bytes/s: a fast-ish and a slow link
LATENCY = 5e-3
METHODS = {"dp": {}, "diloco_h8": {"H": 8}, "powersgd_r4": {"r": 4}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--impl", default=os.environ.get("LABKIT_IMPL", "solutions"), choices=("solutions", "exercises"))
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    os.environ["LABKIT_IMPL"] = args.impl

    import labkit
    from labkit.apps.slow_link_runs import merge, smoothed, time_to, train_over_link

    steps = args.steps or (32 if args.quick else 96)
    batch = 8 if args.quick else 16
    rows = []
    for bandwidth in BANDWIDTHS:
        runs = {}
        for name, kw in METHODS.items():
            method = name.split("_")[0]
            runs[name] = merge(labkit.launch(train_over_link, 2, method, steps=steps, batch_size=batch, seq_len=32,
                                             bandwidth=bandwidth, latency=LATENCY, timeout=600, **kw))
        target = runs["dp"]["eval"][-1][3]
        dp_seconds, dp_bytes = time_to(runs["dp"], target)
        for name, run in runs.items():
            seconds, sent = time_to(run, target)
            rows.append(dict(bandwidth_mbs=bandwidth / 1e6, method=name, target_loss=round(target, 4),
                             final_train_loss=round(smoothed(run["loss"])[-1], 4), val_loss=round(run["val_loss"], 4),
                             seconds=round(run["seconds"][-1], 3), mb_moved=round(run["wire_bytes"][-1] / 1e6, 3),
                             time_to_target=None if seconds is None else round(seconds, 3),
                             mb_to_target=None if sent is None else round(sent / 1e6, 3),
                             time_vs_dp=None if seconds is None else round(seconds / dp_seconds, 3),
                             bytes_vs_dp=round(run["wire_bytes"][-1] / runs["dp"]["wire_bytes"][-1], 4)))

    print(f"slow links: 2 ranks, {steps} steps, batch {batch} x 32 tokens, latency {LATENCY * 1e3:g} ms, "
          f"in-process shaper, impl={args.impl}, {os.cpu_count()} CPU cores")
    print(f"{'MB/s':>6} {'method':<12}{'final val':>11}{'seconds':>9}{'MB moved':>10}"
          f"{'to target (s)':>15}{'MB to target':>14}{'time vs DP':>12}")
    for r in rows:
        fmt = lambda v, spec: "never" if v is None else format(v, spec)  # noqa: E731
        print(f"{r['bandwidth_mbs']:>6g} {r['method']:<12}{r['val_loss']:>11.3f}{r['seconds']:>9.1f}"
              f"{r['mb_moved']:>10.2f}{fmt(r['time_to_target'], '.1f'):>15}{fmt(r['mb_to_target'], '.2f'):>14}"
              f"{fmt(r['time_vs_dp'], '.2f'):>12}")
    print("target = DP's final validation loss at that bandwidth; 'never' = not reached within the steps")
    print(json.dumps({"bench": "slow_links", "impl": args.impl, "world_size": 2, "steps": steps,
                      "latency_s": LATENCY, "shaper": "in-process", "rows": rows}))


if __name__ == "__main__":
    main()
