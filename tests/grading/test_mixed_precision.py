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
        if got != want:
            cause = ("this step's loss is NaN, so every gradient is NaN: found_inf must be True for a NaN as for an "
                     "inf (not torch.isfinite(grad).all()), and step() must then skip optimizer.step()" if step == 9 else
                     "found_inf must be True exactly when some gradient holds an inf or a NaN, and step() skips "
                     "optimizer.step() exactly then" if got else
                     "the gradients were finite: a step is skipped only when unscale_ found an inf or a NaN")
        assert got == want, (f"{where}: your scaler {'took' if got else 'skipped'} the step, GradScaler "
                             f"{'took' if want else 'skipped'} it: {cause}")
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
    found = scaler.unscale_(opt)
    assert found is True, f"unscale_ returned {found!r}, expected found_inf = True: a gradient holds an inf"
    for p, w in zip(model.parameters(), want):
        assert torch.equal(p.grad, w), "unscale_ must multiply every gradient by 1/scale, in place"
    try:
        scaler.unscale_(opt)  # twice in one iteration: the gradients would be divided twice
    except RuntimeError:
        pass
    else:
        pytest.fail(f"a second unscale_(opt) before update() returned normally, expected RuntimeError (as GradScaler "
                    f"raises): the gradients were divided by the scale twice (weight gradient [0, 1] is now "
                    f"{model[0].weight.grad[0, 1].item():.6g}, after one unscale_ {want[0][0, 1].item():.6g}). Likely cause: "
                    "unscale_ does not remember that this iteration was unscaled (found_inf is not None) until update()",
                    pytrace=False)
    stepped = scaler.step(opt)
    assert stepped is False, f"step(opt) returned {stepped!r} after unscale_ found an inf, expected False (skipped)"
    changed = [k for k, v in model.state_dict().items() if not torch.equal(before[k], v)]
    assert not changed, f"a skipped step changed the weights {changed}: step() must not call optimizer.step() when found_inf"
    scaler.update()
    assert scaler.get_scale() == 4.0, f"scale after an inf step's update(): expected 8 * backoff 0.5 = 4, got {scaler.get_scale()}"
    for i, expected in enumerate((4.0, 8.0, 8.0, 16.0)):  # growth every 2 good steps
        opt.zero_grad()
        scaler.scale(((model(x) - y) ** 2).mean()).backward()
        stepped = scaler.step(opt)
        assert stepped is True, (f"good step {i + 1} after the backoff: step(opt) returned {stepped!r}, expected True: "
                                 "the gradients are finite (found_inf is reset by update())")
        scaler.update()
        assert scaler.get_scale() == expected, (
            f"scale after good step {i + 1} since the backoff: {scaler.get_scale()}, expected {expected} (growth by 2 "
            "after every growth_interval=2 good steps in a row, the count restarted by the backoff)")


@pytest.mark.exercise("DynamicLossScaler")
def test_loss_scaler_finds_a_nan_among_finite_gradients():
    mp = impl("mixed_precision")
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mp.DynamicLossScaler(init_scale=8.0)
    x, y = batch(0)
    scaler.scale(((model(x) - y) ** 2).mean()).backward()
    model[2].bias.grad[3] = float("nan")  # one NaN, every other gradient finite
    before = copy.deepcopy(model.state_dict())
    found = scaler.unscale_(opt)
    assert found is True, (f"unscale_ returned found_inf = {found!r} with a NaN in the last layer's bias gradient, expected "
                           "True: check every gradient for inf AND NaN (torch.isfinite), not only torch.isinf")
    stepped = scaler.step(opt)
    assert stepped is False, f"step(opt) returned {stepped!r} with a NaN gradient, expected False (the step skipped)"
    changed = [k for k, v in model.state_dict().items() if not torch.equal(before[k], v)]
    assert not changed, f"a step with a NaN gradient changed the weights {changed}: it must be skipped"
    scaler.update()
    assert scaler.get_scale() == 4.0, f"scale after a NaN step's update(): expected 8 * backoff 0.5 = 4, got {scaler.get_scale()}"


@pytest.mark.exercise("DynamicLossScaler")
def test_loss_scaler_parameter_without_gradient_and_frozen_parameter_bit_equal_to_gradscaler():
    """An unused parameter (.grad None) and a frozen one in the optimizer, as GradScaler allows: both skipped."""
    mp = impl("mixed_precision")
    runs = {}
    for name, make in (("yours", lambda: mp.DynamicLossScaler(init_scale=2.0 ** 10)),
                       ("GradScaler", lambda: torch.amp.GradScaler("cpu", init_scale=2.0 ** 10))):
        model = mlp()
        unused = nn.Parameter(torch.ones(3))  # in the optimizer, never in the loss: its .grad stays None
        model[0].bias.requires_grad_(False)  # frozen: no .grad either
        opt = torch.optim.AdamW(list(model.parameters()) + [unused], lr=1e-2)
        scaler = make()
        for step in range(3):
            x, y = batch(step)
            opt.zero_grad()
            scaler.scale(((model(x) - y) ** 2).mean()).backward()
            try:
                scaler.step(opt)
            except (AttributeError, TypeError) as error:
                pytest.fail(f"step {step}: your scaler's step() failed with {type(error).__name__}: {error}. The optimizer "
                            "holds a parameter whose .grad is None (never used by the loss) and a frozen one: unscale_ "
                            "must skip parameters without a gradient, as GradScaler does", pytrace=False)
            scaler.update()
        runs[name] = (model, unused, scaler.get_scale())
    (ours, our_unused, our_scale), (ref, ref_unused, ref_scale) = runs["yours"], runs["GradScaler"]
    assert our_scale == ref_scale, f"after 3 steps your scale is {our_scale}, GradScaler's {ref_scale}"
    for (n, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), (f"{n} differs from GradScaler's run after 3 steps (largest difference "
                                   f"{(a - b).abs().max().item():.3g}) with an unused and a frozen parameter in the optimizer")
    assert torch.equal(our_unused, ref_unused) and our_unused.grad is None, (
        f"the unused parameter became {our_unused.detach().tolist()} with .grad {our_unused.grad}, GradScaler's run left "
        f"{ref_unused.detach().tolist()} with .grad None: leave a parameter without gradient alone")
