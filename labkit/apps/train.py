"""One training entry point for every strategy, in a notebook, under torchrun, Slurm or mpiexec.

    python -m labkit.apps.train --steps 20                             # single: one process
    python -m labkit.apps.train --dp 2                                 # dp: forks 2 ranks (labkit.launch)
    torchrun --standalone --nproc-per-node 4 -m labkit.apps.train --dp 2 --pp 2   # hybrid
    srun python -m labkit.apps.train --pp 4               # Slurm: one task per rank (labkit/jobs/)
    mpiexec -n 8 python -m labkit.apps.train --dp 2 --pp 4             # PBS / MPI

    from labkit.apps.train import main                   # in a notebook: the same, forked
    report = main(["--dp", "2", "--pp", "2", "--steps", "5"])

The flags choose the strategy (or say --strategy; one that would ignore a given flag is refused).
Strategies, as (dp, pp) meshes of notebook 07 (world size = dp x pp):
    single  one process: labkit.training.loop's step (the reference)
    dp      dp replicas (--dp alone): impl("data_parallel") shard, all-reduce the gradients (notebook 04)
    pp      pp stages, 1F1B micro-batches (--pp alone): impl("pipeline").run_schedule (notebook 06)
    hybrid  dp pipelines of pp stages (--dp and --pp): impl("hybrid").hybrid_step (notebook 07)
and any layout of notebook 14 (chosen by --tp, --cp, --ep or --zero, or --strategy composed):
    composed  dp x pp x cp x tp ranks (ep folded over dp, or dp x cp (x tp): --ep-over) on one Mesh: labkit.compose (TP with
            sequence parallelism and a vocabulary-parallel head, the zigzag ring, the EP all-to-all,
            1F1B, ZeRO-1/2/3 on each parameter's replicas). The same AdamW (no decay on norm weights),
            schedule and global-norm clipping (each parameter's replicas counted once):

    python -m labkit.apps.train --dp 2 --pp 2 --tp 2                       # forks 8 ranks
    python -m labkit.apps.train --dp 2 --ep 2 --cp 2 --model tiny-moe --capacity-factor 2
    python -m labkit.apps.train --cp 2 --ep 2 --ep-over dp,cp --model tiny-moe --capacity-factor 2   # 2 ranks
    python -m labkit.apps.train --dp-replicate 2 --dp-shard 2 --zero 3       # HSDP: 4 ranks
    torchrun --nproc-per-node 8 -m labkit.apps.train --pp 2 --cp 2 --tp 2 --zero 1
    python -m labkit.apps.train --cp 4 --cp-method hybrid                 # all-to-all in pairs, ring across
--cp-method chooses how attention crosses the --cp ranks (solutions/cp_methods.py, notebook 11): ring (default),
allgather (Llama 3's K/V all-gather), ulysses (all-to-all; heads per --tp rank must divide by --cp) or hybrid
(all-to-all inside pairs of cp ranks, ring across the pairs; --cp 4, 6, 8...).
Every strategy trains the same model on the same global batches with the same AdamW,
learning-rate schedule and gradient clipping as `labkit.training.loop`, so its losses and
final weights equal the single-process run's (up to float rounding; tests/test_train_scripts.py).

`labkit.launch` does the process work: run plainly, it forks the ranks; under torchrun
(RANK, WORLD_SIZE), Slurm (SLURM_PROCID, SLURM_NTASKS) or MPI (OMPI_COMM_WORLD_RANK,
PMI_RANK) it runs this process as its rank. The world size then comes from the launcher, and a layout
whose product differs is refused (labkit/apps/train_layout.py: every refusal names its flag and the fix;
a MoE under --cp or --tp needs --capacity-factor n_experts / top_k, 2 for tiny-moe, to drop no token).

Reported, the same way for every strategy and machine: tokens/s = global batch tokens x
timed steps / wall time of those steps (the first step, which warms up, is not timed),
per device, and MFU = tokens/s x FLOPs per token / (peak FLOP/s x devices) from
`labkit.measure.metrics` (None on a CPU: no honest peak). The summary line and the JSON report (the last
line of stdout) give the world size and every axis (dp, pp, cp, tp, ep, zero, microbatches, and the
report's dp_replicate and ep_over; the summary line adds them when not the default) as the ranks' meshes ran them. The ranks' code is in labkit/apps/train_ranks.py.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

# torch is imported inside the functions: a wrong command line fails in a fraction of a second.
from labkit.apps.train_layout import (STRATEGIES, composed_dims, model_config, resolve_composed,  # noqa: F401 - public
                                      resolve_layout, resolve_mesh)
from labkit.apps.train_ranks import composed_rank, strategy_step, train_config, train_rank  # noqa: F401 - public


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m labkit.apps.train", description=__doc__.split("\n")[0])
    p.add_argument("--strategy", choices=STRATEGIES, default=None,
                   help="default: composed if --tp/--cp/--ep/--zero is given, else hybrid for --dp and --pp, "
                        "pp for --pp, dp for --dp, single for none")
    p.add_argument("--dp", type=int, default=None, help="data-parallel replicas (dp, hybrid, composed)")
    p.add_argument("--pp", type=int, default=None, help="pipeline stages (pp, hybrid, composed)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks (composed)")
    p.add_argument("--cp", type=int, default=None, help="context-parallel ranks (composed)")
    p.add_argument("--cp-method", default=None, choices=("ring", "allgather", "ulysses", "hybrid"),
                   help="how attention crosses the --cp ranks (composed; default ring)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel ranks, folded over --ep-over: no ranks of "
                   "their own (composed, MoE)")
    p.add_argument("--ep-overlap", action="store_true", default=None, help="each MoE layer as two halves whose "
                   "all-to-alls hide behind the other half's experts (solutions/moe_overlap.py, notebook 12; composed)")
    p.add_argument("--ep-over", default=None, help="the axes ep is folded over: dp (default: borrowed from the data "
                   "ranks), dp,cp or dp,cp,tp (torchtitan's); ep must divide their product (dp counting dp_shard)")
    p.add_argument("--dp-replicate", type=int, default=None, help="HSDP: the --dp data-parallel ranks as R replicas "
                   "x S shards (--dp = R x S; --dp may be left out). Each replica shards as --zero says (default with "
                   "HSDP: 3, FSDP) and the shards are all-reduced across the R replicas; --zero 0 is refused")
    p.add_argument("--dp-shard", type=int, default=None, help="HSDP: the shards per replica, S (default --dp / R)")
    p.add_argument("--zero", type=int, default=None, choices=(0, 1, 2, 3), help="ZeRO stage (composed)")
    p.add_argument("--microbatches", type=int, default=None, help="per pipeline; default 2 x pp")
    p.add_argument("--model", default="tiny", help="model config: tiny, tiny-moe or seed")
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="MoE capacity factor (>= n_experts / top_k: dropless, needed with cp or tp)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=16, help="the GLOBAL batch, in sequences")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0, help="model init and data order")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                   help="parameters and activations; float64 makes runs comparable across layouts to ~1e-12 "
                        "(the tests use it: N ranks sum in another order than one process)")
    p.add_argument("--impl", choices=("exercises", "solutions"), default=None,
                   help="whose code runs (sets LABKIT_IMPL; default: the environment's, else exercises)")
    p.add_argument("--save", default=None, help="write the final full state dict here (torch.save)")
    p.add_argument("--timeout", type=float, default=600, help="seconds, when forking the ranks")
    p.add_argument("--quiet", action="store_true", help="no per-step lines")
    return p.parse_args(argv)


def scheduled_world_size() -> int | None:
    """The world size a launcher (torchrun, srun, mpiexec) set for this process, else None."""
    from labkit.launching.cluster import scheduled_world

    world = scheduled_world()
    return None if world is None else world["world_size"]


# ---------------------------------------------------------------------------- the report
def report(results, args) -> tuple[dict, dict]:
    """Merge the ranks' results: (the report: the layout the ranks ran, losses, tokens/s, MFU, a weights
    checksum; the gathered weights). The world size and axes are what the ranks' meshes say."""
    import torch

    from labkit.measure import metrics

    config = model_config(args)
    layouts = [r["axes"] for r in results]
    if any(layout != layouts[0] for layout in layouts) or layouts[0]["world_size"] != len(results):
        raise RuntimeError(f"the ranks ran different layouts: {layouts}; this is a bug of labkit.apps.train")
    world_size = len(results)
    losses = next(r["losses"] for r in results if r["losses"] is not None)
    weights = {}
    for r in results:
        weights.update(r["weights"] or {})
    timed = args.steps - 1
    seconds = max(r["seconds"] for r in results)
    tok_s = timed * args.batch_size * args.seq_len / seconds if timed > 0 else float("nan")
    device = results[0]["device"]
    fraction = metrics.mfu(tok_s, config, args.seq_len, device=device, dtype=torch.float32,
                           n_devices=world_size) if timed > 0 and device.startswith("cuda") else None
    return {
        "strategy": args.strategy, "world_size": world_size,
        **{a: layouts[0][a] for a in ("dp", "pp", "cp", "tp", "ep")}, "zero": args.zero,
        "dp_replicate": layouts[0].get("dp_replicate", 1), "ep_over": layouts[0].get("ep_over", ["dp"]),
        "microbatches": args.microbatches, "cp_method": args.cp_method or "ring", "model": args.model, "steps": args.steps,
        "global_batch_tokens": args.batch_size * args.seq_len,
        "first_loss": losses[0], "final_loss": losses[-1],
        "tokens_per_s": tok_s, "tokens_per_s_per_device": tok_s / world_size, "mfu": fraction,
        "weights_checksum": float(sum(w.double().sum() for w in weights.values())),
        "n_params": int(sum(w.numel() for w in weights.values())),
        "device": device,
    }, weights


