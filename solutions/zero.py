"""ZeRO stage 1 by hand: AdamW with its state sharded over the ranks (notebook 09_zero_fsdp).

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


class ZeroAdamW:
    """AdamW with ZeRO-1 sharding: each rank holds the optimizer state of 1/N of the parameters.

    ZeroAdamW(params, lr, betas, eps, weight_decay, group) takes the same hyper-parameters as
    torch.optim.AdamW (one parameter group; every rank passes the same parameters, in the same
    order, with the same values). After loss.backward() on this rank's data, step():
      - averages the gradients over the ranks AND shards them, with one reduce-scatter of the
        flat, zero-padded gradient; a parameter whose .grad is None counts as a zero gradient;
      - runs AdamW on this rank's shard only;
      - all-gathers the updated shards and writes them back into every parameter, in place.
    So every rank ends each step with the same parameters as plain DP + torch.optim.AdamW
    (equal up to float rounding), with ~1/N of the optimizer state.

    Attributes the tests rely on: `shard` (an nn.Parameter: this rank's s = ceil(numel/N)
    elements of the flat, padded parameters, elements [rank*s, (rank+1)*s)) and `optimizer`
    (the torch.optim.AdamW that steps `shard`). The given helper `_flat` needs
    `self.shard_size` (= s) to be set in __init__. Not supported: several parameter groups,
    gradient clipping (it needs a norm over all shards), parameters of mixed dtypes.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, group=None):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("ZeroAdamW got no parameter that requires grad: pass model.parameters()")
        if len({(p.dtype, p.device) for p in self.params}) > 1:
            raise ValueError("ZeroAdamW needs every parameter on one device with one dtype: "
                             "cast the model first (model.float())")
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.numel = sum(p.numel() for p in self.params)
        ### BEGIN SOLUTION
        self.shard_size = shard_size(self.numel, self.world_size)
        self.padding = self.shard_size * self.world_size - self.numel
        start = self.rank * self.shard_size
        flat = self._flat([p.detach() for p in self.params])
        # this rank's master copy of its shard: the only parameters its optimizer knows
        self.shard = nn.Parameter(flat[start:start + self.shard_size].clone())
        self.optimizer = torch.optim.AdamW([self.shard], lr=lr, betas=betas, eps=eps,
                                           weight_decay=weight_decay)
        ### END SOLUTION

    def _flat(self, tensors) -> torch.Tensor:
        """The tensors flattened into one 1-D tensor, zero-padded to shard_size * world_size."""
        pad = tensors[0].new_zeros(self.shard_size * self.world_size - self.numel)
        return torch.cat([t.reshape(-1) for t in tensors] + [pad])

    @property
    def param_groups(self):
        return self.optimizer.param_groups  # so that lr schedulers can drive it

    @torch.no_grad()
    def step(self) -> None:
        ### BEGIN SOLUTION
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        self.shard.grad = reduce_scatter_mean(self._flat(grads), self.group)  # 1. average + shard
        self.optimizer.step()  # 2. AdamW on 1/N of the parameters
        flat = all_gather_flat(self.shard.detach(), self.group)  # 3. everyone gets every shard
        offset = 0
        for p in self.params:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        ### END SOLUTION

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank (exp_avg, exp_avg_sq of the shard, step)."""
        return optimizer_state_bytes(self.optimizer)
