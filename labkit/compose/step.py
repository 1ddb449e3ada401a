"""One training step of the composed model: the learner's 1F1B executor, then every gradient summed
over the group the learner's placement table names, then AdamW or ZeRO on that group (notebook 14).

    stage = parallelize(model, mesh=mesh)
    opt = ComposedOptimizer(stage, mesh=mesh, zero=1, lr=1e-2)
    loss = train_step(stage, opt, tokens, targets, mesh=mesh, microbatches=2)   # the global loss, every rank

Gradient groups. The parameters are grouped by the mesh axes of size > 1 their gradient is summed
over (``impl("placement").placement(name, mesh=mesh).summed_over``); each group's gradients are summed
with ONE all-reduce of their flat concatenation (few large messages, as DDP's buckets).

ZeRO on those same groups: a parameter's optimizer state is sharded over exactly the ranks that hold
a replica of it, with the learner's ZeRO-1 `ShardedOptimizer` (notebook 09) on each group.
- zero=1: the optimizer state sharded (reduce-scatter, AdamW on the shard, all-gather).
- zero=2: also the gradients: each full .grad is dropped as soon as it is reduce-scattered. Under a
  pipeline the micro-batches accumulate into full gradients first, so the saving starts at the
  reduce-scatter (notebook 09's in-backward buckets would reduce once per micro-batch instead).
- zero=3: also the parameters: between steps a rank keeps only its shards; the step begins by
  all-gathering them and keeps them for the whole pipelined step. This is how torchtitan runs FSDP
  under pipeline parallelism (reshard_after_forward=False): gathering each block just in time
  would repeat it for every micro-batch's forward and backward.
HSDP (dp_replicate > 1, `labkit.compose.dims`): a group that spans the replicas is sharded over its ranks
inside one replica (`hsdp_split`); its gradient is synced by the learner's `hsdp_sync` (notebook 10,
``impl("hsdp")``): the reduce-scatter inside the replica, then the all-reduce of each shard across the
dp_replicate replicas (`sync_replicas`), and the ZeRO optimizer's all-gather of the updated shard inside
the replica. hsdp_sync returns the MEAN over the R x S ranks; each rank holds a SHARE of the loss, so the
flat gradient is multiplied by R x S first (exact in float64 for powers of two, and off by one rounding
otherwise: the same as the multiply-then-average of the plain ZeRO groups below).
The ZeRO optimizer averages its group's gradients (in notebook 09 each rank holds a MEAN loss);
here each rank holds a SHARE of the one loss, so the gradient is the sum: the gradients are
multiplied by the group's size before the optimizer averages them.
"""
from __future__ import annotations


import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

from labkit.compose.dims import hsdp_split, live_axes
from labkit.grading import impl
from labkit.measure.timeline import NullTimeline
from labkit.mesh import Mesh
from labkit.parallel.flat import flatten, grads_or_zeros, write_back
from labkit.parallel.sharding import all_gather_flat

ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def gradient_groups(stage, *, mesh: Mesh) -> dict:
    """{live axes: [(name, parameter)]}, from the learner's placement table, in first-appearance order."""
    table = impl("placement")
    groups: dict = {}
    for name, p in stage.named_parameters():
        where = table.placement(name, mesh=mesh)
        if "pp" in where.summed_over:
            raise ValueError(f"{name}: summed over pp, but no parameter is on two pipeline stages: each stage "
                             "owns its layers, and nothing is summed across pp")
        groups.setdefault(live_axes(where.summed_over, mesh), []).append((name, p))
    return groups


