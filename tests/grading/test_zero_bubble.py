"""Grading tests for notebook 06_microbatches, zero bubble: ZB-H1 as data, and the split backward B / W.

Run: pytest tests/grading/test_zero_bubble.py   (add --impl=solutions for the reference)
`zb_h1_schedule` is compared action for action with torch's own ZB-H1 (its
``ScheduleInterleavedZeroBubble`` with one stage per rank) for p <= 6, m <= 10: no process.
`backward_input` / `backward_weight` are checked on one stage of the tiny model in float64
(no process), then a ZB-H1 step on 4 ranks (your `communicate` carries the messages) is
compared with 1F1B's gradients. About 10 s on 2 cores.

Tolerance: the split backward computes every product that one ``backward`` computes; only
the order in which a parameter's micro-batch gradients are added can differ. In float64
that is at most m * 2**-53 ~ 1e-15 relative for m <= 8: rtol 1e-10 leaves a 10^5 margin,
and a wrong gradient (a micro-batch missing, counted twice, or its weight path left out)
is off by far more than 1e-3.
"""
import pytest
import torch

import labkit

from labkit.grading import impl
from labkit.grading.closeness import check_close
from labkit.launching.launcher import launch
from labkit.parallel.torch_schedules import torch_schedule
from labkit.parallel.schedules import first_difference, simulate, validate
from labkit.grading.cases import launch_timeout

F64_TOL = dict(rtol=1e-10, atol=1e-12)
BATCH, SEQ = 8, 16


@pytest.mark.exercise("zb_h1_schedule")
def test_zb_h1_schedule_equals_torch_zero_bubble_many_p_m():
    zb = impl("zero_bubble")
    for p in range(1, 7):
        for m in range(1, 11):
            got = zb.zb_h1_schedule(p, m)
            try:
                want = torch_schedule("InterleavedZeroBubble", p, m, stages_per_rank=1)
            except ValueError:  # torch wants m a multiple of its rounds (m // p): check by rule below only
                want = None
            if want is not None:
                assert got == want, f"p={p}, m={m}: {first_difference(got, want)}"
            validate(got, n_stages=p, n_microbatches=m)
            sim = simulate(got, t_f=1, t_b=2, t_w=1)  # F = B = W = 1
            if m >= p:
                assert sim.makespan == 3 * m + p - 1, (
                    f"p={p}, m={m}, F = B = W = 1 unit: your schedule takes {sim.makespan:g} units, ZB-H1 takes 3m + p - 1 = "
                    f"{3 * m + p - 1} (idle (p-1)(F+B-W) = p-1 units per rank): likely a W in the wrong place")
            assert max(sim.peak_inflight) == min(p, m), (
                f"p={p}, m={m}: your schedule holds {sim.peak_inflight} activations per rank at its peak, ZB-H1 keeps "
                f"1F1B's peak of min(p, m) = {min(p, m)} (on the first stage): likely a warm-up other than "
                "w = min(p - s - 1, m) forwards, or a W that runs too late")


@pytest.mark.exercise("zb_h1_schedule")
def test_zb_h1_four_stages_four_microbatches_exact():
    want = [["0F0", "0F1", "0F2", "0F3", "0B0", "0W0", "0B1", "0W1", "0B2", "0W2", "0B3", "0W3"],
            ["1F0", "1F1", "1F2", "1B0", "1F3", "1B1", "1W0", "1B2", "1W1", "1B3", "1W2", "1W3"],
            ["2F0", "2F1", "2B0", "2F2", "2B1", "2F3", "2B2", "2W0", "2B3", "2W1", "2W2", "2W3"],
            ["3F0", "3B0", "3F1", "3B1", "3F2", "3B2", "3F3", "3B3", "3W0", "3W1", "3W2", "3W3"]]
    got = impl("zero_bubble").zb_h1_schedule(4, 4)
    assert got == want, first_difference(got, want)


# ------------------------------------------------------------- the split backward, one stage
def _stage(index, n_stages=3):
    from labkit.model import build_model, make_stage

    return make_stage(build_model("tiny", seed=0).double(), index, n_stages)


def _inputs(index, mb):
    g = torch.Generator().manual_seed(10 + mb)
    if index == 0:
        return torch.randint(0, 4096, (2, SEQ), generator=g)
    return torch.randn(2, SEQ, _stage(1).config.d_model, generator=g, dtype=torch.float64)


def _forward(stage, index, mb, n_stages=3):
    x = _inputs(index, mb)
    inp = x.detach().requires_grad_() if x.is_floating_point() else None
    if index == n_stages - 1:
        targets = torch.randint(0, 4096, (2, SEQ), generator=torch.Generator().manual_seed(20 + mb))
        return inp, stage(inp, targets), None
    out = stage(x if inp is None else inp)
    return inp, out, torch.randn(out.shape, generator=torch.Generator().manual_seed(30 + mb), dtype=out.dtype)


def _reference(index, n_mb):
    """One full backward per micro-batch: the input gradients and the accumulated .grad."""
    stage, grads_in = _stage(index), []
    for mb in range(n_mb):
        inp, out, grad_out = _forward(stage, index, mb)
        torch.autograd.backward(out, grad_out)
        grads_in.append(None if inp is None else inp.grad)
    return grads_in, {n: p.grad for n, p in stage.named_parameters()}


