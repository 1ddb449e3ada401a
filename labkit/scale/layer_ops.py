"""The ops of one micro-batch on one GPU, at their shapes after TP, CP and SP, timed by `labkit.scale.kernels`.

Shapes, per micro-batch and GPU: T = mb x s / cp tokens enter the GEMMs (TP's all-gather has made
the sequence whole; Ulysses swaps sequence for heads, so its attention sees the whole s and h/cp
heads); the elementwise ops between GEMMs see T / tp rows with sequence parallelism (SP). A
linear layer Y = X W with X (T x k), W (k x n) runs forward gemm(T, n, k), backward its input's
gradient gemm(T, k, n) and its weight's gemm(k, n, T). Per block (torchtitan's Llama, 3 separate
projections wq, wk, wv; Megatron fuses them, the same FLOPs):
    forward   norm, wq (n = d/tp), wk and wv (n = kv_dim/tp), rotary, attention, wo (k = d/tp), residual,
              norm, w1 and w3 (n = H/tp), SwiGLU, w2 (k = H/tp), residual; MoE: a router GEMM (n = E) and
              the local experts' GEMMs as one grouped GEMM of the T top_k ep / E rows each receives
              (ep folded over tp, `Layout.ep_over_tp`: whole experts, n = H, on T top_k ep / (E tp) rows)
    backward  the same in reverse (two GEMMs per linear, attention's backward), plus the recomputed
              forward ops of the recompute policy (`RECOMPUTED`)
The first stage adds the embedding (a gather forward, a scatter-add into fp32 backward), the last
the final norm, the head GEMM (n = V/tp, vocabulary-parallel) and the cross-entropy. Float8
(torchao's dynamic scaling, as torchtitan's float8 rows): every block linear (not the head) in fp8, its
operands cast as the recipe does (tensorwise or rowwise: `float8.float8_casts`).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from labkit.scale import float8 as F8
from labkit.scale import kernels as K
from labkit.scale.cp_traffic import cp_kv_heads

# forward ops each recompute policy runs again in backward (names as in `block_ops`)
_ELEMENTWISE_FORWARD = {"norm1", "norm2", "rotary", "swiglu", "residual1", "residual2"}
RECOMPUTED = {
    "none": frozenset(),
    # torchtitan's op policy: the outputs of every other matmul kept (wq, wv, w1, w2) and attention's
    "selective-op": frozenset({"wk", "wo", "w3"} | _ELEMENTWISE_FORWARD),
    # Megatron-LM's selective recomputation (Korthikanti et al. 2022): the attention core only
    "selective-attn": frozenset({"attention"}),
    "full": None,  # every forward op of the block
}
RECOMPUTED["selective"] = RECOMPUTED["selective-op"]  # torchtitan's name for its op policy


@dataclass(frozen=True)
class Shape:
    """What sets one GPU's op shapes: micro-batch sequences, sequence length, and the parallel degrees."""
    micro_batch: int
    seq_len: int
    tp: int = 1
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = True
    cp_method: str = "ring"
    expert_tp: int = 0  # the tp ranks an expert is split over (Layout.expert_tp); 0: tp
    cp_local: int = 1  # cp ranks inside one node (Layout.cp_local): the hybrid's Ulysses group, its ring across them


@dataclass(frozen=True)
class Options:
    """How the kernels run: torch.compile's fusion, float8 GEMMs, the attention kernel, the recompute policy,
    and whether FSDP all-gathers the float8 linears' weights already in float8 (their casts: float8.counted_bytes)."""
    compile: bool = False
    float8: bool | str = False  # True or "tensorwise", "rowwise": torchao's recipes (float8.FLOAT8_CASTS)
    attention: str = "fa2"
    recompute: str = "none"
    float8_all_gather: bool = False
    compiled_loss: bool | None = None  # the loss function compiled (None: as compile)


def recomputed(policy: str) -> frozenset | None:
    if policy not in RECOMPUTED:
        raise ValueError(f"recompute={policy!r} is not a policy the kernel model knows: choose one of {sorted(RECOMPUTED)}")
    return RECOMPUTED[policy]


