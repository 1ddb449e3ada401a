"""A described cluster: GPUs per node, peak bf16 FLOP/s, memory, links (notebook 15).

A cluster is a small JSON file (`labkit/scale/clusters/<name>.json`, or any path) with these
fields, in these units, and a "sources" object saying where each figure comes from:

    gpus_per_node         int     GPUs joined by NVLink (one node)
    peak_bf16_flops       FLOP/s  dense bf16 tensor-core peak per GPU (989e12 for H100 SXM)
    memory_gib            GiB     device memory per GPU
    nvlink_gbytes_per_s   GB/s    NVLink bandwidth per GPU, one direction
    network_gbits_per_s   Gb/s    network bandwidth per GPU between nodes (one NIC per GPU)
    nvlink_latency_us     us      latency of one step over NVLink (alpha)
    network_latency_us    us      latency of one step across nodes (alpha)

Three optional fields connect it to the kernel model (labkit.scale.kernels, labkit.scale.collectives):
    gpu                        the GPU kind (labkit/scale/gpus/<gpu>.json): without it, `predict`
                               can only use a flat FLOP rate (its `efficiency=`)
    node_busbw_gbytes_per_s    GB/s  measured large-message bus bandwidth of an all-reduce inside one
                               node (nccl-tests); without it the NVLink datasheet rate is used
    network_busbw_gbytes_per_s GB/s  measured large-message bus bandwidth per NIC across nodes; without
                               it the NIC's line rate, network_gbits_per_s / 8; never above that rate. A
                               ring collective of a group with k ranks in each node moves k NICs' worth,
                               up to the node's own busbw (`Cluster.link`'s per_node)
and one optional field that gives a collective kind its own measured bus bandwidth at a level:
    busbw_by_kind              {"node"|"network": {kind: GB/s, or [[bytes, GB/s], ...]}}: one figure, or
                               nccl-tests' busbw against its "size" column (the whole tensor, S) at
                               increasing sizes, read log-linearly in S between them and held flat beyond
                               the ends (`Cluster.link(level, kind, nbytes, ranks)`); within a curve's sizes
                               the measurement is the whole time, no latency added; a node's curve (measured
                               on the whole node) is read for n ranks at S x gpus_per_node / n, the size at
                               which its ring moves the same chunk per step. kind: all_reduce,
                               all_gather, reduce_scatter, all_to_all, send. Where a kind has none, the
                               level's figure above. H100's NVLink SHARP is why this is needed: it speeds
                               up the all-reduce only (460-480 GB/s), the other kinds move ~370 GB/s

Each figure is checked against a plausible range, so a unit off by 1,000 (TFLOP/s written as
FLOP/s, MB/s for GB/s, ms for us) is caught and named with the unit expected.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from labkit.scale.gpu import checked_number, load_gpu

CLUSTER_DIR = Path(__file__).resolve().parent / "clusters"

# field: (type, unit, plausible low, plausible high); each range is about 100x wide around
# today's hardware, so a factor of 1,000 always falls outside it (and 1e12: TFLOP/s for FLOP/s)
FIELDS = {
    "gpus_per_node": (int, "GPUs", 1, 72),
    "peak_bf16_flops": (float, "FLOP/s (e.g. 989e12 for an H100 SXM)", 1e13, 1e16),
    "memory_gib": (float, "GiB (e.g. 80)", 4, 2000),
    "nvlink_gbytes_per_s": (float, "GB/s, one direction (e.g. 450 for H100 NVLink)", 5, 5000),
    "network_gbits_per_s": (float, "Gb/s per GPU (e.g. 400)", 1, 10000),
    "nvlink_latency_us": (float, "microseconds (e.g. 3)", 0.1, 100),
    "network_latency_us": (float, "microseconds (e.g. 10)", 0.3, 300),
}


BUSBW_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")
RING_KINDS = ("all_reduce", "all_gather", "reduce_scatter")  # NCCL spreads their channels over the node's NICs
# NCCL's base latency of one ring collective (Ring/Simple, baseLat in src/graph/tuning.cc: 8.4 us in its 2020 and its
# Hopper-era tuner alike), which its tuner adds to the steps' latencies
RING_BASE_US = 8.4
BUSBW_RANGE = (5, 5000)  # GB/s: as node_busbw_gbytes_per_s


class ClusterError(ValueError):
    """A cluster description with a missing field, a wrong type or an implausible unit."""


@dataclass(frozen=True)
class Cluster:
    name: str
    gpus_per_node: int
    peak_bf16_flops: float
    memory_gib: float
    nvlink_gbytes_per_s: float
    network_gbits_per_s: float
    nvlink_latency_us: float
    network_latency_us: float
    description: str = ""
    gpu: str = ""
    node_busbw_gbytes_per_s: float = 0.0
    network_busbw_gbytes_per_s: float = 0.0
    # ((level, kind, ((bytes, bytes/s), ...)), ...): busbw_by_kind, checked, as a hashable value
    busbw_by_kind: tuple = ()

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30

    def link(self, level: str, kind: str | None = None, nbytes: float = 0.0, ranks: int = 0,
             per_node: int = 1) -> tuple[float, float]:
        """(alpha seconds, beta bytes/s) of one GPU's link at `level`: "node" (NVLink) or "network".
        With a collective `kind` (and its whole tensor's `nbytes`, nccl-tests' size S, over `ranks` ranks), beta is
        that kind's measured bus bandwidth where `busbw_by_kind` gives one (`busbw_at`), else the level's; alpha is 0
        where the size read lies within a curve's measured sizes (the measurement already holds the latency).
        A node's curve is measured over the whole node (gpus_per_node ranks). In a ring, busbw depends on the
        per-step chunk c = S / n alone (busbw = c / (alpha + c / B)), so a group of `ranks` reads the curve where
        the node's ring moves the same chunk, at S x gpus_per_node / ranks; a send moves its whole message, as is.
        per_node: the group's ranks in one node (`Layout.ranks_per_node`). Each GPU has its own NIC (this file's
        contract), and NCCL runs a ring collective (all-gather, reduce-scatter, all-reduce) over as many channels
        as it has rails, each crossing between nodes through another GPU's NIC: the network bus bandwidth of a group
        with k ranks in a node is k NICs' (NVIDIA's NCCL team: 'We usually consider 24GB/s is the peak performance
        per 200G NIC ... so in your case 96GB/s is the target', four NICs, nccl-tests #119; 'add more NICs and you
        should get more bandwidth, up to 160GB/s which is the NVLink intra-node bandwidth', nccl #412), never above
        the same collective inside the node (read as above). An all-to-all or a send moves each rank's own data out
        through its own NIC: one NIC's, whatever k."""
        if level == "node":  # the measured bus bandwidth where the file gives one, else the datasheet link
            alpha, beta = self.nvlink_latency_us * 1e-6, (self.node_busbw_gbytes_per_s or self.nvlink_gbytes_per_s) * 1e9
        elif level == "network":
            alpha = self.network_latency_us * 1e-6
            beta = (self.network_busbw_gbytes_per_s or self.network_gbits_per_s / 8) * 1e9
        else:
            raise ValueError(f"link level must be 'node' or 'network', got {level!r}")
        for lvl, k, curve in self.busbw_by_kind:
            if lvl == level and k == kind:
                size = nbytes * self.gpus_per_node / ranks if level == "node" and ranks and kind != "send" else nbytes
                # a curve measured against size is the whole time at the sizes it spans: nccl-tests' busbw is the
                # wire bytes over the measured time, latency included, so no latency step is added there
                spanned = len(curve) > 1 and curve[0][0] <= size <= curve[-1][0]
                alpha, beta = (0.0 if spanned else alpha), busbw_at(curve, size)
                break
        rails = min(per_node, self.gpus_per_node)
        if level == "network" and rails > 1 and kind in RING_KINDS:
            beta = min(rails * beta, self.link("node", kind, nbytes, ranks)[1])
        return alpha, beta

    def ring_step_latency(self, kind: str, ranks: int, per_node: int) -> float:
        """Seconds per step, on average, of a ring collective over `ranks` ranks spread `per_node` to a node, by NCCL's
        own latency model (src/graph/tuning.cc, ncclTopoTuneModel, ring): a base latency per collective
        (`RING_BASE_US`, Ring/Simple), then each of its steps at its hop's latency: the nodes' crossings
        (all-gather, reduce-scatter: nodes - 1 of the n - 1 steps; all-reduce: 2 x nodes of 2 (n - 1)) at the
        network's (`network_latency_us`), the rest over NVLink (`nvlink_latency_us`). The cost model's ring
        collectives across nodes take it as their alpha (labkit.scale.collectives.ring_link), and ring_time multiplies
        it back by the steps."""
        steps = 2 * (ranks - 1) if kind == "all_reduce" else ranks - 1
        nodes = max(1, math.ceil(ranks / max(1, per_node)))
        crossings = min(steps, 2 * nodes if kind == "all_reduce" else nodes - 1)
        total = RING_BASE_US + (steps - crossings) * self.nvlink_latency_us + crossings * self.network_latency_us
        return total * 1e-6 / steps

    def fastest_busbw(self, level: str) -> float:
        """The largest bus bandwidth any kind gets at `level`: a bound no collective beats (labkit.scale.bounds);
        across nodes a ring collective of a whole node's ranks may reach the node's own (`link`'s per_node)."""
        fastest = max([self.link(level)[1]] + [b for lvl, _, curve in self.busbw_by_kind if lvl == level
                                               for _, b in curve])
        if level != "network":
            return fastest
        return max(fastest, min(self.gpus_per_node * fastest, self.fastest_busbw("node")))  # every rail, capped


