"""torchtitan's published Llama 3.1 runs on H100s, and the cost model's predictions of them (notebook 15).

Source: pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (runs of Dec 2024;
torch 1963fc8, torchtitan 9dec370). Hardware: Grand Teton hosts, 8 H100 (96 GB HBM2e, 500 W)
per host on NVLink, 400 Gb/s RDMA per GPU (clusters/h100-grand-teton.json). TPS/GPU is read
at iteration 90; memory is the maximum over GPUs of torch's peak *reserved* memory (GiB).
"local batch" is sequences per data-parallel rank (FSDP x CP ranks share theirs).
Sequence length: 8192 where the tables do not give one (torchtitan's llama3 train_configs,
`seq_len = 8192`). Pipeline micro-batches: not published; the code's: torchtitan 9dec370 sets
n_microbatches to the pipeline degree when `--experimental.pipeline_parallel_microbatches` is unset
(torchtitan/parallelisms/pipelining_utils.py, build_pipeline_schedule), whatever the stages per rank
(the interleaved row's too). The interleaved schedule's stages per rank are not published; we assume 2.

The rows themselves are in published_runs.json (with every other validation set: labkit.scale.validation).
Only the first row of tables 1 and 3 is plain bf16 eager: the cost model aims at those. The
others use torch.compile and float8 matmuls (and async TP), which the model leaves out: they
are predicted and reported, not aimed at.
"""
from __future__ import annotations

import json
from pathlib import Path

from labkit.scale.cluster import load_cluster
from labkit.scale.cost import EFFICIENCY, predict
from labkit.scale.layout import Layout
from labkit.scale.specs import LLAMA3

SOURCE = "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md"
CLUSTER = "h100-grand-teton"
RUNS_FILE = Path(__file__).with_name("published_runs.json")

FIELDS = ("table", "model", "techniques", "dp", "cp", "tp", "pp", "local_batch", "seq_len", "recompute",
          "schedule", "tps_per_gpu", "memory_gib", "aimed")


def _runs() -> list[dict]:
    """The rows of labkit/scale/published_runs.json's set "torchtitan-2024-12" (the one copy of them), in
    this module's fields; "aimed": plain bf16 eager (nothing outside the model)."""
    rows = json.loads(RUNS_FILE.read_text())["sets"]["torchtitan-2024-12"]["rows"]
    return [dict(table=r["source_row"].split(":")[0].removeprefix("Table "), model=r["model"],
                 techniques=r["source_row"].split(": ", 1)[1], dp=r["dp"], cp=r["cp"], tp=r["tp"], pp=r["pp"],
                 local_batch=r["global_batch"] // r["dp"], seq_len=r["seq_len"], recompute=r["recompute"],
                 schedule=r["schedule"], tps_per_gpu=r["published"]["tps_per_gpu"],
                 memory_gib=r["published"]["memory_gib"], aimed=not r["outside_model"]) for r in rows]


RUNS = _runs()


def layout_of(run: dict) -> Layout:
    """The published setup as a Layout: micro-batches = pp stages (torchtitan's default then)."""
    micro = run["local_batch"] // run["pp"] if run["pp"] > 1 else run["local_batch"]
    return Layout(dp=run["dp"], cp=run["cp"], tp=run["tp"], pp=run["pp"], zero="zero3",
                  recompute=run["recompute"], micro_batch=micro, schedule=run["schedule"],
                  virtual_stages=2 if run["schedule"] == "interleaved" else 1)


def predict_published(cluster=CLUSTER, efficiency: float = EFFICIENCY) -> list[dict]:
    """One row per published run: published and predicted TPS/GPU and GiB, and the errors (pred/pub - 1)."""
    cluster = load_cluster(cluster)
    rows = []
    for run in RUNS:
        layout = layout_of(run)
        p = predict(LLAMA3[run["model"]], layout, cluster, global_batch=run["local_batch"] * run["dp"],
                    seq_len=run["seq_len"], efficiency=efficiency)
        rows.append(dict(run, predicted_tps=p.tokens_per_s_per_gpu, predicted_gib=p.peak_gib, mfu=p.mfu,
                         tps_error=p.tokens_per_s_per_gpu / run["tps_per_gpu"] - 1,
                         memory_error=p.peak_gib / run["memory_gib"] - 1, prediction=p))
    return rows


def format_rows(rows: list[dict]) -> str:
    head = (f"{'table':>5} {'model':>5} {'setup':58s} {'TPS/GPU':>8} {'pred':>7} {'err':>6} "
            f"{'GiB':>6} {'pred':>6} {'err':>6}  aimed")
    lines = [head]
    for r in rows:
        lines.append(f"{r['table']:>5} {r['model']:>5} {r['techniques'][:58]:58s} {r['tps_per_gpu']:8,d} "
                     f"{r['predicted_tps']:7,.0f} {r['tps_error']:+6.0%} {r['memory_gib']:6.1f} "
                     f"{r['predicted_gib']:6.1f} {r['memory_error']:+6.0%}  {'yes' if r['aimed'] else 'no'}")
    return "\n".join(lines)
