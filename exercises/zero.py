# GENERATED from solutions/zero.py by `python -m labkit.grading.stubgen`: this file is yours to edit.
# Fill in every `raise NotImplementedError(...)`; see notebooks/09_zero_fsdp.ipynb.
# untouched-stub fingerprint: 1583be3507a0653a
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
(FSDP) the parameters too (gathered layer by layer when needed): see labkit.measure.memory.

Every function here is collective over `group` (None: the default group).
"""
import torch
import torch.distributed as dist
from torch import nn

# The sharding rule, the flat collectives and the flat helpers are labkit's (labkit.parallel);
# notebook 09 reads them from here too.
from labkit.parallel.flat import flatten, grads_or_zeros, write_back
from labkit.parallel.optim import WrapperOptimizer
from labkit.parallel.sharding import (all_gather_flat, local_shard, optimizer_state_bytes,  # noqa: F401
                                      reduce_scatter_mean, shard_size)
from labkit.renames import renamed_in

NOTEBOOK = "09_zero_fsdp"


class ShardedOptimizer(WrapperOptimizer):
    """ZeRO-1: any element-wise optimizer with its state sharded over the ranks of `group`.

    ShardedOptimizer(params, optimizer_class=torch.optim.AdamW, *, group=None, **defaults) is a
    torch.optim.Optimizer (a labkit.parallel.optim.WrapperOptimizer), called like torch's
    ZeroRedundancyOptimizer: `params` is an iterable of parameters or of parameter-group dicts
    (every rank passes the same parameters, in the same order, with the same values), `defaults`
    the optimizer's hyper-parameters (lr, ...). After loss.backward() on this rank's data, step()
    copies the outer groups' hyper-parameters to the inner optimizer (lr schedulers work), then
      - sync_gradients(), unless called already, averages the gradients over the ranks AND shards
        them: per parameter group, one reduce-scatter of the flat, zero-padded gradient; a .grad
        of None counts as zeros;
      - update_parameters() runs `optimizer_class` on this rank's shards only (one inner group per
        outer group), all-gathers the updated shards and writes them back into every parameter, in place.
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

    def __init__(self, params, optimizer_class=torch.optim.AdamW, *, group: dist.ProcessGroup | None = None,
                 **defaults):
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
    def sync_gradients(self) -> None:
        """Average the gradients over the ranks into this rank's shards' .grad (collective).

        step() calls it when it has not been called since the last step; call it yourself
        to look at the averaged shard gradients first (clipping them, say).

        Given (imported above): ``grads_or_zeros(params)`` (a missing gradient counts as zeros),
        ``flatten(tensors, numel)`` (one 1-D tensor, zero-padded to numel),
        ``reduce_scatter_mean(flat, *, group)`` -> this rank's shard of the average;
        ``self._trainable(group)`` (a parameter group's params that train), ``self.shards``,
        ``self.shard_sizes``, ``self.world_size``, ``self.group``.
        """
        raise NotImplementedError("exercise ShardedOptimizer is not implemented yet: edit exercises/zero.py, see notebooks/09_zero_fsdp.ipynb")
        self.mark_synced()

    @torch.no_grad()
    def update_parameters(self) -> None:
        """The inner optimizer's step on the shards, then every updated shard back into the parameters.

        Given: ``self.optimizer`` (the inner optimizer, over the shards), ``all_gather_flat(shard, *, group)``
        -> every rank's shards concatenated, ``write_back(flat, params)`` (copies a flat tensor into params).
        """
        raise NotImplementedError("exercise ShardedOptimizer is not implemented yet: edit exercises/zero.py, see notebooks/09_zero_fsdp.ipynb")


class ZeroAdamW(ShardedOptimizer):
    """ShardedOptimizer(params, torch.optim.AdamW, group=group, lr=, betas=, eps=, weight_decay=)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, *,
                 group: dist.ProcessGroup | None = None):
        super().__init__(params, torch.optim.AdamW, group=group, lr=lr, betas=betas, eps=eps,
                         weight_decay=weight_decay)


__getattr__ = renamed_in(__name__)  # old names fail naming their replacement, for one release
