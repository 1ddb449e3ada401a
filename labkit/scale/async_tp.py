"""Async TP's exposed time, by its mechanism: the collective decomposed into per-rank chunks (notebook 15).

torchtitan's async TP (`--parallelism.enable_async_tensor_parallel`; the PyTorch post "[Distributed w/
TorchTitan] Introducing Async Tensor Parallelism in PyTorch", discuss.pytorch.org/t/209487, after Wang et
al., "Overlap Communication with Dependent Computation via Decomposition in Large Deep Learning Models",
ASPLOS 2023) splits each sequence-parallel all-gather -> matmul, and matmul -> reduce-scatter, into tp
steps: at each step one rank's chunk of T / tp rows is multiplied while the next chunk moves. The local
chunk needs no transfer, so one chunk's matmul is never overlapped; the others each take the longer of
their matmul and their transfer:

    t_async = g + (tp - 1) max(g, c),   c = t_collective / (tp - 1)   (one ring step: alpha + (A / tp) / busbw)
    exposed = max(0, t_async - G)

G: the matmuls the collective feeds (or that feed it) at their whole shape, g: the same matmuls on one
chunk of T / tp rows, each timed by `labkit.scale.kernels.gemm` (tile and wave quantization: a chunk is a
smaller GEMM and runs at a lower efficiency, the post's "wave quantization" cost of decomposition). With
a free link (c = 0) the exposed time is the split GEMMs' slowdown, tp g - G; with a slow one it tends to
the collective's time less the matmuls it hides behind. The clamp at 0 keeps a split that happens to beat
the whole GEMM (a bad last wave of the whole shape) from paying back other axes' time.

Which matmuls each of a block's TP collectives overlaps (torchtitan's Llama with sequence parallelism;
torch's fused_all_gather_matmul takes several weights at once, fused_matmul_reduce_scatter one):
    forward   all-gather -> wq, wk, wv;  wo -> reduce-scatter;  all-gather -> w1, w3;  w2 -> reduce-scatter
    backward  all-gather of dY -> w2's input gradient;  w1's and w3's input gradients -> reduce-scatter;
              all-gather of dY -> wo's input gradient;  wq's, wk's, wv's input gradients -> reduce-scatter
(the weight gradients contract over T, the dimension the chunks split, and are not decomposed).
Only a reduce-scatter whose input one matmul produces is decomposed: torch's micro-pipeline pass
(torch/_inductor/fx_passes/micro_pipeline_tp.py, `fuse_matmul_reduce_scatter` -> `_find_producer_matmul`, read in
torch 2.13; a 2024 copy in its author's fork, yifuwang/pytorch 2516077, makes the same test) returns without fusing
when the reduce-scatter's input is anything but a (reshaped) mm. The backward's two reduce-scatters take a sum:
the w1 and w3 input gradients (both read the gathered norm output), and the wq, wk and wv ones, added by autograd
before the all-gather's backward reduce-scatters them. Those two (`UNFUSED`) stay NCCL's collectives, exposed as
plain TP's (its `scatter_s`), with no closing sum. The all-gathers are fused with every matmul that takes the
gathered tensor as its left operand
(`fuse_all_gather_matmul`), the backward's two included.
A recomputing backward runs again the forward's collectives its policy does not save
(`labkit.scale.traffic.tp_collectives`), each behind the recomputed matmuls it feeds (`RECOMPUTE_GROUPS`):
full recompute the forward's four groups; torchtitan's op policy its two all-gathers, which feed only
wk and w3 there (wq, wv and w1 are saved: every other matmul).
Each decomposed reduce-scatter ends in a kernel the NCCL one does not have: torch's
fused_matmul_reduce_scatter (torch/distributed/_symmetric_memory/__init__.py) writes every rank's partial
product of its chunk into a stacked buffer (`_pipelined_produce_and_all2all`), then sums them with one
reduction kernel (`reduce_fn(stacked_partials, ...)`: reads T x n, writes T / tp x n), after the pipelined
loop, on the compute stream: `reduce_s`, exposed once per fused reduce-scatter (`SCATTERS` less `UNFUSED`; the
all-gathers' local copy into the symmetric buffer is T / tp rows, not counted). Not modelled: the copy engines
(the post's NVLink transfers use them, not SMs, so no SM contention is charged) and their share of HBM bandwidth,
for which no kernel-level figure was found.
"""
from __future__ import annotations

FORWARD_GROUPS = (("wq", "wk", "wv"), ("wo",), ("w1", "w3"), ("w2",))
BACKWARD_GROUPS = (("w2 dgrad",), ("w1 dgrad", "w3 dgrad"), ("wo dgrad",), ("wq dgrad", "wk dgrad", "wv dgrad"))
RECOMPUTE_GROUPS = {"full": FORWARD_GROUPS, "selective-op": (("wk",), ("w3",))}
# the groups whose matmuls feed a reduce-scatter (the others are fed by an all-gather)
SCATTERS = {("wo",), ("w2",), ("w1 dgrad", "w3 dgrad"), ("wq dgrad", "wk dgrad", "wv dgrad")}
# the reduce-scatters the pass leaves to NCCL: their input sums several matmuls' outputs (module docstring)
UNFUSED = {g for g in SCATTERS if len(g) > 1}


def decomposed(full_s: float, chunk_s: float, collective_s: float, tp: int) -> float:
    """Exposed seconds of one collective decomposed over tp ranks: max(0, g + (tp-1) max(g, c) - G)."""
    if tp <= 1:
        return 0.0
    c = collective_s / (tp - 1)
    return max(0.0, chunk_s + (tp - 1) * max(chunk_s, c) - full_s)


def _gemm_seconds(ops, names) -> float:
    return sum(op.seconds for op in ops if op.kind == "gemm" and op.name in names)


def exposed(blk: dict, chunk_blk: dict, gather_s: float, scatter_s: float, tp: int, recompute: str = "none",
            reduce_s: float = 0.0) -> tuple[float, float]:
    """(forward, backward) exposed seconds of one block's TP collectives under async TP, for one micro-batch.
    blk: `layer_ops.block_ops` at the block's shape; chunk_blk: the same on T / tp rows (one chunk);
    gather_s, scatter_s: one all-gather's and one reduce-scatter's time (`traffic.tp_call_seconds`; float8
    tensorwise TP gathers 1-byte values); recompute: the policy, whose re-run collectives (`RECOMPUTE_GROUPS`)
    hide behind the recomputed forward's matmuls (their times are the forward's); reduce_s: one
    reduce-scatter's closing sum, added for each."""
    def one(direction, g):
        if tp <= 1:
            return 0.0
        if g in UNFUSED:  # NCCL's reduce-scatter, exposed as plain TP's
            return scatter_s
        return (decomposed(_gemm_seconds(blk[direction], g), _gemm_seconds(chunk_blk[direction], g),
                           scatter_s if g in SCATTERS else gather_s, tp) + (reduce_s if g in SCATTERS else 0.0))

    def groups(direction, names):
        return sum(one(direction, g) for g in names)

    forward = groups("forward", FORWARD_GROUPS)
    backward = groups("backward", BACKWARD_GROUPS) + groups("forward", RECOMPUTE_GROUPS.get(recompute, ()))
    return forward, backward
