"""Pipeline stage plumbing shared by the executor and the benches: not an exercise.

- `activation_shape`: the (micro-batch, seq, d_model) that flows between stages, known to every rank;
- `ActivationMemory`: counts the micro-batches whose activations a rank holds, and their bytes;
- `SyntheticStage`: a stand-in stage whose compute is a fixed delay (crisp schedule shapes on
  a few shared CPU cores).

`solutions/pipeline.py` (the executor, `run_schedule`) re-exports them, so that notebooks
reach them as ``impl("pipeline").SyntheticStage``.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import torch.nn as nn


def activation_shape(config, batch_size: int, seq_len: int, n_microbatches: int) -> tuple[int, int, int]:
    """(micro-batch, seq_len, d_model): what flows between stages, known to every rank.

    Receivers must allocate their buffer before the message arrives, so every rank derives
    the shape from the model config and the batch size (no shape message is sent).
    Raises ValueError when the batch does not split into n_microbatches equal parts.
    """
    if n_microbatches < 1 or batch_size % n_microbatches:
        raise ValueError(f"batch size {batch_size} does not split into {n_microbatches} equal micro-batches: "
                         f"choose n_microbatches among the divisors of {batch_size}")
    return (batch_size // n_microbatches, seq_len, config.d_model)


class ActivationMemory:
    """Counts the micro-batches whose activations are held, and the bytes autograd saved for them."""

    def __init__(self, param_ptrs):
        self.param_ptrs, self.held = param_ptrs, {}
        self.peak_count = self.peak_bytes = 0

    @contextmanager
    def count(self, s, mb):
        seen = {}  # bytes of the tensors autograd saves for this micro-batch's backward, parameters excluded

        def pack(t):
            if t.data_ptr() not in self.param_ptrs:
                seen[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.held[s, mb] = sum(seen.values())
        self.peak_count = max(self.peak_count, len(self.held))
        self.peak_bytes = max(self.peak_bytes, sum(self.held.values()))

    def free(self, s, mb):
        self.held.pop((s, mb))


# ----------------------------------------------------------------------- synthetic mode
class _Delay(torch.autograd.Function):
    """Identity that sleeps t_f in forward and t_b in backward."""

    @staticmethod
    def forward(ctx, x, t_f, t_b):
        ctx.save_for_backward(x)  # counted like a real stage's saved activation
        ctx.t_b = t_b
        time.sleep(t_f)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.t_b)
        return grad, None, None


class SyntheticStage(nn.Module):
    """A stand-in stage whose compute is a fixed delay: F sleeps t_f, B sleeps t_b (default 2 t_f).

    Same interface as `labkit.model.Stage`: the first stage takes token ids [b, T], later
    stages activations of ``act_shape`` = (b, T, D); the last stage returns a scalar loss
    when given targets. Sleeping instead of computing makes schedule shapes crisp on a
    few shared CPU cores: the ranks do not compete for cores while they "compute".
    The backward has two paths: t_b - t_w towards the input and t_w towards the weight
    (t_w = t_b / 2 by default), so a zero-bubble B (input gradient) sleeps t_b - t_w and
    its W sleeps t_w; a full backward sleeps t_b. On the first stage a zero-bubble B has
    an input gradient to compute only if the inputs are floating point (act_shape-sized
    rows, e.g. zeros): give it those to time a zero-bubble schedule, token ids otherwise.
    """

    def __init__(self, stage: int, n_stages: int, act_shape, t_f: float = 0.01, t_b: float | None = None,
                 t_w: float | None = None):
        super().__init__()
        self.stage, self.n_stages, self.act_shape = stage, n_stages, tuple(act_shape)
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        self.t_f, self.t_b = t_f, 2 * t_f if t_b is None else t_b
        self.t_w = self.t_b / 2 if t_w is None else t_w
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self, x, targets=None):
        if self.is_first and not x.is_floating_point():  # token ids: stand in for the embedding's output
            x = torch.ones(self.act_shape, device=self.weight.device, requires_grad=True)
        y = _Delay.apply(x, self.t_f, self.t_b - self.t_w) * _Delay.apply(self.weight, 0.0, self.t_w)
        return y.mean() if self.is_last and targets is not None else y
