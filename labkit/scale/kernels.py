"""Every op of a transformer layer at its real shapes, each timed by a roofline (notebook 15).

One op's time, on a GPU kind of `labkit.scale.gpu` (every constant cited in its JSON file):

    GPU time  t = max(FLOPs / (peak x efficiency), bytes / (HBM bandwidth x achieved fraction))
    CPU time  h = kernels x the host's cost per kernel (eager PyTorch: `eager_op_us`; torch.compile: `launch_us`)

The CPU issues kernels while the GPU runs earlier ones (CUDA launches are asynchronous), so the CPU
runs ahead during long ops and spends its lead on short ones: a stretch of ops (one block's forward,
its backward; `labkit.scale.layer_ops.seconds`) takes max(sum of t, sum of h), not the sum of each
op's max. A stretch whose CPU time is the longer is launch-bound: a model made of such ops (the lab's
tiny and seed models) runs at the CPU's pace, n_kernels x eager_op_us, not the GPU's.

GEMM (m x k) @ (k x n), `gemm`: efficiency from the shape. Each tile of the output (`gemm_tiles`, the
largest cuBLAS uses: NVIDIA's Matrix Multiplication Background guide, sections 2.3 and 3) goes to one
SM; the tiles run in waves of `sm_count`; a wave takes a whole tile's FLOPs at one SM's rate:
    t_compute = ceil(tiles / SMs) x 2 tm tn k / (per-SM rate),   tiles = ceil(m / tm) ceil(n / tn)
(tile and wave quantization), the better of the tiles. A tile also spends time outside its k-loop (its
prologue fills the pipeline, its epilogue writes the output: `gemm_tile_k` k-steps), and a kernel a fixed
time whatever its shape (`gemm_kernel_us`), so in full:
    t = gemm_kernel_us + ceil(tiles / SMs) x 2 tm tn (k + gemm_tile_k) / (per-SM rate)
Both come from OpenXLA's measured table of 155 Hopper GEMMs (k = 256..4,096), which the model then gives
back within 5% (without them: median 29% off, up to 2.7x too fast at short k). The per-SM rate is solved
from the measured best GEMM (`mamf_tflops`) at its own shape (`gemm_efficiency`), so the model
reproduces the MAMF figure at the MAMF shape. Where the kind gives the sustained figure
(`msmf_tflops`: the best GEMM once the GPU draws its full TDP and its clock has settled, 15-20% under the
MAMF's short boost-clock burst) that is the reference instead: a training step keeps the GPU saturated. And no shape beats it: the MAMF is the best of
its source's sweep over shapes (a maximum, by its name), so a shape with less quantization loss than the
MAMF's runs at the MAMF rate, not above (`best_rate`; FBGEMM's 500 W shapes bear this out: 546-585 TFLOP/s
where the uncapped waves gave 596-599). Float8 GEMMs: the same tiles at the fp8
peak, 1-byte inputs; tensorwise scales (cuBLAS) at the MAMF's efficiency, rowwise scales (CUTLASS's
rowwise kernel) at a measured rowwise GEMM's where the kind gives one; each recipe's casts are
`labkit.scale.float8`'s.

Attention, `attention`: FlashAttention's published TFLOP/s at head dim 128 against sequence length
(FA3 paper, arXiv 2407.08608, figures 5 and 6: FA3, and FA2 on the same H100), log-linear between the
measured lengths, flat beyond them (the causal backward: the backward figure x the forward's
causal / full ratio at that length, as no causal backward is published). FLOPs: forward 4 b h s_q s_kv hd (half with a causal mask),
backward 2.5 x forward (FlashAttention's own count). Without a table (A100 here), `unfused`: two
batched GEMMs and a fused scale-mask-softmax over the b h s_q s_kv scores (Megatron-LM 2021).

Elementwise ops (norms, rotary, SwiGLU, residuals, loss, embedding, optimizer) are memory-bound:
their bytes, per element, are counted below for eager PyTorch as torchtitan writes them (RMSNorm as
x.float(), pow, mean, rsqrt, mul, type_as, x weight; rotary as complex multiplication) and for
torch.compile, modelled as fusion: every elementwise op between two GEMMs becomes one kernel that
reads its inputs and writes its outputs once (no intermediate tensors, no extra launches). FSDP2's copies
around its collectives (`fsdp_copies`, one per gather and reduce-scatter) and the optimizer step (once a step)
are memory-bound too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from labkit.scale.gpu import GPU


@dataclass(frozen=True)
class Op:
    name: str
    kind: str          # "gemm", "attention", "elementwise", "optimizer"
    flops: float
    bytes: float
    kernels: int
    seconds: float     # the GPU's time: max(compute, memory)
    bound: str         # "compute" or "memory": which of the two sets `seconds`
    host_s: float = 0.0  # the CPU's time to issue its kernels

    def scaled(self, name: str | None = None, times: float = 1.0) -> "Op":
        return Op(name or self.name, self.kind, self.flops * times, self.bytes * times,
                  round(self.kernels * times), self.seconds * times, self.bound, self.host_s * times)


def roofline(name: str, kind: str, flops: float, nbytes: float, kernels: int, gpu: GPU,
             compute_s: float | None = None, compile: bool = False) -> Op:
    """An op's GPU time max(compute, memory), which of the two bounds it, and its CPU time: kernels x
    the host's cost per kernel, eager PyTorch's (`eager_op_us`) or under torch.compile the compiled
    code's launch (`launch_us`)."""
    compute = compute_s if compute_s is not None else 0.0
    memory = nbytes / gpu.hbm_bytes_per_s
    seconds = max(compute, memory)
    bound = "compute" if seconds == compute and compute > 0 else "memory"
    return Op(name, kind, flops, nbytes, kernels, seconds, bound, kernels * gpu.host_us(compile) * 1e-6)


