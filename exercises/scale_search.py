# GENERATED from solutions/scale_search.py by `python -m labkit.grading.stubgen`: this file is yours to edit.
# Fill in every `raise NotImplementedError(...)`; see notebooks/15_at_scale.ipynb.
# untouched-stub fingerprint: a7a2782471163ec5
"""The configuration search (notebook 15_at_scale): fit memory, reach the global batch, maximise throughput.

The Ultra-Scale Playbook's recipe, done by the cost model instead of by 4,000 GPU runs:
    1. fit memory: keep only the layouts whose peak memory per GPU fits the cluster's GPUs;
    2. reach the global batch: dp x (each dp rank's micro-batches x their size) = global batch;
    3. maximise throughput: rank what is left by predicted tokens/s per GPU.

The space searched (every layout `labkit.scale.layout.check_layout` accepts in it):
    dp, pp, cp, tp   any sizes whose product is n_gpus
    ep               1 for a dense model; any divisor of the experts for a MoE (check_layout keeps those
                     that divide dp_shard x cp x tp: folded over dp_shard x cp, or over tp too where
                     it must be, as torchtitan's expert mesh; Layout.ep_over_tp)
    zero             "dp", "zero1", "zero2", "zero3"
    recompute        each of labkit.scale.layout.RECOMPUTE ("none", "selective-op", "selective-attn",
                     "full"); a GPT-shaped model refuses "selective-op" (check_layout)
    micro_batch      any size that splits each dp rank's share of the global batch
    dp_replicate     HSDP's replicas (dp = dp_replicate x dp_shard): any divisor R of dp whose
                     replicas are whole nodes, n_gpus / R a multiple of cluster.gpus_per_node
                     (R = 1, full sharding, always)
    cp_method        when cp > 1, each of labkit.scale.layout.CP_METHODS ("ring", "allgather",
                     "ulysses", "hybrid"); "ring" when cp = 1
    ep_overlap       when ep > 1, False and True (EP's two-micro-batch overlap); False when ep = 1
with the 1F1B schedule and sequence parallelism (the Layout's defaults for the other fields).
check_layout (called by predict) refuses what cannot run, such as Ulysses with heads that do
not split over cp, or zero="dp" with dp_replicate > 1: skip those layouts.
The order is `labkit.scale.cost.ranked(fitting)`: fastest first, with ties by a relative tolerance
(`labkit.scale.cost.TIE`, 0.5%: layouts within it of the fastest layout left are ties, the least memory per GPU
first, then the layout's fields), so that ties break the same way everywhere. Not `sorted(..., key=rank_key)`:
that key orders by the exact tokens/s and lets a layout 0.001% faster win while it costs GiBs more.
"""
from itertools import product

from labkit.scale.cluster import load_cluster
from labkit.scale.cost import no_layout_fits, predict, ranked
from labkit.scale.layout import CP_METHODS, RECOMPUTE, ZERO_STAGES, Layout, LayoutError

NOTEBOOK = "15_at_scale"


def divisors(n: int) -> list[int]:
    """The positive divisors of n, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def search(model, cluster, global_batch: int, seq_len: int, n_gpus: int, top: int = 5, *,
           cost_model=predict) -> list:
    """The `top` best layouts of `model` on `n_gpus` GPUs of `cluster` as labkit.scale Predictions,
    best first (order: `ranked`, ties within 0.5% by memory), among those that fit the GPUs' memory.

    model: a labkit.scale.specs.ModelSpec; cluster: a Cluster or a name ("h100-sxm").
    cost_model: predicts one layout, called as cost_model(model, layout, cluster, global_batch, seq_len,
    n_gpus) -> Prediction (LayoutError where the layout cannot run); labkit.scale.cost.predict (the flat
    model) unless you pass another, e.g. functools.partial(predict, efficiency=None) for the kernel model.
    Raises the LayoutError of `no_layout_fits` (which says how many GPUs of this kind the model
    needs at least) when no layout fits.
    """
    cluster = load_cluster(cluster)
    raise NotImplementedError("exercise search is not implemented yet: edit exercises/scale_search.py, see notebooks/15_at_scale.ipynb")
