"""Peak memory per GPU of a layout: model states, gathered layers, activations, logits (notebook 15).

    model states   labkit.measure.memory.memory_per_rank (the ZeRO paper's formulas) for the parameters
                   this GPU's stage and tp shard hold, sharded over dp x cp (experts, 1/(expert_tp x ep)
                   of them, over the `Layout.efsdp` ranks that replicate them: dp x cp / ep, or
                   dp x cp x tp / ep with ep folded over tp); under HSDP over the shard group
                   only, dp_shard x cp (experts: efsdp), each replica holding a full copy. ZeRO-3 is FSDP2's mixed precision,
                   as torchtitan runs it: fp32 parameters, gradients and Adam moments, all
                   sharded (labkit.measure.memory's "fp32": 4 + 4 + 8 bytes); the other stages keep
                   Megatron's bf16 parameters and gradients with fp32 master + moments
                   ("mixed": 2 + 2 + 12).
    gathered       ZeRO-3 only: the layer being computed and the prefetched next one in bf16
                   (2 x 2 bytes/param), plus that layer's unsharded gradient in bf16 and its
                   fp32 copy for the reduce-scatter (2 + 4): 10 bytes x the larger of a block
                   (its experts / (expert_tp x ep)) and the head, / tp. Under PP, FSDP keeps the whole stage gathered across
                   its micro-batches, as torchtitan does (reshard_after_forward=False, the
                   gradient accumulated unsharded in fp32): 6 bytes x the stage's parameters.
                   DeepSpeed's ZeRO-3 (`Layout.zero3_unit="module"`) gathers one weight-holding
                   submodule at a time, not a block: `deepspeed_gathered_bytes`.
    activations    bytes a block saves for backward for one micro-batch (bf16), x the blocks
                   of the stage, x the micro-batches in flight (1F1B: stage i holds pp - i;
                   stage 0 the most), see `block_activation_bytes`.
    backward       the peak of one block's backward beyond the activations it saved or rebuilt: the gradient
                   flowing in (b s d / sp) and the larger of two moments, on every stage that holds a block:
                   the MLP's gradients at their peak (`mlp_backward_elements`, bf16), and under the CP ring,
                   torch's ring attention backward at its peak with the attention output's gradient beside
                   it (`ring_backward_bytes`), less the block's MLP activations, freed by then.
    logits         on the last stage, the loss of one micro-batch: the fp32 log-softmax output
                   saved for backward, its gradient and the gradient of its input: 12 bytes per
                   logit, / (tp x cp) (torchtitan computes the loss vocabulary-parallel); a compiled loss
                   (torchtitan compiles its loss function with --training.compile from e10cb94, 2024-10-22, off
                   from e8977b0, 2024-12-18, 'compiling loss function causes CUDA errors', so in 9dec370's runs, on
                   again from bbb1b61, 2025-04-02, components/loss.py) fuses the cast and the log-softmax: it keeps
                   the head's bf16 output for its backward and writes a bf16 gradient, 4 bytes per logit; Megatron-
                   LM's (GPT models with megatron_fusions) computes the softmax and its gradient in place in the fp32
                   logits, 6 bytes with the fp16 logits or gradient beside them (`MEGATRON_LOGIT_BYTES`); Llama-shaped
                   models also the head's saved input, b s d / cp in bf16 (torchtitan all-gathers it
                   under SP: ColwiseParallel(input_layouts=Shard(1))).
The total adds every part at its own peak, though the loss's logits are freed before the blocks' backward begins:
an upper bound on the tensors alive at once, by min(logits, rebuilt + backward). Against torch's peak reserved
figures it is the closer one (torchtitan's 18 published rows: 17 within 15% summed, 15 with the two moments
apart, 2026-11-28): the allocator keeps the loss's freed segments, and its fragmentation is not modelled.
Not counted here: what the GPU holds beyond these tensors, labkit.scale.reserve (the cuBLAS workspace in its
allocator segment, the CUDA context, NCCL's buffers; `predict` says a layout fits only with it), the allocator's
fragmentation (published "reserved" figures include it; a run near the limit sets expandable segments to
shrink it) and the attention kernels' own workspace (FlashAttention-2's backward accumulates dq in fp32 inside
the call). A prediction that fits within a few GiB of the GPU's memory is therefore a close call, not a promise.
"""
from __future__ import annotations

from labkit.measure.memory import memory_per_rank
from labkit.scale.cp_traffic import KV_ROTATIONS, cp_kv_heads

