"""The lab's parallel steps as simulated ranks, one per distinct role, against the formulas (notebook 15).

    from labkit.apps.sim_roles import check_role, sweep
    rows = check_role("pp", cfg, batch=4, seq_len=256, world=1024, size=4, rank_role="middle")

`labkit.scale.simulate.measure_step` runs one rank of a large world on fake tensors and the fake
process group; here the lab's own parallel code (your notebook's, through `impl`) plugs in:
    fsdp   notebook 09's ZeRO3 (FSDP by hand) over the world, fp32, AdamW on the shards
    tp     notebook 08's TP blocks (ParallelAttention, ParallelMLP) over a tp axis, the rest
           replicated, then one all-reduce of the local gradients over dp
    pp     notebook 06's run_schedule with 1F1B over a pp axis (Stage: labkit.model.stages),
           then one all-reduce of the stage's gradients over dp; roles first / middle / last
    moe    labkit.model.moe (top-k experts, capacity large enough that no pick is dropped) as
           plain DP. Routing decides at run time how many rows each expert gets, which fake
           tensors cannot answer, so this role runs on small REAL tensors (still the fake PG),
           and expert parallelism's all-to-all bytes come from the closed form
           (labkit.scale.traffic: 2 x 2 per layer of top_k x b s d), not from a measured dispatch.
Each role's expected figures are closed forms written here from the shapes (fp32, full multi-head
attention, the math kernel's s x s scores), so every comparison is exact: FLOPs (6N + 12 L d s per
token, split by what the rank holds), bytes per (op, group size) (ring factors of labkit.comm), and
the model states after the step (labkit.measure.memory's 4 + 4 + 8 bytes per parameter the rank holds).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from labkit.grading import impl
from labkit.measure.memory import memory_per_rank
from labkit.mesh import Mesh
from labkit.scale.simulate import SimStep, measure_step

ROLES = ("fsdp", "tp", "pp", "moe")


def _mesh(world: int, **sizes) -> Mesh:
    """A Mesh on the fake group (its layout is integer arithmetic: it works under fake mode)."""
    return Mesh(world, **sizes)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-4, foreach=False)


def _all_reduce_grads(params, group):
    flat = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
    dist.all_reduce(flat, group=group)


def fsdp_step(cfg, batch: int, seq_len: int) -> SimStep:
    from labkit.model import build_model

    def build():
        model = build_model(cfg)
        model._zero3 = impl("fsdp").ZeRO3(model)
        # the shards are what this rank holds: registered so that MemTracker counts them as PARAM/GRAD
        model._shards = nn.ParameterList(model._zero3.shards())
        return model, _adamw(model._zero3.shards()), torch.randint(0, cfg.vocab_size, (batch, seq_len))

    def run(model, optimizer, tokens):
        model(tokens, tokens).backward()
        model._zero3.sync_gradients()
        optimizer.step()

    return SimStep(build, run)


def tp_step(cfg, batch: int, seq_len: int, world: int, tp: int) -> SimStep:
    from labkit.model import build_model

    def build():
        mesh = _mesh(world, dp=world // tp, tp=tp)
        model, tp_lib = build_model(cfg), impl("tensor_parallel")
        for layer in model.layers:  # parallelize_model's loop, in place
            layer.attention = tp_lib.ParallelAttention(layer.attention, group=mesh.group("tp"))
            layer.feed_forward = tp_lib.ParallelMLP(layer.feed_forward, group=mesh.group("tp"))
        model._mesh = mesh
        return model, _adamw(model.parameters()), torch.randint(0, cfg.vocab_size, (batch, seq_len))

    def run(model, optimizer, tokens):
        model(tokens, tokens).backward()
        _all_reduce_grads(model.parameters(), model._mesh.group("dp"))
        optimizer.step()

    return SimStep(build, run)


def pp_step(cfg, batch: int, seq_len: int, world: int, pp: int, n_micro: int) -> SimStep:
    """This rank's stage (its pp coordinate) under 1F1B with n_micro micro-batches."""
    from labkit.model import build_model, make_stage
    from labkit.parallel.stages import activation_shape

    def build():
        mesh = _mesh(world, dp=world // pp, pp=pp)
        stage = make_stage(build_model(cfg), mesh.coord("pp"), pp)
        stage._mesh = mesh
        return stage, _adamw(stage.parameters()), torch.randint(0, cfg.vocab_size, (batch, seq_len))

    def run(stage, optimizer, tokens):
        pipe = impl("pipeline")
        pipe.run_schedule(stage, pipe.one_f_one_b_schedule(pp, n_micro), tokens, tokens, mesh=stage._mesh,
                          act_shape=activation_shape(cfg, batch, seq_len, n_micro), check=False)
        _all_reduce_grads(stage.parameters(), stage._mesh.group("dp"))
        optimizer.step()

    return SimStep(build, run)


def moe_step(cfg, batch: int, seq_len: int) -> SimStep:
    """Plain DP of an MoE model (labkit.scale.simulate.dp_step) on real tensors: routing needs values."""
    from labkit.scale.simulate import dp_step

    step = dp_step(cfg, batch, seq_len)
    step.fake = False
    return step


def _shapes(cfg):
    d, H, V, E = cfg.d_model, cfg.hidden_dim, cfg.vocab_size, cfg.n_experts
    attention, mlp = 4 * d * d, 3 * d * H
    block = attention + (E * mlp + d * E if E else mlp)        # matmul weights of a block
    active = attention + (cfg.top_k * mlp + d * E if E else mlp)  # those one token multiplies by
    tensors = 9 + (1 + 3 * E - 3 if E else 0)                      # per block: 4 + 3 (or router + 3E) + 2 norms
    return d, V, block, active, tensors


def _ring(op: str, n: int, nbytes) -> float:
    """Bytes one rank sends (labkit.comm's bus factors) for a full tensor of nbytes over n ranks."""
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
            "all_to_all": (n - 1) / n, "send": 1}[op] * nbytes