class ComposedOptimizer:
    """AdamW over the stage's parameters, gradients summed per group, with ZeRO stage `zero` (0-3) on the groups."""

    def __init__(self, stage, *, mesh: Mesh, zero: int = 0, no_decay=None, **adamw):
        """`no_decay`: a predicate on a parameter, True where weight decay is off (the train app's nanoGPT
        rule: ``lambda p: p.dim() < 2``, no decay on norm weights); such parameters get inner optimizers of
        their own (one ZeRO shard each), after the decayed ones of the same gradient group."""
        self.mesh, self.zero, self.hyper = mesh, zero, {**ADAMW, **adamw}
        self.groups = []  # (axes, [params], optimizer)
        self.replicas = {}  # id(optimizer): (shard axes, replica axes) of its group under HSDP
        for axes, named in gradient_groups(stage, mesh=mesh).items():
            shard_axes, replica_axes = hsdp_split(axes, mesh) if zero else (axes, ())
            params = [p for _, p in named]
            off = [p for p in params if no_decay is not None and no_decay(p)]
            for part, hyper in (([p for p in params if all(p is not q for q in off)], self.hyper),
                                (off, {**self.hyper, "weight_decay": 0.0})):
                if not part:
                    continue
                if zero and axes:
                    opt = impl("zero").ShardedOptimizer(part, torch.optim.AdamW, group=mesh.group(shard_axes), **hyper)
                else:
                    opt = torch.optim.AdamW(part, **hyper)
                self.replicas[id(opt)] = (shard_axes, replica_axes)
                self.groups.append((axes, part, opt))
        self.shapes = {p: p.shape for _, params, _ in self.groups for p in params}
        if zero == 3:
            self._free_parameters()

    def set_lr(self, lr: float) -> None:
        """The learning rate of every inner optimizer (a schedule's value for this step)."""
        for _, _, opt in self.groups:
            for inner in [opt] + ([opt.optimizer] if hasattr(opt, "optimizer") else []):
                for group in inner.param_groups:
                    group["lr"] = lr

    def zero_grad(self) -> None:
        for _, params, _ in self.groups:
            for p in params:
                p.grad = None

    def begin_step(self) -> None:
        """ZeRO-3: all-gather every group's parameters from the shards (the only copy between steps)."""
        if self.zero != 3:
            return
        for axes, params, opt in self.groups:
            if axes:
                for p in params:
                    p.data = torch.empty(self.shapes[p], dtype=p.dtype, device=p.device)
                write_back(all_gather_flat(opt.shards[0].detach(), group=self.shard_group(opt)), params)

    @torch.no_grad()
    def step(self, max_norm: float | None = None) -> None:
        """Sum every group's gradients over its replicas, clip the global norm to `max_norm` (if given),
        then AdamW (on the shards with ZeRO)."""
        for axes, params, opt in self.groups:
            self._sync(axes, params, opt)
        if max_norm is not None:
            self._clip(max_norm)
        for axes, params, opt in self.groups:
            if not (self.zero and axes):
                opt.step()
            elif self.zero == 3:
                opt.optimizer.step()  # the shards only; gathered again at the next begin_step
            else:
                opt.step()  # (synced already) AdamW on the shard, then the all-gather into the parameters
        if self.zero == 3:
            self._free_parameters()

    def _sync(self, axes, params, opt) -> None:
        if not axes:
            return
        if not self.zero:
            flat = flatten(grads_or_zeros(params))
            dist.all_reduce(flat, group=self.mesh.group(axes))  # the sum over the replicas
            for p, g in zip(params, flat.split([p.numel() for p in params])):
                p.grad = g.view_as(p)
            return
        if self.replicas[id(opt)][1]:
            self.sync_replicas(opt)  # HSDP: the learner's hsdp_sync, the reduce-scatter and the all-reduce
        else:
            n = self.mesh.size(self.replicas[id(opt)][0])
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(n)  # the optimizer averages over its shard group: times n, the sum of the shares
            opt.sync_gradients()
        if self.zero >= 2:
            for p in params:
                p.grad = None  # the shards' .grad hold what the step needs

    def shard_group(self, opt):
        """The process group a ZeRO optimizer shards over: its gradient group inside one HSDP replica."""
        return self.mesh.group(self.replicas[id(opt)][0])

    def sync_replicas(self, opt) -> None:
        """HSDP: each shard's gradient summed over its shard group and across the dp_replicate replicas, by the
        learner's ``impl("hsdp").hsdp_sync`` (reduce-scatter inside the replica, all-reduce across), into
        the ZeRO optimizer's shards."""
        replica_axes = self.replicas[id(opt)][1]
        hsdp_sync = impl("hsdp").hsdp_sync
        replica_group = self.mesh.group(replica_axes)
        ranks = opt.world_size * self.mesh.size(replica_axes)  # R x S: hsdp_sync's mean over them
        for group, shard, size in zip(opt.param_groups, opt.shards, opt.shard_sizes):
            flat = flatten(grads_or_zeros([p for p in group["params"] if p.requires_grad]), size * opt.world_size)
            flat.mul_(ranks)  # shares of one loss: the sum is wanted, hsdp_sync returns the mean
            shard.grad = hsdp_sync(flat, shard_group=opt.group, replica_group=replica_group)
        opt.mark_synced()

    def _gradients(self):
        """(tensor, replicas): every gradient this rank holds after the sync, with how many ranks hold
        the same values (a ZeRO shard: 1, the shards of a group partition it)."""
        for axes, params, opt in self.groups:
            if self.zero and axes:  # a ZeRO shard: the shards of a replica partition it; HSDP: R replicas
                replica_axes = self.replicas[id(opt)][1]
                yield opt.shards[0].grad, self.mesh.size(replica_axes) if replica_axes else 1
            else:
                for p in params:
                    if p.grad is not None:
                        yield p.grad, self.mesh.size(axes) if axes else 1

    def _clip(self, max_norm: float) -> None:
        """Global-norm clipping as torch.nn.utils.clip_grad_norm_ on one process: every replica's squared
        norm divided by its replica count, summed over the world, so that each value counts once."""
        grads = list(self._gradients())
        sq = torch.zeros((), dtype=torch.float64, device=grads[0][0].device if grads else None)
        for g, replicas in grads:
            sq += g.detach().double().pow(2).sum() / replicas
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sq)
        coef = max_norm / (float(sq.sqrt()) + 1e-6)
        if coef < 1.0:
            for g, _ in grads:
                g.mul_(coef)

    def _free_parameters(self) -> None:
        for axes, params, _ in self.groups:
            if axes:
                for p in params:
                    p.data = p.data.new_empty(0)  # only the optimizer's shard remains

    def torch_optimizers(self) -> list:
        """The inner torch optimizers, one per gradient group (what torch's memory tracker can follow)."""
        return [opt for _, _, opt in self.groups]

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        from labkit.parallel.sharding import optimizer_state_bytes
        return sum(optimizer_state_bytes(opt) for _, _, opt in self.groups)


