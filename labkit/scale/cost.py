"""Step time of a layout on a cluster, built up from kernels and collectives (notebook 15).

With efficiency=None and a GPU kind (the cluster's `gpu` field, labkit/scale/gpus/*.json): the kernel
model (opt-in until it meets issue 34's aims on the published set; `python bench/scale.py` prints both):
    ops        every op of a block, the embedding and the head at their shapes after TP, CP and SP
               (labkit.scale.layer_ops), each timed by a roofline (labkit.scale.kernels): one stage's
               forward F_s and backward B_s (recompute included) per micro-batch
    traffic    each axis's closed-form bytes (labkit.scale.traffic), timed from measured bus bandwidth
               and latency (labkit.scale.collectives, via Cluster.link), then ONE overlap rule per
               mechanism, the same everywhere:
        tp     on the critical path of its block (forward's collectives in its forward; the backward's, and the
               forward's its recompute policy runs again, `traffic.tp_collectives`, in its backward);
               with `async_tp` each collective decomposed into tp
               chunks behind the matmuls it feeds (labkit.scale.async_tp): exposed per collective
               max(0, g + (tp - 1) max(g, t / (tp - 1)) - G), G its matmuls whole, g on one chunk
        cp     the ring's K/V hops hidden only where a chunk's attention outlasts its transfer:
               exposed = max(0, t_ring - t_attention) + the all-gathers' / all-to-alls' time, per block
        ep     exposed in full; with `ep_overlap` labkit.measure.overlap.two_batch_overlap's rule
               (`two_batch_exposed`): each half's all-to-alls behind the other half's experts
        pp     each send/recv a message of the schedule simulator (t_msg): hidden where the
               schedule leaves room, else it shows up as bubble
        dp     FSDP (ZeRO-3) prefetches one layer ahead: hidden behind the step's compute except the
               first gather and the last reduction, exposed = max(0, t_dp - compute) + t_dp / L;
               plain DP / ZeRO-1/2 accumulate each micro-batch's gradient locally and reduce buckets during
               the last micro-batch's backward B_last: exposed = max(0, t_dp - B_last) + t_dp / L (the last
               bucket, one layer's, waits); with Layout.grad_reduce="after" (Megatron-LM's local DDP) after it:
               exposed = t_dp. (The flat model below keeps its own rule: hidden behind the whole compute.)
    overlap    what a hidden NCCL collective (the ring's hops, EP's overlapped all-to-alls, dp) still costs:
               the compute beside it runs GPU.overlap_slowdown slower while it runs (its kernels share the
               SMs and memory), `cost_kernels.contention`: for C seconds of traffic behind a window of W,
               max(C, W + k min(C, W (1 + s))) in all, k = s / (1 + s); async TP's transfers use the copy engines
    pipeline   per-stage F_s + exposed tp/cp/ep + their blocks' contention, B_s likewise, through the lab's
               schedule simulator (labkit.scale.pipeline): makespan = the busiest rank's work + the bubble
    step       makespan + FSDP's copies + exposed dp + dp's contention + the optimizer step (AdamW over this
               GPU's shard); FSDP2's copies (ZeRO-3 by block): each all-gather's copy-out and the reduce-scatter's
               copy-in, memory-bound kernels on the compute stream, once a step (`kernels.fsdp_copies`)
`parts_s` splits it: compute (the busiest rank's kernels), exposed_tp / _cp / _ep / _dp, contention (the blocks')
and contention_dp, bubble, fsdp_copies, optimizer; `bound_s` says how much of one block's forward and backward is compute-, memory- or
launch-bound: each pass takes max(GPU time, CPU time to issue its kernels), and "launch" is the time
the GPU waits for the CPU (a model this small that is mostly "launch" runs at the CPU's pace,
kernels x eager PyTorch's measured cost per kernel; torch.compile's launches cost less).

Otherwise (the default `EFFICIENCY`, this CPU's fit in notebook 15's predict-then-measure, a cluster
without a GPU kind): the flat model `step_time`, compute = FLOPs / (peak x efficiency) with the
overlap rules above in closed form and the 1F1B bubble (pp - 1) / (v m) of the compute (Narayanan et
al. 2021). EFFICIENCY = 0.40 is Llama 3's 38-43% MFU (Dubey et al. 2024, table 4), an end-to-end
figure: the kernel model replaces it once it validates.
Outputs tokens/s per GPU, MFU (model FLOPs against the cluster's bf16 peak) and the peak memory
(labkit.scale.footprint); a layout fits when that peak plus labkit.scale.reserve's reserve (the cuBLAS
workspace in its allocator segment, the CUDA context, NCCL's buffers) is within the GPU's memory.
A power limit enters through the GPU kind (h100-sxm-500w: its GEMM measured at 500 W). Not modelled:
stragglers, link contention between axes sharing a NIC; the SMs a collective takes from the GEMMs enter as
one measured average slowdown of overlapped compute, not per kernel.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from labkit.scale.cost_kernels import kernel_step, params_per_gpu, two_batch_exposed  # noqa: F401 (re-exported)
from labkit.scale.footprint import peak_memory
from labkit.scale.layout import Layout, check_layout
from labkit.scale.reserve import reserve
from labkit.scale.cp_traffic import cp_exposed
from labkit.scale.traffic import axis_traffic

EFFICIENCY = 0.40  # predict's default: the flat model (efficiency=None: the kernel model)
FLAT_EFFICIENCY = EFFICIENCY


@dataclass
class Prediction:
    layout: Layout
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    peak_bytes: float
    fits: bool
    n_micro: int
    parts_s: dict = field(default_factory=dict)  # compute, bubble, exposed per axis
    memory: dict = field(default_factory=dict)   # bytes by part, for the worst stage
    traffic: dict = field(default_factory=dict)  # per axis: bytes, seconds, count
    flops_per_gpu: float = 0.0                   # model + recompute FLOPs per step
    bound_s: dict = field(default_factory=dict)  # one block, forward + backward: compute / memory / launch seconds
    reserve: dict = field(default_factory=dict)  # bytes beyond the tensors (labkit.scale.reserve), by part

    @property
    def reserved_gib(self) -> float:
        """What torch's reserved counter would show: the tensors' peak + the part of the reserve it holds."""
        return (self.peak_bytes + self.reserve.get("in_reserved", 0.0)) / 2**30

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / 2**30


# Predicted tokens/s within this fraction of a faster layout's are a tie (`ranked`). Why 0.5%: the model's inputs
# are quoted to 2-3 significant figures (labkit/scale/gpus/*.json: hbm_fraction 0.84 is +-0.6%, FlashAttention's
# 191 TFLOP/s +-0.3%, the flat model's EFFICIENCY 0.40 +-1.3%), so their rounding alone moves a prediction by
# about half a percent: a smaller difference is not one the model can resolve.
TIE = 0.005


def tie_key(p: Prediction):
    """The order among ties: the least memory per GPU, then the layout's fields (deterministic)."""
    lay = p.layout
    return (round(p.peak_bytes), lay.dp, lay.pp, lay.cp, lay.tp, lay.ep, lay.zero, lay.recompute, lay.micro_batch,
            lay.schedule, lay.virtual_stages, lay.dp_replicate, lay.cp_method, lay.ep_overlap,
            lay.first_stage_embedding_only, lay.last_stage_loss_only)


