"""Activation memory: what autograd keeps for backward, counted, and the formula it follows (notebook 11).

    from labkit.measure.activations import LiveBytes, SavedTensors, block_activation_elements
    with SavedTensors(model) as saved:          # parameters and buffers are not activations
        loss = model(x, y)
    saved.nbytes                                # bytes held for backward, each storage once
    with LiveBytes(model) as live:              # every tensor alive, op by op
        loss = model(x, y); start = live.mark()
        loss.backward()
    live.rise(start, ignore=[p.grad for p in model.parameters()])   # the backward's peak above its start

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

import itertools
import weakref

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


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


def _address(t):
    """The address of t's storage, or None for a wrapper that has none (a functional collective's
    `_wrap_tensor_autograd` output)."""
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return None


class LiveBytes(TorchDispatchMode):
    """Context manager recording the bytes of every tensor alive inside it, after each op.

    What `SavedTensors` cannot see: the gradients and temporaries a backward creates and frees, which
    set its peak (labkit.scale.footprint.mlp_backward_elements). Each op's new storages are added when
    the op returns them and subtracted when Python frees them (a weakref finalizer on the storage), so
    the count is exact and deterministic on a CPU. ``LiveBytes(*modules)`` leaves the modules'
    parameters and buffers out; ``mark()`` is a point in the record; ``rise(start, ignore)`` the most
    bytes alive after any op since ``start`` above those alive at it, leaving out the storages of
    ``ignore`` (the parameters' ``.grad``: model state, not activations).
    """

    def __init__(self, *modules):
        super().__init__()
        self._exclude = {t.untyped_storage().data_ptr() for m in modules
                         for t in list(m.parameters()) + list(m.buffers())}
        self._live: dict[int, tuple[int, int]] = {}  # address -> (allocation id, bytes)
        self._ids = itertools.count()
        self.events: list[tuple[int | None, int]] = []  # (id, +bytes or -bytes); (None, 0) after each op

    def _free(self, uid: int, key: int) -> None:
        if self._live.get(key, (None,))[0] == uid:
            self.events.append((uid, -self._live.pop(key)[1]))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_address(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or _address(t) is None:
                continue  # not a tensor, or a wrapper without storage: its inner tensor was counted where made
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self._exclude or key in self._live or key in inputs or not storage.nbytes():
                continue  # a parameter, a view or in-place result of an input, one already counted, or empty
            uid = next(self._ids)
            self._live[key] = (uid, storage.nbytes())
            self.events.append((uid, storage.nbytes()))
            weakref.finalize(storage, self._free, uid, key)
        self.events.append((None, 0))
        return out

    def mark(self) -> int:
        return len(self.events)

    def rise(self, start: int = 0, ignore=()) -> int:
        """Peak bytes alive after an op since `start`, minus the bytes alive at `start`."""
        keys = {t.untyped_storage().data_ptr() for t in ignore if t is not None}
        skip = {self._live[k][0] for k in keys if k in self._live}
        alive, at_start, peak = 0, 0, 0
        for i, (uid, delta) in enumerate(self.events):
            if i == start:
                at_start = peak = alive
            if uid is not None and uid not in skip:
                alive += delta
            elif uid is None and i >= start:
                peak = max(peak, alive)
        return peak - at_start


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
