"""Expert parallelism: your all-to-all against torch's, and an EP step against one device.

    python bench/experts.py [--quick] [--impl solutions|exercises]

1. all_to_all_single (solutions/all_to_all.py, isend/irecv) against torch's
   dist.all_to_all_single on 4 ranks (gloo on CPU), equal splits, float32, interleaved call
   by call; the slowest rank's time, median over iterations (labkit.links.bandwidth).
   busbw = algbw x (N-1)/N (nccl-tests: each rank keeps 1/N of its data).
2. One training step (forward, backward, gradient all-reduce) of tiny-moe with its experts
   sharded over 4 ranks (ep=4, each rank B/4 rows) against the single-device model on the
   same B rows (one process). Every launched rank runs one torch thread, so the single
   device uses one core while the 4 EP ranks share all the machine's cores (2 on a laptop):
   the ratio mixes that parallelism with the cost of the all-to-alls. On a GPU node each
   rank has its own GPU and the ratio is the EP overhead at equal work per rank.
The hand-written all-to-all first exchanges the split sizes (one small all-gather, so that
bad sizes raise instead of hanging): that fixed cost dominates small messages.
Prints a table, then as its last line one JSON object (ratio = hand / torch busbw at the
largest size).
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MB = 1 << 20
WORLD = 4


def a2a_rank(rank, world_size, sizes, iters):
    import torch
    import torch.distributed as dist

    from labkit.links import bandwidth
    from labkit.grading import impl

    hand = impl("all_to_all").all_to_all_single
    rows = []
    for nbytes in sizes:
        numel = nbytes // 4
        out = torch.empty(numel)
        fns = {"hand": lambda t, group: hand(out, t, group=group),
               "torch": lambda t, group: dist.all_to_all_single(out, t, group=group)}
        seconds = bandwidth.time_collectives(fns, numel, iters=iters)
        for name, s in seconds.items():
            rows.append(dict(name=name, bytes=nbytes, seconds=s,
                             busbw=nbytes / s * (world_size - 1) / world_size))
    return rows


def step_rank(rank, world_size, batch, seq, iters):
    """Median step time of the EP model (every rank) or, on 1 rank, of the single-device model."""
    import torch
    import torch.distributed as dist

    from labkit.grading import impl
    from labkit.mesh import Mesh, shard_rows
    from labkit.model import build_model

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4096, (batch, seq), generator=g)
    if world_size == 1:
        model = build_model("tiny-moe", seed=0)
        step = lambda: model(x, x).backward()
    else:
        ep = impl("expert_parallel")
        mesh = Mesh(world_size, ep=world_size, combined=[("dp", "ep")])
        model = ep.build_ep_model("tiny-moe", mesh=mesh, seed=0)
        xs = shard_rows(x, mesh.index(("dp", "ep")), world_size)

        def step():
            model(xs, xs).backward()
            ep.sync_gradients(model, mesh=mesh)
    times = []
    for i in range(iters + 1):
        if world_size > 1:
            dist.barrier()
        t0 = time.perf_counter()
        step()
        model.zero_grad()
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        if world_size > 1:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i:
            times.append(float(elapsed))
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and iterations")
    parser.add_argument("--impl", default=os.environ.get("LABKIT_IMPL", "solutions"),
                        choices=["solutions", "exercises"], help="whose code (default: solutions)")
    args = parser.parse_args()
    os.environ["LABKIT_IMPL"] = args.impl

    from labkit.links.bandwidth import human_bytes
    from labkit.launching.launcher import launch

    sizes = [64 << 10, 4 * MB, 32 * MB] if args.quick else [64 << 10, MB, 4 * MB, 16 * MB, 64 * MB]
    iters = 5 if args.quick else 11
    start = time.time()
    rows = launch(a2a_rank, WORLD, sizes, iters, timeout=900)[0]
    print(f"all_to_all_single on {WORLD} ranks, float32, impl={args.impl}; busbw = algbw x (N-1)/N")
    print(f"{'size':>10} {'hand GB/s':>10} {'torch GB/s':>11} {'hand/torch':>11}")
    by = {(r["name"], r["bytes"]): r for r in rows}
    for nbytes in sizes:
        h, t = by["hand", nbytes]["busbw"], by["torch", nbytes]["busbw"]
        print(f"{human_bytes(nbytes):>10} {h / 1e9:>10.3f} {t / 1e9:>11.3f} {h / t:>11.2f}")

    batch, seq, step_iters = (8, 64, 3) if args.quick else (32, 128, 7)
    single = launch(step_rank, 1, batch, seq, step_iters, timeout=900)[0]
    ep_time = launch(step_rank, WORLD, batch, seq, step_iters, timeout=900)[0]
    print(f"\ntiny-moe step (forward, backward, gradient all-reduce), {batch} x {seq} tokens in all:")
    print(f"  one device: {single * 1e3:.1f} ms   ep={WORLD}: {ep_time * 1e3:.1f} ms   "
          f"ep / one device = {ep_time / single:.2f}   ({time.time() - start:.0f} s)")
    big = sizes[-1]
    hand, torch_ = by["hand", big]["busbw"], by["torch", big]["busbw"]
    print(json.dumps({"bench": "experts", "world_size": WORLD, "bytes": big,
                      "hand_busbw_gbs": round(hand / 1e9, 4), "torch_busbw_gbs": round(torch_ / 1e9, 4),
                      "ratio": round(hand / torch_, 3), "tokens": batch * seq,
                      "single_step_ms": round(single * 1e3, 2), "ep_step_ms": round(ep_time * 1e3, 2),
                      "ep_over_single": round(ep_time / single, 3), "quick": args.quick}))


if __name__ == "__main__":
    main()
