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

Two optional fields connect it to the kernel model (labkit.scale.kernels, labkit.scale.collectives):
    gpu                        the GPU kind (labkit/scale/gpus/<gpu>.json): without it, `predict`
                               can only use a flat FLOP rate (its `efficiency=`)
    node_busbw_gbytes_per_s    GB/s  measured large-message bus bandwidth of a collective inside one
                               node (nccl-tests); without it the NVLink datasheet rate is used

Each figure is checked against a plausible range, so a unit off by 1,000 (TFLOP/s written as
FLOP/s, MB/s for GB/s, ms for us) is caught and named with the unit expected.
"""
from __future__ import annotations

import json
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

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30

    def link(self, level: str) -> tuple[float, float]:
        """(alpha seconds, beta bytes/s) of one GPU's link at `level`: "node" (NVLink) or "network"."""
        if level == "node":  # the measured bus bandwidth where the file gives one, else the datasheet link
            return self.nvlink_latency_us * 1e-6, (self.node_busbw_gbytes_per_s or self.nvlink_gbytes_per_s) * 1e9
        if level == "network":
            return self.network_latency_us * 1e-6, self.network_gbits_per_s * 1e9 / 8
        raise ValueError(f"link level must be 'node' or 'network', got {level!r}")


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
    if "node_busbw_gbytes_per_s" in values:
        busbw = values["node_busbw_gbytes_per_s"]
        if isinstance(busbw, bool) or not isinstance(busbw, (int, float)) or not 5 <= busbw <= 5000:
            hint = " (a unit off by 1,000?)" if isinstance(busbw, (int, float)) and 5 <= busbw * 1e-3 <= 5000 else ""
            raise ClusterError(f"{where}: node_busbw_gbytes_per_s={busbw!r} is outside 5..5000{hint}: the unit "
                               "expected is GB/s (e.g. 460 for nccl-tests all_reduce on 8 H100 SXM)")
        extra["node_busbw_gbytes_per_s"] = float(busbw)
    return Cluster(name=name, description=values.get("description", ""), **fields, **extra)
