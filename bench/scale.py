"""The cost model against torchtitan's published Llama 3.1 runs on H100s (notebook 15).

    python bench/scale.py [--quick] [--efficiency E]

Predicts, from the published setup only (model, layout, batch, sequence, recompute, GPU and
network: labkit/scale/published.py, clusters/h100-grand-teton.json), the throughput per GPU
and the peak memory of every run of pytorch/torchtitan's
benchmarks/llama3_h100_202412_torchtitan.md, and prints predicted against published with the
error per row (predicted / published - 1). One constant is not an input: the achieved
efficiency (labkit.scale.cost.EFFICIENCY = 0.40, from the Llama 3 paper's measured MFU, never
fitted to these rows). The bf16 eager rows (FSDP on 8 and 128 GPUs) are the ones aimed at
(25% on throughput, 15% on memory); the compile / float8 / async-TP rows are reported only.
Then, as its last line, one JSON object: every row's figures and the worst aimed errors.
No process, no GPU: it is arithmetic and takes well under a second. --quick is accepted (and
changes nothing) so that every bench takes the same flags.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from labkit.scale.cost import EFFICIENCY  # noqa: E402
from labkit.scale.published import SOURCE, format_rows, predict_published  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--efficiency", type=float, default=EFFICIENCY,
                        help="achieved fraction of the bf16 peak (default: the model's constant)")
    args = parser.parse_args()
    rows = predict_published(efficiency=args.efficiency)
    print(f"torchtitan's published Llama 3.1 H100 runs ({SOURCE})")
    print(f"against labkit.scale's cost model, efficiency {args.efficiency:.2f}; err = predicted / published - 1\n")
    print(format_rows(rows))
    aimed = [r for r in rows if r["aimed"]]
    worst_tps = max(abs(r["tps_error"]) for r in aimed)
    worst_mem = max(abs(r["memory_error"]) for r in aimed)
    print(f"\naimed rows (bf16 eager): worst throughput error {worst_tps:.1%} (goal 25%), "
          f"worst memory error {worst_mem:.1%} (goal 15%)")
    keep = ("table", "model", "techniques", "dp", "cp", "tp", "pp", "local_batch", "seq_len", "tps_per_gpu",
            "memory_gib", "aimed")
    out = dict(bench="scale", efficiency=args.efficiency, source=SOURCE,
               rows=[dict({k: r[k] for k in keep}, predicted_tps=round(r["predicted_tps"], 1),
                          predicted_gib=round(r["predicted_gib"], 2), tps_error=round(r["tps_error"], 4),
                          memory_error=round(r["memory_error"], 4), mfu=round(r["mfu"], 4)) for r in rows],
               aimed_worst_tps_error=round(worst_tps, 4), aimed_worst_memory_error=round(worst_mem, 4))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