def float8_recipe(float8) -> str | None:
    """Options.float8 as a recipe: False/None -> None (bf16), True -> "tensorwise", or the recipe named."""
    if not float8:
        return None
    recipe = "tensorwise" if float8 is True else float8
    if recipe not in F8.FLOAT8_RECIPES:
        raise ValueError(f"float8={float8!r} is not a recipe the kernel model knows: choose one of {F8.FLOAT8_RECIPES}")
    return recipe


def _linear(name, rows, n, k, gpu, opts, fp8_ok=True):
    """Forward and backward ops of a linear layer on `rows` rows: Y (rows x n) = X (rows x k) W (k x n)."""
    recipe = float8_recipe(opts.float8) if fp8_ok else None
    dtype = {None: "bf16", "tensorwise": "fp8", "rowwise": "fp8_rowwise"}[recipe]
    c = opts.compile
    fwd = [K.gemm(name, rows, n, k, gpu, dtype, compile=c)]
    bwd = [K.gemm(f"{name} dgrad", rows, k, n, gpu, dtype, compile=c),
           K.gemm(f"{name} wgrad", k, n, rows, gpu, dtype, compile=c)]
    if recipe:
        cast_f, cast_b = F8.float8_casts(name, recipe, rows, k, n, gpu, c, opts.float8_all_gather)
        fwd.append(cast_f)
        bwd.append(cast_b)
    return fwd, bwd