def rank_key(p: Prediction):
    """The strict order before ties: the exact predicted tokens/s, fastest first, then `tie_key`."""
    return (-p.tokens_per_s_per_gpu, *tie_key(p))


def ranked(predictions, tolerance: float = TIE) -> list:
    """The search's order, with ties by a relative tolerance: take the fastest layout left; every layout left whose
    tokens/s is within `tolerance` of it (>= its tokens/s x (1 - tolerance)) is a tie, and the ties go first, by
    `tie_key` (the least memory per GPU, then the layout's fields); repeat with what is left. The result depends
    only on the set of predictions, not on their order, and ranked(ranked(ps)[:k]) == ranked(ps)[:k]."""
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance={tolerance!r}: a fraction of the tokens/s, 0 <= tolerance < 1 (default TIE = {TIE})")
    by_speed, out, i = sorted(predictions, key=rank_key), [], 0
    while i < len(by_speed):
        floor = by_speed[i].tokens_per_s_per_gpu * (1 - tolerance)
        j = i
        while j < len(by_speed) and by_speed[j].tokens_per_s_per_gpu >= floor:
            j += 1
        out += sorted(by_speed[i:j], key=tie_key)
        i = j
    return out


_params_per_gpu = params_per_gpu  # the name before the kernel model


def step_time(compute_s: float, attention_s: float, traffic_s: dict, layout: Layout, n_micro: int,
              layers_per_rank: int, overlap: bool = True, *, cp_hideable_s: float | None = None,
              cp_first_s: float = 0.0, experts_s: float = 0.0) -> tuple[float, dict]:
    """(step seconds, parts) from one GPU's compute time, its attention's share, and each axis's
    traffic time: the overlap rules and the bubble of the module's docstring. `predict` feeds it
    the closed forms; a measured step (labkit.scale.simulate) feeds it its own FLOPs and bytes.
    overlap=False: every axis's traffic is exposed in full (the lab's own steps communicate after
    their compute, as notebooks 04-13 write them). cp_hideable_s: the part of cp's time that can
    overlap attention (None: all of it, the ring); cp_first_s: the part that only the ring's first step, 1 / cp of
    attention, can hide (its K/V by one all-gather, Layout.kv_rotation); experts_s: the experts' compute time per step
    (forward and backward), what hides the all-to-alls under layout.ep_overlap."""
    secs = {axis: traffic_s.get(axis, 0.0) for axis in ("dp", "cp", "tp", "ep", "pp")}
    ring = secs["cp"] if cp_hideable_s is None else cp_hideable_s
    exposed = dict(secs) if not overlap else {
        "dp": max(0.0, secs["dp"] - compute_s) + secs["dp"] / layers_per_rank,
        "cp": cp_exposed(secs["cp"], ring, cp_first_s, attention_s, layout.cp),
        "tp": secs["tp"], "ep": secs["ep"], "pp": secs["pp"],
    }
    if overlap and layout.ep_overlap and secs["ep"]:
        exposed["ep"] = two_batch_exposed(secs["ep"], experts_s, layers_per_rank, n_micro)
    per_micro = compute_s + exposed["tp"] + exposed["ep"]
    stages_per_rank = layout.virtual_stages if layout.schedule == "interleaved" else 1
    bubble = (layout.pp - 1) / (stages_per_rank * n_micro) * per_micro if layout.pp > 1 else 0.0
    step = compute_s + sum(exposed.values()) + bubble
    return step, dict(compute=compute_s, bubble=bubble, **{f"exposed_{a}": v for a, v in exposed.items()})


