"""Every hardware figure the cost model reads, with the measurement it cites (notebook 15).

The GPU kinds (`labkit/scale/gpus/*.json`), the clusters (`labkit/scale/clusters/*.json`) and the
allocator's reserve (`allocator.json`) keep a "sources" object beside their figures. `cited()` lists
them, one row per figure: the file, the field, its value and its source, so notebook 15 can show every
constant and a test can check that none is without one (`uncited`). A few figures share one source:
a measured GEMM's shape is cited with its TFLOP/s, the two link latencies together ("latencies"), the
attention tables by implementation ("attention.fa2", "attention.fa3"), and a cluster's hosts ("hosts")
can cite its GPUs per node and its network.
"""
from __future__ import annotations

import json
from pathlib import Path

from labkit.scale.cluster import CLUSTER_DIR
from labkit.scale.gpu import GPU_DIR

ALLOCATOR_FILE = Path(__file__).with_name("allocator.json")
NOT_FIGURES = {"name", "description", "sources"}
# a field whose source is given under another key: the first key present in "sources" cites it
SHARED = {
    "mamf_shape": ("mamf_tflops",),
    "msmf_shape": ("msmf_tflops",),
    "fp8_rowwise_shape": ("fp8_rowwise_tflops",),
    "nvlink_latency_us": ("latencies",),
    "network_latency_us": ("latencies",),
    "gpus_per_node": ("hosts",),
    "network_gbits_per_s": ("hosts",),
}


def shipped_files() -> list[Path]:
    """The data files of the shipped GPU kinds, clusters and the allocator's reserve."""
    return sorted(GPU_DIR.glob("*.json")) + sorted(CLUSTER_DIR.glob("*.json")) + [ALLOCATOR_FILE]


def source_of(values: dict, field: str) -> str:
    """The source `values["sources"]` gives for `field` (its own key, the key it shares, or for the attention
    tables every "attention.<impl>" key), or "" where it gives none."""
    sources = values.get("sources") or {}
    if sources.get(field):
        return sources[field]
    if field == "attention":  # one source per implementation; cited only if every implementation is
        parts = {impl: sources.get(f"attention.{impl}") for impl in values["attention"]}
        return " | ".join(f"{impl}: {src}" for impl, src in parts.items()) if all(parts.values()) else ""
    return next((sources[key] for key in SHARED.get(field, ()) if sources.get(key)), "")


def cited(paths=None) -> list[dict]:
    """One row per figure of each file: {"file" (its folder and name: "gpus/h100-sxm.json"), "field", "value",
    "source"} ("" where none is given)."""
    rows = []
    for path in paths or shipped_files():
        values = json.loads(Path(path).read_text())
        for field, value in values.items():
            if field in NOT_FIGURES:
                continue
            if field == "attention":
                value = {impl: {kind: len(table) for kind, table in kinds.items()} for impl, kinds in value.items()}
            if field == "fp8_rowwise_linear":  # a measured grid: its size, not its 216 values
                value = "x".join(str(len(value[axis])) for axis in ("m", "k", "n")) + " grid"
            if field == "gemm_shapes_measured":  # a measured table: its size, not its rows
                value = f"{len(value)} GEMMs"
            if field == "busy_node":  # the busy node's mean over alone; its range over the figures measured
                value = f"x{value['ratio']}, {value['range']:.1%} of {value['draws']}"
            rows.append(dict(file=f"{Path(path).parent.name}/{Path(path).name}", field=field, value=value,
                             source=source_of(values, field)))
    return rows


def uncited(paths=None) -> list[str]:
    """'file: field' for every figure without a source: empty for the shipped files (tests/test_scale_constants.py)."""
    return [f"{row['file']}: {row['field']}" for row in cited(paths) if not row["source"]]


def format_cited(files: tuple = (), width: int = 100) -> str:
    """The rows of `cited` for the named files ("gpus/h100-sxm.json"; all where none is named) as a table, each
    source cut to `width` characters ("(as above)" where a figure shares the row above's source)."""
    rows = [r for r in cited() if not files or r["file"] in files]
    lines = [f"{'file':30s} {'field':24s} {'value':>20s}  source"]
    previous = None
    for r in rows:
        value = json.dumps(r["value"]) if isinstance(r["value"], (dict, list)) else f"{r['value']:g}" \
            if isinstance(r["value"], float) else str(r["value"])
        value = value if len(value) <= 20 else value[:17] + "..."
        source = "(as above)" if r["source"] == previous else \
            r["source"] if len(r["source"]) <= width else r["source"][:width - 3] + "..."
        previous = r["source"]
        lines.append(f"{r['file']:30s} {r['field']:24s} {value:>20s}  {source}")
    return "\n".join(lines)
