"""What a linear layer's float8 training costs beyond its GEMMs: torchao's casts (notebook 15).

torchao's dynamic scaling (torchtitan's float8 rows) casts each linear's three operands, the input X
(rows x k), the weight W (k x n) and the output's gradient dY (rows x n), to float8 before each GEMM.
`FLOAT8_CASTS` is torchao's own count of the bytes and kernels each recipe spends per operand.

Counted at the streaming rate, rowwise casts are too cheap. torchao measured its rowwise recipe end to
end (pytorch/ao fdddb2cf, docs/static/fp8-rowwise-perf.png, the float8 README's 'Rowwise scaling'
table): the speedup over bf16 of LayerNorm -> Linear -> Sigmoid, forward and backward, compiled, as the
GPU kernels' summed time (benchmarks/float8/float8_roofline.py), on a 6 x 6 x 6 grid of forward shapes
M, K, N from 1,024 to 32,768. Where a kind gives that table (`GPU.fp8_rowwise_linear`), the casts take
what the table leaves for them:

    casts(M, K, N) = bench_bf16 / speedup - fp8 GEMMs - LayerNorm - Sigmoid

with every term but the speedup the kernel model's own (`bench_seconds`). Over the grid that is
about 2.5 times the counted bytes at the streaming rate, most at small N: the wk and wv projections of
torchtitan's rowwise rows (pytorch/torchtitan issue #1207: 'attention.wk and attention.wv layers were
so small that float8 rowwise conversion resulted in approx ~40% slowdown for those layers').

`cast_factor` is that ratio at a grid point, never under 1 (the counted bytes at the streaming rate are
the least they take); off the grid (the async-TP rows' M is 98,304 and 131,072, TP 8 makes N and K 128 to 512) it is
the nearest grid point's (log-linear between points, clamped at the edges): the casts are memory traffic
in proportion to the operands, so what scales with the shape is their bytes, and the factor is the
measured rate at which those bytes go. The table reproduces exactly at its grid points (tests). The
tensorwise recipe keeps the counted bytes: no tensorwise table is stored.
"""
from __future__ import annotations

import math
from dataclasses import replace
from functools import lru_cache

from labkit.scale.gpu import GPU
from labkit.scale.kernels import Op, gemm, roofline

# torchao's casts of one linear's operands to float8, per recipe and role: (bytes per element, kernels) in the
# forward and in the backward, as torchao counts them (torchao/testing/training/roofline_utils.py,
# get_tensor_memory_traffic_ovhd_s, fuse_with_prev=False; its kernels are torch.compile's):
#   tensorwise  input / grad_output: amax (read 2), a second-stage amax (no traffic), one cast writing both
#               layouts (read 2, write 1 + 1): 6 bytes, 3 kernels, where the tensor is made (input: forward,
#               grad_output: backward); weight: amax (2) and the forward cast (2 + 1), the backward's cast (2 + 1)
#   rowwise     input / grad_output: a cast along dim 0 that also writes the transposed bf16 copy (read 2, write
#               1 + 2), then the cast along dim 1 (read 2, write 1): 8 bytes, 2 kernels; weight: the forward
#               cast (2 + 1), the backward's transpose (2 + 2) and cast (2 + 1): 10 bytes, 3 kernels
FLOAT8_CASTS = {
    "tensorwise": {"input": ((6, 3), (0, 0)), "weight": ((5, 3), (3, 1)), "grad_output": ((0, 0), (6, 3))},
    "rowwise": {"input": ((8, 2), (0, 0)), "weight": ((3, 1), (7, 2)), "grad_output": ((0, 0), (8, 2))},
}
FLOAT8_RECIPES = tuple(FLOAT8_CASTS)
# the weight's casts when FSDP all-gathers it already in float8 (torchao's enable_fsdp_float8_all_gather, tensorwise
# only: WeightWithDynamicFloat8CastTensor casts each shard before the all-gather, with the scales
# precompute_float8_dynamic_scale_for_fsdp computes once a step): nothing on the whole weight forward (its
# column-major view is the GEMM's second operand), the backward's input gradient takes it row-major, which
# torch._scaled_mm refuses, so one copy into the other layout (read 1, write 1). Not counted: the cast of the
# shard, 1 / dp of the weight (read 4, write 1, per gather), and the step's one amax pass over the shards
GATHERED_WEIGHT_CASTS = ((0, 0), (2, 1))

