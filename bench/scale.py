"""The cost model against published training runs: the validation set (notebook 15).

    python bench/scale.py [--quick]

Predicts, from each run's published setup only (model, layout, batch, sequence, recompute, GPU
and network), the throughput per GPU and the peak memory of every row of
labkit/scale/published_runs.json: torchtitan's two H100 benchmark files (Dec 2024, async TP June
2025), Megatron-LM 2021 Table 1, Megatron-LM 2022's MFU table, Llama 3's Table 4. Each set states
in the file how every unpublished input was chosen ("choices"), before predicting; the rows
validate, nothing is fitted to them (labkit.scale.validation). Prints one line per row with its
throughput and memory error (predicted / published - 1) and whether the model says it fits, a
summary per set, then, as its last line, one JSON object: per set and overall, n, rows within
25%, the median and worst |throughput error|, the worst |memory error|.
No process, no GPU: arithmetic, well under a second. --quick is accepted (and changes nothing)
so that every bench takes the same flags.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from labkit.scale.validation import format_sets, load_sets, predict_sets, summarize  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.parse_args()
    results = predict_sets()
    print("labkit.scale's cost model against published runs; err = predicted / published - 1")
    for name, info in load_sets().items():
        print(f"  {name}: {info['source'][:140]}")
    print(format_sets(results))
    every = [r for rows in results.values() for r in rows]
    overall = summarize(every)
    print(f"\nall sets: {overall['n']} rows, {overall['within_25']} within 25%, median |err| "
          f"{overall['median_abs_tps_error']:.0%}, worst {overall['worst_abs_tps_error']:.0%}; "
          f"runs that ran but the model says do not fit: {sum(not r['fits'] for r in every)}")

    def rounded(s):
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items()}

    out = dict(bench="scale", sets={name: rounded(summarize(rows)) for name, rows in results.items()},
               overall=rounded(overall), not_fitting=[r["id"] for r in every if not r["fits"]])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