def expected(role: str, cfg, batch: int, seq_len: int, world: int, size: int = 1, stage: int = 0,
             n_micro: int = 1) -> dict:
    """The closed forms for one rank: {"flops", "bytes": {(op, group size): bytes}, "holds": parameters,
    "tensors": parameter tensors}. size: the tp or pp degree; stage: the pp coordinate."""
    from labkit.model.stages import split_layers

    d, V, block, active, per_block = _shapes(cfg)
    L, tokens, bsd = cfg.n_layers, batch * seq_len, 4 * batch * seq_len * cfg.d_model
    attention = 12 * L * d * seq_len  # per token: 2 matmuls of s x d, x 3 (backward), x 2 FLOPs
    out = {"bytes": {}}

    def add(op, n, nbytes):
        if n > 1:
            out["bytes"][(op, n)] = out["bytes"].get((op, n), 0) + _ring(op, n, nbytes)

    if role in ("fsdp", "moe"):
        out["flops"] = (6 * (L * active + V * d) + attention) * tokens
        if role == "fsdp":
            pad = lambda u: -(-u // world) * world
            unit, root = block + 2 * d, 2 * V * d + d
            add("all_gather", world, 4 * (2 * L * pad(unit) + pad(root)))  # each block in forward and backward
            add("reduce_scatter", world, 4 * (L * pad(unit) + pad(root)))
            out.update(holds=(L * pad(unit) + pad(root)) // world, tensors=L + 1)
        else:
            out.update(holds=L * (block + 2 * d) + 2 * V * d + d, tensors=L * per_block + 3)
            add("all_reduce", world, 4 * out["holds"])
    elif role == "tp":
        t, dp = size, world // size
        out["flops"] = (6 * (L * block // t + V * d) + attention // t) * tokens
        add("all_reduce", t, 4 * L * bsd)  # 2 forward (attention, MLP), 2 backward, per block
        out.update(holds=L * (block // t + 2 * d) + 2 * V * d + d, tensors=L * per_block + 3)
        add("all_reduce", dp, 4 * out["holds"])
    elif role == "pp":
        pp, dp = size, world // size
        layers = len(split_layers(L, pp)[stage])
        first, last = stage == 0, stage == pp - 1
        out["flops"] = (6 * (layers * block + (V * d if last else 0)) + 12 * layers * d * seq_len) * tokens
        add("send", pp, bsd * ((not last) + (not first)))  # activations forward, their gradients back
        # (receives are not counted: count_collectives counts what this rank SENDS)
        out.update(holds=layers * (block + 2 * d) + (V * d if first else 0) + (V * d + d if last else 0),
                   tensors=layers * per_block + first + 2 * last)
        add("all_reduce", dp, 4 * out["holds"])
    else:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return out


def ep_bytes(cfg, batch: int, seq_len: int, ep: int) -> float:
    """Expert parallelism's all-to-all bytes per rank and step, fp32 (the closed form; not measured):
    dispatch and combine of top_k x b s d, forward and backward, per MoE layer."""
    return 2 * 2 * cfg.n_layers * _ring("all_to_all", ep, 4 * cfg.top_k * batch * seq_len * cfg.d_model)


def check_role(role: str, cfg, batch: int, seq_len: int, world: int, size: int = 1, stage: int = 0,
               n_micro: int = 1, rank: int | None = None) -> list[tuple]:
    """[(figure, measured, formula)] for one rank of `role` (the rank: one holding `stage`)."""
    steps = {"fsdp": lambda: fsdp_step(cfg, batch, seq_len),
             "tp": lambda: tp_step(cfg, batch, seq_len, world, size),
             "pp": lambda: pp_step(cfg, batch, seq_len, world, size, n_micro),
             "moe": lambda: moe_step(cfg, batch, seq_len)}
    if role not in steps:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if rank is None:  # the last dp replica's rank with this pp coordinate (pp is the inner axis here)
        rank = world - size + stage if role == "pp" else world - 1
    got = measure_step(steps[role](), world, rank)
    want = expected(role, cfg, batch, seq_len, world, size, stage, n_micro)
    after = got["memory"]["after_step"]
    holds = want["holds"]
    states = memory_per_rank(holds, 1, "dp", "fp32")
    rows = [("FLOPs", got["flops"], want["flops"])]
    for key in sorted(set(got["bytes"]) | set(want["bytes"])):
        if got["bytes"].get(key) or want["bytes"].get(key):
            rows.append((f"bytes {key[0]} over {key[1]}", got["bytes"].get(key, 0), want["bytes"].get(key, 0)))
    # ZeRO3 sets each shard's .grad itself (reduce_grads), not autograd: MemTracker files it under TEMP
    grads = after.get("GRAD", 0) + (after.get("TEMP", 0) if role == "fsdp" else 0)
    rows += [("params after step", after.get("PARAM", 0), states["params"]),
             ("grads after step" + (" (GRAD + TEMP)" if role == "fsdp" else ""), grads, states["grads"]),
             ("optimizer after step", after.get("OPT", 0), states["optimizer"] + 4 * want["tensors"])]
    return rows


def spec_flops(role: str, cfg, batch: int, seq_len: int, size: int = 1, stage: int = 0) -> float:
    """labkit.scale's FLOPs for the rank (spec.flops_per_token, 6N + 12 L d s), split as the rank holds
    the model. It counts the norm weights in N (6 FLOPs each per token, which no matmul does): the gap."""
    from labkit.model.stages import split_layers
    from labkit.scale.specs import spec_from_config

    spec = spec_from_config(cfg)
    per_token = spec.flops_per_token(seq_len)
    if role == "tp":
        head = spec.head_params
        per_token = (per_token - 6 * head) / size + 6 * head  # blocks and attention split, head replicated
    elif role == "pp":
        layers = len(split_layers(cfg.n_layers, size)[stage])
        per_layer = 6 * spec.layer_params + 12 * cfg.d_model * seq_len
        per_token = layers * per_layer + (6 * spec.head_params if stage == size - 1 else 0)
    return per_token * batch * seq_len


def role_list(world: int, tp: int = 8, pp: int = 4) -> list[tuple]:
    """(role, size, stage) of every distinct role of the sweep's layouts on `world` ranks."""
    out = [("fsdp", 1, 0), ("moe", 1, 0)]
    if world % tp == 0 and world > tp:
        out.append(("tp", tp, 0))
    if world % pp == 0 and world > pp:
        out += [("pp", pp, s) for s in sorted({0, 1, pp - 1})]  # first, one middle, last
    return out


def sweep(cfg, moe_cfg, batch: int, seq_len: int, worlds=(8, 16, 32, 64, 128, 256, 512, 1024)) -> dict:
    """Every distinct role of every layout on each world size, measured and checked.

    Returns {"rows": [(world, role, size, stage, figure, measured, formula)], "seconds": total,
    "runs": simulated ranks, "worst_spec_gap": largest |measured / labkit.scale - 1| of the FLOPs}.
    """
    start, rows, worst = time.perf_counter(), [], 0.0
    for world in worlds:
        for role, size, stage in role_list(world):
            c = moe_cfg if role == "moe" else cfg
            b = batch if role != "moe" else 2
            s = seq_len if role != "moe" else moe_cfg.context
            checked = check_role(role, c, b, s, world, size, stage)
            rows += [(world, role, size, stage, *row) for row in checked]
            if role != "moe":
                worst = max(worst, abs(checked[0][1] / spec_flops(role, c, b, s, size, stage) - 1))
    runs = len({r[:4] for r in rows})
    return dict(rows=rows, seconds=time.perf_counter() - start, runs=runs, worst_spec_gap=worst)


def composed_step(config, dims, batch: int, seq_len: int) -> SimStep:
    """Notebook 14's composed step (labkit.compose: the learner's TP+SP, ring attention, 1F1B, ZeRO on one
    Mesh) as one simulated rank. `dims`: a labkit.compose.dims.ParallelDims whose world is the fake
    world's. Dense models: the MoE's all-to-all sizes come from routing counts, which fake tensors
    do not have. One micro-batch: torch's MemTracker refuses a module called twice in one step."""
    from labkit.compose.model import parallelize
    from labkit.compose.step import ComposedOptimizer, train_step
    from labkit.model import build_model

    if config.n_experts:
        raise ValueError("composed_step simulates dense models: the EP all-to-all's sizes depend on the "
                         "routing, which fake tensors do not compute")
    if dims.microbatches != 1:
        raise ValueError("composed_step runs one micro-batch: MemTracker cannot follow a module called "
                         "several times in one step")
    dims.check(config, batch=batch, seq_len=seq_len)
    meshes = []

    def build():
        mesh = dims.build_mesh(dist.get_world_size())
        meshes.append(mesh)
        stage = parallelize(build_model(config), mesh=mesh)
        tokens = torch.randint(0, config.vocab_size, (batch, seq_len))
        return stage, ComposedOptimizer(stage, mesh=mesh, zero=dims.zero), tokens

    def run(stage, optimizer, tokens):
        train_step(stage, optimizer, tokens, tokens, mesh=meshes[-1], microbatches=1)

    return SimStep(build, run)