@pytest.mark.exercise("backward_input")
@pytest.mark.parametrize("index", [0, 1, 2], ids=["first_stage_token_ids", "middle_stage", "last_stage_loss"])
def test_backward_input_is_the_input_gradient_and_leaves_weights_alone(index):
    zb = impl("zero_bubble")
    want, _ = _reference(index, 1)
    stage = _stage(index)
    inp, out, grad_out = _forward(stage, index, 0)
    got = zb.backward_input(inp, out, grad_out)
    if inp is None:
        assert got is None, "the first stage's input is token ids: backward_input returns None"
    else:
        check_close(got, want[0], "the input gradient returned by backward_input", **F64_TOL,
                    hint="return torch.autograd.grad(out, inp, grad_out, retain_graph=True)'s gradient of inp")
    touched = [n for n, p in stage.named_parameters() if p.grad is not None]
    assert not touched, f"backward_input filled .grad of {touched[:3]}: B computes the input gradient only, W the weights'"
    try:
        torch.autograd.grad(out, next(stage.parameters()), grad_out, allow_unused=True)
    except RuntimeError as err:
        pytest.fail(f"the graph was freed after backward_input, so W cannot run ({err}); keep it: retain_graph=True",
                    pytrace=False)


@pytest.mark.exercise("backward_input", "backward_weight")
@pytest.mark.parametrize("index", [0, 1, 2], ids=["first_stage_token_ids", "middle_stage", "last_stage_loss"])
def test_b_then_w_over_three_microbatches_equals_full_backwards(index):
    zb = impl("zero_bubble")
    want_in, want = _reference(index, 3)
    stage = _stage(index)
    params = [p for p in stage.parameters() if p.requires_grad]
    for mb in range(3):
        inp, out, grad_out = _forward(stage, index, mb)
        got_in = zb.backward_input(inp, out, grad_out)
        if inp is not None:
            check_close(got_in, want_in[mb], f"micro-batch {mb}'s input gradient from backward_input", **F64_TOL)
        zb.backward_weight(out, grad_out, params)
    _, two = _reference(index, 2)
    for n, p in stage.named_parameters():
        assert p.grad is not None, f"{n}.grad is None after W: backward_weight must fill every parameter's .grad"
        last = want[n] - two[n]  # the third micro-batch's own gradient
        if torch.allclose(p.grad, last, rtol=1e-8, atol=1e-10) and not torch.allclose(want[n], last):
            pytest.fail(f"{n}: .grad after 3 micro-batches is the last one's alone: accumulate (+=) into an "
                        "existing .grad, do not overwrite it", pytrace=False)
        check_close(p.grad, want[n], f"the gradient of {n} after B and W of 3 micro-batches", **F64_TOL,
                    factors={2: "counted twice: backward_input must not fill the weights' .grad (W does)"})


@pytest.mark.exercise("backward_weight", needs=("backward_input",))
def test_backward_weight_leaves_a_parameter_the_output_does_not_depend_on_untouched():
    """Edge case: a trainable parameter the stage's output does not use (a branch not taken, a head
    kept on another stage): autograd.grad(..., allow_unused=True) gives None for it, and its .grad must
    stay None, as one full backward leaves it."""
    zb = impl("zero_bubble")
    stage = _stage(1)
    unused = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    params = [p for p in stage.parameters() if p.requires_grad] + [unused]
    inp, out, grad_out = _forward(stage, 1, 0)
    zb.backward_input(inp, out, grad_out)
    try:
        zb.backward_weight(out, grad_out, params)
    except (AttributeError, TypeError, RuntimeError) as err:
        pytest.fail(f"backward_weight raised {type(err).__name__}: {err}, given a parameter that `out` does not "
                    "depend on: autograd.grad(..., allow_unused=True) returns None for it; skip it (its .grad "
                    "stays None, as after one full backward)", pytrace=False)
    assert unused.grad is None, (f"backward_weight set .grad = {unused.grad} on a parameter that `out` does not "
                                 "depend on: one full backward leaves it None; skip the None gradients")


# ------------------------------------------------------------- ZB-H1 on 4 real ranks
def _one_f_one_b(p, m):  # the reference 1F1B (notebook 06's exercise): only the split backward is graded below
    return impl("pipeline", "solutions").one_f_one_b_schedule(p, m)


def _zb_rank(rank, world_size):
    from labkit.model import build_model, make_stage

    pipeline = impl("pipeline")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 4096, (BATCH, SEQ), generator=g), torch.randint(0, 4096, (BATCH, SEQ), generator=g)
    out = {}
    for m in (4, 8):
        for name, schedule in (("1F1B", _one_f_one_b(world_size, m)),
                               ("ZB-H1", torch_schedule("InterleavedZeroBubble", world_size, m, stages_per_rank=1))):
            stage = make_stage(build_model("tiny", seed=0).double(), rank, world_size)
            loss = pipeline.run_schedule(stage, schedule, x if rank == 0 else None, y if rank == world_size - 1 else None,
                                         mesh=labkit.Mesh(world_size, pp=world_size), act_shape=pipeline.activation_shape(stage.config, BATCH, SEQ, m))
            out[name, m] = ({n: p.grad.clone() for n, p in stage.named_parameters()}, loss)
    return out


@pytest.mark.exercise("backward_input", "backward_weight")
@pytest.mark.filterwarnings("ignore::labkit.launching.launcher.OversubscriptionWarning")
def test_zb_h1_on_four_ranks_equals_one_f_one_b_gradients():
    results = launch(_zb_rank, 4, timeout=launch_timeout(30))
    for rank, got in enumerate(results):
        for m in (4, 8):
            (zb, zb_loss), (ref, ref_loss) = got["ZB-H1", m], got["1F1B", m]
            for n in ref:
                check_close(zb[n], ref[n], f"m={m}, stage {rank}: the gradient of {n} after ZB-H1 (reference: 1F1B)",
                            **F64_TOL, hint="backward_weight must ADD each micro-batch's weight gradients into .grad "
                                            "(creating it when None); backward_input must leave the weights' .grad alone")
            if rank == 3:
                check_close(zb_loss, ref_loss, f"m={m}: the last stage's loss after ZB-H1 (reference: 1F1B)")