def train_step(stage, optimizer: ComposedOptimizer, tokens, targets, *, mesh: Mesh, microbatches: int = 1,
               timeline=None, max_norm: float | None = None) -> float:
    """One step on the GLOBAL batch tokens, targets [B, s] (the same on every rank); returns the global
    loss (cross-entropy plus the MoE balance loss, as one process computes it) on every rank."""
    B, s = tokens.shape
    device = next(stage.parameters()).device  # a GPU node: the batch goes where the stage is
    tokens, targets = tokens.to(device), targets.to(device)
    x, y = impl("placement").local_batch(tokens, targets, mesh=mesh)
    check_local_batch(x, y, (B, s), mesh=mesh)
    optimizer.zero_grad()
    optimizer.begin_step()
    stage.begin_step(B, s)
    rows = B // mesh.size("batch")
    act_shape = (rows // microbatches, s // mesh.size("cp") // mesh.size("tp"), stage.config.d_model)
    pipeline = impl("pipeline")
    schedule = pipeline.one_f_one_b_schedule(mesh.size("pp"), microbatches)
    tl = timeline if timeline is not None else NullTimeline()
    ce = pipeline.run_schedule(stage, schedule, x, y, mesh=mesh, act_shape=act_shape, loss_scale=1.0, timeline=tl)
    with tl.span("reduce", mesh.coord("pp")):
        optimizer.step(max_norm)
    return global_loss(stage, ce, mesh=mesh)


def check_local_batch(x, y, shape, *, mesh: Mesh) -> None:
    """ValueError naming the learner's local_batch when what it returned is not this rank's share of the
    global batch `shape` (B, s): B / batch rows and s / cp positions, x on the first stage, y on the last."""
    (B, s), rows, n = shape, shape[0] // mesh.size("batch"), shape[1] // mesh.size("cp")
    for what, t, due in (("x", x, mesh.is_first("pp")), ("y", y, mesh.is_last("pp"))):
        if due and (t is None or tuple(t.shape) != (rows, n)):
            got = "None" if t is None else f"shape {tuple(t.shape)}"
            raise ValueError(f"local_batch (your exercises/placement.py) returned {what} = {got} on rank {mesh.rank} "
                             f"{mesh.coords()}; this rank reads B / batch = {B} / {mesh.size('batch')} = {rows} rows "
                             f"(shard_rows at mesh.index('batch'), of mesh.size('batch')) and s / cp = {s} / "
                             f"{mesh.size('cp')} = {n} positions, {what} on the {'first' if what == 'x' else 'last'} stage")


def global_loss(stage, ce, *, mesh: Mesh) -> float:
    """The step's loss on every rank: the last stages' cross-entropy shares (each tp group's once)
    and every stage's MoE balance-loss shares, summed over the world."""
    dtype = next(stage.parameters()).dtype
    total = torch.zeros((), dtype=dtype if dtype == torch.float64 else torch.float32)
    if ce is not None:
        total += ce.detach().to(total.dtype) / mesh.size("tp")  # every tp rank holds the same cross-entropy
    total += torch.as_tensor(stage.aux_total, dtype=total.dtype)
    if dist.is_initialized() and mesh.world_size > 1:
        dist.all_reduce(total)
    return float("nan") if is_fake(total) else float(total)  # a simulated rank (labkit.scale) has no values
