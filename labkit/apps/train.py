"""One training entry point for every strategy, in a notebook, under torchrun, Slurm or mpiexec.

    python -m labkit.apps.train --strategy single --steps 20
    python -m labkit.apps.train --strategy dp --dp 2                   # forks 2 ranks (labkit.launch)
    torchrun --standalone --nproc-per-node 4 -m labkit.apps.train --strategy hybrid --dp 2 --pp 2
    srun python -m labkit.apps.train --strategy pp        # Slurm: one task per rank (labkit/jobs/)
    mpiexec -n 8 python -m labkit.apps.train --strategy hybrid --dp 2 --pp 4   # PBS / MPI

    from labkit.apps.train import main                   # in a notebook: the same, forked
    report = main(["--strategy", "hybrid", "--dp", "2", "--pp", "2", "--steps", "5"])

Strategies, as (dp, pp) meshes of notebook 07 (world size = dp x pp):
    single  one process: labkit.training.loop's step (the reference)
    dp      dp replicas: impl("data_parallel") shard, all-reduce the gradients (notebook 04)
    pp      pp stages, 1F1B micro-batches: impl("pipeline").run_schedule (notebook 06)
    hybrid  dp pipelines of pp stages: impl("hybrid").hybrid_step (notebook 07)
and any layout of notebook 14 (chosen by --tp, --cp, --ep or --zero, or --strategy composed):
    composed  dp x pp x cp x tp ranks (ep borrowed from dp) on one Mesh: labkit.compose (TP with
            sequence parallelism and a vocabulary-parallel head, the zigzag ring, the EP all-to-all,
            1F1B, ZeRO-1/2/3 on each parameter's replicas). The same AdamW (no decay on norm weights),
            schedule and global-norm clipping (each parameter's replicas counted once):

    python -m labkit.apps.train --dp 2 --pp 2 --tp 2                       # forks 8 ranks
    python -m labkit.apps.train --dp 2 --ep 2 --cp 2 --model tiny-moe --capacity-factor 2
    torchrun --nproc-per-node 8 -m labkit.apps.train --pp 2 --cp 2 --tp 2 --zero 1
Every strategy trains the same model on the same global batches with the same AdamW,
learning-rate schedule and gradient clipping as `labkit.training.loop`, so its losses and
final weights equal the single-process run's (up to float rounding; tests/test_train_scripts.py).

`labkit.launch` does the process work: run plainly, it forks the ranks; under torchrun
(RANK, WORLD_SIZE), Slurm (SLURM_PROCID, SLURM_NTASKS) or MPI (OMPI_COMM_WORLD_RANK,
PMI_RANK) it runs this process as its rank. The world size then comes from the launcher.

Reported, the same way for every strategy and machine: tokens/s = global batch tokens x
timed steps / wall time of those steps (the first step, which warms up, is not timed),
per device, and MFU = tokens/s x FLOPs per token / (peak FLOP/s x devices) from
`labkit.measure.metrics` (None on a CPU: no honest peak). The last line of stdout is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

# torch is imported inside the functions: a wrong command line fails in a fraction of a second.
STRATEGIES = ("single", "dp", "pp", "hybrid", "composed")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m labkit.apps.train", description=__doc__.split("\n")[0])
    p.add_argument("--strategy", choices=STRATEGIES, default=None,
                   help="default: composed if --tp/--cp/--ep/--zero is given, else single")
    p.add_argument("--dp", type=int, default=None, help="data-parallel replicas (dp, hybrid)")
    p.add_argument("--pp", type=int, default=None, help="pipeline stages (pp, hybrid)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks (composed)")
    p.add_argument("--cp", type=int, default=None, help="context-parallel ranks (composed)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel ranks, borrowed from dp (composed, MoE)")
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


def resolve_mesh(strategy: str, dp: int | None, pp: int | None, world_size: int | None):
    """(dp, pp) for the strategy; missing sizes come from the launcher's world size (or 2)."""
    if strategy == "single":
        dp, pp = 1, 1
    elif strategy == "dp":
        dp, pp = dp or world_size or 2, 1
    elif strategy == "pp":
        dp, pp = 1, pp or world_size or 2
    else:
        if dp is None and pp is None:
            dp, pp = 2, (world_size // 2 if world_size else 2)
        elif dp is None:
            dp = (world_size or 2 * pp) // pp
        elif pp is None:
            pp = (world_size or 2 * dp) // dp
    if world_size is not None and dp * pp != world_size:
        raise SystemExit(f"--strategy {strategy} with dp={dp}, pp={pp} needs {dp * pp} processes, but the "
                         f"launcher started {world_size}: change --dp/--pp or the number of processes")
    return dp, pp


def model_config(args):
    """The run's ModelConfig: the named config, with --capacity-factor for a MoE."""
    from labkit.model import get_config

    extra = {} if args.capacity_factor is None else {"capacity_factor": args.capacity_factor}
    return get_config(args.model, **extra)


def composed_dims(args):
    from labkit.compose.dims import ParallelDims

    return ParallelDims(dp=args.dp, pp=args.pp, cp=args.cp, tp=args.tp, ep=args.ep, zero=args.zero,
                        microbatches=args.microbatches)


def resolve_composed(args, world: int | None) -> int:
    """Fill the composed layout's sizes (dp from the launcher's world size if left out) and check it
    against the model, batch and world with labkit.compose's checks, before any process work."""
    args.pp, args.cp, args.tp, args.ep = (v or 1 for v in (args.pp, args.cp, args.tp, args.ep))
    args.zero = args.zero or 0
    if args.dp is None:
        rest = args.pp * args.cp * args.tp
        args.dp = world // rest if world and world % rest == 0 else max(1, args.ep)
    if args.microbatches is None:
        args.microbatches = 2 * args.pp if args.pp > 1 else 1
    try:
        dims = composed_dims(args)
        dims.check(model_config(args), batch=args.batch_size, seq_len=args.seq_len, world_size=world)
    except ValueError as e:
        raise SystemExit(f"python -m labkit.apps.train: {e}") from None
    return dims.world_size


# ---------------------------------------------------------------------------- the ranks
def _global_grad_clip(params, max_norm: float, group, reduce: bool = True) -> None:
    """clip_grad_norm_ over the WHOLE model: each stage holds some of the gradients, so the
    squared norms are summed over the pipeline group before scaling (replicas agree already)."""
    import torch
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    sq = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else None)
    for g in grads:
        sq += g.detach().double().pow(2).sum()
    if reduce:
        dist.all_reduce(sq, group=group)
    coef = max_norm / (sq.sqrt().item() + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)