def waves(m: int, n: int, tile: tuple, sm_count: int) -> tuple[int, int]:
    """(tiles, waves) of an m x n output cut into `tile`-sized pieces over `sm_count` SMs."""
    tiles = math.ceil(m / tile[0]) * math.ceil(n / tile[1])
    return tiles, math.ceil(tiles / sm_count)


def quantization(m: int, n: int, gpu: GPU) -> float:
    """Useful fraction of the SMs' work for an m x n output, with the best tile: m n / (waves x SMs x tile)."""
    return max(m * n / (waves(m, n, t, gpu.sm_count)[1] * gpu.sm_count * t[0] * t[1]) for t in gpu.gemm_tiles)


def reference_gemm(gpu: GPU, dtype: str = "bf16") -> tuple[float, float, tuple | None]:
    """(TFLOP/s, its peak TFLOP/s, shape) of the measured GEMM the per-SM rate comes from: for "fp8_rowwise" the
    kind's measured rowwise GEMM where it gives one; else the MSMF where it gives one (sustained at the power
    limit: what a training step runs at), else the MAMF. Tensorwise fp8 shares the bf16 reference's efficiency."""
    if dtype == "fp8_rowwise" and gpu.fp8_rowwise_tflops:
        return gpu.fp8_rowwise_tflops, gpu.peak_fp8_tflops, gpu.fp8_rowwise_shape
    if gpu.msmf_tflops:
        return gpu.msmf_tflops, gpu.peak_bf16_tflops, gpu.msmf_shape
    return gpu.mamf_tflops, gpu.peak_bf16_tflops, gpu.mamf_shape


def tile_overhead_s(gpu: GPU) -> float:
    """Seconds one output tile spends outside its k-loop (`gemm_tile_k`: its prologue and epilogue, in bf16
    k-steps of the largest tile; the same time in fp8, whose epilogue writes the same bf16 output)."""
    if not gpu.gemm_tile_k:
        return 0.0
    tm, tn = gpu.gemm_tiles[0]
    return 2.0 * tm * tn * gpu.gemm_tile_k / _per_sm(gpu, "bf16")


def _best_tile(m: int, n: int, gpu: GPU) -> tuple:
    return min(gpu.gemm_tiles, key=lambda t: (waves(m, n, t, gpu.sm_count)[1] * t[0] * t[1], t))


