# GENERATED from solutions/tensor_parallel.py by `python -m labkit.grading.stubgen`: this file is yours to edit.
# Fill in every `raise NotImplementedError(...)`; see notebooks/08_tensor_parallel.ipynb.
# untouched-stub fingerprint: 69643f619f00549e
"""Tensor parallelism, Megatron-style (notebook 08_tensor_parallel).

A linear layer y = x W^T + b can be cut across the ranks of a TP group in two ways:
- column parallel: each rank owns a slice of W's ROWS (output features) and computes
  its slice of y; the input x must be the same on every rank.
- row parallel: each rank owns a slice of W's COLUMNS (input features), multiplies its
  slice of x, and the partial results are SUMMED over the ranks (one all-reduce).
Column then row (Megatron's MLP, attention with heads split over the ranks) needs one
all-reduce in the forward pass and one in the backward pass, and nothing in between.

Two autograd functions, each the other's conjugate, place those all-reduces:
    copy_to_parallel      forward: identity     backward: all-reduce (sum)
    reduce_from_parallel  forward: all-reduce   backward: identity
The parallel modules are built from a full (unsharded) module, so that each rank keeps
only its slice and the result can be compared with the unsharded layer exactly.

Every function here is collective over `group` (None: the default group). Without an
initialised process group the world is one rank, and nothing is communicated.
"""
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labkit.parallel.tp import check_divisible, tp_world  # noqa: F401 (notebooks 08 and 11 use them from here)
from labkit.renames import renamed_in

NOTEBOOK = "08_tensor_parallel"


# ---------------------------------------------------------------------------------------
# Communication (labkit.comm.traffic.count_traffic counts it: it sees every dist.<op> call)


def _all_reduce(x, group):
    if tp_world(group)[1] == 1:
        return x
    x = x.contiguous()  # in place: the callers pass a clone, never a tensor autograd still needs
    dist.all_reduce(x, group=group)
    return x


def _all_gather_last(x, group):
    _, world = tp_world(group)
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _my_slice_last(x, group):
    rank, world = tp_world(group)
    return x.chunk(world, dim=-1)[rank].contiguous() if world > 1 else x


class CopyToParallel(torch.autograd.Function):
    """f: identity forward, all-reduce backward (each rank's branch adds to dL/dx)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group), None


class ReduceFromParallel(torch.autograd.Function):
    """g: all-reduce forward (sum the partial results), identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromParallel(torch.autograd.Function):
    """All-gather along the last dim forward; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _my_slice_last(grad, ctx.group), None


class ScatterToParallel(torch.autograd.Function):
    """Keep this rank's slice of the last dim forward; backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _my_slice_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_last(grad, ctx.group), None


def copy_to_parallel(x, *, group: dist.ProcessGroup | None = None):
    return CopyToParallel.apply(x, group)


def reduce_from_parallel(x, *, group: dist.ProcessGroup | None = None):
    return ReduceFromParallel.apply(x, group)


def gather_from_parallel(x, *, group: dist.ProcessGroup | None = None):
    return GatherFromParallel.apply(x, group)


def scatter_to_parallel(x, *, group: dist.ProcessGroup | None = None):
    return ScatterToParallel.apply(x, group)


def _param(t: torch.Tensor) -> nn.Parameter:
    # a copy, not a view: the shard must not keep the full weight alive, nor share its .grad
    return nn.Parameter(t.detach().clone())


# ---------------------------------------------------------------------------------------
# The parallel layers


class ColumnParallelLinear(nn.Module):
    """The slice of `linear` that computes this rank's block of output features.

    Keeps rows [rank*k, (rank+1)*k) of linear.weight [out, in] (and of the bias),
    k = out_features // world. The input x [..., in] must be identical on every rank.
    forward(x) returns this rank's block of outputs [..., k], or with gather_output=True
    the full output [..., out] (all-gathered). In backward, dL/dx is all-reduced (the
    input fed every rank's block), so it equals the unsharded layer's dL/dx on every rank.
    Raises ValueError when out_features does not divide by the TP size.
    """

    def __init__(self, linear: nn.Linear, *, group: dist.ProcessGroup | None = None, gather_output: bool = False):
        super().__init__()
        self.group, self.gather_output = group, gather_output
        raise NotImplementedError("exercise ColumnParallelLinear is not implemented yet: edit exercises/tensor_parallel.py, see notebooks/08_tensor_parallel.ipynb")

    def forward(self, x):
        raise NotImplementedError("exercise ColumnParallelLinear is not implemented yet: edit exercises/tensor_parallel.py, see notebooks/08_tensor_parallel.ipynb")