def train_config(args):
    """The `labkit.training.loop.TrainConfig` of a run: AdamW, warm-up + cosine, clipping at 1.0."""
    from labkit.training.loop import TrainConfig

    return TrainConfig.quick(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                             lr=args.lr, min_lr=args.lr / 10, warmup=max(1, args.steps // 10), seed=args.seed)


def strategy_step(strategy: str, module, mesh, model_config, cfg, m: int):
    """(x, y) -> loss (None on ranks that do not hold it): one forward and backward of `strategy` on
    this rank's `module`, gradients synchronised over the mesh's dp axis; the optimizer step is the caller's."""
    import torch.distributed as dist

    from labkit.grading import impl
    from labkit.mesh import shard_rows

    if strategy == "single":
        return lambda x, y: _plain(module, x, y)
    if strategy == "dp":
        def dp_step(x, y):
            xs, ys = shard_rows((x, y), mesh.coord("dp"), mesh.size("dp"))
            loss = _plain(module, xs, ys)
            impl("data_parallel").sync_gradients(module, group=mesh.group("dp"))
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=mesh.group("dp"))
            return loss / mesh.size("dp")
        return dp_step
    if strategy == "pp":
        pipeline = impl("pipeline")
        schedule = pipeline.one_f_one_b_schedule(mesh.size("pp"), m)
        act_shape = pipeline.activation_shape(model_config, cfg.batch_size, cfg.seq_len, m)
        return lambda x, y: pipeline.run_schedule(module, schedule, x if mesh.is_first("pp") else None,
                                                  y if mesh.is_last("pp") else None, mesh=mesh, act_shape=act_shape)
    hybrid = impl("hybrid")
    return lambda x, y: hybrid.hybrid_step(module, x, y, m, mesh=mesh)


def _plain(module, x, y):
    loss = module(x, y)
    loss.backward()
    return loss


def train_rank(rank: int, world_size: int, args) -> dict:
    """One rank's training run; returns its losses (where known), timing and stage weights."""
    import torch.distributed as dist

    from labkit.data import get_batch, load_tokens
    from labkit.grading import impl
    from labkit.launching.launcher import rank_device
    from labkit.mesh import Mesh
    from labkit.model import build_model, make_stage
    from labkit.training.loop import lr_at, make_optimizer

    device = rank_device()
    cfg = train_config(args)
    tokens = load_tokens("tinystories")
    import torch

    model = build_model(model_config(args), seed=args.seed, device=device).to(getattr(torch, args.dtype))
    if args.strategy == "composed":
        return composed_rank(world_size, args, cfg, model, tokens, device)
    mesh = Mesh(world_size, dp=args.dp, pp=args.pp)  # the one topology: every group, every neighbour
    m = args.microbatches
    if args.strategy in ("single", "dp"):
        module = model
    else:
        module = make_stage(model, mesh.coord("pp"), mesh.size("pp"))
    opt = make_optimizer(module, cfg)
    if args.strategy == "dp":
        impl("data_parallel").broadcast_parameters(model, src=0, group=mesh.group("dp"))
    forward_backward = strategy_step(args.strategy, module, mesh, model.config, cfg, m)

    losses, t_start = [], None
    for step in range(cfg.steps):
        if step == 1:  # the first step warms up (allocations, lazy init): time the others
            dist.barrier()
            t_start = time.perf_counter()
        x, y = get_batch(tokens, cfg.batch_size, cfg.seq_len, step, seed=cfg.seed, device=device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = forward_backward(x, y)  # gradients synchronised, no optimizer step yet
        if cfg.grad_clip is not None:
            _global_grad_clip(list(module.parameters()), cfg.grad_clip, mesh.group("pp"), reduce=mesh.size("pp") > 1)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if loss is not None:
            losses.append(loss.item())
            if mesh.coord("dp") == 0 and mesh.is_last("pp") and not args.quiet:  # the last stage of pipeline 0
                print(f"step {step:4d}  loss {losses[-1]:.4f}", flush=True)
    dist.barrier()
    seconds = time.perf_counter() - t_start if t_start is not None else float("nan")
    mine = {id(p) for p in module.parameters()}
    weights = {n: p.detach().cpu() for n, p in model.named_parameters() if id(p) in mine}
    return {"losses": losses if losses else None, "seconds": seconds, "device": str(device),
            "weights": weights if mesh.coord("dp") == 0 else None}  # replica 0 speaks for all


def composed_rank(world_size: int, args, cfg, model, tokens, device) -> dict:
    """The composed strategy's ranks: labkit.compose's step with the loop's AdamW, schedule and clipping."""
    import torch.distributed as dist

    from labkit.compose.model import parallelize
    from labkit.compose.state import full_state
    from labkit.compose.step import ComposedOptimizer, train_step
    from labkit.data import get_batch
    from labkit.training.loop import lr_at

    dims = composed_dims(args)
    mesh = dims.build_mesh(world_size)
    stage = parallelize(model, mesh=mesh)
    opt = ComposedOptimizer(stage, mesh=mesh, zero=dims.zero, lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=cfg.weight_decay, no_decay=lambda p: p.dim() < 2)  # as make_optimizer
    losses, t_start = [], None
    for step in range(cfg.steps):
        if step == 1:
            dist.barrier()
            t_start = time.perf_counter()
        x, y = get_batch(tokens, cfg.batch_size, cfg.seq_len, step, seed=cfg.seed, device=device)
        opt.set_lr(lr_at(step, cfg))
        losses.append(train_step(stage, opt, x, y, mesh=mesh, microbatches=dims.microbatches, max_norm=cfg.grad_clip))
        if dist.get_rank() == 0 and not args.quiet:
            print(f"step {step:4d}  loss {losses[-1]:.4f}", flush=True)
    dist.barrier()
    seconds = time.perf_counter() - t_start if t_start is not None else float("nan")
    opt.begin_step()  # ZeRO-3: the parameters back from the shards
    weights = {n: w.cpu() for n, w in full_state(stage, mesh=mesh).items()}
    return {"losses": losses, "seconds": seconds, "device": str(device), "weights": weights}


# ---------------------------------------------------------------------------- the report
def report(results, args, world_size: int) -> tuple[dict, dict]:
    """Merge the ranks' results: (the report: losses, tokens/s, MFU, a weights checksum; the gathered weights)."""
    import torch

    from labkit.measure import metrics

    config = model_config(args)
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
        "strategy": args.strategy, "dp": args.dp, "pp": args.pp, "microbatches": args.microbatches,
        **({a: getattr(args, a) for a in ("cp", "tp", "ep", "zero")} if args.strategy == "composed" else {}),
        "world_size": world_size, "model": args.model, "steps": args.steps,
        "global_batch_tokens": args.batch_size * args.seq_len,
        "first_loss": losses[0], "final_loss": losses[-1],
        "tokens_per_s": tok_s, "tokens_per_s_per_device": tok_s / world_size, "mfu": fraction,
        "weights_checksum": float(sum(w.double().sum() for w in weights.values())),
        "n_params": int(sum(w.numel() for w in weights.values())),
        "device": device,
    }, weights


def main(argv=None) -> dict:
    """Parse ``argv``, run every rank (forked, or this process under a launcher), report.

    Returns the report dict (on every process); rank 0 (or the forking parent) prints the
    summary and, as the last line, the JSON object.
    """
    args = parse_args(argv)
    if args.impl:
        os.environ["LABKIT_IMPL"] = args.impl  # before any impl(): forked ranks inherit it
    world = scheduled_world_size()
    composed_flags = any(getattr(args, a) is not None for a in ("tp", "cp", "ep", "zero"))
    if args.strategy is None:
        args.strategy = "composed" if composed_flags else "single"
    elif composed_flags and args.strategy != "composed":
        raise SystemExit(f"--tp/--cp/--ep/--zero belong to the composed strategy, not --strategy {args.strategy}: "
                         "leave --strategy out (or say --strategy composed)")
    if args.strategy == "composed":
        world_size = resolve_composed(args, world)
    else:
        args.dp, args.pp = resolve_mesh(args.strategy, args.dp, args.pp, world)
        if args.microbatches is None:
            args.microbatches = 2 * args.pp if args.strategy in ("pp", "hybrid") else 1
        world_size = args.dp * args.pp
    if args.batch_size % (args.dp * args.microbatches):
        raise SystemExit(f"--batch-size {args.batch_size} must split into dp x microbatches = "
                         f"{args.dp} x {args.microbatches} equal parts")
    import torch
    import torch.distributed as dist

    from labkit.launching.launcher import launch

    import labkit.data, labkit.model, labkit.training.loop  # noqa: E401,F401 - imported once, inherited by forked ranks
    results = launch(train_rank, world_size, args, timeout=args.timeout)
    out, weights = report(results, args, world_size)
    leader = not dist.is_initialized() or dist.get_rank() == 0
    if leader:
        if args.save:
            torch.save(weights, args.save)
        from labkit.measure.metrics import format_rate

        mfu_text = "n/a (no known peak FLOP/s for this device)" if out["mfu"] is None else f"{out['mfu']:.1%}"
        layout = composed_dims(args).short() if args.strategy == "composed" else f"dp={args.dp} pp={args.pp}"
        print(f"{args.strategy} {layout} m={args.microbatches} on {world_size} rank(s), "
              f"{out['device']}: loss {out['first_loss']:.4f} -> {out['final_loss']:.4f}; "
              f"{format_rate(out['tokens_per_s'])} ({format_rate(out['tokens_per_s_per_device'])} per device), "
              f"MFU {mfu_text}")
        print(json.dumps(out), flush=True)
    if dist.is_initialized():  # under a launcher: leave together
        dist.barrier()
        dist.destroy_process_group()
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
