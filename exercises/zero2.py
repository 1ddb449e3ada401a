# GENERATED from solutions/zero2.py by `python -m labkit.grading.stubgen`: this file is yours to edit.
# Fill in every `raise NotImplementedError(...)`; see notebooks/09_zero_fsdp.ipynb.
# untouched-stub fingerprint: 0ab1e332bb79c381
"""ZeRO-2 by hand: optimizer state AND gradients sharded over the ranks (notebook 09_zero_fsdp).

ZeRO-1 still builds every rank's full gradient, then reduce-scatters it in the step. ZeRO-2
reduce-scatters the gradients DURING backward, bucket by bucket, as the bucketed DP of
notebook 04 all-reduces them, but each rank keeps only its shard of each bucket: as soon as a
bucket's reduce-scatter is launched its parameters' full .grad are dropped, and the flat
buffer goes once the collective is done. At most two buckets of full gradient exist at once
(the one being reduced, the one being filled) next to the 1/N shards:

    backward   post-accumulate-grad hook: when a bucket's gradients are all there, flatten
               them (zero-padded to a multiple of N), drop the params' .grad, start an async
               reduce-scatter (waiting first for the previous bucket: its buffer is freed)
    sync_gradients()  wait for the last buckets, average into the shards' .grad
    step()     (sync_gradients() unless called already), step the optimizer on the shards,
               all-gather each bucket's updated shard back into the parameters

Every rank ends each step with the parameters of DP + the same optimizer. Communication:
one reduce-scatter + one all-gather per bucket = DP's all-reduce.
"""
import torch
import torch.distributed as dist
from torch import nn

from labkit.parallel.flat import bucket_parameters, flatten, grads_or_zeros, trainable, write_back
from labkit.parallel.optim import WrapperOptimizer
from labkit.parallel.sharding import all_gather_flat, local_shard, shard_size

NOTEBOOK = "09_zero_fsdp"


class Zero2Optimizer(WrapperOptimizer):
    """ZeRO-2: Zero2Optimizer(model, optimizer_class=torch.optim.AdamW, bucket_size_mb=25.0, *, group=None, **defaults).

    A torch.optim.Optimizer (a labkit.parallel.optim.WrapperOptimizer: lr schedulers drive it; its
    one parameter group holds the model's trainable parameters and `defaults`, copied to the inner
    optimizer at each step()). Trainable parameters (model.parameters(): tied weights once, frozen
    ones never) are put in REVERSE order into buckets of about bucket_size_mb MB (`labkit.parallel.flat.
    bucket_parameters`, as BucketedDataParallel does). Bucket i is a flat vector padded to a
    multiple of N; rank r owns its elements [r*s_i, (r+1)*s_i), s_i = ceil(numel_i / N), as the
    nn.Parameter `shards[i]`. `optimizer` = optimizer_class(shards, **defaults) (element-wise
    optimizers only, as ZeRO-1). Usage: loss.backward(); opt.step(); opt.zero_grad(), step()
    calling sync_gradients() unless you did; step(closure) returns the closure's loss. A .grad
    that is None when its bucket is reduced counts as zeros. Attributes: `buckets` (lists of
    Parameters, buckets[0] = the LAST parameters of the model), `shards`, `optimizer`, and
    `peak_grad_bytes`: the most bytes of gradient (full .grad, bucket buffers, shard gradients)
    seen at once by the hooks and step(). Raises ValueError when bucket_size_mb <= 0 or no
    parameter requires grad. One backward per step(): a second backward before step() raises
    RuntimeError.
    """

    def __init__(self, model: nn.Module, optimizer_class=torch.optim.AdamW, bucket_size_mb: float = 25.0, *,
                 group: dist.ProcessGroup | None = None, **defaults):
        params = trainable(model)
        if not params:
            raise ValueError("the model has no parameter that requires grad")
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.peak_grad_bytes = 0
        super().__init__(params, defaults)  # the outer group: what lr schedulers write
        raise NotImplementedError("exercise Zero2Optimizer is not implemented yet: edit exercises/zero2.py, see notebooks/09_zero_fsdp.ipynb")
        self.state = self.optimizer.state  # the (sharded) state lives in the inner optimizer

    def _reset(self):
        self._ready = [set() for _ in self.buckets]  # ids of the params whose grad is ready
        self._pending = [None] * len(self.buckets)  # (work or None, shard gradient, flat buffer or None)
        self._next = 0  # the next bucket to launch: launches happen in bucket order

    def _track(self):
        """Bytes of gradient alive now: params' .grad, buffers in flight, shard gradients."""
        live = sum(p.grad.numel() * p.grad.element_size() for p in self._bucket_of if p.grad is not None)
        for entry in self._pending:
            if entry is not None:
                live += sum(t.numel() * t.element_size() for t in entry[1:] if t is not None)
        self.peak_grad_bytes = max(self.peak_grad_bytes, live)

    def _grad_ready(self, param):
        """Hook: param's .grad is final for this backward; launch every complete bucket in order."""
        raise NotImplementedError("exercise Zero2Optimizer is not implemented yet: edit exercises/zero2.py, see notebooks/09_zero_fsdp.ipynb")

    def _finish_bucket(self, i):
        """Wait for bucket i's reduce-scatter and free its flat buffer; keep the shard's SUM."""
        work, out, flat = self._pending[i]
        if work is not None:
            work.wait()
        self._pending[i] = (None, out, None)

    def _launch(self, i):
        """Start bucket i's async reduce-scatter (SUM); its full gradients are dropped."""
        raise NotImplementedError("exercise Zero2Optimizer is not implemented yet: edit exercises/zero2.py, see notebooks/09_zero_fsdp.ipynb")

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """Launch the waiting buckets, wait for them, average into the shards' .grad (collective)."""
        raise NotImplementedError("exercise Zero2Optimizer is not implemented yet: edit exercises/zero2.py, see notebooks/09_zero_fsdp.ipynb")
        self.mark_synced()

    @torch.no_grad()
    def update_parameters(self) -> None:
        """Step the shards, all-gather every bucket's updated shard back into its parameters."""
        raise NotImplementedError("exercise Zero2Optimizer is not implemented yet: edit exercises/zero2.py, see notebooks/09_zero_fsdp.ipynb")

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