def predict(model, layout: Layout, cluster, global_batch: int, seq_len: int, n_gpus: int | None = None,
            efficiency: float | None = EFFICIENCY, value_bytes: int = 2, overlap: bool = True, *,
            compile: bool = False, float8: bool | str = False, async_tp: bool = False,
            attention: str | None = None, float8_all_gather: bool = False,
            compiled_loss: bool | None = None) -> Prediction:
    """The cost model's figures for one layout (LayoutError if it cannot run, before any arithmetic).
    value_bytes, overlap: see axis_traffic and step_time (the defaults: bf16 GPUs that overlap).
    efficiency=None and a cluster with a GPU kind: the kernel model (module docstring), with
    compile (torch.compile's fusion), float8 (fp8 block GEMMs: True or "tensorwise", "rowwise", torchao's
    recipes), async_tp (TP decomposed behind its GEMMs, labkit.scale.async_tp),
    attention ("fa2", "fa3", "unfused"; default fa2 where the GPU has its figures, else unfused) and
    float8_all_gather (torchao's: FSDP2 gathers the float8 linears' weights in float8, tensorwise only;
    labkit.scale.float8.fsdp_gather_bytes; nothing where FSDP does not gather) and compiled_loss (whether
    the loss function runs compiled, its kernels and its logits' memory: labkit.scale.footprint; None: as compile)."""
    n_gpus = layout.world_size if n_gpus is None else n_gpus
    n_micro = check_layout(model, layout, n_gpus, cluster.gpus_per_node, global_batch, seq_len)
    if efficiency is None and getattr(cluster, "gpu", ""):
        return _from_kernels(model, layout, cluster, global_batch, seq_len, n_gpus, n_micro, value_bytes,
                             dict(compile=compile, float8=float8, async_tp=async_tp, attention=attention,
                                  float8_all_gather=float8_all_gather, compiled_loss=compiled_loss))
    efficiency = FLAT_EFFICIENCY if efficiency is None else efficiency
    tokens = global_batch * seq_len
    model_flops = model.flops_per_token(seq_len) * tokens / n_gpus
    flops = model_flops + model.recompute_flops_per_token(seq_len, layout.recompute) * tokens / n_gpus
    # an uneven pipeline split: the fullest rank's blocks set the pace
    L = layout.layers_per_rank(model.n_layers)
    flops *= L * layout.pp / model.n_layers if layout.pp > 1 else 1.0
    rate = cluster.peak_bf16_flops * efficiency
    traffic = axis_traffic(model, layout, cluster, n_micro, seq_len, _params_per_gpu(model, layout), value_bytes)
    attention = 12 * model.n_layers * model.d_model * seq_len * tokens / n_gpus / rate
    # the experts' FLOPs on this GPU (forward + backward, the fullest pipeline rank's blocks): what hides EP's
    # all-to-alls under ep_overlap
    experts = 6 * model.top_k * model.expert_params * L * layout.pp * tokens / n_gpus / rate if model.n_experts else 0.0
    step, parts = step_time(flops / rate, attention, {a: v["seconds"] for a, v in traffic.items()}, layout,
                            n_micro, L, overlap, cp_hideable_s=traffic.get("cp", {}).get("hideable_seconds"),
                            cp_first_s=traffic.get("cp", {}).get("first_step_seconds", 0.0), experts_s=experts)
    memory = peak_memory(model, layout, n_micro, seq_len, cp_local=layout.cp_local(cluster.gpus_per_node),
                         compiled_loss=loss_compiled(dict(compile=compile, compiled_loss=compiled_loss)))
    extra = reserve(layout, getattr(cluster, "gpu", ""))  # fits: the tensors' peak + this within the GPU's memory
    return Prediction(
        layout=layout, step_s=step, tokens_per_s_per_gpu=tokens / step / n_gpus,
        mfu=model_flops / step / cluster.peak_bf16_flops, peak_bytes=memory["total"],
        fits=memory["total"] + extra["total"] <= cluster.memory_bytes, n_micro=n_micro,
        parts_s=parts, reserve=extra,
        memory=memory, traffic=traffic, flops_per_gpu=flops)


