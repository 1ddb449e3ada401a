"""Activation memory: what autograd keeps for backward, counted, and the formula it follows (notebook 11).

    from labkit.measure.activations import SavedTensors, block_activation_elements
    with SavedTensors(model) as saved:          # parameters and buffers are not activations
        loss = model(x, y)
    saved.nbytes                                # bytes held for backward, each storage once

Counting uses `torch.autograd.graph.saved_tensors_hooks`: every tensor an operation saves for
backward passes through the pack hook, and we add up the distinct storages (a view, a
transpose, a reshape of a saved tensor costs nothing more). It is exact and deterministic,
unlike an allocator reading, and it works on a CPU. With `torch.utils.checkpoint`
(recomputation, `ModelConfig(recompute=True)`) the checkpoint saves only each block's input
through these hooks; the block's own activations exist again, one block at a time, during
backward: `recompute_peak_elements` adds that.

The formula (elements per layer) for labkit.model's block, b sequences of s tokens, width d,
a heads, SwiGLU width H, is `block_activation_elements`. Term by term:
    attention norm  x, x/rms (the weight's mul reads it), 1/rms, its output
                    (the input of wq, wk, wv)                          3bsd + bs
    attention       q, k (rotated), v, output, log-sum-exp             4bsd + abs   (flash kernel)
                    q, k, v and the softmax probabilities              3bsd + as^2b (math kernel)
    wo              its input (the heads put back together)            bsd
    MLP norm        as the attention norm                              3bsd + bs
    SwiGLU          w1 x, silu(w1 x), w3 x, their product              4bsH
(The rotary embedding saves nothing big: its multiplications read the fixed cos/sin tables.)
Megatron's per-layer 34sbh + 5as^2b bytes (Korthikanti et al. 2022) counts the same things for
GPT in bf16 with dropout and a 4h GELU MLP; here everything is fp32 (4 bytes), there is no
dropout, and torch's CPU attention is a flash kernel that never stores the s x s scores.
"""
from __future__ import annotations

import torch
from torch.autograd.graph import saved_tensors_hooks


class SavedTensors:
    """Context manager counting the bytes saved for backward inside it, each storage once.

    ``SavedTensors(*modules)``: the parameters and buffers of ``modules`` are left out (they
    are model state, not activations). After the block: ``nbytes`` and ``count``.
    """

    def __init__(self, *modules):
        self._exclude = {t.untyped_storage().data_ptr() for m in modules
                         for t in list(m.parameters()) + list(m.buffers())}
        self._seen: dict[int, int] = {}
        self._hooks = saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        # the graph holds `t` until backward, so its storage's address cannot be reused meanwhile
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self._exclude and storage.nbytes():
            self._seen.setdefault(key, storage.nbytes())
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)

    @property
    def nbytes(self) -> int:
        return sum(self._seen.values())

    @property
    def count(self) -> int:
        return len(self._seen)


def block_activation_elements(b: int, s: int, d: int, a: int, hidden: int, flash: bool = True) -> int:
    """Elements one labkit.model block saves for backward (see the module docstring's table).

    flash=True: torch's fused CPU attention kernel (the default for fp32 on CPU), which keeps
    the output and the log-sum-exp instead of the s x s probabilities (flash=False: the math
    kernel, `torch.nn.attention.sdpa_kernel(SDPBackend.MATH)`).
    """
    for name, value in dict(b=b, s=s, d=d, a=a, hidden=hidden).items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    norm = 3 * b * s * d + b * s
    attention = 4 * b * s * d + a * b * s if flash else 3 * b * s * d + a * s * s * b
    return norm + attention + b * s * d + norm + 4 * b * s * hidden


def megatron_bytes(b: int, s: int, h: int, a: int) -> int:
    """Megatron-LM's per-layer activation bytes, GPT in bf16 with dropout: s b h (34 + 5 a s / h)."""
    return s * b * h * 34 + 5 * a * s * s * b


def recompute_peak_elements(b: int, s: int, d: int, a: int, hidden: int, n_layers: int, flash: bool = True) -> int:
    """Peak activation elements of the blocks with recomputation: every block's input, plus one
    block's activations rebuilt during its backward."""
    return n_layers * b * s * d + block_activation_elements(b, s, d, a, hidden, flash)
