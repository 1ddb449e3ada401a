"""What SlowLink sees of one ZeRO-2 step, one ZeRO-3 step and one sequence-parallel block, on 2 ranks.

    python bench/slow_link_traffic.py [--quick] [--impl solutions|exercises]

Inside `labkit.links.shaper.SlowLink(inf)` (it only counts: no sleep) each rank runs, on the tiny
model: a ZeRO-2 step (Zero2Optimizer, 0.05 MB buckets), a ZeRO-3 step (ZeRO3 over its 4
blocks, forward, backward, finish) and one block with sequence parallelism (forward and
backward, s = 8). Prints the calls per op, payload and wire bytes of each, then one JSON object
as the last line. Before labkit.comm (main at 998a852) all three read 0 calls and 0 bytes:
ZeRO bound its ops at import and SlowLink did not know the *_single ops.
"""
import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def one_rank(rank, world):
    import torch

    from labkit.grading import impl
    from labkit.model import build_model
    from labkit.links.shaper import SlowLink

    out, g = {}, torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (2, 16), generator=g)
    runs = {}
    model2 = build_model("tiny", seed=0)
    opt = impl("zero2").Zero2Optimizer(model2, bucket_size_mb=0.05)
    runs["zero2"] = lambda: (model2(x, x).backward(), opt.step())
    model3 = build_model("tiny", seed=0)
    z3 = impl("fsdp").ZeRO3(model3)
    runs["zero3"] = lambda: (model3(x, x).backward(), z3.sync_gradients())
    model_sp = build_model("tiny", seed=0)
    pb = impl("sequence_parallel").ParallelBlock(model_sp.layers[1], sequence_parallel=True)
    xs = torch.randn(2, 8 // world, 64, generator=g).requires_grad_()
    runs["sp_block"] = lambda: pb(xs, model_sp.rope).backward(torch.ones(2, 8 // world, 64))
    for name, step in runs.items():
        with SlowLink(float("inf")) as link:
            step()
        out[name] = dict(calls=link.calls, by_op=link.by_op, payload_bytes=link.payload_bytes,
                         wire_bytes=link.wire_bytes)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="accepted for make bench: the run is always this small")
    parser.add_argument("--impl", default=os.environ.get("LABKIT_IMPL", "solutions"))
    args = parser.parse_args()
    os.environ["LABKIT_IMPL"] = args.impl
    from labkit.launching.launcher import launch

    result = launch(one_rank, 2, timeout=120)[0]
    print(f"{'run':<10} {'calls':>5} {'payload B':>10} {'wire B':>10}  by op")
    for name, r in result.items():
        print(f"{name:<10} {r['calls']:>5} {r['payload_bytes']:>10} {r['wire_bytes']:>10.0f}  {r['by_op']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
