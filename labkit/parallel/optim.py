"""The plumbing that makes a sharded optimizer a `torch.optim.Optimizer` (ZeRO-1 and ZeRO-2 share it).

A sharded optimizer keeps the model's parameters in its own ``param_groups`` (so that lr schedulers,
which write ``param_groups[i]["lr"]``, drive it) and does the arithmetic with an inner optimizer,
``self.optimizer``, over this rank's shards. One step is always the same three moves:

    copy every outer group's hyper-parameters into the inner group (what a scheduler wrote)
    sync_gradients()       unless the caller did: the averaged gradient shards into the shards' .grad
    update_parameters()    the inner step, then the updated shards back into the parameters

Subclasses write the last two; `step(closure=None)` returns the closure's loss, as torch's do.
"""
from __future__ import annotations

import torch

from labkit.parallel.sharding import optimizer_state_bytes


class WrapperOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer over the model's parameters whose inner optimizer steps `self.optimizer`'s shards.

    Subclasses set `self.optimizer` (one inner group per outer group, in order) and write
    `sync_gradients()` (collective; it ends by calling `self.mark_synced()`) and `update_parameters()`.
    """

    optimizer: torch.optim.Optimizer

    def mark_synced(self) -> None:
        """The gradients of this backward are synchronised: step() will not call sync_gradients() again."""
        self._synced = True

    def sync_gradients(self) -> None:  # pragma: no cover - every subclass writes it
        raise TypeError(f"{type(self).__name__} must define sync_gradients()")

    def update_parameters(self) -> None:  # pragma: no cover - every subclass writes it
        raise TypeError(f"{type(self).__name__} must define update_parameters()")

    @torch.no_grad()
    def step(self, closure=None):
        """One step: hyper-parameters to the inner optimizer, sync_gradients() unless done, update_parameters()."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})  # lr schedulers write outer
        if not getattr(self, "_synced", False):
            self.sync_gradients()
        self.update_parameters()
        self._synced = False
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.optimizer.zero_grad(set_to_none)

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank (e.g. exp_avg, exp_avg_sq of the shards, step)."""
        return optimizer_state_bytes(self.optimizer)