BF16 = 2
LOGIT_BYTES = 12
COMPILED_LOGIT_BYTES = 4
MEGATRON_LOGIT_BYTES = 6  # its vocabulary-parallel loss: the fp32 logits turned into the softmax and its gradient in
# place (4), beside the fp16 logits until the cast is done, and the fp16 gradient after (2): kernels.ELEMENTWISE


def korthikanti_layer_bytes(model, layout, micro_batch: int, seq_len: int) -> dict:
    """Bytes one GPT-shaped block (`attention="materialized"`, dropout, GeLU 4h) keeps for backward,
    element by element as Korthikanti et al. 2022 (arXiv 2205.05198) sec. 4.1 count them (2-byte
    activations, 1-byte dropout masks), s tokens (s / cp per rank), b sequences, width h, a heads, TP t:
        not split by TP (SP splits them by t):  the two LayerNorms' inputs 2 x 2sbh, the QKV and the
            MLP matmuls' inputs 2 x 2sbh, the two dropout masks after attention and MLP 2 x sbh   (10 sbh)
        split by TP:  Q, K 4sbh, V 2sbh, the output projection's input 2sbh, GeLU's input 8sbh and the
            second matmul's input 8sbh  (24 sbh);  the attention core: softmax output 2as^2b, its
            dropout mask as^2b and output 2as^2b  (5 a s^2 b)
    so 34 sbh + 5 a s^2 b without parallelism, sbh (10 + 24/t + 5as/(ht)) with TP, sbh/t (34 + 5as/h)
    with TP and SP, 34 sbh / t with SP and "selective-attn" (the core's 5as^2b/t rebuilt in backward),
    2 sbh (/ t with SP) with "full" (the block's input). Returns {"saved", "rebuilt"} like
    `block_activation_bytes`. Under CP the queries are s / cp and the scores s / cp x s.
    """
    t, cp = layout.tp, layout.cp
    sp = t if layout.sequence_parallel else 1
    b, s, h, a = micro_batch, seq_len // cp, model.d_model, model.n_heads
    sbh = s * b * h
    replicated = 10 * sbh / sp
    split = 24 * sbh / t
    core = 5 * a * s * seq_len * b / t
    everything = replicated + split + core
    recompute = layout.recompute
    if recompute == "none":
        return {"saved": everything, "rebuilt": 0.0}
    if recompute == "selective-attn":
        return {"saved": replicated + split, "rebuilt": core}
    if recompute == "full":
        return {"saved": 2 * sbh / sp, "rebuilt": everything}
    raise ValueError(f"recompute={recompute!r}: torchtitan's op policy is defined for its Llama blocks; for "
                     f"{model.name} (GPT-shaped) use 'none', 'selective-attn' or 'full'")


