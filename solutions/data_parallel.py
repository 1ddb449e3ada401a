"""Data parallelism by hand (notebook 04_data_parallel).

Every rank holds an identical copy of the model, reads a different slice of the
global batch, and averages its gradients with the other ranks before the
optimizer step. If the copies start equal and see the same averaged gradient,
they stay equal, and N ranks with micro-batch b train exactly like one process
with batch N x b (up to float rounding).

All functions are collective: every rank of `group` must call them, in the same
order, with models of the same structure.
"""
import zlib

import torch
import torch.distributed as dist
from torch import nn

from labkit.parallel.flat import bucket_parameters, trainable as _trainable  # a tied Parameter is listed once
from labkit.renames import renamed_in, renamed_method

NOTEBOOK = "04_data_parallel"


def _sum_in_place(flat: torch.Tensor, group, allreduce_fn) -> torch.Tensor:
    """Sum `flat` over the ranks with torch's all-reduce or a plug-in one."""
    if allreduce_fn is None:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        return flat
    out = allreduce_fn(flat, group=group)  # in place, or returning the sum: accept both
    return flat if out is None else out


def broadcast_parameters(model: nn.Module, src: int = 0, *, group: dist.ProcessGroup | None = None) -> None:
    """Overwrite every rank's parameters AND buffers with those of rank `src`, in place.

    Call it once after building the model (and after loading a checkpoint on
    `src`): replicas that start different never become equal again.
    `src` is a global rank.
    """
    ### BEGIN SOLUTION
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(tensor.data, src=src, group=group)
    ### END SOLUTION


def sync_gradients(model: nn.Module, *, group: dist.ProcessGroup | None = None, allreduce_fn=None) -> None:
    """Replace each trainable parameter's .grad by its average over the ranks, in place.

    Call it between loss.backward() and optimizer.step(). Gradients are
    flattened into one buffer, summed with ONE all-reduce and divided by the
    world size.
    - frozen parameters (requires_grad=False) are skipped;
    - a rank whose gradient is None contributes zeros (the parameter was not
      used by its data); if NO rank has a gradient, .grad stays None so the
      optimizer skips the parameter, exactly as in single-process training;
    - `allreduce_fn(tensor, group=group)` replaces torch's all-reduce (e.g. your
      ring): it must SUM over the ranks, in place or returning the result.
    """
    ### BEGIN SOLUTION
    params = _trainable(model)
    if not params:
        return
    # One buffer: every gradient (zeros where None), then a 0/1 "has a gradient" mask,
    # so a single all-reduce also tells every rank which parameters got a gradient anywhere.
    pieces = [p.grad.reshape(-1) if p.grad is not None else torch.zeros_like(p).reshape(-1) for p in params]
    mask = torch.tensor([float(p.grad is not None) for p in params], dtype=pieces[0].dtype)
    flat = torch.cat(pieces + [mask.to(pieces[0].device)])
    flat = _sum_in_place(flat, group, allreduce_fn)
    world_size = dist.get_world_size(group)
    offset = 0
    for p, count in zip(params, flat[-len(params):].tolist()):
        n = p.numel()
        if count > 0:  # some rank had a gradient: average, the others counting as zeros
            grad = flat[offset:offset + n].view_as(p) / world_size
            if p.grad is None:
                p.grad = grad.to(p.dtype)
            else:
                p.grad.copy_(grad)
        offset += n
    ### END SOLUTION


def average_weights(model: nn.Module, *, group: dist.ProcessGroup | None = None) -> None:
    """Replace every parameter by its average over the ranks, in place ("weight aggregation").

    After one local plain-SGD step this equals gradient averaging; with
    momentum or Adam it does not (their update is not linear in the gradient).
    """
    ### BEGIN SOLUTION
    params = list(model.parameters())
    with torch.no_grad():
        flat = torch.cat([p.reshape(-1) for p in params])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat /= dist.get_world_size(group)
        offset = 0
        for p in params:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
    ### END SOLUTION