def gemm_efficiency(gpu: GPU, dtype: str = "bf16") -> float:
    """Fraction of the peak one SM reaches inside its k-loop, in a full wave, solved from the reference GEMM
    (`reference_gemm`: MSMF or MAMF, or a measured rowwise fp8 GEMM): its time is the kernel's fixed cost
    (`gemm_kernel_us`) plus its waves, each a tile's k-loop and its prologue and epilogue (`gemm_tile_k`, in the
    bf16 reference's k-steps: solved with it; a rowwise fp8 reference pays that time per tile too). Without
    either figure: the reference / (its peak x its shape's quantization; no shape given: none)."""
    tflops, peak, shape = reference_gemm(gpu, dtype)
    if not shape:
        return tflops / peak
    m, n, k = shape
    tm, tn = _best_tile(m, n, gpu)
    w = waves(m, n, (tm, tn), gpu.sm_count)[1]
    loop_s = 2.0 * m * n * k / (tflops * 1e12) - gpu.gemm_kernel_us * 1e-6
    own = dtype == "fp8_rowwise" and gpu.fp8_rowwise_tflops  # a reference of its own, not the bf16 one
    steps = k if own else k + gpu.gemm_tile_k
    if own:
        loop_s -= w * tile_overhead_s(gpu)
    return w * 2.0 * tm * tn * steps * gpu.sm_count / (peak * 1e12 * loop_s)


@lru_cache(maxsize=64)
def _per_sm(gpu: GPU, dtype: str) -> float:
    return gpu.peak_flops(dtype) * gemm_efficiency(gpu, dtype) / gpu.sm_count * gpu.clock_factor


def best_rate(gpu: GPU, dtype: str = "bf16") -> float:
    """FLOP/s no GEMM of this dtype beats: the reference GEMM's measured rate (the best of its source's sweep),
    at this dtype's peak (fp8 tensorwise: the bf16 reference's x the fp8 / bf16 peaks)."""
    tflops, peak, _ = reference_gemm(gpu, dtype)
    return tflops * gpu.peak_flops(dtype) / peak * gpu.clock_factor


