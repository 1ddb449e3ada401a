"""Grading tests for notebook 01_single_device (solutions/single_device.py).

References: torch.optim.SGD for sgd_step, autograd on the whole batch for
accumulate_gradients. The tiny model on a batch of 8 x 16 tokens: a few seconds in all.

The proofs run in float64. Accumulating micro-batch gradients sums in another order than one
full-batch backward, and ``p - lr * g`` may round once (a fused multiply-add, as torch's SGD
kernels do on some CPUs) or twice (as a learner's ``p -= lr * p.grad`` does): in float32 those
differences are whatever the CPU's kernels make them. In float64 they are ~1e-16 relative, so
``RTOL``/``ATOL`` below are 10^4 times that and still 10^8 times smaller than any real mistake.
"""
import pytest
import torch
from torch import nn

from labkit.grading import impl
from labkit.grading.closeness import check_close
from labkit.model import build_model

B, T = 8, 16
RTOL, ATOL = 1e-12, 1e-14  # float64: see the module docstring


def model64(seed):
    return build_model("tiny", seed=seed).double()


def close(got, want, name, factors=None, hint=""):
    check_close(got, want, name, rtol=RTOL, atol=ATOL, factors=factors, hint=hint)


def accumulation_factors(n):
    """The likely causes of an accumulated gradient that is a multiple of the full batch's."""
    stale = {2: "the gradients of an earlier call added in: set every .grad to None first (model.zero_grad(set_to_none=True))"}
    return {**stale, n: f"the SUM of the {n} micro-batches' gradients where their mean was due: divide each "
                        f"micro-batch's loss by n_microbatches = {n} before backward()",
            1 / n: f"divided by n_microbatches = {n} twice (the loss and the gradient, say)"}


