"""ZeRO-3 / FSDP by hand: parameters sharded per block, gathered just in time (notebook 09_zero_fsdp).

ZeRO-1 shards the optimizer state, ZeRO-2 also the gradients; ZeRO-3 shards the parameters
too. No rank holds the whole model: each unit (a transformer block; the rest of the model,
embedding, final norm and head, is the "root" unit) keeps its trainable parameters as ONE
flat, zero-padded vector cut into N shards, and rank r stores shard r only. A unit's full
parameters exist only while it computes:

    forward   pre-forward hook : all-gather the unit (or wait for the prefetched gather),
                                 start the NEXT block's all-gather (async, prefetch)
              post-forward hook: free the gathered parameters (reshard after forward)
    backward  pre-backward hook (on the block's output): all-gather again, prefetch the
                                 block before it
              post-backward    : once every parameter of the unit has its gradient,
                                 reduce-scatter the flat gradient (rank r keeps the average
                                 of shard r) and free the full gradient and parameters
    step      a plain optimizer over the shards (one nn.Parameter per unit)

Communication per step: all-gather forward + all-gather backward + reduce-scatter = 3 x P
elements moved, against DP's all-reduce (= reduce-scatter + all-gather) of 2 x P: 1.5 x.
The root unit stays gathered from its forward to its backward (as FSDP2 does for the root),
so it is gathered once per step: the measured ratio is 1.5 - P_root / (2 P).

The freeing trick is FSDP's own: every parameter's .data is a view into the unit's flat
buffer; freeing resizes that buffer's storage to 0 bytes, gathering resizes it back and
fills it. The module's code, and autograd's saved tensors, keep pointing at the same
storage, so forward and backward run unchanged. Outside forward/backward the parameters
are unreadable: use `full_parameters()`.

Frozen parameters (requires_grad=False) are not sharded: they stay whole on every rank,
as in the given model. Every function here is collective over `group` (None: default group).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from labkit.parallel.flat import flatten, grads_or_zeros
from labkit.measure.timeline import Timeline, or_null
from labkit.parallel.sharding import local_shard, reduce_scatter_mean, shard_size
from labkit.renames import renamed_in, renamed_method

NOTEBOOK = "09_zero_fsdp"


class FlatShard:
    """One ZeRO-3 unit: the trainable parameters `params` of one module, stored flat and sharded.

    FlatShard(params, *, group=None, name=""):
      - `shard`: an nn.Parameter, this rank's s = ceil(numel/N) elements [rank*s, (rank+1)*s)
        of the unit's flat, zero-padded parameters: what the optimizer steps;
      - `flat`: the gathered buffer of s*N elements; every parameter's .data becomes a view of
        it. __init__ ends resharded: flat's storage holds 0 bytes.
    unshard(async_op=False): allocate flat's storage and all-gather the shards into it; with
        async_op=True return the Work (call wait() before using the parameters); a no-op
        returning None when already gathered or in flight.
    wait(): wait for an in-flight gather.   reshard(): free flat's storage.
    reduce_grads(): the parameters' gradients (zeros where None), flattened and padded,
        reduce-scattered to their average over the ranks; rank r ADDS its shard to
        shard.grad; the parameters' .grad are set to None (the full gradient is freed).
    `gathered_bytes()`: bytes the gathered buffer holds now (0 when resharded).
    """

    def __init__(self, params, *, group: dist.ProcessGroup | None = None, name: str = ""):
        self.params, self.group, self.name = list(params), group, name
        if not self.params:
            raise ValueError(f"unit {name!r} has no trainable parameter to shard: leave a frozen block "
                             "out of blocks=[...] (it then stays whole on every rank)")
        if len({(p.dtype, p.device) for p in self.params}) > 1:
            raise ValueError(f"unit {name!r} mixes dtypes or devices: cast the model first (model.float())")
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.numel = sum(p.numel() for p in self.params)
        self.work = None  # an in-flight async all-gather
        # Yours: shard_size(numel, world) (elements per rank), flatten_padded(tensors, numel) (one flat,
        # zero-padded copy), make each p.data a view of self.flat, then self.reshard().
        ### BEGIN SOLUTION
        self.shard_size = shard_size(self.numel, self.world_size)
        self.flat = flatten([p.detach() for p in self.params], self.shard_size * self.world_size)
        self.shard = nn.Parameter(local_shard(self.flat, self.rank, self.world_size).clone())
        offset = 0
        for p in self.params:  # the module keeps its Parameters; their data now lives in `flat`
            p.data = self.flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.reshard()
        ### END SOLUTION

    def gathered_bytes(self) -> int:
        return self.flat.untyped_storage().nbytes()

    def unshard(self, async_op: bool = False):
        """Give flat its storage back (``self.flat.untyped_storage().resize_(numel * element_size)``)
        and all-gather: ``_all_gather(self.flat, self.shard.detach(), group=self.group, async_op=async_op)``;
        keep the Work in ``self.work`` when async. Nothing to do when gathered or in flight."""
        ### BEGIN SOLUTION
        if self.work is not None or self.gathered_bytes() > 0:
            return None
        self.flat.untyped_storage().resize_(self.flat.numel() * self.flat.element_size())
        work = dist.all_gather_single(self.flat, self.shard.detach(), group=self.group, async_op=async_op)
        if async_op:
            self.work = work
        return work
        ### END SOLUTION

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None

    def reshard(self) -> None:
        """Wait for an in-flight gather (``self.wait()``), then free flat's storage (``resize_(0)``)."""
        ### BEGIN SOLUTION
        self.wait()
        self.flat.untyped_storage().resize_(0)
        ### END SOLUTION

    def reduce_grads(self) -> None:
        """``reduce_scatter_mean(flatten_padded(grads, self.flat.numel()), self.group)`` -> this rank's
        averaged shard, ADDED to ``self.shard.grad`` (None: set it); then every ``p.grad = None``."""
        ### BEGIN SOLUTION
        mine = reduce_scatter_mean(flatten(grads_or_zeros(self.params), self.flat.numel()), group=self.group)
        self.shard.grad = mine if self.shard.grad is None else self.shard.grad + mine
        for p in self.params:
            p.grad = None
        ### END SOLUTION