def shard_for_rank(batch, rank: int, world_size: int):
    """This rank's rows of a global batch: rows [rank*b, (rank+1)*b) with b = B // world_size.

    `batch` is a tensor or a tuple/list of tensors sharing their first dimension
    B (e.g. (x, y)); the result has the same structure. Every rank gets unique
    rows and together they cover the batch exactly once.
    Raises ValueError when B does not split evenly across the ranks (uneven
    shards would weigh the ranks' mean losses unequally) or the rank is out of range.
    """
    ### BEGIN SOLUTION
    tensors = list(batch) if isinstance(batch, (tuple, list)) else [batch]
    if not tensors:
        raise ValueError("the batch holds no tensors: pass a tensor or a tuple such as (x, y)")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    sizes = {t.shape[0] for t in tensors}
    if len(sizes) != 1:
        raise ValueError(f"the tensors of a batch must share their first dimension, got {sorted(sizes)}")
    (size,) = sizes
    if size % world_size:
        raise ValueError(f"global batch of {size} rows does not split across {world_size} ranks: "
                         f"use a global batch size that is a multiple of {world_size}")
    b = size // world_size
    shards = [t[rank * b:(rank + 1) * b] for t in tensors]
    if hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*shards)
    if isinstance(batch, (tuple, list)):
        return type(batch)(shards)
    return shards[0]
    ### END SOLUTION


class BucketedDataParallel(nn.Module):
    """Gradient averaging overlapped with backward, as torch's DDP does it.

    Trainable parameters are grouped, in REVERSE order (the last layers' grads
    are ready first in backward), into buckets of about `bucket_size_mb` MB
    (a parameter larger than that gets a bucket of its own). A
    post-accumulate-grad hook counts the ready gradients; when a bucket is
    complete its async all-reduce (dist.all_reduce(async_op=True)) starts while
    backward goes on. Buckets are launched in bucket order on every rank (a
    bucket waits for the earlier ones), so the collectives always match.

    Like torch's DDP, construction first broadcasts the parameters and buffers from the group's
    first rank (`broadcast_parameters`), so every replica starts from the same weights.

    Usage, once per step:  loss = ddp(x, y); loss.backward(); ddp.sync_gradients(); opt.step()
    Attributes: `module` (the wrapped model), `world_size`, and `buckets`: a list of
    lists of Parameters, buckets[0] holding the LAST parameters of the model.
    __init__ builds them, registers the hooks (kept in `_hooks`) and calls `_reset()`.
    sync_gradients() launches the buckets still waiting (those holding parameters that
    got no gradient), waits for all of them and writes back averaged
    gradients, with the same None rule as `sync_gradients`. Tied weights
    are reduced once, frozen parameters never. One backward per sync_gradients():
    a second backward before sync_gradients() raises RuntimeError.
    """
    finish = renamed_method("BucketedDataParallel.finish")  # an old name, for one release (labkit/renames.py)

    def __init__(self, model: nn.Module, bucket_size_mb: float = 25.0, *, group: dist.ProcessGroup | None = None):
        super().__init__()
        first = dist.get_global_rank(group, 0) if group is not None else 0
        broadcast_parameters(model, src=first, group=group)  # as DDP does: replicas start equal
        ### BEGIN SOLUTION
        self.module, self.group = model, group
        self.world_size = dist.get_world_size(group)
        self.buckets = bucket_parameters(_trainable(model), bucket_size_mb)  # reversed, ~bucket_size_mb each
        self._bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self._bucket_of]
        self._reset()
        ### END SOLUTION

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _reset(self):
        self._ready = [set() for _ in self.buckets]  # ids of the params whose grad is ready
        self._pending = [None] * len(self.buckets)  # (work, flat buffer) once launched
        self._next = 0  # the next bucket to launch: launches happen in bucket order

    def _grad_ready(self, param):
        """Hook: param's .grad is final for this backward; launch every complete bucket in order."""
        ### BEGIN SOLUTION
        i = self._bucket_of[param]
        if self._pending[i] is not None or id(param) in self._ready[i]:
            raise RuntimeError("BucketedDataParallel: a second backward before sync_gradients(); "
                               "call sync_gradients() after every backward (no gradient accumulation)")
        self._ready[i].add(id(param))
        while self._next < len(self.buckets) and len(self._ready[self._next]) == len(self.buckets[self._next]):
            self._launch(self._next)
        ### END SOLUTION

    def _launch(self, i):
        """Start the async SUM all-reduce of bucket i: its grads (zeros where None) + a has-grad mask."""
        ### BEGIN SOLUTION
        bucket = self.buckets[i]
        pieces = [p.grad.reshape(-1) if p.grad is not None else torch.zeros_like(p).reshape(-1) for p in bucket]
        mask = torch.tensor([float(p.grad is not None) for p in bucket], dtype=pieces[0].dtype)
        flat = torch.cat(pieces + [mask.to(pieces[0].device)])
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._pending[i] = (work, flat)
        self._next = i + 1
        ### END SOLUTION

    def sync_gradients(self) -> None:
        """Launch the waiting buckets, wait for every all-reduce, write averaged grads back."""
        ### BEGIN SOLUTION
        while self._next < len(self.buckets):  # buckets holding a parameter that got no grad
            self._launch(self._next)
        for bucket, (work, flat) in zip(self.buckets, self._pending):
            work.wait()
            counts = flat[-len(bucket):].tolist()
            flat.div_(self.world_size)
            offset = 0
            for p, count in zip(bucket, counts):
                n = p.numel()
                if count > 0:  # same None rule as the function sync_gradients
                    grad = flat[offset:offset + n].view_as(p)
                    if p.grad is None:
                        p.grad = grad.to(p.dtype)
                    else:
                        p.grad.copy_(grad)
                offset += n
        self._reset()
        ### END SOLUTION

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (the wrapped model trains alone again)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