def loss_compiled(options: dict) -> bool:
    """Whether the kernel model's options run the loss function compiled: compiled_loss, else as compile."""
    given = options.get("compiled_loss")
    return bool(options.get("compile", False) if given is None else given)


def _from_kernels(model, layout, cluster, global_batch, seq_len, n_gpus, n_micro, value_bytes, options) -> Prediction:
    tokens = global_batch * seq_len
    model_flops = model.flops_per_token(seq_len) * tokens / n_gpus
    try:
        recompute = model.recompute_flops_per_token(seq_len, layout.recompute)
    except ValueError:  # a policy the kernel model knows (layer_ops.RECOMPUTED) that this spec's formula does not
        recompute = 0.0
    flops = model_flops + recompute * tokens / n_gpus
    if layout.pp > 1:  # the fullest rank's blocks, as the flat model counts them
        flops *= layout.layers_per_rank(model.n_layers) * layout.pp / model.n_layers
    got = kernel_step(model, layout, cluster, global_batch, seq_len, n_gpus, n_micro, value_bytes, options)
    memory = peak_memory(model, layout, n_micro, seq_len, cp_local=layout.cp_local(cluster.gpus_per_node),
                         compiled_loss=loss_compiled(options))
    extra = reserve(layout, getattr(cluster, "gpu", ""))  # fits: the tensors' peak + this within the GPU's memory
    step = got["step_s"]
    return Prediction(layout=layout, step_s=step, tokens_per_s_per_gpu=tokens / step / n_gpus,
                      mfu=model_flops / step / cluster.peak_bf16_flops, peak_bytes=memory["total"],
                      fits=memory["total"] + extra["total"] <= cluster.memory_bytes, n_micro=n_micro,
                      parts_s=got["parts_s"], reserve=extra,
                      memory=memory, traffic=got["traffic"], flops_per_gpu=flops, bound_s=got["bound_s"])


def min_gpus(model, cluster) -> int:
    """Whole nodes of GPUs whose memory holds the model states alone (16 bytes per parameter,
    fully sharded): a lower bound below which no layout can fit."""
    per_gpu = cluster.memory_bytes
    need = -(-16 * model.n_params // int(per_gpu))
    g = cluster.gpus_per_node
    return max(1, -(-need // g) * g) if need > 1 else 1


def no_layout_fits(model, cluster, n_gpus: int, smallest_peak: float | None):
    """The LayoutError for a search that found nothing: what the model needs, in GPUs of this kind."""
    from labkit.scale.layout import LayoutError

    need = min_gpus(model, cluster)
    kind = f"{cluster.name} ({cluster.memory_gib:g} GiB each)"
    states = 16 * model.n_params / 2**30
    if need > n_gpus:
        return LayoutError(f"{model.name} needs at least {need} GPUs of this kind, {kind}: its model states "
                           f"alone are 16 bytes x {model.n_params:,} parameters = {states:,.0f} GiB; "
                           f"{n_gpus} GPUs cannot hold them in any layout")
    least = f"; the least memory of any layout is {smallest_peak / 2**30:,.1f} GiB" if smallest_peak else ""
    return LayoutError(f"no layout of {model.name} on {n_gpus} GPUs of {kind} fits{least}: "
                       "use more GPUs, shorter sequences or a smaller global batch")
