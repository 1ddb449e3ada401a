"""The validation set: published training runs, and the cost model's error on each (bench/scale.py, notebook 15).

The runs live in `published_runs.json`, one set per source (torchtitan's two H100 benchmark files,
Megatron-LM 2021 Table 1, Megatron-LM 2022's MFU table, Llama 3's Table 4). Each row carries its
source row and a quote of its text; each set states the inputs its source does not publish
("choices"), chosen before any prediction was made. The rows validate; nothing is fitted to them.

A published figure becomes tokens/s per GPU by the source's own FLOP count:
    tps_per_gpu      as published (torchtitan)
    tflops_per_gpu   Megatron 2021: / eq. 3 with recomputation (`ModelSpec.paper_flops_per_token`);
                     Llama 3: / model FLOPs per token (`ModelSpec.flops_per_token`)
    mfu              Megatron 2022: MFU x peak / eq. 3 without recomputation
The error of a row is predicted / published - 1 (throughput, and memory where published: published
memory is torch's peak reserved, so it is compared with `Prediction.reserved_gib`, the tensors' peak plus
the cuBLAS workspace's segment; "fits" is the peak plus labkit.scale.reserve's whole reserve within the GPU).

Two models predict (`MODELS_OF_COST`): "flat", compute / (peak x labkit.scale.cost.EFFICIENCY) plus
exposed traffic and bubble, the default of `predict`; and "kernels", every op by a roofline from
kernel-level figures (`predict(..., efficiency=None)`), with each row's torch.compile, float8 (its
recipe: "float8 rowwise" where the source names rowwise scales, else tensorwise, torchao's default) and
async TP (its "outside_model" list) switched on, since the kernel model can express them.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

from labkit.scale.cluster import load_cluster
from labkit.scale.cost import predict
from labkit.scale.layout import Layout
from labkit.scale.specs import MODELS

RUNS_FILE = Path(__file__).with_name("published_runs.json")
LAYOUT_FIELDS = ("dp", "pp", "cp", "tp", "zero", "recompute", "micro_batch", "schedule", "virtual_stages",
                 "first_stage_embedding_only", "last_stage_loss_only", "cp_method", "zero3_unit", "sequence_parallel",
                 "grad_reduce", "kv_rotation")


def load_sets(path: Path | str = RUNS_FILE) -> dict:
    """{set name: {"source", "cluster", "metric", "choices", "rows", ...}} from the data file."""
    return json.loads(Path(path).read_text())["sets"]


def layout_of(row: dict) -> Layout:
    """A row's layout: the fields it gives (Layout's defaults for the rest: sequence parallelism on)."""
    return Layout(**{k: row[k] for k in LAYOUT_FIELDS if k in row})


def published_tps(row: dict, spec, set_info: dict, peak_flops: float) -> float:
    """The row's published throughput as tokens/s per GPU, by its source's own FLOP count."""
    pub, seq = row["published"], row["seq_len"]
    if "tps_per_gpu" in pub:
        return float(pub["tps_per_gpu"])
    flops = set_info.get("flops", "model")
    if "tflops_per_gpu" in pub and flops == "eq3-recompute":
        return pub["tflops_per_gpu"] * 1e12 / spec.paper_flops_per_token(seq, recompute=True)
    if "tflops_per_gpu" in pub and flops == "model":
        return pub["tflops_per_gpu"] * 1e12 / spec.flops_per_token(seq)
    if "mfu_percent" in pub and flops == "eq3-no-recompute":
        return pub["mfu_percent"] / 100 * peak_flops / spec.paper_flops_per_token(seq, recompute=False)
    raise ValueError(f"row {row['id']}: no published figure this module reads ({sorted(pub)} with flops={flops!r})")


MODELS_OF_COST = ("flat", "kernels")


def row_spec(row: dict):
    """The row's ModelSpec: its model, with the implementation flags the row sets (fused_kernels, sp_saves_shard,
    kv_repeated, unpadded_attention)."""
    spec = MODELS[row["model"]]
    flags = {flag: True for flag in ("fused_kernels", "sp_saves_shard", "kv_repeated", "unpadded_attention")
             if row.get(flag)}
    return dataclasses.replace(spec, **flags) if flags else spec


def model_options(row: dict, model: str, set_info: dict | None = None) -> dict:
    """`predict`'s keywords for one row under the flat or the kernel model. Both read whether the loss ran compiled
    (its logits' memory, labkit.scale.footprint): with "torch.compile", unless set_info's "compiled_loss" says
    otherwise (torchtitan's 2024 code ran it eager beside a compiled model); the kernel model reads the rest."""
    if model not in MODELS_OF_COST:
        raise ValueError(f"unknown cost model {model!r}: use one of {MODELS_OF_COST}")
    out = row.get("outside_model", [])
    compiled = "torch.compile" in out
    loss = (set_info or {}).get("compiled_loss")
    loss = compiled if loss is None else loss
    if model == "flat":
        return {"compiled_loss": loss}
    float8 = "rowwise" if "float8 rowwise" in out else "float8" in out  # True: torchao's default, tensorwise
    return dict(efficiency=None, compile=compiled, float8=float8, async_tp="async TP" in out,
                float8_all_gather="float8 all-gather" in out, compiled_loss=loss)


def predict_row(row: dict, set_info: dict, model: str = "flat") -> dict:
    """One row: published and predicted tokens/s/GPU and GiB, the errors, whether it fits."""
    cluster = load_cluster(set_info["cluster"])
    spec = row_spec(row)
    p = predict(spec, layout_of(row), cluster, global_batch=row["global_batch"], seq_len=row["seq_len"],
                **model_options(row, model, set_info))
    pub_tps = published_tps(row, spec, set_info, cluster.peak_bf16_flops)
    gib = row["published"].get("memory_gib")
    return dict(id=row["id"], source_row=row["source_row"], model=row["model"], layout=p.layout.short(),
                outside_model=row.get("outside_model", []), published_tps=pub_tps, predicted_tps=p.tokens_per_s_per_gpu,
                tps_error=p.tokens_per_s_per_gpu / pub_tps - 1, published_gib=gib, predicted_gib=p.reserved_gib,
                memory_error=None if gib is None else p.reserved_gib / gib - 1, fits=p.fits,
                reserve_gib=p.reserve["total"] / 2**30,
                gpu_gib=cluster.memory_gib, note=row.get("note"), prediction=p)


def lab_model_on_one_gpu(name: str, batch: int, seq: int, cluster_name: str) -> dict:
    """labkit.model's `name` ("tiny", "seed") trained alone on one GPU of `cluster_name`, eager, no recompute, as the
    kernel model sees it: its tokens/s, a block's time by bound (shares of it), and one step's kernels as
    layer_ops.step_kernels counts them, with the GPU kind's CPU cost per kernel (eager_op_us). The small end of the
    validation: bench/scale.py --small and bench/gpu_check.py's predict row set it beside measured steps."""
    from labkit.model import get_config
    from labkit.scale.gpu import load_gpu
    from labkit.scale.layer_ops import step_kernels
    from labkit.scale.specs import spec_from_config

    cluster = load_cluster(cluster_name)
    spec, gpu = spec_from_config(get_config(name, context=seq)), load_gpu(cluster.gpu)
    p = predict(spec, Layout(zero="dp", recompute="none", micro_batch=batch, sequence_parallel=False), cluster,
                batch, seq, n_gpus=1, efficiency=None)
    total = sum(p.bound_s.values())
    return {"tokens_per_s": p.tokens_per_s_per_gpu, "bound": {k: v / total for k, v in p.bound_s.items()},
            "kernels": step_kernels(spec, gpu, batch, seq)["kernels"], "eager_op_us": gpu.eager_op_us}


# the outside_model tags of each mechanism whose gain `gains` checks
MECHANISM_TAGS = {"float8": ("float8", "float8 rowwise"), "async TP": ("async TP",)}


def _precision(row: dict) -> str:
    tags = row["outside_model"]
    return "rowwise" if "float8 rowwise" in tags else "tensorwise" if "float8" in tags else "bf16"


def gains(results: dict, mechanism: str = "float8") -> list[dict]:
    """Each row with `mechanism` (a key of MECHANISM_TAGS) beside its set's row of the same run without it (model,
    layout, every other item of outside_model alike): {set, id, base (the row without it), recipe (the row's
    precision: bf16, tensorwise or rowwise float8), measured (published tok/s ratio - 1), predicted (the same of the
    predictions)}. What the two rows share cancels in the ratio (the GPU's clock, the network, the framework's
    overheads), so the gain checks that mechanism alone: for float8, torchao's GEMMs, casts and float8 TP; for
    async TP, the decomposed collectives (labkit.scale.async_tp). results: predict_sets'."""
    tags = MECHANISM_TAGS[mechanism]
    out = []
    for name, rows in results.items():
        def key(r):
            return r["model"], r["layout"], tuple(sorted(t for t in r["outside_model"] if t not in tags))

        without = {key(r): r for r in rows if tags[0] not in r["outside_model"]}
        for r in rows:
            base = without.get(key(r)) if tags[0] in r["outside_model"] else None
            if base:
                out.append(dict(set=name, id=r["id"], base=base["id"], recipe=_precision(r),
                                measured=r["published_tps"] / base["published_tps"] - 1,
                                predicted=r["predicted_tps"] / base["predicted_tps"] - 1))
    return out


def predict_sets(path: Path | str = RUNS_FILE, model: str = "flat") -> dict:
    """{set name: [predict_row of each row]}"""
    return {name: [predict_row(r, info, model) for r in info["rows"]] for name, info in load_sets(path).items()}


def summarize(rows: list[dict]) -> dict:
    """n, rows within 25%, median and worst |throughput error|, worst |memory error| (None if none)."""
    errs = [abs(r["tps_error"]) for r in rows]
    mems = [abs(r["memory_error"]) for r in rows if r["memory_error"] is not None]
    return dict(n=len(rows), within_25=sum(e <= 0.25 for e in errs), median_abs_tps_error=statistics.median(errs),
                worst_abs_tps_error=max(errs), worst_abs_memory_error=max(mems) if mems else None)


def format_sets(results: dict) -> str:
    """A readable table: one line per row, a summary line per set."""
    lines = []
    for name, rows in results.items():
        lines.append(f"\n{name}")
        lines.append(f"  {'row':38s} {'layout':38s} {'tok/s/GPU':>9} {'pred':>8} {'err':>6} {'GiB':>6} {'pred':>6} "
                     f"{'err':>6} fits  outside the model")
        for r in rows:
            gib = f"{r['published_gib']:6.1f}" if r["published_gib"] is not None else f"{'-':>6}"
            merr = f"{r['memory_error']:+6.0%}" if r["memory_error"] is not None else f"{'-':>6}"
            lines.append(f"  {r['source_row'][:38]:38s} {r['layout'][:38]:38s} {r['published_tps']:9,.0f} "
                         f"{r['predicted_tps']:8,.0f} {r['tps_error']:+6.0%} {gib} {r['predicted_gib']:6.1f} {merr} "
                         f"{'yes' if r['fits'] else 'NO ':4s} {', '.join(r['outside_model']) or '-'}")
        s = summarize(rows)
        lines.append(f"  -> {s['n']} rows, {s['within_25']} within 25%, median |err| {s['median_abs_tps_error']:.0%}, "
                     f"worst {s['worst_abs_tps_error']:.0%}")
    return "\n".join(lines)
