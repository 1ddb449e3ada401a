"""Megatron sequence parallelism (SP) on top of notebook 08's tensor parallelism (notebook 11_long_sequences).

Notebook 08's TP block splits attention (by heads) and the MLP (by hidden units) over the t
ranks of a TP group, but leaves the norms and the residual adds replicated: every rank computes
them on the whole sequence and stores their activations, t times over. SP (Korthikanti et al.
2022) splits those regions along the SEQUENCE instead: each rank holds s/t positions there.

    TP:  x [B, s, d]   -f-> TP region -g->    f: identity / all-reduce    g: all-reduce / identity
    SP:  x [B, s/t, d] -gather_sequence-> TP region -scatter_sequence-> x [B, s/t, d]
         gather_sequence:  all-gather along the sequence forward, reduce-scatter backward
         scatter_sequence: reduce-scatter along the sequence forward, all-gather backward
The conjugate pair again. An all-reduce is a reduce-scatter then an all-gather, so SP sends the
same bytes as TP, and the norm and residual activations shrink by t.

The norms' weights are replicated but each rank's copy sees only s/t tokens: their gradients
are partial sums, added over the TP group by `ParallelBlock.sync_gradients()` (as Megatron does).
Every function with a group is collective over it (None: the default group).
"""
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labkit.grading import impl
from labkit.parallel.tp import check_divisible, tp_world
from labkit.renames import renamed_in

NOTEBOOK = "11_long_sequences"
SEQ = 1  # activations are [batch, sequence, features]


def _world(group):
    return tp_world(group)


def all_gather_sequence(x, *, group: dist.ProcessGroup | None = None):
    """[B, n, d] on each rank -> [B, t*n, d], the ranks' blocks in rank order."""
    _, world = _world(group)
    if world == 1:
        return x
    local = x.movedim(SEQ, 0).contiguous()  # [n, B, d]: the collective stacks along dim 0
    out = torch.empty((world * local.shape[0],) + local.shape[1:], dtype=x.dtype, device=x.device)
    dist.all_gather_single(out, local, group=group)
    return out.movedim(0, SEQ).contiguous()  # contiguous: the matmuls that read it save it once, not a copy each


def reduce_scatter_sequence(x, *, group: dist.ProcessGroup | None = None):
    """[B, s, d] partial sums on each rank -> this rank's block [B, s/t, d] of their sum."""
    rank, world = _world(group)
    if world == 1:
        return x
    n = check_divisible(x.shape[SEQ], world, "sequence length s")
    out = torch.empty((n,) + x.movedim(SEQ, 0).shape[1:], dtype=x.dtype, device=x.device)
    dist.reduce_scatter_single(out, x.movedim(SEQ, 0).contiguous(), group=group)
    return out.movedim(0, SEQ).contiguous()


class GatherSequence(torch.autograd.Function):
    """Enter the TP region: all-gather along the sequence forward; backward reduce-scatter.

    forward(x [B, s/t, d], group) -> [B, s, d]. Every rank's TP region uses every position, so
    dL/dx of this rank's positions is the SUM over the ranks of their gradients there: the
    backward reduce-scatters grad [B, s, d] to [B, s/t, d] (TP's f had all-reduce here).
    Use this module's ``all_gather_sequence(x, group)`` and ``reduce_scatter_sequence(x, group)``
    (always with the group: it need not be the whole world); keep the group on ``ctx`` for backward.
    """

    @staticmethod
    def forward(ctx, x, group):
        ### BEGIN SOLUTION
        ctx.group = group
        return all_gather_sequence(x, group=group)
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION
        return reduce_scatter_sequence(grad.contiguous(), group=ctx.group), None
        ### END SOLUTION


class ScatterSequence(torch.autograd.Function):
    """Leave the TP region: reduce-scatter along the sequence forward; backward all-gather.

    forward(x [B, s, d] partial sums, group) -> this rank's block [B, s/t, d] of their sum
    (TP's g all-reduced here). Each rank's block of the sum depends on every rank's partial
    result, so the backward all-gathers the blocks' gradients back to [B, s, d].
    Use ``reduce_scatter_sequence(x, group)`` and ``all_gather_sequence(grad, group)``.
    """

    @staticmethod
    def forward(ctx, x, group):
        ### BEGIN SOLUTION
        ctx.group = group
        return reduce_scatter_sequence(x, group=group)
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION
        return all_gather_sequence(grad.contiguous(), group=ctx.group), None
        ### END SOLUTION


def gather_sequence(x, *, group: dist.ProcessGroup | None = None):
    return GatherSequence.apply(x, group)


def scatter_sequence(x, *, group: dist.ProcessGroup | None = None):
    return ScatterSequence.apply(x, group)