# torchao's float8 TP (torchao/float8/float8_tensor_parallel.py: Float8ColwiseParallel, Float8RowwiseParallel and
# PrepareFloat8ModuleInput, "with all-gather in float8. This currently assumes tensorwise scaling"): a block's input
# is cast before the sequence-parallel all-gather, and the output's gradient (NoopFwToFloat8BwDynamic, after the
# forward's reduce-scatter) before the backward's all-gather, so both all-gathers move 1-byte values; the
# reduce-scatters sum bf16 partials. torchtitan runs it whenever float8 is tensorwise (9dec370's
# parallelisms/parallelize_llama.py: with every float8 run; June 2025's models/llama3/infra/parallelize.py:
# enable_float8_tensorwise_tp = float8 and not rowwise); the rowwise recipe keeps plain TP, bf16 all-gathers.
# Not counted: the same code casts each shared input once, on its T / tp rows before the gather, where
# `float8_casts` casts each linear's input on its T rows (4 of a block's 7 linears share 2 inputs).
FLOAT8_TP_GATHER_BYTES = {"tensorwise": 1}


def check_all_gather(recipe: str | None) -> None:
    """torchao's float8 all-gather under FSDP is tensorwise only (torchtitan June 2025's float8 converter asserts
    'using float8_config.enable_fsdp_float8_all_gather together with float8_config.recipe_name is not supported')."""
    if recipe != "tensorwise":
        raise ValueError(f"float8_all_gather=True needs float8=True (tensorwise), not float8={recipe!r}: torchao "
                         "all-gathers FSDP's weights in float8 only under tensorwise scaling; drop float8_all_gather "
                         "or use the tensorwise recipe")


def fsdp_gather_bytes(model, layout, dense: float, value_bytes: int, recipe: str | None,
                      float8_all_gather: bool) -> float:
    """Bytes per parameter of FSDP2's all-gathers of the `dense` parameters this GPU holds unsharded (its stage,
    its tp shard: `cost_kernels.params_per_gpu`): value_bytes, or under torchao's float8 all-gather (tensorwise) 1
    byte for the weights of every block linear float8 trains (wq, wk, wv, wo and a dense MLP's; not the norms, the
    embedding, the head or a MoE's router), value_bytes for the rest, averaged over those parameters."""
    if not float8_all_gather:
        return float(value_bytes)
    check_all_gather(recipe)
    m = model
    linears = m.attention_params + (0 if m.n_experts else m.expert_params)
    fp8 = layout.layers_per_rank(m.n_layers) * linears / layout.tp
    return (value_bytes * dense - (value_bytes - 1) * fp8) / dense


def tp_gather_bytes(recipe: str | None, value_bytes: int) -> int:
    """Bytes per value of TP's all-gathers under a float8 recipe (None: bf16 training): torchao's float8 TP's."""
    return FLOAT8_TP_GATHER_BYTES.get(recipe, value_bytes) if recipe else value_bytes

# the benchmark's neighbours, compiled, bytes per element: LayerNorm without affine over X (forward read 2,
# write 2; backward read x and dy, write dx: 6), Sigmoid over Y (the same 4 and 6)
_LAYERNORM_BYTES, _SIGMOID_BYTES = 4 + 6, 4 + 6


def counted_bytes(recipe: str, rows: int, k: int, n: int, weight_gathered: bool = False) -> tuple[float, float, int, int]:
    """(forward bytes, backward bytes, forward kernels, backward kernels) of torchao's casts, as it counts them;
    weight_gathered: FSDP gathers the weight in float8 (`GATHERED_WEIGHT_CASTS`, tensorwise only)."""
    if recipe not in FLOAT8_CASTS:
        raise ValueError(f"float8={recipe!r} is not a recipe the kernel model knows: choose one of {FLOAT8_RECIPES}")
    elements = {"input": rows * k, "weight": k * n, "grad_output": rows * n}
    casts = dict(FLOAT8_CASTS[recipe])
    if weight_gathered:
        check_all_gather(recipe)
        casts["weight"] = GATHERED_WEIGHT_CASTS
    nbytes = [sum(casts[role][d][0] * elements[role] for role in elements) for d in (0, 1)]
    kernels = [sum(casts[role][d][1] for role in elements) for d in (0, 1)]
    return nbytes[0], nbytes[1], kernels[0], kernels[1]


