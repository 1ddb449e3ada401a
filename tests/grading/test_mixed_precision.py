"""Grading tests for notebook 01_single_device: the dynamic loss scaler (fp16 mixed precision).

Run: pytest tests/grading/test_mixed_precision.py   (add --impl=solutions for the reference)
Your DynamicLossScaler and torch.amp.GradScaler("cpu") drive two identical models, trained under
fp16 autocast with AdamW, from a scale large enough to overflow (2^26: the fp16 backward overflows
from 2^24 on this model) and growth every 4 good steps, so the run backs off, skips steps, grows
and overflows again; one step has a NaN loss. After every step the scale, the skipped steps, every
parameter and AdamW's state must be bit-equal (torch.equal): the arithmetic is the same, so any
difference is a bug. Odd steps unscale before step (to clip the gradients), as GradScaler allows.
A second of CPU.
"""
import copy

import pytest
import torch
from torch import nn

from labkit.grading import impl

STEPS = 24


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(32, 16, generator=g), torch.randn(32, 16, generator=g)


def train_step(model, opt, scaler, step):
    x, y = batch(step)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = ((model(x).float() - y) ** 2).mean()
    if step == 9:
        loss = loss * float("nan")  # a NaN loss: every gradient NaN, the step must be skipped
    opt.zero_grad()
    scaler.scale(loss).backward()
    if step % 2:  # unscale first to clip the true gradients, as in most training loops
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    stepped = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    scaler.update()
    return stepped


@pytest.mark.exercise("DynamicLossScaler")
def test_loss_scaler_bit_equal_to_torch_gradscaler_over_a_run_with_overflows():
    mp = impl("mixed_precision")
    settings = dict(init_scale=2.0 ** 26, growth_factor=2.0, backoff_factor=0.5, growth_interval=4)
    mine, ref = mlp(), mlp()
    opt_mine, opt_ref = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (mine, ref))
    scaler, torch_scaler = mp.DynamicLossScaler(**settings), torch.amp.GradScaler("cpu", **settings)
    skipped = 0
    for step in range(STEPS):
        where = f"step {step} (GradScaler's scale before it: {torch_scaler.get_scale():g})"
        got = train_step(mine, opt_mine, scaler, step)
        want = train_step(ref, opt_ref, torch_scaler, step)
        assert got == want, f"{where}: your scaler {'stepped' if got else 'skipped'}, GradScaler did not"
        assert scaler.get_scale() == torch_scaler.get_scale(), (
            f"{where}: scale {scaler.get_scale()} after update(), GradScaler's {torch_scaler.get_scale()}")
        for (name, p), q in zip(mine.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), f"{where}: parameter {name} differs from GradScaler's run"
            for key, value in opt_ref.state[q].items():
                assert torch.equal(opt_mine.state[p][key], value), f"{where}: AdamW's {key} of {name} differs"
        skipped += not want
    assert 3 <= skipped < STEPS - 5, f"the run should skip a few steps (overflows, the NaN), skipped {skipped}"


@pytest.mark.exercise("DynamicLossScaler")
def test_loss_scaler_skips_a_step_with_inf_or_nan_gradients_and_backs_off():
    mp = impl("mixed_precision")
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mp.DynamicLossScaler(init_scale=8.0, growth_interval=2)
    x, y = batch(0)
    loss = ((model(x) - y) ** 2).mean()
    scaled = scaler.scale(loss)
    assert torch.equal(scaled, loss * 8.0), "scale(loss) must be loss * the scale"
    scaled.backward()
    want = [p.grad / 8.0 for p in model.parameters()]
    model[0].weight.grad[0, 0] = float("inf")
    want[0][0, 0] = float("inf")
    before = copy.deepcopy(model.state_dict())
    assert scaler.unscale_(opt) is True, "unscale_ must return found_inf = True when a gradient holds an inf"
    for p, w in zip(model.parameters(), want):
        assert torch.equal(p.grad, w), "unscale_ must multiply every gradient by 1/scale, in place"
    with pytest.raises(RuntimeError):
        scaler.unscale_(opt)  # twice in one iteration: the gradients would be divided twice
    assert scaler.step(opt) is False, "step must skip (return False) when found_inf"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "a skipped step changed weights"
    scaler.update()
    assert scaler.get_scale() == 4.0, f"backoff: 8 * 0.5 = 4, got {scaler.get_scale()}"
    for expected in (4.0, 8.0, 8.0, 16.0):  # growth every 2 good steps
        opt.zero_grad()
        scaler.scale(((model(x) - y) ** 2).mean()).backward()
        assert scaler.step(opt) is True
        scaler.update()
        assert scaler.get_scale() == expected, f"growth every growth_interval=2 good steps: expected {expected}"