@lru_cache(maxsize=200_000)
def gemm(name: str, m: int, n: int, k: int, gpu: GPU, dtype: str = "bf16", batch: int = 1, compile: bool = False) -> Op:
    """(m x k) @ (k x n), `batch` times in one kernel, in bf16 or fp8 (inputs 1 byte, output bf16).
    An output of fewer tiles than SMs is split along k (split-K, CUTLASS's media/docs/efficient_gemm.md,
    'Parallelized Reductions'): s = min(SMs // tiles, k // 256) slices run side by side, their fp32 partial
    sums written and read back (8 m n s bytes more); the better of split and not."""
    flops = 2.0 * m * n * k * batch
    in_bytes = 1 if dtype in ("fp8", "fp8_rowwise") else 2
    nbytes = batch * (in_bytes * (m * k + k * n) + 2 * m * n)
    per_sm = _per_sm(gpu, dtype)
    cap = best_rate(gpu, dtype)
    tile_s, kernel_s = tile_overhead_s(gpu), gpu.gemm_kernel_us * 1e-6
    best, extra = math.inf, 0.0
    for t in gpu.gemm_tiles:
        tiles = waves(m, n, t, gpu.sm_count)[0] * batch
        for split in {1, max(1, min(gpu.sm_count // tiles, k // 256))}:
            compute = kernel_s + math.ceil(tiles * split / gpu.sm_count) * (
                2.0 * t[0] * t[1] * math.ceil(k / split) / per_sm + tile_s)
            compute = max(compute, flops / cap)  # never faster than the measured best (`best_rate`)
            partials = 8.0 * m * n * batch * split if split > 1 else 0.0
            total = max(compute, (nbytes + partials) / gpu.hbm_bytes_per_s)
            if total < best:
                best, chosen, extra = total, compute, partials
    return roofline(name, "gemm", flops, nbytes + extra, 1, gpu, chosen, compile)


def attention_rate(gpu: GPU, impl: str, kind: str, seq: int) -> float:
    """Published FLOP/s of attention `impl` ("fa2", "fa3") at sequence length `seq`: log-linear between
    the figure's lengths, its end values beyond them; x the kind's `attention_scale` (1 where the
    tables were measured on this kind's own power limit)."""
    if impl not in gpu.attention:
        raise ValueError(f"{gpu.name} has no {impl!r} attention figures (it has {sorted(gpu.attention) or 'none'}): "
                         "use attention='unfused', or add the table to its JSON file")
    points = gpu.attention[impl][kind]
    scale = gpu.attention_scale * gpu.clock_factor * 1e12
    if seq <= points[0][0]:
        return points[0][1] * scale
    for (s0, v0), (s1, v1) in zip(points, points[1:]):
        if seq <= s1:
            w = math.log(seq / s0) / math.log(s1 / s0)
            return (v0 + w * (v1 - v0)) * scale
    return points[-1][1] * scale


@lru_cache(maxsize=200_000)
def attention(direction: str, heads: int, q_len: int, kv_len: int, head_dim: int, causal: bool, gpu: GPU,
              impl: str = "fa2", compile: bool = False) -> Op:
    """Attention of `heads` (batch x heads) sequences, forward or backward, FlashAttention or "unfused"."""
    forward = 4.0 * heads * q_len * kv_len * head_dim * (0.5 if causal else 1.0)
    flops = forward if direction == "forward" else 2.5 * forward
    if impl == "unfused":
        return _unfused(direction, heads, q_len, kv_len, head_dim, gpu, compile)
    kind = "backward" if direction == "backward" else ("forward_causal" if causal else "forward")
    qkv = 2 * heads * head_dim * (2 * q_len + 2 * kv_len)  # q, k, v, out in bf16
    nbytes = qkv if direction == "forward" else 2 * qkv
    rate = attention_rate(gpu, impl, kind, q_len)
    if direction == "backward" and causal:  # no causal backward is published: the forward's causal / full ratio
        rate *= attention_rate(gpu, impl, "forward_causal", q_len) / attention_rate(gpu, impl, "forward", q_len)
    return roofline(f"attention {direction}", "attention", flops, nbytes, 1, gpu, flops / rate, compile)


def _unfused(direction, heads, q_len, kv_len, head_dim, gpu, compile=False) -> Op:
    """Megatron-LM 2021's attention: QK^T and AV as batched GEMMs, a fused scale-mask-softmax (read and
    write the bf16 scores); backward: two GEMMs each, and the softmax's gradient (read 2, write 1)."""
    scores = 2.0 * heads * q_len * kv_len
    times = 1 if direction == "forward" else 2
    qk = gemm("attention QK^T", q_len, kv_len, head_dim, gpu, batch=heads, compile=compile)
    av = gemm("attention AV", q_len, head_dim, kv_len, gpu, batch=heads, compile=compile)
    soft = roofline("softmax", "elementwise", 0, scores * (2 if direction == "forward" else 3), 1, gpu, compile=compile)
    return Op(f"attention {direction} (unfused)", "attention", times * (qk.flops + av.flops),
              times * (qk.bytes + av.bytes) + soft.bytes, 2 * times + 1,
              times * (qk.seconds + av.seconds) + soft.seconds, "compute",
              times * (qk.host_s + av.host_s) + soft.host_s)


def ring_merges(direction: str, out_elements: float, kv_elements: float, cp: int, gpu: GPU,
                compile: bool = False) -> Op:
    """The elementwise work of torch's ring attention around its flash kernels, which torchtitan's CP runs
    (torch/distributed/tensor/experimental/_context_parallel/_attention.py: `_templated_ring_attention`, its
    backward and `_SDPAMerger`, with convert_to_f32 and enable_load_balance at their defaults, True), over this
    rank's output (`out_elements`: b h/tp (s/cp) hd) and its K (`kv_elements`, the same for V); memory-bound,
    not hidden by the ring's transfers (they are the same stream's work). Bytes per element, as the code reads
    and writes them:
      forward, each of the cp - 1 steps after the first: K and V concatenated into the send buffer (read 2,
        write 2, each); the block's output cast to fp32 (2 + 4) and merged, out - sigmoid(lse_b - lse) x
        (out - out_b), three fp32 passes (12 + 8 + 12): 38 on a whole step; on the load-balanced half of the
        steps that update half the rows, half of that plus the concatenation that rebuilds the whole (8):
        32.5 on average; then once, the output back to bf16 (4 + 2); 12 kernels a step, 2 once
      backward, each of the cp steps: dK and dV added into their fp32 accumulators (read 4 + 2, write 4; the
        half-row steps rebuild them by concatenation: 11.5 on average, each), the pair concatenated into the
        fp32 send buffer (4 + 4, each), dQ likewise added (11.5); K and V concatenated (cp - 1 times, as
        forward); once, the three fp32 accumulators zeroed (4) and cast back to bf16 (4 + 2); 6 kernels a
        step, 6 once."""
    o, kv = out_elements, kv_elements
    if direction == "forward":
        nbytes = (cp - 1) * (8 * kv + 32.5 * o) + 6 * o
        kernels = 12 * (cp - 1) + 2
    else:
        nbytes = (cp - 1) * 8 * kv + cp * (2 * (11.5 + 8) * kv + 11.5 * o) + 10 * (o + 2 * kv)
        kernels = 6 * cp + 6
    return roofline(f"ring attention merges {direction}", "elementwise", 0.0, nbytes, kernels, gpu, compile=compile)


def unpadded_attention(direction: str, q_elements: float, kv_elements: float, gpu: GPU) -> Op:
    """What llm-foundry's flash path (attn_impl 'flash': llmfoundry/models/layers/attention.py, flash_attn_fn, at
    5e85bd62d) runs around its kernel, eager, over this rank's q (`q_elements`: T x d / tp) and its K and V (each
    `kv_elements`): flash_attn's bert_padding.unpad_input on each of q, k and v, then pad_input on the output.
      forward: each unpad_input runs mask.sum, torch.nonzero, .max().item(), cumsum, F.pad and a gather of the
        tensor into a new one (read 2, write 2 bytes an element; 7 kernels); pad_input a zeros and an index_put
        (write 2; read 2, write 2). torch.nonzero and .item() each wait for the GPU (two host syncs an unpad_input),
        so from q's nonzero until the attention kernel is launched the GPU runs only what the CPU is issuing: the 18
        kernels launched after that first sync (4 of q's, 7 of k's, 7 of v's) take the host's time on the GPU's
        clock too (eager_op_us each), where elsewhere the CPU's lead hides it
      backward: pad_input's an index of the output's gradient (read 2, write 2); each unpad_input's a zeros and
        a scatter_ into it (write 2; read 2, write 2)
    Memory-bound. The triton path (attn_impl 'triton') indexes nothing: it is not charged this."""
    if direction == "forward":
        nbytes = 4 * (q_elements + 2 * kv_elements) + 6 * q_elements
        kernels, waited = 3 * 7 + 2, 18
    else:
        nbytes = 4 * q_elements + 6 * (q_elements + 2 * kv_elements)
        kernels, waited = 1 + 3 * 2, 0
    op = roofline(f"unpad and pad {direction}", "elementwise", 0.0, nbytes, kernels, gpu)
    waited_s = waited * gpu.eager_op_us * 1e-6
    return Op(op.name, op.kind, 0.0, nbytes, kernels, op.seconds + waited_s, op.bound, op.host_s)


def elementwise(name: str, elements: float, eager: tuple, compiled: tuple, gpu: GPU, compile: bool) -> Op:
    """A memory-bound op over `elements` values: (bytes per element, kernels) eager or compiled."""
    per_element, kernels = compiled if compile else eager
    return roofline(name, "elementwise", 0.0, per_element * elements, kernels, gpu, compile=compile)


# bytes per element and kernels of each elementwise op, (eager, compiled), forward and backward.
# eager RMSNorm (torchtitan's): x.float() 2+4, pow 4+4, mean 4, rsqrt -, x*r 4+4, type_as 4+2, *weight 2+2 = 36
# bytes in 7 kernels; its autograd about twice that. Compiled: read x, write y (4), backward read x and dy,
# write dx (6) plus the weight's gradient reduction. Rotary per q/k element: float 2+4, complex mul 4+4, back 4+2.
# SwiGLU per hidden element: silu(a) 2+2, * b 4+2 = 10 (compiled 6). Residual add 6 (compiled: inside the norm, 2).
# Cross-entropy per logit: float 2+4, log_softmax 4+4, gather - (compiled: read 2, write 4 for the backward).
ELEMENTWISE = {
    "rmsnorm": {"forward": ((36, 7), (4, 1)), "backward": ((72, 12), (6, 2))},
    "rotary": {"forward": ((20, 3), (4, 1)), "backward": ((20, 3), (4, 1))},
    "swiglu": {"forward": ((10, 2), (6, 1)), "backward": ((16, 4), (8, 1))},
    "residual": {"forward": ((6, 1), (2, 0)), "backward": ((6, 1), (2, 0))},
    "cross_entropy": {"forward": ((14, 3), (6, 1)), "backward": ((14, 3), (6, 1))},
    # GPT's GeLU per hidden element: read 2, write 2 (its backward reads x and dy, writes dx); a dropout: read 2,
    # write 2 and a 1-byte mask (backward: read dy and the mask, write dx); fused RMSNorm / SwiGLU kernels
    # (Apex, Transformer Engine, torchtitan's Triton norm): the compiled figures in eager too
    "gelu": {"forward": ((4, 1), (4, 1)), "backward": ((6, 1), (6, 1))},
    "dropout": {"forward": ((5, 1), (5, 1)), "backward": ((5, 1), (5, 1))},
    "rmsnorm_fused": {"forward": ((4, 1), (4, 1)), "backward": ((6, 2), (6, 2))},
    "swiglu_fused": {"forward": ((6, 1), (6, 1)), "backward": ((8, 1), (8, 1))},
    # Megatron-LM's fused bias + dropout + residual add (its JIT kernel): read the sublayer's output and the
    # residual, write the sum and the 1-byte mask (7); backward: the dropout's (read dy and the mask, write dx: 5)
    # and the residual stream's two gradients added (6), as "dropout" and "residual" each count them
    "dropout_add": {"forward": ((7, 1), (7, 1)), "backward": ((11, 2), (11, 2))},
    # Megatron-LM's vocabulary-parallel cross-entropy (megatron/mpu/cross_entropy.py, 6985e58; gpt_model.py casts the
    # logits to fp32 first unless --fp16-lm-cross-entropy) per logit: the cast 2+4, max 4, sub_ 4+4, exp 4+4, sum 4,
    # div_ 4+4 (the softmax saved in place) = 38 in 6 kernels; backward the in-place mul_ 4+4 and the cast back 4+2
    "cross_entropy_megatron": {"forward": ((38, 6), (38, 6)), "backward": ((14, 2), (14, 2))},
}


def ew(op: str, direction: str, elements: float, gpu: GPU, compile: bool, name: str | None = None) -> Op:
    eager, compiled = ELEMENTWISE[op][direction]
    return elementwise(name or op, elements, eager, compiled, gpu, compile)


def optimizer_step(params: float, tensors: int, gpu: GPU, compile: bool = False) -> Op:
    """AdamW over this GPU's `params` fp32 parameters in `tensors` tensors, torch's foreach implementation:
    about 8 passes (lerp, mul, addcmul, sqrt, div, add, addcdiv, weight decay), each reading about two
    fp32 tensors and writing one (12 bytes), plus the gradient norm's read for clipping: 100 bytes per
    parameter; each pass launches one kernel per 36 tensors (multi_tensor_apply's depth-4 limit,
    aten/src/ATen/native/cuda/MultiTensorApply.cuh) or per 320 x 65,536 elements, whichever is more."""
    launches = 9 * max(math.ceil(tensors / 36), math.ceil(params / (320 * 65536)))
    return roofline("optimizer", "optimizer", 0.0, 100.0 * params, launches, gpu, compile=compile)


def fsdp_copies(params: float, units: int, gpu: GPU, value_bytes: int, grad_bytes: int, gathers: int,
                scatters: int, gather_bytes: float | None = None) -> Op:
    """FSDP2's copies on the compute stream around its collectives, per step, for the `params` parameters this
    GPU holds unsharded, gathered in `units` groups (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py):
      each all-gather's copy-out, `foreach_all_gather_copy_out`: split_with_sizes_copy from the gathered
        buffer into the parameters, on the current stream once it has waited for the all-gather's event:
        reads and writes value_bytes P, `gathers` times a step;
      each reduce-scatter's copy-in, `foreach_reduce` -> `foreach_reduce_scatter_copy_in`: chunk_cat of the
        unsharded gradients into one buffer of the reduce dtype, on the current stream (the reduce-scatter
        stream waits for it): reads value_bytes P, writes grad_bytes P, `scatters` times.
    Memory-bound, one kernel per unit and call, launched by FSDP's hooks (eager). The all-gather's copy-in runs
    on its own stream (all_gather_copy_in_stream) beside the compute, and is not counted here. gather_bytes: what
    the all-gathers move per parameter where it is not value_bytes (float8.fsdp_gather_bytes), which the copy-out
    reads and writes. FSDP1 (`Layout.zero3_unit="flat"`, torch/distributed/fsdp/_runtime_utils.py) is called with
    gathers=0: its all-gather writes the flat parameter whose views the block reads, and only its gradient is cast
    to the reduce dtype before each reduce-scatter (`_post_backward_hook`)."""
    moved = value_bytes if gather_bytes is None else gather_bytes
    nbytes = (gathers * 2 * moved + scatters * (value_bytes + grad_bytes)) * params
    return roofline("fsdp copies", "elementwise", 0.0, nbytes, (gathers + scatters) * units, gpu)
