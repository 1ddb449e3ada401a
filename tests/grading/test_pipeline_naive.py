"""Grading tests for notebook 05_pipeline_parallel: forward_step, backward_step and naive_step.

Run: pytest tests/grading/test_pipeline_naive.py   (add --impl=solutions for the reference)
The chain tests pass tensors between stages inside one process (what send/recv would
carry); the last tests run `naive_step` on 2, 3 and 4 real ranks, then on two pipelines in
Mesh(4, pp=2, tp=2) (pp not innermost: neighbours are not rank +/- 1), under a short launch
timeout (a forgotten send or receive hangs: the report shows where each rank waits, your
lines first), and name the first stage whose gradient differs. About 15 s on 2 cores.
"""
import linecache
import re

import pytest
import torch

from labkit.grading import impl
from labkit.launching.launcher import LaunchError, launch
from labkit.mesh import Mesh

# Pipelined gradients against one model, in float32: the same products, but each parameter's
# gradient is a sum over m <= 8 micro-batches instead of one batched reduction. Each extra addition
# rounds by at most 2**-24 of the running sum, so an element differs by at most
# m * 6e-8 * max|partial gradient| (~1e-1 here) = 5e-8 absolute and 5e-7 relative: atol 1e-6 and
# rtol 1e-4 leave 20x and 200x margin on any CPU, and a wrong micro-batch or stage is off by >1e-3.
F32_GRAD_TOL = dict(rtol=1e-4, atol=1e-6)

BATCH, SEQ = 4, 16


def _data():
    g = torch.Generator().manual_seed(2)
    return (torch.randint(0, 4096, (BATCH, SEQ), generator=g), torch.randint(0, 4096, (BATCH, SEQ), generator=g))


def _reference(x, y):
    from labkit.model import build_model

    model = build_model("tiny", seed=0)
    loss = model(x, y)
    loss.backward()
    return model, loss.detach()


def _chain(n_stages, x, y, loss_scale=1.0):
    """Forward through every stage, then backward, passing detached tensors like messages."""
    from labkit.model import build_model, make_stages

    naive = impl("pipeline_naive")
    model = build_model("tiny", seed=0)
    stages = make_stages(model, n_stages)
    saved, msg = [], x
    for s, stage in enumerate(stages):
        inp, out = naive.forward_step(stage, msg, y if s == n_stages - 1 else None, loss_scale)
        saved.append((inp, out))
        msg = out.detach()  # what send/recv carries: data, no autograd history
    grad = None
    for s in reversed(range(n_stages)):
        inp, out = saved[s]
        grad = naive.backward_step(inp, out, grad)
        if s == 0:
            assert grad is None, "the first stage's input is token ids: backward_step returns None"
        else:
            assert grad is not None and grad.shape == (BATCH, SEQ, model.config.d_model)
            grad = grad.detach()
    return model, saved


@pytest.mark.exercise("forward_step")
@pytest.mark.parametrize("n_stages", [2, 4])
def test_forward_step_chain_equals_model_loss(n_stages):
    x, y = _data()
    _, ref_loss = _reference(x, y)
    naive = impl("pipeline_naive")
    from labkit.model import build_model, make_stages

    stages, msg = make_stages(build_model("tiny", seed=0), n_stages), x
    for s, stage in enumerate(stages):
        inp, out = naive.forward_step(stage, msg, y if s == n_stages - 1 else None)
        if s == 0:
            assert inp is None
        else:
            assert inp.is_leaf and inp.requires_grad, "a later stage's graph starts at a leaf that requires grad"
            torch.testing.assert_close(inp, msg)
        msg = out.detach()
    torch.testing.assert_close(out, ref_loss)


@pytest.mark.exercise("forward_step")
def test_forward_step_loss_scale_multiplies_the_last_loss():
    from labkit.model import build_model, make_stage

    x, y = _data()
    _, ref_loss = _reference(x, y)
    _, out = impl("pipeline_naive").forward_step(make_stage(build_model("tiny", seed=0), 0, 1), x, y, 0.25)
    torch.testing.assert_close(out, ref_loss * 0.25)


@pytest.mark.exercise("forward_step", "backward_step")
@pytest.mark.parametrize("n_stages", [2, 3, 4])
def test_backward_step_chain_gradients_equal_single_model(n_stages):
    x, y = _data()
    ref, _ = _reference(x, y)
    model, _ = _chain(n_stages, x, y)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, **F32_GRAD_TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.exercise("forward_step", "backward_step")
def test_backward_step_accumulates_over_two_half_batches():
    # two halves with loss_scale 1/2 each must give the full batch's gradient
    from labkit.model import build_model, make_stages

    x, y = _data()
    ref, _ = _reference(x, y)
    naive = impl("pipeline_naive")
    model = build_model("tiny", seed=0)
    s0, s1 = make_stages(model, 2)
    for xs, ys in zip(x.chunk(2), y.chunk(2)):
        inp0, out0 = naive.forward_step(s0, xs)
        inp1, out1 = naive.forward_step(s1, out0.detach(), ys, 0.5)
        grad = naive.backward_step(inp1, out1)
        naive.backward_step(inp0, out0, grad)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, **F32_GRAD_TOL, msg=lambda m: f"{name}: {m}")