def summary(out: dict) -> str:
    """The report's one readable line: strategy, world size and every axis, losses, tokens/s, MFU."""
    from labkit.measure.metrics import format_rate

    mfu_text = "n/a (no known peak FLOP/s for this device)" if out["mfu"] is None else f"{out['mfu']:.1%}"
    layout = " ".join(f"{a}={out[a]}" for a in ("dp", "pp", "cp", "tp", "ep", "zero", "microbatches"))
    layout += f" cp_method={out['cp_method']}" if out.get("cp_method", "ring") != "ring" else ""
    if out.get("dp_replicate", 1) > 1:
        layout += f" dp_replicate={out['dp_replicate']}"
    if list(out.get("ep_over", ["dp"])) != ["dp"]:
        layout += f" ep_over={','.join(out['ep_over'])}"
    return (f"{out['strategy']} on {out['world_size']} rank(s), {layout}, {out['device']}: loss "
            f"{out['first_loss']:.4f} -> {out['final_loss']:.4f}; {format_rate(out['tokens_per_s'])} "
            f"({format_rate(out['tokens_per_s_per_device'])} per device), MFU {mfu_text}")


def main(argv=None) -> dict:
    """Parse ``argv``, run every rank (forked, or this process under a launcher), report.

    Returns the report dict (on every process); rank 0 (or the forking parent) prints the
    summary and, as the last line, the JSON object. A layout that cannot run stops (SystemExit,
    one line naming the flag and the fix) before any rank starts.
    """
    args = parse_args(argv)
    if args.impl:
        os.environ["LABKIT_IMPL"] = args.impl  # before any impl(): forked ranks inherit it
    world_size = resolve_layout(args, scheduled_world_size())
    import torch
    import torch.distributed as dist

    from labkit.launching.launcher import launch

    import labkit.data, labkit.model, labkit.training.loop  # noqa: E401,F401 - imported once, inherited by forked ranks
    results = launch(train_rank, world_size, args, timeout=args.timeout)
    out, weights = report(results, args)
    leader = not dist.is_initialized() or dist.get_rank() == 0
    if leader:
        if args.save:
            torch.save(weights, args.save)
        print(summary(out))
        print(json.dumps(out), flush=True)
    if dist.is_initialized():  # under a launcher: leave together
        dist.barrier()
        dist.destroy_process_group()
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