class ZeRO3:
    """FSDP by hand: shard `model` into one FlatShard per block plus a root unit, and hook it.

    ZeRO3(model, blocks=None, *, group=None, prefetch=True, timeline=None): `blocks` are the
    modules gathered one at a time, in forward order (default: `model.layers`); every other
    trainable parameter forms the root unit, gathered in the model's pre-forward hook and kept
    until its gradients are reduced. Raises ValueError when there is no block to wrap, or when
    a parameter is shared by two units (tie weights inside one unit, e.g. embedding and head).
    A block without trainable parameters cannot be a unit: leave it out of `blocks` (it then runs
    whole, as given). Every rank must use the same parameters in its forward, so that the hooks
    issue the same collectives in the same order everywhere.
    Usage, once per step (every rank):
        loss = model(x, y); loss.backward(); zero3.sync_gradients(); opt.step(); opt.zero_grad()
    with `opt = torch.optim.AdamW(zero3.shards(), ...)`. sync_gradients() reduces the units whose
    gradients never all arrived (a parameter unused by the loss: zeros) and frees them.
    `peak_gathered_bytes`: the most bytes of gathered parameters held at once (reset it
    yourself); `gathered_elements`, `reduced_elements`: elements all-gathered and
    reduce-scattered so far (the communication volume). `timeline`: a labkit Timeline that
    gets "F"/"B" spans per block (mb = block index) and "allgather" spans (issue to wait end).
    """
    finish = renamed_method("ZeRO3.finish")  # an old name, for one release (labkit/renames.py)

    def __init__(self, model: nn.Module, blocks=None, *, group: dist.ProcessGroup | None = None,
                 prefetch: bool = True, timeline: Timeline | None = None):
        blocks = list(blocks if blocks is not None else getattr(model, "layers", []))
        if not blocks:
            raise ValueError(f"{type(model).__name__} has no blocks to wrap: pass blocks=[...], the "
                             "modules to gather one at a time (e.g. model.layers)")
        self.model, self.group, self.prefetch, self.timeline = model, group, prefetch, or_null(timeline)
        owner = {}
        for i, block in enumerate(blocks):
            for p in block.parameters():
                if owner.setdefault(p, i) != i:
                    raise ValueError(f"a parameter is shared by blocks {owner[p]} and {i}: "
                                     "ZeRO-3 gathers one unit at a time, keep tied weights in one unit")
        for name, p in model.named_parameters():
            if p in owner and any(p is q for m in _outside(model, blocks) for q in m.parameters(recurse=False)):
                raise ValueError(f"{name} is shared by block {owner[p]} and the root: keep tied weights in one unit")
        self.blocks = blocks
        self.units = [FlatShard([p for p in b.parameters() if p.requires_grad], group=group, name=f"block {i}")
                      for i, b in enumerate(blocks)]
        rest = [p for p in model.parameters() if p.requires_grad and p not in owner]
        self.root = FlatShard(rest, group=group, name="root") if rest else None
        self.peak_gathered_bytes = self.gathered_elements = self.reduced_elements = 0
        self._t0 = {}
        ### BEGIN SOLUTION
        self._hooks = [model.register_forward_pre_hook(lambda m, args: self._pre_forward_root())]
        for i, block in enumerate(blocks):
            self._hooks.append(block.register_forward_pre_hook(lambda m, args, i=i: self._pre_forward(i)))
            self._hooks.append(block.register_forward_hook(lambda m, args, out, i=i: self._post_forward(i, out)))
        for unit in self._all_units():
            self._ready(unit)
            for p in unit.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(lambda p, u=unit: self._post_backward(u, p)))
        ### END SOLUTION

    def shards(self) -> list:
        """The parameters the optimizer steps: one flat shard per unit."""
        return [u.shard for u in self.units] + ([self.root.shard] if self.root else [])

    # -- gathering, with the bookkeeping that the notebook measures --------------------------
    def _gather(self, unit, async_op=False):
        if unit.work is None and unit.gathered_bytes() == 0:
            self.gathered_elements += unit.flat.numel()
            self._t0[unit] = time.perf_counter()
        unit.unshard(async_op=async_op)
        held = sum(u.gathered_bytes() for u in self._all_units())  # in-flight gathers hold memory too
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, held)
        if not async_op:
            unit.wait()
            if unit in self._t0:
                self.timeline.record("allgather", self._t0[unit], time.perf_counter(), mb=self._index(unit))
            self._t0.pop(unit, None)

    def _all_units(self):
        return self.units + ([self.root] if self.root else [])

    def _index(self, unit):
        return self.units.index(unit) if unit in self.units else None

    def _ready(self, unit):
        unit.pending = {p for p in unit.params}  # parameters whose gradient has not arrived yet

    def _span(self, kind, i):
        self._t0[(kind, i)] = time.perf_counter()

    def _end_span(self, kind, i):
        if (kind, i) in self._t0:
            self.timeline.record(kind, self._t0.pop((kind, i)), time.perf_counter(), mb=i)

    # -- the hooks -----------------------------------------------------------------------------
    def _pre_forward_root(self):
        if self.root is not None:
            self._gather(self.root)

    def _pre_forward(self, i):
        """Block i's forward pre-hook: ``self._gather(self.units[i])`` (waits if prefetched); with
        ``self.prefetch``, start the next unit's gather (``self._gather(unit, async_op=True)``);
        ``self._span("F", i)``."""
        ### BEGIN SOLUTION
        self._gather(self.units[i])  # waits if it was prefetched
        if self.prefetch and i + 1 < len(self.units):
            self._gather(self.units[i + 1], async_op=True)  # overlaps with block i's compute
        self._span("F", i)
        ### END SOLUTION

    def _post_forward(self, i, out):
        """Block i's forward hook: ``self._end_span("F", i)``, reshard the unit, and register
        ``out.register_hook(...)`` (when out requires grad) to call ``self._pre_backward(i)``; return out."""
        ### BEGIN SOLUTION
        self._end_span("F", i)
        self.units[i].reshard()
        if torch.is_tensor(out) and out.requires_grad:
            out.register_hook(lambda grad, i=i: self._pre_backward(i))
        return out
        ### END SOLUTION

    def _pre_backward(self, i):
        """Gradient of block i's output arrives: gather unit i again, prefetch unit i-1, ``self._span("B", i)``."""
        ### BEGIN SOLUTION
        self._gather(self.units[i])
        if self.prefetch and i > 0:
            self._gather(self.units[i - 1], async_op=True)
        self._span("B", i)
        ### END SOLUTION

    def _post_backward(self, unit, param):
        """A parameter's gradient is final (``register_post_accumulate_grad_hook``): drop it from
        ``unit.pending``; when none is left, ``self._end_span("B", self._index(unit))``, count
        ``self.reduced_elements``, ``unit.reduce_grads()``, ``unit.reshard()``, ``self._ready(unit)``."""
        ### BEGIN SOLUTION
        unit.pending.discard(param)
        if unit.pending:
            return
        self._end_span("B", self._index(unit))
        self.reduced_elements += unit.flat.numel()
        unit.reduce_grads()
        unit.reshard()
        self._ready(unit)
        ### END SOLUTION

    def sync_gradients(self) -> None:
        """After backward: reduce the units still waiting for a gradient (zeros), free everything."""
        for unit in self._all_units():
            # not reduced by its hook: some (or all) of its gradients never arrived
            if len(unit.pending) < len(unit.params) or unit.shard.grad is None:
                self.reduced_elements += unit.flat.numel()
                unit.reduce_grads()
            unit.reshard()
            self._ready(unit)

    @torch.no_grad()
    def full_parameters(self) -> dict:
        """{name: full parameter (a copy)} on every rank: gathers each unit once (collective)."""
        out = {}
        for unit in self._all_units():
            unit.unshard()
            out.update({id(p): p.detach().clone() for p in unit.params})
            unit.reshard()
        return {n: out.get(id(p), p.detach()) for n, p in self.model.named_parameters()}


def _outside(model, blocks):
    """The modules of `model` that are not inside any block."""
    inside = {id(m) for b in blocks for m in b.modules()}
    return [m for m in model.modules() if id(m) not in inside]


__getattr__ = renamed_in(__name__)  # old names fail naming their replacement, for one release