def _naive_rank(rank, world_size, tp=1, dtype=torch.float32):
    """naive_step on Mesh(world_size, pp=world_size // tp, tp=tp): with tp > 1 there are tp pipelines
    and pp is not the innermost axis (Mesh(4, pp=2, tp=2): pipelines 0->2 and 1->3)."""
    from labkit.model import build_model, make_stage

    naive = impl("pipeline_naive")
    x, y = _data()
    model = build_model("tiny", seed=0).to(dtype)  # naive_step's buffers follow the stage: no dtype= passed
    mesh = Mesh(world_size, pp=world_size // tp, tp=tp)
    stage = make_stage(model, mesh.coord("pp"), mesh.size("pp"))
    loss = naive.naive_step(stage, x, y, mesh=mesh, act_shape=(BATCH, SEQ, model.config.d_model))
    return {n: p.grad for n, p in stage.named_parameters()}, loss


HUNG = []  # world sizes whose launch timed out: the later ones are not run


def _launch_or_show_your_lines(fn, world_size, *args):
    # Short timeout: the step takes well under a second; a missing send or receive never ends.
    if HUNG:
        pytest.fail(f"not run: naive_step hung on {HUNG[0]} ranks (see that test's report)", pytrace=False)
    try:
        return launch(fn, world_size, *args, timeout=20)
    except LaunchError as err:
        if "timed out" not in str(err):
            raise
        report = str(err)
    HUNG.append(world_size)
    found = dict.fromkeys(re.findall(r'File "([^"]*exercises/[^"]+)", line (\d+) in (\w+)', report))
    mine = "\n".join(f"  {path.split('exercises/')[-1]}:{line} in {fn}: {linecache.getline(path, int(line)).strip()}"
                      for path, line, fn in found)
    pytest.fail(f"{world_size} ranks hung. Your lines where they wait:\n{mine}\nEvery recv needs the matching "
                f"send on the neighbour (activations to mesh.next_rank('pp'), gradients back to "
                f"mesh.prev_rank('pp'): global ranks, not stage +/- 1). "
                f"The launcher's report:\n{report}", pytrace=False)


@pytest.mark.exercise("naive_step", needs=("forward_step", "backward_step"))
@pytest.mark.filterwarnings("ignore::labkit.launching.launcher.OversubscriptionWarning")
@pytest.mark.parametrize("p", [2, 3, 4])
def test_naive_step_real_ranks_equals_single_model_p_2_3_4(p):
    from labkit.model import make_stages

    results = _launch_or_show_your_lines(_naive_rank, p)
    x, y = _data()
    ref, ref_loss = _reference(x, y)
    for s, stage in enumerate(make_stages(ref, p)):  # the first stage whose gradient differs
        grads, loss = results[s]
        for n, param in stage.named_parameters():
            assert grads[n] is not None, f"stage {s}, {n}: no gradient (did this stage run its backward?)"
            torch.testing.assert_close(grads[n], param.grad, **F32_GRAD_TOL,
                                       msg=lambda m: f"p={p}: stage {s} is the first whose gradient differs ({n}): {m}")
        if s == p - 1:
            torch.testing.assert_close(loss, ref_loss)
        else:
            assert loss is None, f"p={p}: stage {s} must return None (only the last stage has the loss)"


@pytest.mark.exercise("naive_step", needs=("forward_step", "backward_step"))
@pytest.mark.filterwarnings("ignore::labkit.launching.launcher.OversubscriptionWarning")
def test_naive_step_two_pipelines_pp_not_innermost_neighbours_from_the_mesh():
    # Mesh(4, pp=2, tp=2): stage 1 of rank 0's pipeline is rank 2 and of rank 1's is rank 3.
    # A step that sends to stage + 1 or receives from stage - 1 (ranks, not the mesh's neighbours)
    # talks to the wrong pipeline or to a rank outside mesh.group("pp"): it fails here.
    from labkit.model import make_stages

    results = _launch_or_show_your_lines(_naive_rank, 4, 2)
    x, y = _data()
    ref, ref_loss = _reference(x, y)
    stages = make_stages(ref, 2)
    for rank, (grads, loss) in enumerate(results):
        s = Mesh(4, pp=2, tp=2, rank=rank).coord("pp")
        for n, param in stages[s].named_parameters():
            assert grads[n] is not None, f"rank {rank} (stage {s}), {n}: no gradient (did this stage run its backward?)"
            torch.testing.assert_close(grads[n], param.grad, **F32_GRAD_TOL,
                                       msg=lambda m: f"Mesh(4, pp=2, tp=2): rank {rank} (stage {s}) has a wrong "
                                                     f"gradient ({n}); its neighbours are mesh.prev_rank('pp') / "
                                                     f"mesh.next_rank('pp'): {m}")
        if s == 1:
            torch.testing.assert_close(loss, ref_loss)
        else:
            assert loss is None, f"rank {rank} is stage 0: it must return None (only the last stage has the loss)"


def _naive_rank_float64(rank, world_size):
    return _naive_rank(rank, world_size, 1, torch.float64)


@pytest.mark.exercise("naive_step", needs=("forward_step", "backward_step"))
def test_naive_step_float64_stages_receive_float64_without_a_dtype_argument():
    """dtype follows the module: a float64 pipeline equals the float64 model (float64: the sums of
    different order agree to ~1e-15 relative, so 1e-10 is far from rounding and far below any real error)."""
    from labkit.model import build_model, make_stages

    results = _launch_or_show_your_lines(_naive_rank_float64, 2)
    x, y = _data()
    ref = build_model("tiny", seed=0).double()
    ref_loss = ref(x, y)
    ref_loss.backward()
    for s, stage in enumerate(make_stages(ref, 2)):
        grads, loss = results[s]
        for n, param in stage.named_parameters():
            assert grads[n] is not None and grads[n].dtype == torch.float64, f"stage {s}, {n}: {grads[n]!r:.80}"
            torch.testing.assert_close(grads[n], param.grad, rtol=1e-10, atol=1e-12,
                                       msg=lambda m: f"stage {s} is the first whose gradient differs ({n}): {m}")
    torch.testing.assert_close(results[1][1], ref_loss.detach(), rtol=1e-12, atol=0)
