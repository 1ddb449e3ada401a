"""Throughput and model FLOPs utilisation (MFU).

    from labkit.measure.metrics import flops_per_token, mfu, peak_flops
    tok_s = tokens / seconds
    print(mfu(tok_s, model.config, seq_len=256, device="cuda"))   # e.g. 0.41, or None on a CPU

FLOPs per token of a training step (forward + backward), PaLM's estimate (appendix B):
    6 * N  +  12 * n_layers * d_model * seq_len
N counts the parameters a matmul touches: everything except the embedding table (a lookup,
not a matmul); the untied head counts. The second term is attention's QK^T and AV, which
have no parameters. MFU = achieved FLOPs/s / the device's peak FLOPs/s.

Peak FLOPs come from the vendors' data sheets (dense, no structured sparsity), per device
and math mode. `mfu` and `peak_flops` return None on a CPU or an unknown GPU rather than
a made-up number: add your device to PEAK_FLOPS.
"""
from __future__ import annotations

import re

import torch

TFLOPS = 1e12
# name fragment (as in torch.cuda.get_device_name) -> peak FLOP/s per math mode, dense.
# Fragments match whole words ("A10" is not "A100", "L4" is not "L40S"); the first match wins,
# so the specific variants come before the generic names.
PEAK_FLOPS = {
    "H100 PCIe": {"bf16": 756 * TFLOPS, "fp16": 756 * TFLOPS, "tf32": 378 * TFLOPS, "fp32": 51 * TFLOPS},
    "H100 NVL": {"bf16": 835 * TFLOPS, "fp16": 835 * TFLOPS, "tf32": 418 * TFLOPS, "fp32": 60 * TFLOPS},
    "H100": {"bf16": 989 * TFLOPS, "fp16": 989 * TFLOPS, "tf32": 495 * TFLOPS, "fp32": 67 * TFLOPS},  # SXM
    "H200": {"bf16": 989 * TFLOPS, "fp16": 989 * TFLOPS, "tf32": 495 * TFLOPS, "fp32": 67 * TFLOPS},  # SXM
    "A100": {"bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS, "tf32": 156 * TFLOPS, "fp32": 19.5 * TFLOPS},
    "L40S": {"bf16": 362 * TFLOPS, "fp16": 362 * TFLOPS, "tf32": 183 * TFLOPS, "fp32": 91.6 * TFLOPS},
    "L4": {"bf16": 121 * TFLOPS, "fp16": 121 * TFLOPS, "tf32": 60 * TFLOPS, "fp32": 30.3 * TFLOPS},
    "A10": {"bf16": 125 * TFLOPS, "fp16": 125 * TFLOPS, "tf32": 62.5 * TFLOPS, "fp32": 31.2 * TFLOPS},
    "V100": {"fp16": 125 * TFLOPS, "fp32": 15.7 * TFLOPS},  # SXM2; no bf16, no tf32
    "T4": {"fp16": 65 * TFLOPS, "fp32": 8.1 * TFLOPS},
    "RTX 4090": {"bf16": 165.2 * TFLOPS, "fp16": 165.2 * TFLOPS, "tf32": 82.6 * TFLOPS, "fp32": 82.6 * TFLOPS},
    "RTX 3090": {"bf16": 71 * TFLOPS, "fp16": 71 * TFLOPS, "tf32": 35.6 * TFLOPS, "fp32": 35.6 * TFLOPS},
}


def matmul_params(config) -> int:
    """Parameters used in matmuls (all but the embedding table), from the config alone."""
    d, h, L, V = config.d_model, config.hidden_dim, config.n_layers, config.vocab_size
    per_layer = 4 * d * d + 3 * d * h + 2 * d  # wq wk wv wo, w1 w2 w3, two RMSNorm weights
    return L * per_layer + d + V * d  # + final norm + head


def flops_per_token(config, seq_len: int | None = None) -> int:
    """Training FLOPs per token (forward + backward): 6 N + 12 n_layers d_model seq_len."""
    seq_len = config.context if seq_len is None else seq_len
    return 6 * matmul_params(config) + 12 * config.n_layers * config.d_model * seq_len


def math_mode(dtype: torch.dtype = torch.float32) -> str:
    """'bf16', 'fp16', 'tf32' (fp32 matmuls allowed to use TF32 tensor cores) or 'fp32'."""
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    # TF32 runs where either switch allows it: the old flag, or set_float32_matmul_precision("high"/"medium")
    tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    return "tf32" if tf32 else "fp32"


def lookup_peak(device_name: str, mode: str = "bf16") -> float | None:
    """Peak FLOP/s of a GPU by its name (torch.cuda.get_device_name) and math mode; None if unknown."""
    for fragment, peaks in PEAK_FLOPS.items():
        if re.search(rf"\b{fragment}\b", device_name):
            return peaks.get(mode)
    return None


def peak_flops(device=None, dtype: torch.dtype = torch.bfloat16) -> float | None:
    """The device's dense peak FLOP/s for `dtype`; None on a CPU or an unknown GPU."""
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return lookup_peak(torch.cuda.get_device_name(device), math_mode(dtype))


def mfu(tokens_per_s: float, config, seq_len: int | None = None, device=None,
        dtype: torch.dtype = torch.bfloat16, n_devices: int = 1) -> float | None:
    """Model FLOPs utilisation in [0, 1] of `n_devices` devices, or None where the peak is unknown."""
    peak = peak_flops(device, dtype)
    if peak is None:
        return None
    return tokens_per_s * flops_per_token(config, seq_len) / (peak * n_devices)


def format_rate(tokens_per_s: float) -> str:
    """'12.3k tok/s'."""
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if tokens_per_s >= scale:
            return f"{tokens_per_s / scale:.1f}{unit} tok/s"
    return f"{tokens_per_s:.0f} tok/s"