def _checksums(model: nn.Module):
    names, sums = [], []
    tensors = [("parameter", n, t) for n, t in model.named_parameters()]
    tensors += [("buffer", n, t) for n, t in model.named_buffers()]
    for kind, name, tensor in tensors:
        names.append(f"{kind} {name!r}")
        raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # the exact bits
        sums.append(zlib.crc32(raw.numpy().tobytes()))
    return names, torch.tensor(sums, dtype=torch.int64)


class ReplicaMismatchError(RuntimeError):
    """The ranks' copies of the model differ."""


def check_replicas(model: nn.Module, *, group: dist.ProcessGroup | None = None) -> None:
    """Raise ReplicaMismatchError on EVERY rank if the replicas' weights differ bit for bit.

    Compares one CRC32 checksum per parameter and buffer (one small all-gather);
    the message names the first differing tensor and the ranks that differ from
    the lowest rank of the group. Cheap enough to call at start-up and now and then.
    """
    names, sums = _checksums(model)
    if dist.get_backend(group) == "nccl":  # nccl only moves GPU tensors
        sums = sums.to(torch.device("cuda", torch.cuda.current_device()))
    gathered = [torch.empty_like(sums) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, sums, group=group)
    table = torch.stack(gathered).cpu()  # [ranks, tensors]
    differs = (table != table[0]).any(dim=0)
    if differs.any():
        first = int(differs.nonzero()[0])
        ranks = (table[:, first] != table[0, first]).nonzero().flatten().tolist()
        raise ReplicaMismatchError(
            f"replicas differ: {names[first]} on group ranks {ranks} differs from group rank 0 "
            f"({int(differs.sum())} of {len(names)} tensors differ). Call broadcast_parameters(model) "
            "after building the model, and average the gradients on every step.")


__getattr__ = renamed_in(__name__)  # old names fail naming their replacement, for one release
