"""The cost model against published runs it was not built on: torchtitan's rows (labkit.scale.published)
and Megatron-LM 2021's Table 1 (Narayanan et al., arXiv 2104.04473), kept here, test-local, until the
validation set of bench/scale.py lands.

    PYTHONPATH=. python tests/scale_validation.py           # the table, median and worst |error|
    PYTHONPATH=. python tests/scale_validation.py --flat    # the same rows by the flat model (before)
    PYTHONPATH=. python tests/scale_validation.py --small   # the lab's tiny and seed models on one H200
    PYTHONPATH=. python tests/scale_validation.py --sets    # after merging s40-published: its 47 runs

Megatron-LM 2021 Table 1 (GPT models on Selene, DGX A100 80GB, 8 x 200 Gb/s HDR per node; sequence
2048, vocabulary 51,200): its "achieved teraFLOP/s per GPU" counts FLOPs with its own formula,
96 B s l h^2 (1 + s / 6h + V / 16 l h) per batch (full activation recomputation included), so
tokens/s/GPU = TFLOP/s / (96 l h^2 (1 + s/6h + V/16lh)). Unpublished inputs, chosen before looking
at any result: GPT's 4h GELU MLP as a SwiGLU of the same parameters (hidden 8h/3, rounded to a
multiple of 8), micro-batch 1, plain 1F1B, no sequence parallelism (2021), full recompute (the paper's),
plain data parallelism with bucketed all-reduce, attention unfused (no FlashAttention in 2021).
torchtitan rows: their flags from the "techniques" column (compile, float8, async TP); attention
torch SDPA's FlashAttention-2.
"""
from __future__ import annotations

import statistics

from labkit.scale.cluster import load_cluster
from labkit.scale.cost import predict
from labkit.scale.layout import Layout
from labkit.scale.published import RUNS, layout_of
from labkit.scale.specs import LLAMA3, ModelSpec

# (billions, heads, hidden, layers, tp, pp, gpus, batch, achieved TFLOP/s per GPU): Table 1
MEGATRON_2021 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
SEQ, VOCAB = 2048, 51200


def megatron_rows(**kw) -> list[dict]:
    cluster = load_cluster("a100-sxm")
    rows = []
    for billions, heads, h, layers, tp, pp, gpus, batch, tflops in MEGATRON_2021:
        hidden = round(8 * h / 3 / 8) * 8
        spec = ModelSpec(f"gpt-{billions}b", d_model=h, n_layers=layers, n_heads=heads, n_kv_heads=heads,
                         hidden_dim=hidden, vocab_size=VOCAB)
        dp = gpus // (tp * pp)
        lay = Layout(dp=dp, tp=tp, pp=pp, zero="dp", recompute="full", micro_batch=1, sequence_parallel=False)
        flops_per_token = 96 * layers * h * h * (1 + SEQ / (6 * h) + VOCAB / (16 * layers * h))
        published = tflops * 1e12 / flops_per_token
        p = predict(spec, lay, cluster, batch, SEQ, **kw)
        rows.append(dict(source="Megatron 2021 T1", setup=f"{billions}B tp{tp} pp{pp} dp{dp}", published=published,
                         predicted=p.tokens_per_s_per_gpu, parts=p.parts_s))
    return rows


def torchtitan_rows(flags: bool = True, **kw) -> list[dict]:
    cluster = load_cluster("h100-grand-teton")
    rows = []
    for run in RUNS:
        t = run["techniques"]
        opts = dict(compile="compile" in t, float8="float8" in t, async_tp="async TP" in t) if flags else {}
        p = predict(LLAMA3[run["model"]], layout_of(run), cluster, run["local_batch"] * run["dp"], run["seq_len"],
                    **opts, **kw)
        rows.append(dict(source=f"torchtitan T{run['table']}", setup=f"{run['model']} {t}", published=run["tps_per_gpu"],
                         predicted=p.tokens_per_s_per_gpu, parts=p.parts_s))
    return rows


def summary(rows) -> dict:
    errors = [abs(r["predicted"] / r["published"] - 1) for r in rows]
    return dict(median=statistics.median(errors), worst=max(errors),
                within_25=sum(e <= 0.25 for e in errors), rows=len(errors))


def format_table(rows) -> str:
    lines = [f"{'source':18s} {'setup':62s} {'published':>10s} {'predicted':>10s} {'error':>7s}"]
    for r in rows:
        lines.append(f"{r['source']:18s} {r['setup'][:62]:62s} {r['published']:10,.0f} {r['predicted']:10,.0f} "
                     f"{r['predicted'] / r['published'] - 1:+7.1%}")
    s = summary(rows)
    lines.append(f"median |error| {s['median']:.1%}, worst {s['worst']:.1%}, {s['within_25']}/{s['rows']} within 25%")
    return "\n".join(lines)


def small_end() -> str:
    """The lab's own models on one H200 (bench/single_device.py, /work/shared/gpu-2026-11-26/single_bf16.txt:
    tiny 409.1k tok/s at batch 64 x 128, seed 523.1k at 64 x 256, bf16, eager): predicted, and what bounds a block."""
    from labkit.model import get_config
    from labkit.scale.specs import spec_from_config

    cluster, lines = load_cluster("h200-sxm"), []
    for name, batch, seq, measured in (("tiny", 64, 128, 409.1e3), ("seed", 64, 256, 523.1e3)):
        spec = spec_from_config(get_config(name, context=seq))
        p = predict(spec, Layout(zero="dp", recompute="none", micro_batch=batch, sequence_parallel=False), cluster,
                    batch, seq, n_gpus=1, efficiency=None)
        bound = {k: f"{v / sum(p.bound_s.values()):.0%}" for k, v in p.bound_s.items()}
        lines.append(f"{name}: measured {measured:,.0f} tok/s, predicted {p.tokens_per_s_per_gpu:,.0f} "
                     f"({p.tokens_per_s_per_gpu / measured - 1:+.0%}); a block's time by bound: {bound}")
    return "\n".join(lines)


def validation_sets(kernels: bool = True) -> str:
    """After the merge with the validation set (labkit.scale.validation, published_runs.json): every set's rows
    predicted by the kernel model, each row's flags from its "outside_model" list (torch.compile, float8,
    async TP), or by the flat model (kernels=False)."""
    import labkit.scale.validation as V

    plain = V.predict

    def predict_row(row, set_info, _row=V.predict_row):
        out = row.get("outside_model", [])
        flags = dict(efficiency=None, compile="torch.compile" in out, float8="float8" in out,
                     async_tp="async TP" in out) if kernels else {}
        V.predict = lambda *a, **k: plain(*a, **k, **flags)
        try:
            return _row(row, set_info)
        finally:
            V.predict = plain

    results = {name: [predict_row(r, info) for r in info["rows"]] for name, info in V.load_sets().items()}
    rows = [r for got in results.values() for r in got]
    return V.format_sets(results) + f"\nall sets: {V.summarize(rows)}"


if __name__ == "__main__":
    import sys

    if "--sets" in sys.argv:  # needs labkit.scale.validation (branch s40-published)
        print(validation_sets(kernels="--flat" not in sys.argv))
        raise SystemExit
    if "--small" in sys.argv:
        print(small_end())
        raise SystemExit

    flat = "--flat" in sys.argv  # the flat model (compute / (peak x 0.40)), as before the kernel model
    kw = dict(efficiency=0.40) if flat else dict(efficiency=None)
    rows = torchtitan_rows(flags=not flat, **kw) + megatron_rows(**kw)
    print(format_table(rows))