def bench_seconds(m: int, k: int, n: int, gpu: GPU, dtype: str) -> tuple[float, float]:
    """(the linear's three GEMMs, LayerNorm + Sigmoid) of torchao's benchmark at forward shape M, K, N, compiled,
    in the kernel model: forward gemm(M, N, K), the input's gradient gemm(M, K, N), the weight's gemm(K, N, M)."""
    gemms = sum(gemm("bench", *s, gpu, dtype, compile=True).seconds for s in ((m, n, k), (m, k, n), (k, n, m)))
    return gemms, (_LAYERNORM_BYTES * m * k + _SIGMOID_BYTES * m * n) / gpu.hbm_bytes_per_s


def measured_cast_seconds(m: int, k: int, n: int, gpu: GPU) -> float:
    """The rowwise casts' seconds at a grid point of the kind's table: bench_bf16 / speedup - the rest."""
    speedup = gpu.fp8_rowwise_linear[3][(m, k, n)]
    bf16_gemms, neighbours = bench_seconds(m, k, n, gpu, "bf16")
    fp8_gemms, _ = bench_seconds(m, k, n, gpu, "fp8_rowwise")
    return (bf16_gemms + neighbours) / speedup - fp8_gemms - neighbours


@lru_cache(maxsize=4096)
def _grid_factor(m: int, k: int, n: int, gpu: GPU) -> float:
    fwd, bwd, _, _ = counted_bytes("rowwise", m, k, n)
    return max(1.0, measured_cast_seconds(m, k, n, gpu) / ((fwd + bwd) / gpu.hbm_bytes_per_s))


def _bracket(axis: tuple, x: int) -> tuple[int, int, float]:
    """The grid points around x on one axis and x's log-linear weight between them (clamped at the ends)."""
    if x <= axis[0]:
        return axis[0], axis[0], 0.0
    if x >= axis[-1]:
        return axis[-1], axis[-1], 0.0
    for lo, hi in zip(axis, axis[1:]):
        if x <= hi:
            return lo, hi, math.log(x / lo) / math.log(hi / lo)
    raise AssertionError("unreachable")


def cast_factor(rows: int, k: int, n: int, gpu: GPU) -> float:
    """How many times the counted cast bytes' streaming time the rowwise casts take at this shape: the kind's
    table (trilinear in log M, K, N between grid points, the edge's beyond it); 1 without a table."""
    if not gpu.fp8_rowwise_linear:
        return 1.0
    ms, ks, ns, _ = gpu.fp8_rowwise_linear
    (m0, m1, wm), (k0, k1, wk), (n0, n1, wn) = _bracket(ms, rows), _bracket(ks, k), _bracket(ns, n)
    total = 0.0
    for m, a in ((m0, 1 - wm), (m1, wm)):
        for kk, b in ((k0, 1 - wk), (k1, wk)):
            for nn, c in ((n0, 1 - wn), (n1, wn)):
                if a * b * c:
                    total += a * b * c * _grid_factor(m, kk, nn, gpu)
    return total


def float8_casts(name: str, recipe: str, rows: int, k: int, n: int, gpu: GPU, compile: bool,
                 weight_gathered: bool = False) -> tuple[Op, Op]:
    """(forward, backward) casts of a linear Y (rows x n) = X (rows x k) W (k x n) under float8 `recipe`:
    torchao's counted bytes, at the streaming rate, or for rowwise on a kind with torchao's table at the
    rate that table measured (`cast_factor`); weight_gathered: FSDP all-gathered W in float8 (`counted_bytes`)."""
    fwd_bytes, bwd_bytes, fwd_kernels, bwd_kernels = counted_bytes(recipe, rows, k, n, weight_gathered)
    ops = [roofline(f"{name} cast", "elementwise", 0.0, b, kern, gpu, compile=compile)
           for b, kern in ((fwd_bytes, fwd_kernels), (bwd_bytes, bwd_kernels))]
    factor = cast_factor(rows, k, n, gpu) if recipe == "rowwise" else 1.0
    if factor != 1.0:
        ops = [replace(op, seconds=op.seconds * factor) for op in ops]  # still memory-bound, a slower rate
    return ops[0], ops[1]
