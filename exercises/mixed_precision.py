# GENERATED from solutions/mixed_precision.py by `python -m labkit.grading.stubgen`: this file is yours to edit.
# Fill in every `raise NotImplementedError(...)`; see notebooks/01_single_device.ipynb.
# untouched-stub fingerprint: 9899966991c97fdb
"""fp16 mixed precision: dynamic loss scaling (notebook 01_single_device).

fp16 has 5 exponent bits: its smallest normal number is 2^-14 ~ 6.1e-5 and its smallest number
2^-24 ~ 6e-8. Gradients of a mean loss over many tokens are often smaller, so in fp16 they lose
their digits or flush to zero. Loss scaling multiplies the loss by a large S before backward: every
gradient is S times larger (backward is linear in the loss), clear of the underflow, and divided by
S again in fp32 before the optimizer step. Too large an S overflows to inf instead; the *dynamic*
scaler finds the largest S that works:

    scale(loss)      loss * S
    unscale_(opt)    every gradient times 1/S, and found_inf = "some gradient is inf or NaN"
    step(opt)        opt.step() unless found_inf: that step is skipped (its gradients are garbage)
    update()         found_inf: S *= backoff_factor (0.5), the count of good steps restarts at 0;
                     else one more good step, and after growth_interval good steps in a row
                     S *= growth_factor (2): try a larger scale again

This is the algorithm of torch.amp.GradScaler; the grading test checks it bit for bit.
bf16 has fp32's 8 exponent bits, so it needs none of this (notebook 01, section 10).
"""
import torch

NOTEBOOK = "01_single_device"


class DynamicLossScaler:
    """torch.amp.GradScaler's dynamic loss scaling, by hand; equal to it bit for bit.

    The scale S is a float32 scalar tensor, starting at init_scale; growth_tracker counts the
    good steps in a row. Use per iteration: scaler.scale(loss).backward(); scaler.step(opt);
    scaler.update(); (optionally scaler.unscale_(opt) before step, e.g. to clip gradients).
    - scale(loss) -> loss * S.
    - unscale_(optimizer) -> found_inf (bool): multiply, in place, every .grad of the optimizer's
      parameters (those that have one) by inv = 1/S, computed in float64 and rounded to float32
      (as GradScaler does); found_inf is True when any gradient holds an inf or a NaN. At most
      once per iteration: a second call before update() raises RuntimeError.
    - step(optimizer) -> True if optimizer.step() ran: unscale_ first if not yet done this
      iteration; skip the step when found_inf.
    - update(): found_inf: S *= backoff_factor and growth_tracker = 0; otherwise growth_tracker
      += 1, and when it reaches growth_interval, S *= growth_factor (only if that stays finite)
      and growth_tracker = 0. Then a new iteration starts (unscale_ allowed again).
    - get_scale() -> S as a Python float.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        if not (growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1 and init_scale > 0):
            raise ValueError(f"need growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1 and "
                             f"init_scale > 0; got {growth_factor}, {backoff_factor}, {growth_interval}, {init_scale}")
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self._scale = torch.tensor(float(init_scale), dtype=torch.float32)
        self.growth_tracker = 0
        self.found_inf = None  # None: not unscaled yet in this iteration

    def get_scale(self) -> float:
        return self._scale.item()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("exercise DynamicLossScaler is not implemented yet: edit exercises/mixed_precision.py, see notebooks/01_single_device.ipynb")

    def unscale_(self, optimizer) -> bool:
        raise NotImplementedError("exercise DynamicLossScaler is not implemented yet: edit exercises/mixed_precision.py, see notebooks/01_single_device.ipynb")

    def step(self, optimizer) -> bool:
        raise NotImplementedError("exercise DynamicLossScaler is not implemented yet: edit exercises/mixed_precision.py, see notebooks/01_single_device.ipynb")

    def update(self) -> None:
        raise NotImplementedError("exercise DynamicLossScaler is not implemented yet: edit exercises/mixed_precision.py, see notebooks/01_single_device.ipynb")
