"""ZeRO-1, ZeRO-2, ZeRO-3 by hand and FSDP2 against plain data parallelism: step time and memory per rank.

    python bench/zero.py [--quick] [--impl solutions|exercises] [--world-size N] [--model tiny|seed]

On N ranks (labkit.launch: gloo on CPU, nccl with a GPU per rank), the same model trains with
    dp     plain DP: one flat all-reduce of the gradients, then torch.optim.AdamW
    zero1  ZeroAdamW (ShardedOptimizer): reduce-scatter, AdamW on 1/N of the parameters, all-gather
    zero2  Zero2Optimizer: gradients reduce-scattered in buckets during backward
    zero3  ZeRO3 by hand: per-block flat shards gathered just in time, with prefetch
    fsdp2  torch's fully_shard on every block and the root
The modes are interleaved step by step so that noise from other processes hits them alike; a step's
time is the slowest rank's, median over the steps after a warm-up. Memory per rank: on a GPU the
allocator's peak (torch.cuda.max_memory_allocated, reset per mode); on CPU there is no allocator
peak, so the model states are counted: parameters resident at the peak (ZeRO-3: shards + the gathered
units its hooks measured; FSDP2: its local shards + the same gathered units), the gradient peak
(ZeRO-2: measured by its hooks; ZeRO-3/FSDP2: shards + one block's full gradient, the formula), and
the optimizer state as held.
Prints a table, then as its last line one JSON object with every figure and the ratios to DP, and
zero3_vs_fsdp2 (by-hand ZeRO-3 step time / FSDP2's; goal <= 1.1).
--quick: the tiny model, 2 ranks, 6 steps; default: the seed model, 2 ranks, 20 steps.
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HYPER = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
MODES = ("dp", "zero1", "zero2", "zero3", "fsdp2")
NAMES = {"dp": "DP + AdamW", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3 by hand", "fsdp2": "FSDP2"}


def run_rank(rank, world_size, model_name, steps, batch, seq):
    import torch
    import torch.distributed as dist

    from labkit.data import get_batch, load_tokens
    from labkit.grading import impl
    from labkit.launching.launcher import rank_device
    from labkit.model import build_model
    from labkit.parallel.flat import allreduce_mean_
    from labkit.parallel.sharding import optimizer_state_bytes

    zero, zero2, fsdp = impl("zero"), impl("zero2"), impl("fsdp")
    device = rank_device()
    cuda = device.type == "cuda"
    tokens = load_tokens("tinystories")
    models = {mode: build_model(model_name, seed=0, device=device) for mode in MODES}
    n = sum(p.numel() for p in models["dp"].parameters())
    block = max(sum(p.numel() for p in b.parameters()) for b in models["dp"].layers)
    opts = {"dp": torch.optim.AdamW(models["dp"].parameters(), **HYPER),
            "zero1": zero.ZeroAdamW(models["zero1"].parameters(), **HYPER),
            # buckets of ~1/8 of the gradient: small against the model, as ZeRO-2's formula assumes
            "zero2": zero2.Zero2Optimizer(models["zero2"], torch.optim.AdamW, bucket_size_mb=4 * n / 8 / 2**20,
                                          **HYPER)}
    zero3 = fsdp.ZeRO3(models["zero3"], prefetch=True)
    opts["zero3"] = torch.optim.AdamW(zero3.shards(), **HYPER)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(device.type, (world_size,))
    for b in models["fsdp2"].layers:
        fully_shard(b, mesh=mesh)
    fully_shard(models["fsdp2"], mesh=mesh)
    opts["fsdp2"] = torch.optim.AdamW(models["fsdp2"].parameters(), **HYPER)

    times = {mode: [] for mode in MODES}
    peak = {}
    for step in range(steps):
        x, y = get_batch(tokens, batch * world_size, seq, step, rank=rank, world_size=world_size, device=device)
        for mode in MODES:
            model, opt = models[mode], opts[mode]
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            model(x, y).backward()
            if mode == "dp":
                allreduce_mean_([p.grad for p in model.parameters()])  # plain DP: one flat all-reduce
            if mode == "zero3":
                zero3.sync_gradients()
            opt.step()
            opt.zero_grad()
            if cuda:
                torch.cuda.synchronize()
                peak[mode] = torch.cuda.max_memory_allocated()
            times[mode].append(time.perf_counter() - start)
    state = {mode: optimizer_state_bytes(opts[mode]) for mode in ("dp", "zero3", "fsdp2")}
    state["zero1"], state["zero2"] = opts["zero1"].state_bytes(), opts["zero2"].state_bytes()
    if not cuda:  # counted model states (see the docstring)
        shards = sum(s.numel() for s in zero3.shards()) * 4
        local = sum(p.to_local().numel() for p in models["fsdp2"].parameters()) * 4
        grads = {"dp": 4 * n, "zero1": 4 * n, "zero2": opts["zero2"].peak_grad_bytes,
                 "zero3": shards + 4 * block, "fsdp2": local + 4 * block}
        # FSDP2 gathers the same units (blocks, root kept gathered, one block prefetched): ZeRO-3's count
        params = {"dp": 4 * n, "zero1": 4 * n, "zero2": 4 * n, "zero3": shards + zero3.peak_gathered_bytes,
                  "fsdp2": local + zero3.peak_gathered_bytes}
        peak = {mode: params[mode] + grads[mode] + state[mode] for mode in MODES}
    return dict(times=times, peak=peak, params=n, cuda=cuda)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 6 steps")
    parser.add_argument("--impl", default=os.environ.get("LABKIT_IMPL", "solutions"),
                        choices=["solutions", "exercises"], help="whose ZeRO code (default: solutions)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--model", choices=["tiny", "seed"], default=None)
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    os.environ["LABKIT_IMPL"] = args.impl
    model = args.model or ("tiny" if args.quick else "seed")
    steps = args.steps or (6 if args.quick else 20)
    batch, seq = (4, 64) if args.quick else (8, 128)
    warmup = 2 if steps > 3 else 0

    import torch

    from labkit.launching.launcher import launch

    # torch imports modules lazily at the first backward and the first optimizer: pay it once
    # here rather than in every rank's first timed step
    w = torch.ones(2, requires_grad=True)
    (w * 2).sum().backward()
    torch.optim.AdamW([w]).step()

    results = launch(run_rank, args.world_size, model, steps, batch, seq, timeout=600)
    step_ms = {mode: 1e3 * statistics.median(max(r["times"][mode][i] for r in results)
                                              for i in range(warmup, steps)) for mode in MODES}
    peak = {mode: max(r["peak"][mode] for r in results) for mode in MODES}
    params, cuda = results[0]["params"], results[0]["cuda"]

    what = "allocator peak" if cuda else "model states"
    print(f"ZeRO vs DP: {model} model ({params:,} parameters), {args.world_size} ranks, "
          f"{batch}x{seq} tokens per rank, median of {steps - warmup} steps ({args.impl})")
    print(f"{'':16s} {'step ms':>9s} {'/ DP':>6s} {what + ' per rank':>28s} {'/ DP':>6s}")
    for mode in MODES:
        print(f"{NAMES[mode]:16s} {step_ms[mode]:9.1f} {step_ms[mode] / step_ms['dp']:6.2f} "
              f"{peak[mode]:>22,} bytes {peak[mode] / peak['dp']:6.3f}")
    out = dict(bench="zero", model=model, params=params, world_size=args.world_size, impl=args.impl,
               memory=("cuda_max_memory_allocated" if cuda else "counted_model_states"))
    for mode in MODES:
        out[f"{mode}_step_ms"] = round(step_ms[mode], 2)
        out[f"{mode}_bytes"] = peak[mode]
        if mode != "dp":
            out[f"{mode}_step_time_ratio"] = round(step_ms[mode] / step_ms["dp"], 3)
            out[f"{mode}_memory_ratio"] = round(peak[mode] / peak["dp"], 4)
    out["zero3_vs_fsdp2"] = round(step_ms["zero3"] / step_ms["fsdp2"], 3)
    print(f"by-hand ZeRO-3 / FSDP2 step time: {out['zero3_vs_fsdp2']} (goal <= 1.1)")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
