"""Step time of a layout on a cluster: compute + exposed traffic + bubble (notebook 15).

    compute   the GPU's FLOPs per step (model FLOPs + recomputation) / (peak x efficiency)
    traffic   each axis's alpha-beta time (labkit.scale.traffic), of which only the part
              that cannot hide behind compute is paid:
                dp    overlaps the whole forward and backward (FSDP prefetch, bucketed
                      reduction): exposed = max(0, t_dp - t_compute) + t_dp / L (the first
                      gather and the last reduction of a step have nothing to hide behind)
                cp    the K/V ring overlaps attention (Liu et al. 2023): exposed =
                      max(0, t_ring - t_attention) + t_rest, t_rest the all-gather's and
                      the all-to-alls' time (cp_method "allgather", "ulysses", the
                      hybrid's inside a node), which attention waits for
                ep    exposed in full; with `ep_overlap` (two half micro-batches, notebook 12)
                      labkit.measure.overlap.two_batch_overlap's rule per layer and direction:
                      of the 4 half all-to-alls (time t each) 2 are exposed in full and 2 by
                      max(0, t - the other half's experts); backward's experts take twice
                      forward's. Not modelled: the SMs the all-to-all takes from compute
                      (DeepSeek-V3 gives it 20 of 132), half-size expert matmuls running below
                      the efficiency, attention or the other half's dense layers hiding it too
                      (DualPipe's pairing), the router's imbalance
                tp, pp   on the critical path: exposed in full (no async TP)
    bubble    1F1B: (pp - 1) / m of the compute and TP/EP time of a step (m micro-batches);
              interleaved with v virtual stages: (pp - 1) / (v m) (Narayanan et al. 2021)
Outputs tokens/s per GPU (the step's tokens / step time / GPUs), MFU (model FLOPs only, against
the cluster's peak) and the peak memory (labkit.scale.footprint).

`EFFICIENCY` is the one achieved-efficiency constant: the fraction of the bf16 peak a
transformer's forward and backward reach once every kernel, not only the matmuls, is counted.
It is not fitted to any row we predict: it is Meta's own measurement of Llama 3 pre-training
in bf16 on H100s, 38-43% MFU on 8,192-16,384 GPUs ("The Llama 3 Herd of Models", Dubey et al.
2024, table 4); we take 0.40, the middle, as the efficiency of compute alone (their MFU also pays
the bubble and exposed traffic, so it is a slight underestimate).

Left out: kernel fusion and torch.compile (fewer, faster non-matmul kernels), float8 matmuls,
async TP (TP traffic hidden behind matmuls), stragglers and jitter between ranks, the
efficiency's dependence on matrix size (small TP shards and micro-batches run below it),
NCCL's protocol choices and link contention between axes that share a NIC, power limits.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from labkit.measure.overlap import two_batch_overlap
from labkit.scale.footprint import peak_memory
from labkit.scale.layout import Layout, check_layout
from labkit.scale.traffic import axis_traffic

EFFICIENCY = 0.40


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

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / 2**30


def rank_key(p: Prediction):
    """The search's order: fastest first, then the least memory, then the layout's fields."""
    lay = p.layout
    return (-round(p.tokens_per_s_per_gpu, 6), round(p.peak_bytes), lay.dp, lay.pp, lay.cp, lay.tp, lay.ep,
            lay.zero, lay.recompute, lay.micro_batch, lay.schedule, lay.virtual_stages, lay.dp_replicate,
            lay.cp_method, lay.ep_overlap)


def _params_per_gpu(model, layout) -> dict:
    m = model
    layers = layout.layers_per_rank(m.n_layers)
    head = max(m.embedding_params, m.head_params)  # the heavier end stage
    dense = layers * m.layer_dense_params + (head if layout.pp > 1 else m.embedding_params + m.head_params)
    return {"dense": dense / layout.tp, "experts": layers * m.expert_params * m.n_experts / (layout.tp * layout.ep)}


def step_time(compute_s: float, attention_s: float, traffic_s: dict, layout: Layout, n_micro: int,
              layers_per_rank: int, overlap: bool = True, *, cp_hideable_s: float | None = None,
              experts_s: float = 0.0) -> tuple[float, dict]:
    """(step seconds, parts) from one GPU's compute time, its attention's share, and each axis's
    traffic time: the overlap rules and the bubble of the module's docstring. `predict` feeds it
    the closed forms; a measured step (labkit.scale.simulate) feeds it its own FLOPs and bytes.
    overlap=False: every axis's traffic is exposed in full (the lab's own steps communicate after
    their compute, as notebooks 04-13 write them). cp_hideable_s: the part of cp's time that can
    overlap attention (None: all of it, the ring); experts_s: the experts' compute time per step
    (forward and backward), what hides the all-to-alls under layout.ep_overlap."""
    secs = {axis: traffic_s.get(axis, 0.0) for axis in ("dp", "cp", "tp", "ep", "pp")}
    ring = secs["cp"] if cp_hideable_s is None else cp_hideable_s
    exposed = dict(secs) if not overlap else {
        "dp": max(0.0, secs["dp"] - compute_s) + secs["dp"] / layers_per_rank,
        "cp": max(0.0, ring - attention_s) + secs["cp"] - ring,
        "tp": secs["tp"], "ep": secs["ep"], "pp": secs["pp"],
    }
    if overlap and layout.ep_overlap and secs["ep"]:
        exposed["ep"] = two_batch_exposed(secs["ep"], experts_s, layers_per_rank, n_micro)
    per_micro = compute_s + exposed["tp"] + exposed["ep"]
    stages_per_rank = layout.virtual_stages if layout.schedule == "interleaved" else 1
    bubble = (layout.pp - 1) / (stages_per_rank * n_micro) * per_micro if layout.pp > 1 else 0.0
    step = compute_s + sum(exposed.values()) + bubble
    return step, dict(compute=compute_s, bubble=bubble, **{f"exposed_{a}": v for a, v in exposed.items()})


def two_batch_exposed(ep_s: float, experts_s: float, layers: int, n_micro: int) -> float:
    """EP's exposed all-to-all time per step under the two-micro-batch overlap: ep_s is the time of the
    8 half all-to-alls per layer and micro-batch (axis_traffic's count: dispatch and combine of two halves,
    forward and backward), each t = ep_s / (8 L m); a half's experts take c = experts_s / (6 L m) forward
    and 2c backward. Per layer and micro-batch: two_batch_overlap(t, c) + two_batch_overlap(t, 2c)'s
    layer_exposed_s (with c = 0: 8t, all of it)."""
    t = ep_s / (8 * layers * n_micro)
    c = experts_s / (6 * layers * n_micro)
    per_layer = two_batch_overlap(t, c)["layer_exposed_s"] + two_batch_overlap(t, 2 * c)["layer_exposed_s"]
    return layers * n_micro * per_layer


def predict(model, layout: Layout, cluster, global_batch: int, seq_len: int, n_gpus: int | None = None,
            efficiency: float = EFFICIENCY, value_bytes: int = 2, overlap: bool = True) -> Prediction:
    """The cost model's figures for one layout (LayoutError if it cannot run, before any arithmetic).
    value_bytes, overlap: see axis_traffic and step_time (the defaults: bf16 GPUs that overlap)."""
    n_gpus = layout.world_size if n_gpus is None else n_gpus
    n_micro = check_layout(model, layout, n_gpus, cluster.gpus_per_node, global_batch, seq_len)
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
                            experts_s=experts)
    memory = peak_memory(model, layout, n_micro, seq_len, cp_local=layout.cp_local(cluster.gpus_per_node))
    return Prediction(
        layout=layout, step_s=step, tokens_per_s_per_gpu=tokens / step / n_gpus,
        mfu=model_flops / step / cluster.peak_bf16_flops, peak_bytes=memory["total"],
        fits=memory["total"] <= cluster.memory_bytes, n_micro=n_micro,
        parts_s=parts,
        memory=memory, traffic=traffic, flops_per_gpu=flops)


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