@lru_cache(maxsize=50_000)
def block_ops(model, shape: Shape, opts: Options, gpu) -> dict:
    """{"forward": [Op], "backward": [Op]} of one block for one micro-batch (backward includes the recompute)."""
    m, s = model, shape
    d, hd = m.d_model, m.d_model // m.n_heads
    T = s.micro_batch * s.seq_len // s.cp
    rows_sp = T // s.tp if s.sequence_parallel else T
    fwd, bwd = {}, {}

    def add(name, pair):
        fwd[name], bwd[name] = pair

    def ew(name, op, elements):
        add(name, ([K.ew(op, "forward", elements, gpu, opts.compile, name)],
                   [K.ew(op, "backward", elements, gpu, opts.compile, name)]))

    fused = getattr(m, "fused_kernels", False)  # a fused RMSNorm and SwiGLU: compiled-like bytes, one kernel
    megatron = getattr(m, "megatron_fusions", False)  # Megatron-LM's GPT kernels (specs' docstring)
    # Apex's FusedLayerNorm and torch's LayerNorm (one kernel a pass): the bytes of a fused RMSNorm
    norm = "rmsnorm_fused" if fused or megatron or m.norm == "layernorm" else "rmsnorm"
    # Megatron's bias + dropout + residual add, one kernel: the sublayer outputs' dropouts live in the residuals
    residual = "dropout_add" if megatron and getattr(m, "dropout", False) else "residual"
    ew("norm1", norm, rows_sp * d)
    add("wq", _linear("wq", T, d // s.tp, d, gpu, opts))
    add("wk", _linear("wk", T, m.kv_dim // s.tp, d, gpu, opts))
    add("wv", _linear("wv", T, m.kv_dim // s.tp, d, gpu, opts))
    if not megatron and m.positions == "rotary":  # learned positions (GPT's, MPT's) are added once, to the embedding
        ew("rotary", "rotary", T * (d + m.kv_dim) // s.tp)
    heads = s.micro_batch * m.n_heads // s.tp
    if s.cp > 1 and s.cp_method == "ulysses":
        heads, q_len = heads // s.cp, s.seq_len  # every position, 1/cp of the heads
    else:
        q_len = s.seq_len // s.cp  # this rank's positions against every key (the ring's, the gather's, the hybrid's)
    impl = "unfused" if getattr(m, "attention", "flash") == "materialized" else opts.attention
    if getattr(m, "unpadded_attention", False):  # llm-foundry's flash path: unpad q, k, v, pad the output
        q_el, kv_el = heads * q_len * hd, s.micro_batch * (m.attention_kv_heads // s.tp) * q_len * hd
        add("unpad", ([K.unpadded_attention("forward", q_el, kv_el, gpu)],
                      [K.unpadded_attention("backward", q_el, kv_el, gpu)]))
    add("attention", ([K.attention("forward", heads, q_len, s.seq_len, hd, True, gpu, impl, opts.compile)],
                      [K.attention("backward", heads, q_len, s.seq_len, hd, True, gpu, impl, opts.compile)]))
    # the ring's merges of partial outputs and its send buffers (kernels.ring_merges): the ring's cp ranks, or the
    # hybrid's ring across cp / cp_local node groups (each rank then holds heads / cp_local of l x the positions:
    # the same elements), over the K/V heads as the method holds them (cp_traffic.cp_kv_heads)
    ring = {"ring": s.cp, "hybrid": s.cp // max(1, s.cp_local)}.get(s.cp_method, 1)
    if ring > 1:
        kv_heads = cp_kv_heads(s.cp_method, m.attention_kv_heads // s.tp, s.cp, s.cp_local)
        out, kv = heads * q_len * hd, s.micro_batch * kv_heads * q_len * hd
        fwd["attention"].append(K.ring_merges("forward", out, kv, ring, gpu, opts.compile))
        bwd["attention"].append(K.ring_merges("backward", out, kv, ring, gpu, opts.compile))
    add("wo", _linear("wo", T, d, d // s.tp, gpu, opts))
    ew("residual1", residual, rows_sp * d)
    ew("norm2", norm, rows_sp * d)
    mlp = getattr(m, "mlp", "swiglu")
    if m.n_experts:
        add("router", _linear("router", T, m.n_experts, d, gpu, opts, fp8_ok=False))
        local = max(1, m.n_experts // s.ep)
        etp = s.expert_tp or s.tp
        # split experts (etp = tp) see the tp group's T tokens; whole ones (ep folded over tp) each tp rank's T / tp
        rows = max(1, T // (s.tp // etp) * m.top_k * s.ep // m.n_experts)
        hid = m.hidden_dim // etp
        pairs = [_linear(n, rows, width, k, gpu, opts) for n, width, k in
                 (("w1", hid, d), ("w3", hid, d), ("w2", d, hid))]
        for name, (f, b) in zip(("w1", "w3", "w2"), pairs):
            add(name, ([o.scaled(times=local) for o in f], [o.scaled(times=local) for o in b]))
        ew("swiglu", "swiglu", rows * local * hid)
    elif mlp == "gelu":  # GPT's MLP: d x H, GeLU, H x d
        add("w1", _linear("w1", T, m.hidden_dim // s.tp, d, gpu, opts))
        ew("gelu", "gelu", T * m.hidden_dim // s.tp)
        add("w2", _linear("w2", T, d, m.hidden_dim // s.tp, gpu, opts))
    else:
        add("w1", _linear("w1", T, m.hidden_dim // s.tp, d, gpu, opts))
        add("w3", _linear("w3", T, m.hidden_dim // s.tp, d, gpu, opts))
        ew("swiglu", "swiglu_fused" if fused else "swiglu", T * m.hidden_dim // s.tp)
        add("w2", _linear("w2", T, d, m.hidden_dim // s.tp, gpu, opts))
    if getattr(m, "dropout", False):  # GPT's dropouts: on the attention scores and after each sublayer's output
        outputs = 0 if residual == "dropout_add" else 2 * rows_sp * d  # fused into the residual adds
        ew("dropout", "dropout", heads * q_len * s.seq_len + outputs)
    ew("residual2", residual, rows_sp * d)
    again = recomputed(opts.recompute)
    again = set(fwd) if again is None else again
    forward = [op for name in fwd for op in fwd[name]]
    backward = [op for name in reversed(list(bwd)) for op in bwd[name]]
    recompute = [op for name in fwd if name in again for op in fwd[name]]
    return {"forward": forward, "backward": recompute + backward, "recompute": recompute}



@lru_cache(maxsize=50_000)
def end_ops(model, shape: Shape, opts: Options, gpu, which: str) -> dict:
    """The first stage's embedding ("embedding") or the last stage's norm, head and loss ("head")."""
    m, s = model, shape
    T = s.micro_batch * s.seq_len // s.cp
    rows_sp = T // s.tp if s.sequence_parallel else T
    if which == "embedding":
        gather = K.roofline("embedding", "elementwise", 0.0, 4.0 * rows_sp * m.d_model, 1, gpu, compile=opts.compile)
        scatter = K.roofline("embedding grad", "elementwise", 0.0,
                             6.0 * rows_sp * m.d_model + 4.0 * m.vocab_size * m.d_model / s.tp, 3, gpu,
                             compile=opts.compile)
        return {"forward": [gather], "backward": [scatter]}
    final = "rmsnorm_fused" if m.norm == "layernorm" else "rmsnorm"  # as the blocks' norms (block_ops)
    norm_f = K.ew(final, "forward", rows_sp * m.d_model, gpu, opts.compile, "final norm")
    norm_b = K.ew(final, "backward", rows_sp * m.d_model, gpu, opts.compile, "final norm")
    head_f, head_b = _linear("head", T, m.vocab_size // s.tp, m.d_model, gpu, opts, fp8_ok=False)
    loss = T * m.vocab_size // s.tp
    fused = opts.compile if opts.compiled_loss is None else opts.compiled_loss
    ce = "cross_entropy_megatron" if getattr(m, "megatron_fusions", False) else "cross_entropy"
    return {"forward": [norm_f, *head_f, K.ew(ce, "forward", loss, gpu, fused, "loss")],
            "backward": [K.ew(ce, "backward", loss, gpu, fused, "loss"), *head_b, norm_b]}


def seconds(ops) -> float:
    """A stretch of ops issued back to back: max(the GPU's time, the CPU's time to issue them)
    (labkit.scale.kernels' docstring: the CPU's lead during long ops pays for the short ones)."""
    ops = list(ops)
    return max(sum(op.seconds for op in ops), sum(op.host_s for op in ops))


def by_bound(ops) -> dict:
    """The stretch's seconds by what bounds them: the GPU's compute- and memory-bound ops, and
    "launch", the time the GPU waits for the CPU (max(0, CPU time - GPU time)); they sum to seconds(ops)."""
    out = {"compute": 0.0, "memory": 0.0, "launch": 0.0}
    for op in ops:
        out[op.bound] += op.seconds
    out["launch"] = max(0.0, sum(op.host_s for op in ops) - out["compute"] - out["memory"])
    return out


def step_kernels(model, gpu, micro_batch: int, seq_len: int) -> dict:
    """One eager step of `model` on one GPU (no parallelism, no recompute), as this module counts it: its kernels
    (the blocks' forward and backward, the embedding, the final norm, head and loss, the optimizer), their CPU
    time (kernels x eager_op_us) and their GPU time. What a profiler counts on a real step can be set beside
    it (bench/gpu_check.py's predict row): a launch-bound step's time is its kernel count x the cost of one."""
    shape = Shape(micro_batch, seq_len, sequence_parallel=False)
    opts = Options(attention="fa2" if "fa2" in gpu.attention else "unfused")
    blk = block_ops(model, shape, opts, gpu)
    ends = [end_ops(model, shape, opts, gpu, which) for which in ("embedding", "head")]
    ops = (blk["forward"] + blk["backward"]) * model.n_layers + [o for e in ends for o in e["forward"] + e["backward"]]
    ops.append(K.optimizer_step(model.n_params, 9 * model.n_layers + 3, gpu))
    return {"kernels": sum(o.kernels for o in ops), "host_s": sum(o.host_s for o in ops),
            "gpu_s": sum(o.seconds for o in ops)}
