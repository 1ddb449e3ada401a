# GENERATED from solutions/zero.py by `python -m labkit.stubgen`: this file is yours to edit.
# Fill in every `raise NotImplementedError(...)`; see notebooks/09_zero_fsdp.ipynb.
# untouched-stub fingerprint: 4893a0f40422ba5b
"""ZeRO stage 1 by hand: an optimizer with its state sharded over the ranks (notebook 09_zero_fsdp).

Plain data parallelism keeps a full copy of the optimizer state on every rank: for Adam,
two fp32 tensors (exp_avg, exp_avg_sq) as large as the model, twice the parameters'
own memory. ZeRO-1 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models") keeps the training step of DP but gives each of N ranks the
state of 1/N of the parameters only:

    flat = all parameters, flattened and zero-padded to a multiple of N
    1. reduce-scatter the gradients: rank r receives the AVERAGE gradient of its shard r
    2. AdamW step on shard r only (exp_avg, exp_avg_sq exist only for shard r)
    3. all-gather the updated shards: every rank has every updated parameter again

A reduce-scatter plus an all-gather move the same bytes as DP's one all-reduce (a ring
all-reduce IS a reduce-scatter followed by an all-gather), so ZeRO-1 saves memory at no
extra communication. ZeRO-2 would also free the gradients outside the shard, ZeRO-3
(FSDP) the parameters too (gathered layer by layer when needed): see labkit.memory.

Every function here is collective over `group` (None: the default group).
"""
import math

import torch
import torch.distributed as dist
from torch import nn

NOTEBOOK = "09_zero_fsdp"

# torch 2.13 names the flat collectives *_single (the older names still work, deprecated).
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def shard_size(numel: int, world_size: int) -> int:
    """Elements per rank once `numel` is padded to a multiple of world_size: ceil(numel / N)."""
    return math.ceil(numel / world_size)