def block_activation_bytes(model, layout, micro_batch: int, seq_len: int, cp_local: int = 1) -> dict:
    """Bytes one block keeps for backward, for one micro-batch: {"saved", "rebuilt", "mlp"}.

    "saved" lives from the block's forward to its backward; "rebuilt" exists during the
    block's backward only (with recompute); "mlp": of both, the MLP sublayer's (its norm, its SwiGLU,
    its SP-gathered input), which its backward frees before the attention's backward begins (0 for GPT-shaped
    models, which have no ring moment). GPT-shaped models (materialized attention): `korthikanti_layer_bytes`.
    Llama-shaped ones (flash attention), elements per layer, with b sequences of s tokens, width d, a heads, KV
    width d_kv, MLP width H (labkit.measure.activations' table, with grouped-query attention: k and v are d_kv
    wide):
        norms          2 x (3 b s d + b s)
        attention      q b s d, k and v 2 b s d_kv, output b s d, log-sum-exp a b s
        wo input       b s d
        SwiGLU         4 b s H  (x top_k for MoE: each token's activations in its k experts); GeLU 2 b s H
    With `model.fused_kernels` a norm saves b s d + b s and SwiGLU 3 b s H (specs' docstring); torch's LayerNorm
    (`model.norm="layernorm"`) saves b s d + b s too.
    TP splits the heads and H; with sequence parallelism also the norms. CP splits s; by
    `layout.cp_method`: "allgather" (Llama 3) also holds the other cp - 1 ranks' K and V,
    2 b (cp - 1) s d_kv / tp, as attention's saved input; "ulysses" holds the whole sequence
    (cp s) for heads / cp heads, the same count as the ring's except the K/V heads, replicated
    to lcm(n_kv / tp, cp) under GQA (labkit.scale.cp_traffic.cp_kv_heads), the hybrid the same
    with `cp_local` ranks; the ring holds its own k, v only.
    Recompute "full" keeps the block's input only (b s d); "selective-op" keeps the block's input,
    the outputs of wq, wv, attention (and its log-sum-exp), w1 and w2; "selective-attn" keeps all
    but the attention core's output and log-sum-exp (b s d + a b s, / tp), which backward rebuilds.
    """
    if model.attention == "materialized":
        return dict(korthikanti_layer_bytes(model, layout, micro_batch, seq_len), mlp=0.0)  # no ring moment
    m, tp, cp = model, layout.tp, layout.cp
    b, s, d, dkv, a = micro_batch, seq_len // cp, m.d_model, m.kv_dim, m.n_heads
    h = m.hidden_dim * (m.top_k if m.n_experts else 1)
    sp = tp if layout.sequence_parallel else 1
    # a fused RMSNorm and torch's LayerNorm (one kernel) save the input and the per-row statistics; eager RMSNorm 3
    norms = 2 * ((1 if m.fused_kernels or m.norm == "layernorm" else 3) * b * s * d + b * s) / sp
    # SwiGLU: w1's and w3's outputs, silu's, their product (fused: silu rebuilt inside); GeLU: w1's output, GeLU's
    mlp = (2 if m.mlp == "gelu" else 3 if m.fused_kernels else 4) * b * s * h / tp
    # k and v as attention saves them: this tp rank's K/V heads (replicated for the all-to-alls under GQA)
    kv_held = 2 * b * s * (d // a) * cp_kv_heads(layout.cp_method, m.attention_kv_heads // tp, cp, cp_local)
    gathered = 2 * b * (cp - 1) * s * dkv / tp if cp > 1 and layout.cp_method == "allgather" else 0.0
    attention = (2 * b * s * d + a * b * s) / tp + kv_held + gathered + b * s * d / tp
    # torchtitan's SP all-gathers each sublayer's input (PrepareModuleInput: Shard(1) -> Replicate()) and its
    # column-parallel linears save that whole tensor: 2 b s d more (Megatron's SP keeps the shard: sp_saves_shard)
    sp_inputs = 2 * b * s * d if sp > 1 and not m.sp_saves_shard else 0.0
    everything = norms + attention + mlp + sp_inputs
    block_input = b * s * d / sp
    if layout.recompute == "none":
        saved, rebuilt = everything, 0.0
    elif layout.recompute == "full":
        saved, rebuilt = block_input, everything
    elif layout.recompute == "selective-attn":
        rebuilt = (b * s * d + a * b * s) / tp
        saved = everything - rebuilt
    else:  # the op policy recomputes the all-gathers (torchtitan saves reduce-scatters only): sp_inputs rebuilt
        saved = block_input + (2 * b * s * d + b * s * dkv + a * b * s) / tp + b * s * h / tp + b * s * d / sp \
            + gathered
        rebuilt = everything - saved
    return {"saved": BF16 * saved, "rebuilt": BF16 * max(rebuilt, 0.0), "mlp": BF16 * (norms / 2 + mlp + sp_inputs / 2)}


# DeepSpeed's ZeRO-3 defaults (deepspeed/runtime/zero/config.py, DeepSpeedZeroConfig): the gradient bucket
# `reduce_bucket_size` = 5e8 elements; `stage3_prefetch_bucket_size` = 5e7 elements, smaller than a large
# model's one weight, so the prefetch runs one submodule ahead.
DS_REDUCE_BUCKET = 5e8


def deepspeed_gathered_bytes(model, layout) -> float:
    """What DeepSpeed's ZeRO-3 holds unsharded at its peak, per GPU: the weight being computed and the next one,
    prefetched, in 16 bits (2 + 2 bytes), that weight's unsharded 16-bit gradient before its reduce-scatter (2),
    all of the largest weight (/ tp: the MLP's d x H, wq's d x d, the embedding's V x d), plus the gradient bucket
    (2 bytes x DS_REDUCE_BUCKET). FSDP2 gathers a whole block instead (`stage_memory`)."""
    m = model
    largest = max(m.d_model * m.hidden_dim, m.d_model * m.d_model, m.vocab_size * m.d_model) / layout.tp
    return 6 * largest + 2 * DS_REDUCE_BUCKET


def mlp_backward_elements(b: int, s: int, d: int, hidden: int, tp: int = 1, gated: bool = True) -> int:
    """Elements an MLP's backward holds at its peak beyond what it saved and the gradient flowing in, b s tokens,
    width d, hidden width H' = hidden / tp, measured op by op on labkit.model's SwiGLU and on a GELU MLP
    (labkit.measure.activations.LiveBytes, tests/test_scale_memory.py). Two moments can be the peak:
        the gate     the second matmul's input gradient (b s H'), then SwiGLU's two input gradients (2 b s H'),
                     once the second matmul's saved input is freed: 2 b s H' (GELU: its one, b s H')
        the input    the first matmuls' input gradients and their sum, each the whole width d (TP: of the gathered
                     input, before SP's reduce-scatter), once the gate's gradients and saved tensors are freed:
                     3 b s d - 4 b s H' (GELU: one gradient, b s d - b s H')
    Llama's widths (H = 3.5 d) peak at the gate up to tp 4 and at the input from tp 8. Not counted: elementwise
    temporaries of unfused norms, which can peak higher where H' is small (eager RMSNorm: about 2 b s d), and
    compiled code that sums the input gradients in place (b s d less)."""
    hp = -(-hidden // tp)
    per_token = max(2 * hp, 3 * d - 4 * hp) if gated else max(hp, d - hp)
    return b * s * per_token


def ring_backward_bytes(q_elements: float, kv_elements: float, cp: int, rotation: str) -> float:
    """Bytes torch's ring attention backward holds at its peak beyond its inputs, on the last cp rank: torch's
    `_templated_ring_attention_backward` (torch/distributed/tensor/experimental/_context_parallel/_attention.py,
    read in torch 2.13; torchtitan's CP calls it, causal, with its default load balancing), q_elements of this
    rank's q (and of its output gradient), kv_elements of its k and of its v each. At the moment the last cp rank
    sends its summed dK, dV on from its second step:
        6 q        the fp32 dq accumulator (4) and the step's bf16 dq (2)
        38 kv      the dK, dV received from the step before, fp32 (8); this step's K, V concatenated to send on,
                   bf16 (4: made at every step, also where nothing is sent); the step's bf16 dK, dV on half the
                   chunk (2: load balancing's first half); the load balancing's fp32 copies of dK and dV with
                   that half added (`_partial_update`'s cat: 8); the dK, dV concatenated to send on (8) and
                   the all-to-all's output receiving the next ones (8)
        the K, V arriving, bf16: "allgather" (torchtitan's rotate method: one all-gather of every rank's K
                   and V, kept for the whole loop) 4 cp kv; "p2p" (torch's all-to-all rotater) the K, V
                   being used and those in flight, 8 kv (4 at cp = 2: one rotation, nothing in flight).
    Measured op by op with labkit.measure.activations.LiveBytes around torch's own function, run as each rank of
    torch's fake process group in turn, the attention kernel replaced by one that returns its outputs' shapes
    (tests/test_scale_ring_memory.py): exact on the last rank at cp 2, 3, 4 and 8 where K, V are as wide as q
    (torchtitan's repeated heads) or half as wide; a rank before the last may add the logsumexp half it copies
    (1 / (2 dh) byte per q element). Narrower K, V (GQA's 1/4 unrepeated) peak at another moment, by up to
    1.625 bytes per q element more. Not counted: the attention kernel's own workspace (module docstring)."""
    if rotation not in KV_ROTATIONS:
        raise ValueError(f"rotation={rotation!r}: torch's ring rotates K/V by 'allgather' or 'p2p'")
    arriving = 4 * cp if rotation == "allgather" else (4 if cp == 2 else 8)
    return 6 * q_elements + (38 + arriving) * kv_elements


def stage_params(model, layout, first: bool, last: bool, layers: int | None = None) -> tuple[int, int]:
    """(dense, expert) parameters one GPU of a pipeline rank holds before ZeRO: its blocks (`layers`;
    None: the busiest rank's), the embedding if first, the head if last, / tp; experts / (expert_tp x ep)."""
    m = model
    layers = layout.layers_per_rank(m.n_layers) if layers is None else layers
    dense = layers * m.layer_dense_params + first * m.embedding_params + last * m.stage_head_params(first)
    experts = layers * m.expert_params * m.n_experts
    return -(-dense // layout.tp), -(-experts // (layout.expert_tp * layout.ep))


def _states(model, layout, first: bool, last: bool, layers: int) -> dict:
    """labkit.measure.memory's model states for one GPU of a stage."""
    dense, experts = stage_params(model, layout, first, last, layers)
    precision = "fp32" if layout.zero == "zero3" else "mixed"
    shard_over = layout.dp_shard * layout.cp  # dp x cp without HSDP (dp_replicate = 1)
    out = memory_per_rank(dense, shard_over, layout.zero, precision)
    if experts:
        extra = memory_per_rank(experts, layout.efsdp, layout.zero, precision)  # an expert's replicas
        out = {k: out[k] + extra[k] for k in out}
    return out


def stage_memory(model, layout, stage: int, n_micro: int, seq_len: int, cp_local: int = 1,
                 compiled_loss: bool = False) -> dict:
    """Peak bytes of a GPU of pipeline rank `stage` (its blocks: `layout.rank_layers`), by part, and
    their "total"; compiled_loss: the loss function runs compiled (the module docstring's logits)."""
    m, pp = model, layout.pp
    first, last = stage == 0, stage == pp - 1
    layers = layout.rank_layers(m.n_layers)[stage]
    states = _states(model, layout, first, last, layers)
    out = {"params": states["params"], "grads": states["grads"], "optimizer": states["optimizer"]}
    gathered = 0.0
    if layout.zero == "zero3" and pp > 1:
        # FSDP inside a pipeline (torchtitan): the stage stays gathered over all its micro-batches
        # (reshard_after_forward=False) and accumulates its unsharded gradient in fp32: 2 + 4 bytes
        gathered = 6 * sum(stage_params(model, layout, first, last, layers))
    elif layout.zero == "zero3" and layout.zero3_unit == "module":
        gathered = deepspeed_gathered_bytes(model, layout)
    elif layout.zero == "zero3":
        block = m.layer_dense_params / layout.tp + m.expert_params * m.n_experts / (layout.expert_tp * layout.ep)
        ends = max(last * m.stage_head_params(first), first * m.embedding_params) / layout.tp
        gathered = 10 * max(block, ends)
    out["gathered"] = gathered
    act = block_activation_bytes(model, layout, layout.micro_batch, seq_len, cp_local)
    in_flight = min(n_micro, pp - stage) if pp > 1 else 1
    if layout.schedule == "interleaved" and pp > 1:
        # Narayanan et al. 2021: interleaving holds (1 + (p - 1)/(p v)) x 1F1B's activations
        in_flight = in_flight * (1 + (pp - 1) / (pp * layout.virtual_stages))
    out["activations"] = in_flight * layers * act["saved"] + (act["rebuilt"] if layers else 0.0)
    b, s, sp = layout.micro_batch, seq_len // layout.cp, layout.tp if layout.sequence_parallel else 1
    hidden = m.hidden_dim * (m.top_k if m.n_experts else 1)
    mlp = BF16 * mlp_backward_elements(b, s, m.d_model, hidden, layout.tp, gated=m.mlp == "swiglu")
    ring = 0.0
    if layout.cp > 1 and layout.cp_method == "ring" and m.attention != "materialized":
        q = b * s * m.d_model / layout.tp
        kv = b * s * (m.d_model // m.n_heads) * cp_kv_heads("ring", m.attention_kv_heads // layout.tp, layout.cp)
        # with dO, the core's input; the block's MLP activations are freed by then (their backward ran first)
        ring = ring_backward_bytes(q, kv, layout.cp, layout.kv_rotation) + BF16 * q - act["mlp"]
    out["backward"] = BF16 * b * s * m.d_model / sp + max(mlp, ring) if layers else 0.0
    tokens = layout.micro_batch * seq_len
    # the loss, and the head's saved input: the final norm's output, whole (all-gathered under SP), bf16
    head_input = BF16 * tokens * m.d_model / layout.cp if m.attention != "materialized" else 0.0
    per_logit = (MEGATRON_LOGIT_BYTES if getattr(m, "megatron_fusions", False) else
                 COMPILED_LOGIT_BYTES if compiled_loss else LOGIT_BYTES)
    out["logits"] = (per_logit * tokens * m.vocab_size / (layout.tp * layout.cp) + head_input) if last else 0.0
    out["total"] = sum(out.values())
    return out


def peak_memory(model, layout, n_micro: int, seq_len: int, cp_local: int = 1, compiled_loss: bool = False) -> dict:
    """The stage with the largest total (PP ranks differ; torchtitan reports the max over GPUs).
    cp_local: the cp ranks per node (Layout.cp_local), read by the hybrid CP method only; compiled_loss: see
    stage_memory."""
    stages = [stage_memory(model, layout, i, n_micro, seq_len, cp_local, compiled_loss) for i in range(layout.pp)]
    worst = max(range(layout.pp), key=lambda i: stages[i]["total"])
    return dict(stages[worst], stage=worst)
