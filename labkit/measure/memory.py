"""Memory per rank for the model states under plain DP and ZeRO stages 1, 2, 3 (notebook 09).

The formulas are those of the ZeRO paper (Rajbhandari et al. 2020, section 3 and figure 1),
for a model of P parameters trained with Adam on N data-parallel ranks:

                    params        grads         optimizer states
    plain DP        p P           g P           k P
    ZeRO-1 (os)     p P           g P           k P / N
    ZeRO-2 (os+g)   p P           g P / N       k P / N
    ZeRO-3 (os+g+p) p P / N       g P / N       k P / N       (what FSDP implements)

bytes per parameter (p, g, k):
    "mixed"  2, 2, 12  bf16/fp16 params and grads; fp32 master params + exp_avg + exp_avg_sq
                       (the paper's K = 12: 16 bytes per parameter in all)
    "fp32"   4, 4, 8   everything fp32, as in this lab on CPU: the params ARE the master
                       copy, Adam adds exp_avg + exp_avg_sq (16 bytes per parameter too)
Sharded terms are rounded up: a rank holds ceil(P / N) elements of a flat, padded tensor.
Not counted: activations (they depend on batch, sequence and checkpointing, not on ZeRO),
temporary buffers, fragmentation, and Adam's step counter. ZeRO-3 also holds one gathered
layer at a time (its parameters, then its full gradient until it is reduce-scattered):
`gathered_layer_bytes`; `suggest` counts it.

Offload (ZeRO-Offload, Ren et al. 2021; FSDP2's CPUOffloadPolicy): `offload=True` moves the
optimizer states (k bytes/param: in mixed precision the fp32 master copy and both Adam
moments) to the host's memory, and the update runs on the CPU. The GPU keeps params and grads;
the result gets an "offloaded" entry: the host bytes per rank, not part of "total".

    from labkit.measure.memory import memory_per_rank, param_count, LLAMA_7B
    memory_per_rank(param_count(LLAMA_7B), world_size=8, stage="zero2")
"""
from __future__ import annotations

import math

from labkit.model import ModelConfig, get_config

PRECISIONS = {
    "mixed": dict(params=2, grads=2, optimizer=12),
    "fp32": dict(params=4, grads=4, optimizer=8),
}
STAGES = ("dp", "zero1", "zero2", "zero3")
STAGE_NAMES = {"dp": "plain DP", "zero1": "ZeRO-1 (optimizer states)",
               "zero2": "ZeRO-2 (+ gradients)", "zero3": "ZeRO-3 / FSDP (+ parameters)"}
# which of the three model states a stage shards over the ranks
SHARDED = {"dp": (), "zero1": ("optimizer",), "zero2": ("optimizer", "grads"),
           "zero3": ("optimizer", "grads", "params")}

# LLaMA-2 7B in labkit.model's terms (untied head, SwiGLU 11008): 6.74e9 parameters
LLAMA_7B = ModelConfig(vocab_size=32000, d_model=4096, n_heads=32, n_layers=32, context=4096,
                       hidden_dim=11008)


def param_count(config: ModelConfig | str) -> int:
    """Parameters of labkit.model's Transformer for `config`, without building it.

    embedding V*D + per layer (attention 4*D*D + SwiGLU 3*D*H + two norms 2*D)
    + final norm D + head V*D.
    """
    c = get_config(config) if isinstance(config, str) else config
    D, H, V, L = c.d_model, c.hidden_dim, c.vocab_size, c.n_layers
    return 2 * V * D + L * (4 * D * D + 3 * D * H + 2 * D) + D


def _check(world_size: int, stage: str, precision: str) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {tuple(PRECISIONS)}, got {precision!r}")


def memory_per_rank(n_params: int, world_size: int, stage: str = "dp", precision: str = "mixed",
                    offload: bool = False) -> dict:
    """Bytes of params, grads and optimizer states on ONE rank's device, and their total.

    stage: "dp", "zero1", "zero2" or "zero3"; precision: "mixed" (2+2+12) or "fp32" (4+4+8).
    offload=True: the optimizer states live in host memory instead ("optimizer" is 0 on the
    device, "offloaded" holds the host bytes per rank; "total" counts the device only).
    """
    _check(world_size, stage, precision)
    if n_params < 0:
        raise ValueError(f"n_params must be >= 0, got {n_params}")
    shard = math.ceil(n_params / world_size)
    out = {}
    for state, nbytes in PRECISIONS[precision].items():
        out[state] = nbytes * (shard if state in SHARDED[stage] else n_params)
    host = out["optimizer"] if offload else 0
    if offload:
        out["optimizer"] = 0
    out["total"] = sum(out.values())
    if offload:
        out["offloaded"] = host
    return out