def close_step(before, got, want, name):
    """The parameter after the step against torch's; the cause read from the two steps got - before, want - before."""
    if torch.equal(got, before) and not torch.equal(want, before):
        raise AssertionError(f"{name} did not move (torch.optim.SGD moves it by up to {(want - before).abs().max():.3g}): "
                             "the update must change the parameter in place (p.add_(p.grad, alpha=-lr) or p -= lr * "
                             "p.grad under torch.no_grad()); p = p - lr * p.grad only rebinds a local name")
    close(got - before, want - before, f"the step of {name} (parameter after minus before)",
          factors={-1: "p + lr * grad where p - lr * grad was due (the step goes uphill)"})


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def sd():
    return impl("single_device")


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 4096, (B, T + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def _full_batch_grads(model, x, y):
    model.zero_grad(set_to_none=True)
    loss = model(x, y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.exercise("sgd_step")
def test_sgd_step_matches_torch_optim_sgd():
    ours, ref = model64(1), model64(1)
    before = {name: p.detach().clone() for name, p in ours.named_parameters()}
    x, y = _batch()
    for model in (ours, ref):
        model(x, y).backward()
    sd().sgd_step(ours.parameters(), lr=0.1)  # a generator, as model.parameters() is
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        close_step(before[name], p.detach(), q.detach(), name)


@pytest.mark.exercise("sgd_step")
def test_sgd_step_skips_params_whose_grad_is_none_and_keeps_grads():
    used, unused = nn.Parameter(torch.tensor([1.0, 2.0])), nn.Parameter(torch.tensor([3.0]))
    (used * torch.tensor([10.0, 20.0])).sum().backward()
    try:
        sd().sgd_step([used, unused], lr=0.5)
    except (TypeError, AttributeError) as error:
        pytest.fail(f"sgd_step failed with {type(error).__name__}: {error}, given a parameter whose .grad is None (unused, "
                    "or frozen): skip parameters without a gradient (if p.grad is not None)", pytrace=False)
    close_step(torch.tensor([1.0, 2.0]), used.detach(), torch.tensor([1.0 - 5.0, 2.0 - 10.0]), "a used parameter")
    check_close(unused.detach(), torch.tensor([3.0]), "a parameter whose .grad is None (unused or frozen)",
                hint="skip parameters whose .grad is None: they must not move")
    assert unused.grad is None, f"sgd_step set the .grad of an unused parameter to {unused.grad}: leave a None .grad None"
    check_close(used.grad, torch.tensor([10.0, 20.0]), "the gradient after sgd_step",
                hint="sgd_step leaves .grad as it is: zeroing the gradients is the caller's job")


@pytest.mark.exercise("sgd_step")
def test_sgd_step_is_not_recorded_by_autograd():
    p = nn.Parameter(torch.ones(3))
    (2 * p).sum().backward()
    sd().sgd_step([p], lr=1.0)
    assert p.is_leaf and p.grad_fn is None and p.requires_grad, (
        f"after sgd_step the parameter has is_leaf={p.is_leaf}, grad_fn={p.grad_fn}, requires_grad={p.requires_grad}; "
        "expected a leaf that requires grad and has no grad_fn: update it in place under torch.no_grad()")
    close_step(torch.ones(3), p.detach(), -torch.ones(3), "the parameter")


@pytest.mark.exercise("sgd_step")
def test_sgd_step_negative_lr_raises_and_zero_lr_changes_nothing():
    p = nn.Parameter(torch.ones(2))
    p.sum().backward()
    with pytest.raises(ValueError, match="learning rate"):
        sd().sgd_step([p], lr=-0.1)
    sd().sgd_step([p], lr=0.0)
    assert torch.equal(p.detach(), torch.ones(2)), f"lr=0 moved the parameter from [1, 1] to {p.detach().tolist()}"


@pytest.mark.exercise("accumulate_gradients")
@pytest.mark.parametrize("n_microbatches", [1, 2, 4, 8])
def test_accumulate_gradients_equals_the_full_batch_gradient(n_microbatches):
    model = model64(2)
    x, y = _batch(seed=n_microbatches)
    full_loss, full_grads = _full_batch_grads(model, x, y)
    loss = sd().accumulate_gradients(model, x, y, n_microbatches)
    # The returned loss may be summed in float32 (torch.zeros(()) is): up to n_microbatches <= 8
    # float32 roundings of ~6e-8 each, so a relative 1e-6 bounds them.
    check_close(torch.as_tensor(loss).reshape(()).double(), full_loss.double(), "the returned loss", rtol=1e-6, atol=0,
                factors={n_microbatches: f"the sum of the {n_microbatches} micro-batches' losses where their mean "
                                         "was due"}, hint="return the batch's mean loss, detached")
    for name, p in model.named_parameters():
        close(p.grad, full_grads[name], f"the gradient of {name} after {n_microbatches} micro-batches",
              factors=accumulation_factors(n_microbatches))


@pytest.mark.exercise("accumulate_gradients")
def test_accumulate_gradients_clears_stale_gradients_first():
    model = model64(3)
    x, y = _batch()
    _, full_grads = _full_batch_grads(model, x, y)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e3)  # left over from an earlier step
    sd().accumulate_gradients(model, x, y, 2)
    for name, p in model.named_parameters():
        close(p.grad, full_grads[name], f"the gradient of {name} (stale gradients of 1e3 were there before the call)",
              factors=accumulation_factors(2), hint="set every .grad to None first (model.zero_grad(set_to_none=True))")


@pytest.mark.exercise("accumulate_gradients")
def test_accumulate_gradients_returns_a_detached_scalar():
    model = build_model("tiny", seed=4)
    x, y = _batch()
    loss = sd().accumulate_gradients(model, x, y, 4)
    loss = torch.as_tensor(loss)
    assert loss.numel() == 1 and not loss.requires_grad, (
        f"accumulate_gradients returned a tensor of {loss.numel()} elements with requires_grad={loss.requires_grad}; "
        "expected one number, detached from the graph (loss.detach())")


@pytest.mark.exercise("accumulate_gradients")
def test_accumulate_gradients_batch_not_divisible_into_microbatches_raises():
    model = model64(5)
    x, y = _batch()  # 8 rows
    with pytest.raises(ValueError, match="does not split into 3 equal"):
        sd().accumulate_gradients(model, x, y, 3)
    with pytest.raises(ValueError, match="n_microbatches"):
        sd().accumulate_gradients(model, x, y, 0)
    _, full_grads = _full_batch_grads(model, x[:6], y[:6])
    sd().accumulate_gradients(model, x[:6], y[:6], 3)  # 6 rows do split into 3
    for name, p in model.named_parameters():
        close(p.grad, full_grads[name], f"the gradient of {name} after 3 micro-batches of 2 rows",
              factors=accumulation_factors(3))


@pytest.mark.exercise("sgd_step", "accumulate_gradients")
def test_three_accumulated_sgd_steps_train_like_full_batch_torch_sgd():
    ours, ref = model64(6), model64(6)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(3):
        x, y = _batch(seed=10 + step)
        sd().accumulate_gradients(ours, x, y, 4)
        sd().sgd_step(ours.parameters(), lr=0.5)
        opt.zero_grad()
        ref(x, y).backward()
        opt.step()
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        close(p.detach(), q.detach(), f"{name} after 3 steps of accumulate_gradients(4 micro-batches) + sgd_step")