def busbw_at(curve: tuple, nbytes: float) -> float:
    """Bytes/s of a measured busbw curve ((bytes, bytes/s), ...) at size `nbytes`: log-linear in the size
    between two measured sizes, the nearest end's figure outside them (a flat curve has one point)."""
    if len(curve) == 1 or nbytes <= curve[0][0]:
        return curve[0][1]
    for (s0, b0), (s1, b1) in zip(curve, curve[1:]):
        if nbytes <= s1:
            return b0 + (b1 - b0) * math.log(nbytes / s0) / math.log(s1 / s0)
    return curve[-1][1]


def check_busbw_by_kind(values, where: str) -> tuple:
    """`busbw_by_kind` as Cluster holds it, or ClusterError naming the level, kind or point and the fix."""
    if not isinstance(values, dict):
        raise ClusterError(f"{where}: busbw_by_kind must map a level ('node', 'network') to {{kind: GB/s or "
                           "[[bytes, GB/s], ...]}}")
    out = []
    for level, kinds in values.items():
        if level not in ("node", "network") or not isinstance(kinds, dict):
            raise ClusterError(f"{where}: busbw_by_kind[{level!r}]: the levels are 'node' and 'network', "
                               "each a dict {kind: GB/s or [[bytes, GB/s], ...]}")
        for kind, figure in kinds.items():
            at = f"{where}: busbw_by_kind[{level!r}][{kind!r}]"
            if kind not in BUSBW_KINDS:
                raise ClusterError(f"{at}: {kind!r} is not a collective kind the model times: one of {BUSBW_KINDS}")
            points = [[0, figure]] if isinstance(figure, (int, float)) and not isinstance(figure, bool) else figure
            if not isinstance(points, list) or not points or not all(
                    isinstance(p, list) and len(p) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                                for x in p) for p in points):
                raise ClusterError(f"{at} must be a number (GB/s) or a list of [bytes, GB/s] pairs, got {figure!r}")
            sizes = [p[0] for p in points]
            if any(b <= a for a, b in zip(sizes, sizes[1:])) or sizes[0] < 0:
                raise ClusterError(f"{at}: the sizes must increase, in bytes (nccl-tests' size column), got {sizes}")
            if any(gbps <= 0 for _, gbps in points):
                raise ClusterError(f"{at}: every busbw must be positive, in GB/s, got {[g for _, g in points]}")
            # small messages are latency-bound (1.3 GB/s at 32 KiB on 8 A100s), so the unit is checked on the
            # curve's largest figure, its large-message end: MB/s or TB/s moves that one out of range
            low, high = BUSBW_RANGE
            size, gbps = max(points, key=lambda p: p[1])
            if not low <= gbps <= high:
                hint = " (a unit off by 1,000?)" if low <= gbps * 1e-3 <= high or low <= gbps * 1e3 <= high else ""
                raise ClusterError(f"{at}: {gbps:g} at {size:g} bytes is outside {low}..{high}{hint}: the unit "
                                   "expected is GB/s (nccl-tests' busbw column, e.g. 362 for reduce_scatter on 8 H100)")
            out.append((level, kind, tuple((float(s), float(g) * 1e9) for s, g in points)))
    return tuple(out)