def gathered_layer_bytes(layer_params: int, precision: str = "mixed") -> int:
    """Bytes a ZeRO-3 rank holds for ONE gathered layer: its parameters, then its full gradient."""
    _check(1, "zero3", precision)
    return (PRECISIONS[precision]["params"] + PRECISIONS[precision]["grads"]) * layer_params


def suggest(n_params: int, gpu_gb: float, n_gpus: int, gpus_per_node: int = 8, largest_layer_params: int = 0,
            fast_inter_node: bool = True, headroom: float = 0.7) -> dict:
    """A first strategy for training `n_params` with Adam in mixed precision (notebook 10).

    Returns {"plan": text, "stage": the ZeRO stage the plan assumes ("dp" = no ZeRO, "zero1",
    "zero3"), "per_gpu": model-state bytes per GPU}. `headroom` of each GPU's gpu_gb * 1e9 bytes
    is for model states, the rest for activations. The rules, in order:
      1. the 16 bytes/param fit on one GPU: plain DP (no ZeRO);
      2. fast links and ZeRO-3 fits: 16 P / N sharded states + ONE gathered layer's params and
         grads (2 + 2 bytes/param; prefetching holds a second layer's params: the head-room);
      3. that gathered layer alone is too big: TP inside a node splits it (TP x ZeRO-3);
      4. otherwise (slow links, or still too big): PP stages across nodes x DP with ZeRO-1.
    Under DP and ZeRO-1/2 the whole model's parameters sit on every GPU, so rule 1 (and PP's
    stages) need the full 16 bytes of every layer they hold; under ZeRO-3 only a layer's
    gathered parameters must be resident at once.
    """
    if n_gpus < 1 or gpu_gb <= 0:
        raise ValueError(f"need n_gpus >= 1 and gpu_gb > 0, got {n_gpus} and {gpu_gb}")
    budget = headroom * gpu_gb * 1e9
    dp = memory_per_rank(n_params, 1, "dp")["total"]
    if dp <= budget:
        return dict(plan=f"DP on {n_gpus} GPU(s), no ZeRO: the model states take {format_bytes(dp)} "
                         f"of {gpu_gb:g} GB", stage="dp", per_gpu=dp)
    layer = gathered_layer_bytes(largest_layer_params)
    z3 = memory_per_rank(n_params, n_gpus, "zero3")["total"]
    if fast_inter_node and z3 + layer <= budget:
        gathered = f"{format_bytes(layer)} for the gathered layer" if layer else "one gathered layer (size not given)"
        return dict(plan=f"ZeRO-3 / FSDP on {n_gpus} GPUs: {format_bytes(z3)} of sharded states + "
                         f"{gathered} per GPU; fast links make the gathers cheap",
                    stage="zero3", per_gpu=z3 + layer)
    if fast_inter_node and layer > budget - z3:
        tp = 2
        while z3 + layer / tp > budget and tp < gpus_per_node:
            tp *= 2
        if z3 + layer / tp <= budget:
            return dict(plan=f"TP={tp} inside a node x ZeRO-3: one gathered layer ({format_bytes(layer)}) "
                             f"does not fit next to the shards, TP splits it", stage="zero3",
                        per_gpu=z3 + layer / tp)
    pp = 2
    while memory_per_rank(n_params // pp, max(1, n_gpus // pp), "zero1")["total"] > budget and pp < n_gpus:
        pp *= 2
    per_gpu = memory_per_rank(n_params // pp, max(1, n_gpus // pp), "zero1")["total"]
    return dict(plan=f"PP={pp} stages across nodes x DP={max(1, n_gpus // pp)} with ZeRO-1 "
                     f"({format_bytes(per_gpu)} per GPU)"
                     + ("" if fast_inter_node else ": slow links carry only the stage boundaries' activations"),
                stage="zero1", per_gpu=per_gpu)


def max_params(gpu_bytes: float, world_size: int, stage: str = "dp", precision: str = "mixed") -> int:
    """The largest model whose model states fit in gpu_bytes per rank (activations not counted)."""
    _check(world_size, stage, precision)
    per_param = sum(b / world_size if s in SHARDED[stage] else b for s, b in PRECISIONS[precision].items())
    n = int(gpu_bytes / per_param)
    fits = lambda m: memory_per_rank(m, world_size, stage, precision)["total"] <= gpu_bytes
    while n > 0 and not fits(n):  # the shards' rounding up can cost a few parameters
        n -= 1
    while fits(n + 1):
        n += 1
    return n


def memory_table(n_params: int, world_size: int, precision: str = "mixed", offload: bool = False) -> list[dict]:
    """One row per stage: memory_per_rank plus the stage's name."""
    return [dict(stage=s, name=STAGE_NAMES[s], **memory_per_rank(n_params, world_size, s, precision, offload))
            for s in STAGES]


def format_bytes(n: float) -> str:
    """Human-readable bytes with binary prefixes: 1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def format_table(n_params: int, world_size: int, precision: str = "mixed", offload: bool = False) -> str:
    """The memory table as aligned text, per rank (with offload: the device's bytes, then the host's)."""
    keys = ("params", "grads", "optimizer", "total") + (("offloaded",) if offload else ())
    head = f"{'per rank':30s} " + " ".join(f"{'host' if k == 'offloaded' else k:>12s}" for k in keys)
    lines = [f"{n_params:,} parameters, {world_size} ranks, {precision} "
             f"({'+'.join(str(b) for b in PRECISIONS[precision].values())} bytes/param)"
             + (", optimizer states offloaded to the host" if offload else ""), head]
    for row in memory_table(n_params, world_size, precision, offload):
        lines.append(f"{row['name']:30s} " + " ".join(f"{format_bytes(row[k]):>12s}" for k in keys))
    return "\n".join(lines)


def plot_memory(n_params: int, world_size: int, precision: str = "mixed", gpu_bytes: float | None = None, ax=None,
                offload: bool = False):
    """Stacked bars of params / grads / optimizer states per rank (on the device) for each stage."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    rows = memory_table(n_params, world_size, precision, offload)
    unit, scale = ("GiB", 2**30) if rows[0]["total"] >= 2**30 else ("MiB", 2**20)
    bottom = [0.0] * len(rows)
    for state, color in (("params", "tab:blue"), ("grads", "tab:orange"), ("optimizer", "tab:green")):
        values = [r[state] / scale for r in rows]
        ax.bar([r["stage"] for r in rows], values, bottom=bottom, label=state, color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    if gpu_bytes:
        ax.axhline(gpu_bytes / scale, color="red", linestyle="--", label=f"GPU {gpu_bytes / 2**30:.0f} GiB")
    ax.set_ylabel(f"{unit} per rank")
    size = f"{n_params / 1e9:.3g}B" if n_params >= 1e9 else f"{n_params / 1e6:.3g}M"
    ax.set_title(f"{size} params on {world_size} ranks ({precision}); activations not counted", fontsize=10)
    ax.legend()
    return ax


def calculator(n_params: int | None = None, world_size: int = 8, precision: str = "mixed",
               gpu_gib: float = 80.0):
    """An ipywidgets calculator: model size, ranks, precision, GPU memory -> table and bars."""
    import ipywidgets as w
    import matplotlib.pyplot as plt

    n_params = n_params if n_params is not None else param_count(LLAMA_7B)
    params = w.FloatLogSlider(value=n_params, base=10, min=6, max=12, step=0.05, description="params",
                              readout_format=".3g", continuous_update=False)
    ranks = w.SelectionSlider(options=[2**i for i in range(11)], value=world_size, description="ranks",
                              continuous_update=False)
    prec = w.Dropdown(options=list(PRECISIONS), value=precision, description="precision")
    gpu = w.FloatText(value=gpu_gib, description="GPU GiB")
    offload = w.Checkbox(value=False, description="offload optimizer states to the CPU")
    out = w.Output()

    def update(*_):
        with out:
            out.clear_output(wait=True)
            n = int(params.value)
            print(format_table(n, ranks.value, prec.value, offload.value))
            fits = [s for s in STAGES if memory_per_rank(n, ranks.value, s, prec.value, offload.value)["total"]
                    <= gpu.value * 2**30]
            print(f"model states fit in {gpu.value:g} GiB with: {', '.join(fits) or 'none of the stages'}")
            plot_memory(n, ranks.value, prec.value, gpu.value * 2**30, offload=offload.value)
            plt.show()

    for widget in (params, ranks, prec, gpu, offload):
        widget.observe(update, names="value")
    update()
    return w.VBox([w.HBox([params, ranks]), w.HBox([prec, gpu]), offload, out])
