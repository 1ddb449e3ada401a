"""Simulated ranks of 8 to 1,024-rank worlds, one per distinct role, against the closed forms (notebook 15).

    python bench/scale_sim.py [--quick] [--impl solutions|exercises] [--layers L] [--seq S]

For every world size 8, 16, ..., 1,024, each distinct role of the lab's parallel steps (labkit/apps/
sim_roles.py: FSDP over the world; DP x TP 8; DP x PP 4 with its first, a middle and its last stage;
an MoE under DP) runs as ONE rank on fake tensors and the fake process group; torch's FlopCounterMode,
MemTracker and labkit.comm's traffic count measure it, and every figure is compared with its closed
form (exact). The dense model has Llama-3 8B's width (d 4096, 32 heads, MLP 14,336, vocabulary
128,256; no grouped-query attention in labkit's model), L layers, batch 1 x S tokens; the MoE is small
and runs on real tensors (routing needs values). Prints the time of the whole sweep, the simulated ranks,
the mismatches (none expected) and the largest gap of the FLOPs to labkit.scale's 6N + 12 L d s (the norm
weights it counts in N), then one JSON object as its last line.
--quick: 4 layers, 2,048 tokens; default: 32 layers, 8,192 tokens (Llama-3 8B's shape).
"""
import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--impl", default=os.environ.get("LABKIT_IMPL", "solutions"), choices=["solutions", "exercises"])
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    args = parser.parse_args()
    os.environ["LABKIT_IMPL"] = args.impl
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)  # MemTracker's and FakeTensor's chatter

    from labkit.apps.sim_roles import sweep
    from labkit.model import ModelConfig

    layers, seq = args.layers or (4 if args.quick else 32), args.seq or (2048 if args.quick else 8192)
    cfg = ModelConfig(vocab_size=128256, d_model=4096, n_heads=32, n_layers=layers, context=seq, hidden_dim=14336)
    moe = ModelConfig(vocab_size=512, d_model=64, n_heads=4, n_layers=2, context=64, hidden_dim=64, n_experts=8,
                      top_k=2, capacity_factor=8.0)
    out = sweep(cfg, moe, 1, seq)
    wrong = [r for r in out["rows"] if r[5] != r[6]]
    print(f"{'world':>6s} {'role':5s} {'stage':>5s} {'figures':>7s} {'exact':>5s}")
    for key in dict.fromkeys(r[:4] for r in out["rows"]):
        figures = [r for r in out["rows"] if r[:4] == key]
        stage = str(key[3]) if key[1] == "pp" else "-"
        print(f"{key[0]:6d} {key[1]:5s} {stage:>5s} {len(figures):7d} {'yes' if all(r[5] == r[6] for r in figures) else 'NO':>5s}")
    print(f"\n{out['runs']} simulated ranks ({layers} layers x {seq} tokens at Llama-3 8B's width), "
          f"{len(out['rows'])} figures, {len(wrong)} mismatches, in {out['seconds']:.0f} s on "
          f"{len(os.sched_getaffinity(0))} cores; largest FLOPs gap to labkit.scale: {out['worst_spec_gap']:.2e}")
    print(json.dumps(dict(bench="scale_sim", layers=layers, seq_len=seq, runs=out["runs"], figures=len(out["rows"]),
                          mismatches=len(wrong), seconds=round(out["seconds"], 1),
                          worst_spec_flops_gap=out["worst_spec_gap"])))


if __name__ == "__main__":
    main()