class RowParallelLinear(nn.Module):
    """The slice of `linear` that reads this rank's block of input features.

    Keeps columns [rank*k, (rank+1)*k) of linear.weight [out, in], k = in_features // world,
    and the full bias (added once, after the sum). With input_is_parallel=True, forward(x)
    takes this rank's block x [..., k] (what a ColumnParallelLinear returns); with False it
    takes the full x [..., in] and keeps its block. The partial products are all-reduced,
    so every rank returns the full output [..., out] of the unsharded layer.
    Raises ValueError when in_features does not divide by the TP size.
    """

    def __init__(self, linear: nn.Linear, *, group: dist.ProcessGroup | None = None, input_is_parallel: bool = True):
        super().__init__()
        self.group, self.input_is_parallel = group, input_is_parallel
        raise NotImplementedError("exercise RowParallelLinear is not implemented yet: edit exercises/tensor_parallel.py, see notebooks/08_tensor_parallel.ipynb")

    def forward(self, x):
        raise NotImplementedError("exercise RowParallelLinear is not implemented yet: edit exercises/tensor_parallel.py, see notebooks/08_tensor_parallel.ipynb")


class ParallelMLP(nn.Module):
    """Megatron's MLP for labkit.model's SwiGLU: w2(silu(w1 x) * w3 x) with ONE all-reduce.

    w1 (gate) and w3 (up) are column parallel: each rank computes hidden units
    [rank*k, (rank+1)*k) of both, so the element-wise silu(.) * (.) needs no communication;
    w2 (down) is row parallel over the same k hidden units and sums the results.
    w1 and w3 read the same x: call copy_to_parallel ONCE and apply their local weights
    (F.linear(x, self.w1.weight)) rather than their forward, which would each all-reduce
    dL/dx in backward. So: one all-reduce in forward (w2's) and one in backward.
    forward(x [..., d_model], identical on every rank) -> [..., d_model], equal to the
    unsharded MLP on every rank. Raises ValueError when hidden_dim does not divide by the
    TP size.
    """

    def __init__(self, mlp: nn.Module, *, group: dist.ProcessGroup | None = None):
        super().__init__()
        raise NotImplementedError("exercise ParallelMLP is not implemented yet: edit exercises/tensor_parallel.py, see notebooks/08_tensor_parallel.ipynb")

    def forward(self, x):
        raise NotImplementedError("exercise ParallelMLP is not implemented yet: edit exercises/tensor_parallel.py, see notebooks/08_tensor_parallel.ipynb")


class ParallelAttention(nn.Module):
    """labkit.model's causal attention with its heads split over the ranks.

    wq, wk, wv are column parallel: the rows of head h are [h*hd, (h+1)*hd), so a block of
    rows is a block of whole heads and each rank computes n_heads // world heads on its
    own. wo is row parallel over the same heads and sums the heads' contributions: one
    all-reduce in forward, one in backward, as in the MLP. forward(x, rope) matches
    Attention.forward. Raises ValueError when n_heads does not divide by the TP size.
    """

    def __init__(self, attention: nn.Module, *, group: dist.ProcessGroup | None = None):
        super().__init__()
        _, world = tp_world(group)
        self.local_heads = check_divisible(attention.n_heads, world, "n_heads")
        self.group = group
        # wq, wk, wv share one input: ONE copy_to_parallel (one backward all-reduce) for the three
        self.wq, self.wk, self.wv = (ColumnParallelLinear(w, group=group)
                                     for w in (attention.wq, attention.wk, attention.wv))
        self.wo = RowParallelLinear(attention.wo, group=group, input_is_parallel=True)

    def forward(self, x, rope):
        B, T, _ = x.shape
        x = copy_to_parallel(x, group=self.group)
        local = lambda w: F.linear(x, w.weight).view(B, T, self.local_heads, -1).transpose(1, 2)
        q, k, v = local(self.wq), local(self.wk), local(self.wv)  # [B, local heads, T, hd]
        y = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


def parallelize_model(model: nn.Module, *, group: dist.ProcessGroup | None = None) -> nn.Module:
    """A copy of a labkit.model.Transformer whose attention and MLPs are tensor parallel.

    The embedding, norms and head stay replicated (every rank computes them in full): their
    inputs' gradients are already summed by the parallel blocks, so their gradients agree on
    every rank without any extra communication. The model itself is left unchanged.
    """
    tp = copy.deepcopy(model)
    for layer in tp.layers:
        layer.attention = ParallelAttention(layer.attention, group=group)
        layer.feed_forward = ParallelMLP(layer.feed_forward, group=group)
    return tp


def tp_comm_per_layer(batch: int, seq: int, d_model: int, tp: int, bytes_per_elem: int = 2) -> dict:
    """Bytes each rank sends per transformer layer per step (ring all-reduce: 2(tp-1)/tp x size).

    Forward: 2 all-reduces of the activations [batch, seq, d_model] (attention, MLP);
    backward: 2 more (the copy_to_parallel of each). Returns counts and bytes.
    """
    size = batch * seq * d_model * bytes_per_elem
    per_allreduce = 2 * (tp - 1) / tp * size
    return dict(allreduces=4, activation_bytes=size, bytes_sent_per_rank=4 * per_allreduce)


__getattr__ = renamed_in(__name__)  # old names fail naming their replacement, for one release
