"""Data-parallel step time: flat all-reduce vs bucketed (overlapped) vs torch DDP, and scaling.

    python bench/data_parallel.py [--quick] [--ranks 4] [--impl solutions|exercises]

One run measures, on `--ranks` ranks, the same training step (forward, backward,
gradient averaging, AdamW) with three ways of averaging the gradients:
  flat      sync_gradients: one all-reduce after backward (no overlap)
  bucketed  BucketedDataParallel: per-bucket async all-reduces during backward
  ddp       torch.nn.parallel.DistributedDataParallel, same bucket size
The modes take turns, round after round, and each keeps its median step time, so
a slow moment of a shared machine hurts all three alike. Then the bucketed step
runs on 1, 2, ... ranks with the same per-rank batch (weak scaling):
efficiency(N) = tokens/s on N ranks / (N x tokens/s on 1 rank).
Prints a table, then one JSON object as the last line.
On a CPU-only machine every rank computes on the same few cores: with more ranks
than cores, efficiency measures the oversubscription, not the method.
"""
import argparse
import json
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from labkit.data import get_batch, load_tokens  # noqa: E402
from labkit.grading import impl  # noqa: E402
from labkit.launching.launcher import OversubscriptionWarning, launch  # noqa: E402
from labkit.model import build_model  # noqa: E402

MODES = ("flat", "bucketed", "ddp")


def _device(rank):
    # launch picks nccl when every rank can have its own GPU, else gloo on the CPU
    return torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_step(mode, model, bucket_mb):
    """A function step(x, y) doing one training step with `mode`'s gradient averaging."""
    dp = impl("data_parallel")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if mode == "ddp":
        device_ids = [model.output.weight.device.index] if model.output.weight.is_cuda else None
        net = DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=bucket_mb)
    elif mode == "bucketed":
        net = dp.BucketedDataParallel(model, bucket_size_mb=bucket_mb)
    else:
        net = model

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        net(x, y).backward()
        if mode == "bucketed":
            net.sync_gradients()
        elif mode == "flat":
            dp.sync_gradients(model)
        opt.step()
    return step


def bench_rank(rank, world_size, modes, cfg):
    """Median step time (s) of each mode on this rank, modes taking turns round by round."""
    device = _device(rank)
    tokens = load_tokens("tinystories")
    steps = {}
    for mode in modes:
        model = build_model(cfg["model"], seed=0, device=device)
        steps[mode] = make_step(mode, model, cfg["bucket_mb"])
    batch = lambda s: get_batch(tokens, cfg["micro_batch"] * world_size, cfg["seq_len"], s,  # noqa: E731
                                rank=rank, world_size=world_size, device=device)
    times = {mode: [] for mode in modes}
    for round_ in range(cfg["rounds"]):
        for mode in modes:
            for s in range(cfg["warmup"] if round_ == 0 else 0):
                steps[mode](*batch(s))
            _sync(device)
            dist.barrier()
            t0 = time.perf_counter()
            for s in range(cfg["steps"]):
                steps[mode](*batch(s))
            _sync(device)
            dist.barrier()
            times[mode].append((time.perf_counter() - t0) / cfg["steps"])
    return {mode: statistics.median(t) for mode, t in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CPU, CI)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--impl", choices=("exercises", "solutions"), default=os.environ.get("LABKIT_IMPL", "solutions"),
                        help="whose data_parallel to time (default: $LABKIT_IMPL, else solutions)")
    args = parser.parse_args()
    os.environ["LABKIT_IMPL"] = args.impl
    warnings.simplefilter("ignore", OversubscriptionWarning)  # said in the table's header instead
    if args.quick:
        cfg = dict(model="tiny", micro_batch=4, seq_len=64, bucket_mb=0.5, warmup=2, steps=4, rounds=5)
    else:
        cfg = dict(model="seed", micro_batch=8, seq_len=256, bucket_mb=4.0, warmup=3, steps=10, rounds=5)
    n = args.ranks
    tokens_per_step = lambda ranks: cfg["micro_batch"] * ranks * cfg["seq_len"]  # noqa: E731

    # The first optimizer built in a process imports torch._dynamo (seconds): once here, so
    # that the forked ranks inherit it instead of each importing it.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    modes = launch(bench_rank, n, MODES, cfg, timeout=600)[0]
    scaling = {}
    for ranks in sorted({1, 2, n} if n >= 2 else {1}):
        t = modes["bucketed"] if ranks == n else launch(bench_rank, ranks, ("bucketed",), cfg, timeout=600)[0]["bucketed"]
        scaling[ranks] = tokens_per_step(ranks) / t
    efficiency = {r: scaling[r] / (r * scaling[1]) for r in scaling}

    print(f"data parallel, {n} ranks, model {cfg['model']}, micro-batch {cfg['micro_batch']} x {cfg['seq_len']} "
          f"tokens per rank, buckets {cfg['bucket_mb']} MB, impl={args.impl}, {os.cpu_count()} CPU cores"
          f"{', ' + str(torch.cuda.device_count()) + ' GPUs' if torch.cuda.is_available() else ''}")
    if n > (os.cpu_count() or 1):
        print(f"note: {n} ranks on {os.cpu_count()} CPU cores take turns on the cores (oversubscribed)")
    print(f"{'mode':<10}{'step (ms)':>12}{'tokens/s':>12}{'vs ddp':>9}")
    for mode, t in modes.items():
        print(f"{mode:<10}{t * 1e3:>12.1f}{tokens_per_step(n) / t:>12.0f}{t / modes['ddp']:>9.2f}")
    print(f"\n{'ranks':<10}{'tokens/s':>12}{'efficiency':>12}   (bucketed, same per-rank batch)")
    for ranks in scaling:
        print(f"{ranks:<10}{scaling[ranks]:>12.0f}{efficiency[ranks]:>12.2f}")
    print(json.dumps({
        "bench": "data_parallel", "impl": args.impl, "world_size": n, "cpu_cores": os.cpu_count(), "model": cfg["model"], "micro_batch": cfg["micro_batch"],
        "seq_len": cfg["seq_len"], "bucket_mb": cfg["bucket_mb"],
        **{f"{mode}_step_s": round(t, 6) for mode, t in modes.items()},
        **{f"{mode}_tokens_per_s": round(tokens_per_step(n) / t, 1) for mode, t in modes.items()},
        "bucketed_vs_ddp": round(modes["bucketed"] / modes["ddp"], 4),
        "bucketed_vs_flat": round(modes["bucketed"] / modes["flat"], 4),
        "tokens_per_s_by_ranks": {str(r): round(v, 1) for r, v in scaling.items()},
        f"scaling_efficiency_1_to_{n}": round(efficiency[n], 4),
    }))


if __name__ == "__main__":
    main()