def reduce_scatter_mean(flat: torch.Tensor, group=None, via_allreduce: bool = False) -> torch.Tensor:
    """This rank's shard of the average of `flat` over the ranks.

    flat: 1-D, length a multiple of the world size, identical in length on every rank.
    Returns a new tensor of length len(flat) // N: elements [r*s, (r+1)*s) of the mean.
    gloo supports reduce-scatter in torch 2.13 (checked); `via_allreduce=True` is the
    fallback for a backend that does not: all-reduce everything, keep the shard. Same
    result, but every rank receives the whole sum: about twice the traffic.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if flat.dim() != 1 or flat.numel() % world:
        raise ValueError(f"flat must be 1-D with a length that divides by the world size {world}, "
                         f"got shape {tuple(flat.shape)}: pad it first (see shard_size)")
    size = flat.numel() // world
    if via_allreduce:
        total = flat.clone()
        dist.all_reduce(total, group=group)
        out = total[rank * size:(rank + 1) * size].clone()
    else:
        out = torch.empty(size, dtype=flat.dtype, device=flat.device)
        # SUM then divide (not ReduceOp.AVG): AVG is missing on some backends and versions
        _reduce_scatter(out, flat.contiguous(), group=group)
    return out.div_(world)


def all_gather_flat(shard: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate every rank's 1-D `shard` (same length everywhere) in rank order."""
    world = dist.get_world_size(group)
    out = torch.empty(shard.numel() * world, dtype=shard.dtype, device=shard.device)
    _all_gather(out, shard.contiguous(), group=group)
    return out


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes THIS rank holds in an optimizer's state (Adam: exp_avg, exp_avg_sq, step).

    A DTensor (FSDP2's sharded state) counts its local shard only.
    """
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t
    return sum(local(t).numel() * t.element_size()
               for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t))


def flatten_padded(tensors, total: int) -> torch.Tensor:
    """The tensors flattened into one 1-D tensor, zero-padded to `total` elements."""
    flat = [t.reshape(-1) for t in tensors]
    pad = total - sum(t.numel() for t in flat)
    return torch.cat(flat + [flat[0].new_zeros(pad)])


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1: any element-wise optimizer with its state sharded over the ranks of `group`.

    ShardedOptimizer(params, optimizer_class=torch.optim.AdamW, group=None, **defaults) is a
    torch.optim.Optimizer, called like torch's ZeroRedundancyOptimizer: `params` is an iterable
    of parameters or of parameter-group dicts (every rank passes the same parameters, in the
    same order, with the same values), `defaults` the optimizer's hyper-parameters (lr, ...).
    After loss.backward() on this rank's data, step():
      - averages the gradients over the ranks AND shards them: per parameter group, one
        reduce-scatter of the flat, zero-padded gradient; a .grad of None counts as zeros;
      - runs `optimizer_class` on this rank's shards only (one inner group per outer group,
        with the outer group's hyper-parameters, copied at every step so that lr schedulers work);
      - all-gathers the updated shards and writes them back into every parameter, in place.
    Every rank ends each step with the parameters of plain DP + optimizer_class, with ~1/N of
    its state. Parameters with requires_grad=False are left alone.

    Attributes: `shards` (one nn.Parameter per parameter group: this rank's s = ceil(numel/N)
    elements [rank*s, (rank+1)*s) of the group's flat, padded parameters), `shard_sizes` (the s
    of each group) and `optimizer` (the inner optimizer_class instance that steps `shards`).
    Sharding cuts tensors at arbitrary elements, so the inner optimizer must be element-wise
    (SGD, Adam, AdamW, ...: not LAMB or Adafactor, which need whole tensors). Not supported:
    gradient clipping (a norm over all shards), mixed dtypes or devices within a group,
    state_dict() (the state is spread over the ranks).
    """

    def __init__(self, params, optimizer_class=torch.optim.AdamW, group=None, **defaults):
        self.group, self.optimizer_class = group, optimizer_class
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.shards, self.shard_sizes, self.optimizer = [], [], None
        super().__init__(params, defaults)  # calls add_param_group once per group
        if not self.shards:
            raise ValueError("ShardedOptimizer got no parameter that requires grad: pass model.parameters()")
        self.state = self.optimizer.state  # the (sharded) state lives in the inner optimizer

    @staticmethod
    def _trainable(group) -> list:
        return [p for p in group["params"] if p.requires_grad]

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (as torch.optim.Optimizer does) and create this rank's shard of it."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        params = self._trainable(group)
        if not params:
            raise ValueError("a parameter group has no parameter that requires grad: drop it")
        if len({(p.dtype, p.device) for p in params}) > 1:
            raise ValueError("ShardedOptimizer needs the parameters of a group on one device with one dtype: "
                             "cast the model first (model.float())")
        hyper = {k: v for k, v in group.items() if k != "params"}
        # Yours: shard_size(numel, self.world_size), flatten_padded(tensors, numel), this rank's slice as an
        # nn.Parameter appended to self.shards (and its size to self.shard_sizes), and an inner
        # self.optimizer_class([dict(params=[shard], **hyper)]) (or .add_param_group for later groups).
        raise NotImplementedError("exercise ShardedOptimizer is not implemented yet: edit exercises/zero.py, see notebooks/09_zero_fsdp.ipynb")

    @property
    def shard(self) -> nn.Parameter:
        """The shard of the first (often only) parameter group."""
        return self.shards[0]

    @torch.no_grad()
    def step(self, closure=None):
        """Average and shard the gradients, step the shards, gather the parameters back.

        Given in this module: ``reduce_scatter_mean(flat, group)`` -> this rank's shard of the
        average; ``all_gather_flat(shard, group)`` -> every rank's shards, concatenated;
        ``flatten_padded(tensors, numel)``; ``self._trainable(group)`` (the params that train).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})  # lr schedulers write outer
        raise NotImplementedError("exercise ShardedOptimizer is not implemented yet: edit exercises/zero.py, see notebooks/09_zero_fsdp.ipynb")
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.optimizer.zero_grad(set_to_none)

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank (e.g. exp_avg, exp_avg_sq of the shards, step)."""
        return optimizer_state_bytes(self.optimizer)


class ZeroAdamW(ShardedOptimizer):
    """ShardedOptimizer(params, torch.optim.AdamW, group, lr=, betas=, eps=, weight_decay=)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, group=None):
        super().__init__(params, torch.optim.AdamW, group, lr=lr, betas=betas, eps=eps,
                         weight_decay=weight_decay)