def check_fields(values: dict, where: str = "the cluster") -> dict:
    """The fields of `values` with their types, or ClusterError naming the field and its unit."""
    return {field: checked_number(values, field, spec, where, ClusterError) for field, spec in FIELDS.items()}


def list_clusters() -> list[str]:
    """The names of the shipped clusters."""
    return sorted(p.stem for p in CLUSTER_DIR.glob("*.json"))


def load_cluster(name_or_path: str | Path | dict | Cluster) -> Cluster:
    """A shipped cluster by name ("h100-sxm"), a JSON file's path, or a dict of the fields."""
    if isinstance(name_or_path, Cluster):
        return name_or_path
    if isinstance(name_or_path, dict):
        values, where = name_or_path, "the cluster dict"
    else:
        path = Path(name_or_path)
        if not path.suffix:
            path = CLUSTER_DIR / f"{name_or_path}.json"
            if not path.exists():
                raise ClusterError(f"no cluster named {name_or_path!r}; shipped: {list_clusters()}, "
                                   "or give a path to a JSON file")
        values, where = json.loads(path.read_text()), str(path)
    fields = check_fields(values, where)
    name = values.get("name") or (Path(where).stem if where.endswith(".json") else "custom")
    extra = {}
    if values.get("gpu"):
        load_gpu(values["gpu"])  # a missing or wrong GPU file is named now, not at the first prediction
        extra["gpu"] = values["gpu"]
    for field, example in (("node_busbw_gbytes_per_s", "460 for nccl-tests all_reduce on 8 H100 SXM"),
                           ("network_busbw_gbytes_per_s", "46 for one 400 Gb/s NDR NIC")):
        if field not in values:
            continue
        busbw = values[field]
        if isinstance(busbw, bool) or not isinstance(busbw, (int, float)) or not 5 <= busbw <= 5000:
            hint = " (a unit off by 1,000?)" if isinstance(busbw, (int, float)) and 5 <= busbw * 1e-3 <= 5000 else ""
            raise ClusterError(f"{where}: {field}={busbw!r} is outside 5..5000{hint}: the unit expected is GB/s "
                               f"(e.g. {example})")
        extra[field] = float(busbw)
    line = fields["network_gbits_per_s"] / 8
    if extra.get("network_busbw_gbytes_per_s", 0) > line:  # Gb/s written for GB/s is 8x: caught here, not by range
        raise ClusterError(f"{where}: network_busbw_gbytes_per_s={extra['network_busbw_gbytes_per_s']:g} is above the "
                           f"NIC's line rate, network_gbits_per_s / 8 = {line:g} GB/s: a measured bus bandwidth cannot "
                           "beat its link; is it in Gb/s? The unit expected is GB/s")
    if "busbw_by_kind" in values:
        extra["busbw_by_kind"] = check_busbw_by_kind(values["busbw_by_kind"], where)
    return Cluster(name=name, description=values.get("description", ""), **fields, **extra)
