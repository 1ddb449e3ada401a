"""All-reduce bandwidth: your ring vs the naive master vs torch's dist.all_reduce
(and the optional pipelined ring and tree).

    python bench/allreduce.py [--quick] [--impl solutions|exercises]

2 and 4 ranks (labkit.launch, gloo on CPU or nccl with a GPU per rank), float32
tensors from 1 KB to 64 MB. The three all-reduces are interleaved call by call
so that noise from other processes hits them alike; each time is the slowest
rank's, median over iterations (labkit.links.bandwidth, nccl-tests definitions).
Prints a table of busbw, then as its last line one JSON object with the 4-rank
64 MB figures: ring, naive and torch busbw in GB/s and ratio = ring / torch.
--quick: fewer sizes and iterations, still including 4 ranks x 64 MB.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

KB, MB = 1 << 10, 1 << 20
FULL_SIZES = [KB, 4 * KB, 16 * KB, 64 * KB, 256 * KB, MB, 4 * MB, 16 * MB, 64 * MB]
QUICK_SIZES = [KB, 64 * KB, 4 * MB, 64 * MB]


def iterations(nbytes, quick):
    if nbytes >= 16 * MB:
        return 3 if quick else 7
    return 5 if quick else 15


def run_rank(rank, world_size, sizes, quick):
    import torch.distributed as dist

    from labkit.links import bandwidth
    from labkit.grading import impl

    allreduce = impl("allreduce")
    fns = {"ring": allreduce.ring_allreduce, "naive": allreduce.naive_allreduce, "torch": dist.all_reduce,
           "pipelined ring": allreduce.pipelined_ring_allreduce, "tree": allreduce.tree_allreduce}
    return bandwidth.sweep(fns, sizes, iters_for=lambda nbytes: iterations(nbytes, quick))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and iterations")
    parser.add_argument("--impl", default=os.environ.get("LABKIT_IMPL", "solutions"),
                        choices=["solutions", "exercises"], help="whose all-reduce (default: solutions)")
    args = parser.parse_args()
    os.environ["LABKIT_IMPL"] = args.impl

    from labkit.links import bandwidth
    from labkit.launching.launcher import launch

    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    rows, start = [], time.time()
    for world_size in (2, 4):
        rows += launch(run_rank, world_size, sizes, args.quick, timeout=900)[0]
    print(f"all-reduce, float32, impl={args.impl}, {time.time() - start:.0f} s; busbw = algbw x 2(N-1)/N")
    print(bandwidth.format_table(rows))

    def gbs(name):
        row = next(r for r in rows if r["world_size"] == 4 and r["bytes"] == 64 * MB and r["name"] == name)
        return row["busbw"] / 1e9

    ring, naive, torch_ = gbs("ring"), gbs("naive"), gbs("torch")
    pipelined, tree = gbs("pipelined ring"), gbs("tree")
    print(f"4 ranks, 64 MB: ring / torch = {ring / torch_:.2f}, naive / torch = {naive / torch_:.2f}")
    print(json.dumps({"bench": "allreduce", "world_size": 4, "bytes": 64 * MB,
                      "ring_busbw_gbs": round(ring, 4), "naive_busbw_gbs": round(naive, 4),
                      "torch_busbw_gbs": round(torch_, 4), "ratio": round(ring / torch_, 3),
                      "pipelined_busbw_gbs": round(pipelined, 4), "tree_busbw_gbs": round(tree, 4),
                      "quick": args.quick}))


if __name__ == "__main__":
    main()
