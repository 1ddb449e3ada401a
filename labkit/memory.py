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
temporary buffers, the gathered layer of ZeRO-3, fragmentation, and Adam's step counter.

    from labkit.memory import memory_per_rank, param_count, LLAMA_7B
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


def memory_per_rank(n_params: int, world_size: int, stage: str = "dp", precision: str = "mixed") -> dict:
    """Bytes of params, grads and optimizer states on ONE rank, and their total.

    stage: "dp", "zero1", "zero2" or "zero3"; precision: "mixed" (2+2+12) or "fp32" (4+4+8).
    """
    _check(world_size, stage, precision)
    if n_params < 0:
        raise ValueError(f"n_params must be >= 0, got {n_params}")
    shard = math.ceil(n_params / world_size)
    out = {}
    for state, nbytes in PRECISIONS[precision].items():
        out[state] = nbytes * (shard if state in SHARDED[stage] else n_params)
    out["total"] = sum(out.values())
    return out


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


def memory_table(n_params: int, world_size: int, precision: str = "mixed") -> list[dict]:
    """One row per stage: memory_per_rank plus the stage's name."""
    return [dict(stage=s, name=STAGE_NAMES[s], **memory_per_rank(n_params, world_size, s, precision))
            for s in STAGES]


def format_bytes(n: float) -> str:
    """Human-readable bytes with binary prefixes: 1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def format_table(n_params: int, world_size: int, precision: str = "mixed") -> str:
    """The memory table as aligned text, per rank."""
    head = f"{'per rank':30s} {'params':>12s} {'grads':>12s} {'optimizer':>12s} {'total':>12s}"
    lines = [f"{n_params:,} parameters, {world_size} ranks, {precision} "
             f"({'+'.join(str(b) for b in PRECISIONS[precision].values())} bytes/param)", head]
    for row in memory_table(n_params, world_size, precision):
        lines.append(f"{row['name']:30s} " + " ".join(f"{format_bytes(row[k]):>12s}"
                                                       for k in ("params", "grads", "optimizer", "total")))
    return "\n".join(lines)


def plot_memory(n_params: int, world_size: int, precision: str = "mixed", gpu_bytes: float | None = None, ax=None):
    """Stacked bars of params / grads / optimizer states per rank for each stage."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    rows = memory_table(n_params, world_size, precision)
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
    out = w.Output()

    def update(*_):
        with out:
            out.clear_output(wait=True)
            n = int(params.value)
            print(format_table(n, ranks.value, prec.value))
            fits = [s for s in STAGES if memory_per_rank(n, ranks.value, s, prec.value)["total"] <= gpu.value * 2**30]
            print(f"model states fit in {gpu.value:g} GiB with: {', '.join(fits) or 'none of the stages'}")
            plot_memory(n, ranks.value, prec.value, gpu.value * 2**30)
            plt.show()

    for widget in (params, ranks, prec, gpu):
        widget.observe(update, names="value")
    update()
    return w.VBox([w.HBox([params, ranks]), w.HBox([prec, gpu]), out])
