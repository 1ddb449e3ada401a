"""ZeRO-1 vs plain data parallelism: optimizer memory per rank and time per training step.

    python bench/zero.py [--quick] [--impl solutions|exercises] [--world-size N] [--model tiny|seed]

On N ranks (labkit.launch: gloo on CPU, nccl with a GPU per rank), the same model trains
with (a) plain DP: one flat all-reduce of the gradients, then torch.optim.AdamW, and
(b) ZeroAdamW: reduce-scatter, AdamW on 1/N of the parameters, all-gather. The two are
interleaved step by step so that noise from other processes hits them alike; a step's
time is the slowest rank's, median over the steps after a warm-up. Prints a table, then
as its last line one JSON object: step times, optimizer-state bytes per rank, and the
ratios ZeRO / DP (state_ratio ~ 1/N; step_time_ratio ~ 1 since a reduce-scatter plus an
all-gather move the bytes of one all-reduce).
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


def run_rank(rank, world_size, model_name, steps, batch, seq):
    import torch
    import torch.distributed as dist

    from labkit.data import get_batch, load_tokens
    from labkit.grading import impl
    from labkit.launch import rank_device
    from labkit.model import build_model

    zero = impl("zero")
    device = rank_device()
    tokens = load_tokens("tinystories")
    models = {mode: build_model(model_name, seed=0, device=device) for mode in ("dp", "zero")}
    opts = {"dp": torch.optim.AdamW(models["dp"].parameters(), **HYPER),
            "zero": zero.ZeroAdamW(models["zero"].parameters(), **HYPER)}

    def dp_allreduce(model):
        grads = [p.grad for p in model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= world_size
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    times = {"dp": [], "zero": []}
    for step in range(steps):
        x, y = get_batch(tokens, batch * world_size, seq, step, rank=rank, world_size=world_size, device=device)
        for mode in ("dp", "zero"):
            model, opt = models[mode], opts[mode]
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            model(x, y).backward()
            if mode == "dp":
                dp_allreduce(model)
            opt.step()
            opt.zero_grad()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[mode].append(time.perf_counter() - start)
    state = {"dp": zero.optimizer_state_bytes(opts["dp"]), "zero": opts["zero"].state_bytes()}
    return dict(times=times, state=state, params=sum(p.numel() for p in models["dp"].parameters()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 6 steps")
    parser.add_argument("--impl", default=os.environ.get("LABKIT_IMPL", "solutions"),
                        choices=["solutions", "exercises"], help="whose ZeroAdamW (default: solutions)")
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

    from labkit.launch import launch

    # torch imports modules lazily at the first backward and the first optimizer: pay it once
    # here rather than in every rank's first timed step
    w = torch.ones(2, requires_grad=True)
    (w * 2).sum().backward()
    torch.optim.AdamW([w]).step()

    results = launch(run_rank, args.world_size, model, steps, batch, seq, timeout=600)
    step_ms = {mode: 1e3 * statistics.median(max(r["times"][mode][i] for r in results)
                                              for i in range(warmup, steps)) for mode in ("dp", "zero")}
    state = {mode: max(r["state"][mode] for r in results) for mode in ("dp", "zero")}
    params = results[0]["params"]

    print(f"ZeRO-1 vs DP: {model} model ({params:,} parameters), {args.world_size} ranks, "
          f"{batch}x{seq} tokens per rank, median of {steps - warmup} steps ({args.impl})")
    print(f"{'':14s} {'step ms':>10s} {'optimizer state per rank':>26s}")
    for mode, name in (("dp", "DP + AdamW"), ("zero", "ZeroAdamW")):
        print(f"{name:14s} {step_ms[mode]:10.1f} {state[mode]:>20,} bytes")
    out = dict(bench="zero", model=model, params=params, world_size=args.world_size, impl=args.impl,
               dp_step_ms=round(step_ms["dp"], 2), zero_step_ms=round(step_ms["zero"], 2),
               step_time_ratio=round(step_ms["zero"] / step_ms["dp"], 3),
               dp_state_bytes=state["dp"], zero_state_bytes=state["zero"],
               state_ratio=round(state["zero"] / state["dp"], 4))
    print(f"ratios ZeRO / DP: step time {out['step_time_ratio']}, optimizer state {out['state_ratio']} "
          f"(1/N = {1 / args.world_size:.3f})")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
