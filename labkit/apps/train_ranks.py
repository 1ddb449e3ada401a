"""The train app's ranks: one rank's training run for each strategy (`python -m labkit.apps.train`).

Every strategy trains the same model on the same global batches with the same AdamW, learning-rate
schedule and gradient clipping as `labkit.training.loop`. Each rank returns its losses (where it holds
them), its timing, its weights and the layout it ran: its mesh's axis sizes and the world it joined.
"""
from __future__ import annotations

import time

from labkit.apps.train_layout import composed_dims, model_config


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


def mesh_axes(mesh) -> dict:
    """The layout this rank runs, as the app's flags count it: dp is the batch ranks (ep's included where it
    is a grid axis), with HSDP's replicas and the axes ep is folded over."""
    import torch.distributed as dist

    sizes = {a: mesh.size(a) for a in ("dp", "pp", "cp", "tp", "ep")}
    sizes["dp"] = mesh.size("batch")
    return {**sizes, "world_size": dist.get_world_size(), "dp_replicate": mesh.size("dp_replicate"),
            "ep_over": list(mesh.ep_over)}


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
    """One rank's training run; returns its losses (where known), timing, stage weights and layout."""
    import torch
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
            "weights": weights if mesh.coord("dp") == 0 else None,  # replica 0 speaks for all
            "axes": mesh_axes(mesh)}


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
    stage = parallelize(model, mesh=mesh, cp_method=dims.cp_method, ep_overlap=dims.ep_overlap)
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
    return {"losses": losses, "seconds": seconds, "device": str(device), "weights": weights,
            "axes": mesh_axes(mesh)}