class ParallelBlock(nn.Module):
    """labkit.model.Block with attention split by heads and the MLP by hidden units over `group`.

    sequence_parallel=True (SP): forward(x [B, s/t, d] this rank's block of positions) ->
    [B, s/t, d]; the norms and residuals run on s/t positions, gather_sequence / scatter_sequence
    enter and leave the TP regions. sequence_parallel=False (notebook 08's TP): forward(x [B, s, d],
    the same on every rank) -> [B, s, d], with copy_to_parallel / reduce_from_parallel. The
    weights are this rank's slices of `block`'s (rows of wq wk wv w1 w3, columns of wo w2), the
    norms copies. ValueError when n_heads or hidden_dim does not divide by the TP size.
    regather=True (with SP): enter through `GatherThenLinear`, Megatron's way, so that the
    gathered [B, s, d] input is not kept for backward but all-gathered again there.
    """

    def __init__(self, block: nn.Module, *, group: dist.ProcessGroup | None = None, sequence_parallel: bool = True,
                 regather: bool = False):
        super().__init__()
        rank, world = tp_world(group)
        self.group, self.sequence_parallel, self.regather = group, sequence_parallel, regather and sequence_parallel
        self.heads = check_divisible(block.attention.n_heads, world, "n_heads")
        hidden = check_divisible(block.feed_forward.w1.out_features, world, "hidden_dim")
        d = block.attention.wq.out_features // world
        rows = lambda w, k: nn.Parameter(w.weight[rank * k:(rank + 1) * k].detach().clone())
        cols = lambda w, k: nn.Parameter(w.weight[:, rank * k:(rank + 1) * k].detach().clone())
        a, m = block.attention, block.feed_forward
        self.wq, self.wk, self.wv, self.wo = rows(a.wq, d), rows(a.wk, d), rows(a.wv, d), cols(a.wo, d)
        self.w1, self.w3, self.w2 = rows(m.w1, hidden), rows(m.w3, hidden), cols(m.w2, hidden)
        self.attention_norm, self.ffn_norm = copy.deepcopy(block.attention_norm), copy.deepcopy(block.ffn_norm)

    def sync_gradients(self) -> None:
        """After backward: with SP, sum the norm weights' partial gradients (each rank saw s/t tokens) over
        the group, in place; without SP every rank saw every token and there is nothing to do."""
        if not self.sequence_parallel or tp_world(self.group)[1] == 1:
            return
        for norm in (self.attention_norm, self.ffn_norm):
            if norm.weight.grad is not None:
                dist.all_reduce(norm.weight.grad, group=self.group)

    def enter(self, x, *weights):
        """The TP region's first matmuls (column parallel) on x: one output per weight."""
        if self.regather:
            return GatherThenLinear.apply(x, self.group, *weights)
        if self.sequence_parallel:
            x = gather_sequence(x, group=self.group)
        else:
            x = impl("tensor_parallel").copy_to_parallel(x, group=self.group)
        return [F.linear(x, w) for w in weights]

    def leave(self, x):
        if self.sequence_parallel:
            return scatter_sequence(x, group=self.group)
        return impl("tensor_parallel").reduce_from_parallel(x, group=self.group)

    def forward(self, x, rope):
        q, k, v = self.enter(self.attention_norm(x), self.wq, self.wk, self.wv)  # [B, s, d/t]: every position
        B, T, _ = q.shape
        heads = lambda t: t.view(B, T, self.heads, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(rope(heads(q)), rope(heads(k)), heads(v), is_causal=True)
        x = x + self.leave(F.linear(y.transpose(1, 2).reshape(B, T, -1), self.wo))  # partial sums -> summed
        gate, up = self.enter(self.ffn_norm(x), self.w1, self.w3)
        return x + self.leave(F.linear(F.silu(gate) * up, self.w2))


class GatherThenLinear(torch.autograd.Function):
    """All-gather x along the sequence, then F.linear with each weight; keep only the LOCAL x.

    Megatron-SP's memory saving: the column-parallel matmuls need the gathered input [B, s, d]
    for their weight gradients, but saving it would undo SP's division by t. Instead this keeps
    x [B, s/t, d] and all-gathers it again in backward (one more all-gather per region, which
    Megatron overlaps with the input-gradient matmul). The input gradient is reduce-scattered,
    as GatherSequence's backward does.
    """

    @staticmethod
    def forward(ctx, x, group, *weights):
        ctx.group = group
        ctx.save_for_backward(x, *weights)
        full = all_gather_sequence(x, group=group)
        return tuple(F.linear(full, w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        full = all_gather_sequence(x, group=ctx.group).flatten(0, -2)  # again, instead of having kept it
        grad_x = sum(g @ w for g, w in zip(grads, weights))
        grad_w = [g.flatten(0, -2).T @ full for g in grads]
        return (reduce_scatter_sequence(grad_x.contiguous(), group=ctx.group), None, *grad_w)


__getattr__ = renamed_in(__name__)  # old names fail naming their replacement, for one release
