"""Grading tests for notebook 08_tensor_parallel: column/row parallel linear, the Megatron MLP.

Run: pytest tests/grading/test_tensor_parallel.py   (add --impl=solutions for the reference)
Every test runs the sharded layer on 2 and 4 ranks and compares, on every rank, with the
unsharded layer run in the same process: the output, dL/dinput, and the gradient of each
sharded weight against the matching slice of the full layer's gradient. The group= cases run
the same checks in two disjoint TP groups [1, 3] and [0, 2] of 4 ranks (one launch, labkit.grading.cases),
each group with its own layer. About 20 s on 2 cores.
"""
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from labkit.grading import diagnose
from labkit.grading.cases import expect_case, launch_cases, run_cases
from labkit.comm.traffic import count_traffic
from labkit.grading import impl
from labkit.grading.closeness import check_close
from labkit.launching.launcher import launch
from labkit.model import SwiGLU, Attention, build_model, get_config
from labkit.grading.cases import launch_timeout

TIMEOUT = launch_timeout(20)  # a hang is reported by the launcher, with stacks, in seconds

# torch imports modules lazily on first use (sympy on the first backward, DTensor on the first
# assert_close): seconds each on 2 busy cores. Pay it once here, before the ranks fork.
_x = torch.ones(2, requires_grad=True)
(_x * 2).backward(torch.ones(2))
torch.testing.assert_close(_x.grad, 2 * _x.detach())
WORLD_SIZES = [2, 4]


def block(t, rank, world, dim):
    """This rank's contiguous block of t along dim."""
    return t.chunk(world, dim=dim)[rank]


def FACTORS(world):
    """The likely causes of a result that is `world` times the reference's (or 1/world of it)."""
    return {world: f"summed over the {world} ranks where one rank's value (or one sum) was due: a collective too many, "
                   "or one on the wrong tensor",
            1 / world: f"divided by the {world} ranks where the sum was due"}


def reference(layer, x, dy):
    """Output, input gradient and parameter gradients of the unsharded layer."""
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(dy)
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def _column(rank, world, group=None, seed=0):
    """rank, world: in the TP group (`group`, None: the default group)."""
    tp = impl("tensor_parallel")
    for bias in (True, False):
        for gather in (False, True):
            where = f"column-parallel, TP rank {rank} of {world}, bias={bias}, gather_output={gather}"
            torch.manual_seed(seed)  # same full layer and data on every rank
            full = nn.Linear(6, 8 * world // 2 * 3, bias=bias)  # 12 or 24 outputs
            x, dy = torch.randn(2, 3, 6), torch.randn(2, 3, full.out_features)
            y_ref, dx_ref, g_ref = reference(full, x, dy)
            layer = tp.ColumnParallelLinear(full, group=group, gather_output=gather)
            k = full.out_features // world
            assert layer.weight.shape == (k, 6), (
                f"weight has shape {tuple(layer.weight.shape)}, expected {(k, 6)}: rows [rank*k, (rank+1)*k) of "
                f"the full weight, k = out_features // the size of group= = {full.out_features} // {world}")
            xs = x.clone().requires_grad_()
            y = layer(xs)
            if gather:
                check_close(y, y_ref, f"{where}: the gathered output", factors=FACTORS(world),
                            hint="gather_output=True: all-gather the ranks' output blocks along the last dimension")
                y.backward(dy)
            else:
                check_close(y, block(y_ref, rank, world, -1), f"{where}: this rank's output block", factors=FACTORS(world),
                            hint="rank r computes output features [r*k, (r+1)*k): rows r*k.. of the weight, by its rank "
                                 "in group= (tp_world(group))")
                y.backward(block(dy, rank, world, -1))
            check_close(xs.grad, dx_ref, f"{where}: the input's gradient", factors=FACTORS(world),
                        hint="every rank's block contributes to dL/dx: the input goes through copy_to_parallel "
                             "(identity forward, all-reduce over group= backward)")
            check_close(layer.weight.grad, block(g_ref["weight"], rank, world, 0), f"{where}: the weight shard's gradient",
                        factors=FACTORS(world))
            if bias:
                check_close(layer.bias.grad, block(g_ref["bias"], rank, world, 0), f"{where}: the bias shard's gradient",
                            factors=FACTORS(world))
            else:
                assert layer.bias is None, f"{where}: the layer has a bias, the full layer has none: keep bias=None"
    return True


@pytest.mark.exercise("ColumnParallelLinear")
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_column_parallel_forward_backward_equal_unsharded_with_and_without_gather_and_bias(world):
    assert launch(_column, world, timeout=TIMEOUT) == [True] * world


def _row(rank, world, group=None, seed=0):
    tp = impl("tensor_parallel")
    for bias in (True, False):
        for input_is_parallel in (True, False):
            where = f"row-parallel, TP rank {rank} of {world}, bias={bias}, input_is_parallel={input_is_parallel}"
            torch.manual_seed(seed)
            full = nn.Linear(4 * world, 5, bias=bias)
            x, dy = torch.randn(2, 3, full.in_features), torch.randn(2, 3, 5)
            y_ref, dx_ref, g_ref = reference(full, x, dy)
            layer = tp.RowParallelLinear(full, group=group, input_is_parallel=input_is_parallel)
            assert layer.weight.shape == (5, 4), (
                f"weight has shape {tuple(layer.weight.shape)}, expected (5, 4): columns [rank*k, (rank+1)*k) "
                f"of the full weight, k = in_features // the size of group= = {full.in_features} // {world}")
            xs = (block(x, rank, world, -1) if input_is_parallel else x).clone().requires_grad_()
            y = layer(xs)
            check_close(y, y_ref, f"{where}: the output (the full one on every rank)", factors=FACTORS(world),
                        hint="sum the ranks' partial products over group= (reduce_from_parallel), then add the bias once")
            y.backward(dy)
            dx_expected = block(dx_ref, rank, world, -1) if input_is_parallel else dx_ref
            check_close(xs.grad, dx_expected, f"{where}: the input's gradient", factors=FACTORS(world),
                        hint="with input_is_parallel=False the full input is cut into this rank's columns (scatter_to_parallel)")
            check_close(layer.weight.grad, block(g_ref["weight"], rank, world, 1), f"{where}: the weight shard's gradient",
                        factors=FACTORS(world))
            if bias:  # the bias is added once, after the sum: its gradient is the full one
                check_close(layer.bias.grad, g_ref["bias"], f"{where}: the bias's gradient (the full one)",
                            factors=FACTORS(world))
    return True


@pytest.mark.exercise("RowParallelLinear")
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_row_parallel_forward_backward_equal_unsharded_parallel_and_full_input(world):
    assert launch(_row, world, timeout=TIMEOUT) == [True] * world


def _mlp(rank, world, group=None, seed=0):
    tp = impl("tensor_parallel")
    torch.manual_seed(seed)
    full = SwiGLU(get_config("tiny"))  # d_model 64, hidden 176 = 4 x 44
    x, dy = torch.randn(2, 5, 64), torch.randn(2, 5, 64)
    y_ref, dx_ref, g_ref = reference(full, x, dy)
    mlp = tp.ParallelMLP(full, group=group)
    xs = x.clone().requires_grad_()
    with count_traffic() as forward:
        y = mlp(xs)
    with count_traffic() as backward:
        y.backward(dy)
    check_close(y, y_ref, f"ParallelMLP, TP rank {rank} of {world}: the output", factors=FACTORS(world))
    check_close(xs.grad, dx_ref, f"ParallelMLP, TP rank {rank} of {world}: the input's gradient", factors=FACTORS(world))
    diagnose.assert_same_named({f"{name}.weight": getattr(mlp, name).weight.grad for name in ("w1", "w3", "w2")},
                               {f"{name}.weight": block(g_ref[f"{name}.weight"], rank, world, dim)
                                for name, dim in (("w1", 0), ("w3", 0), ("w2", 1))},
                               "weight gradient", f"TP rank {rank} of {world}")
    return forward.log(), backward.log()  # [(op, payload bytes)]: every dist.<op> call


@pytest.mark.exercise("ParallelMLP", needs=("ColumnParallelLinear", "RowParallelLinear"))
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_parallel_mlp_equals_swiglu_with_one_allreduce_each_way(world):
    for forward_log, backward_log in launch(_mlp, world, timeout=TIMEOUT):
        want = [("all_reduce", 2 * 5 * 64 * 4)]  # one all-reduce of the [2, 5, 64] float32 activations
        assert forward_log == want, (f"ParallelMLP's forward called {forward_log} ((op, payload bytes) per call), "
                                     f"expected {want}: one all-reduce of the output, after w2")
        assert backward_log == want, (f"ParallelMLP's backward called {backward_log}, expected {want}: one all-reduce "
                                      "of dL/dx, before w1 and w3 (one copy_to_parallel shared by both)")


def _attention(rank, world):
    tp = impl("tensor_parallel")
    model = build_model("tiny", seed=0)  # 4 heads of 16
    full = model.layers[0].attention
    torch.manual_seed(0)  # same x and dy on every rank
    x, dy = torch.randn(2, 7, 64), torch.randn(2, 7, 64)
    xr = x.clone().requires_grad_()
    y_ref = full(xr, model.rope)
    y_ref.backward(dy)
    attn = tp.ParallelAttention(full)
    xs = x.clone().requires_grad_()
    y = attn(xs, model.rope)
    y.backward(dy)
    where = f"attention split by heads, TP rank {rank} of {world}"
    check_close(y, y_ref, f"{where}: the output", factors=FACTORS(world))
    check_close(xs.grad, xr.grad, f"{where}: the input's gradient", factors=FACTORS(world))
    for name, dim in (("wq", 0), ("wk", 0), ("wv", 0), ("wo", 1)):
        check_close(getattr(attn, name).weight.grad, block(getattr(full, name).weight.grad, rank, world, dim),
                    f"{where}: the gradient of {name}'s shard", factors=FACTORS(world))
    return True


@pytest.mark.exercise("ColumnParallelLinear", "RowParallelLinear")
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_attention_split_by_heads_equals_attention(world):
    assert launch(_attention, world, timeout=TIMEOUT) == [True] * world


def _whole_model(rank, world):
    tp = impl("tensor_parallel")
    model = build_model("tiny", seed=0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 4096, (2, 16), generator=g), torch.randint(0, 4096, (2, 16), generator=g)
    loss_ref = model(x, y)
    loss_ref.backward()
    tp_model = tp.parallelize_model(model)
    with count_traffic() as traffic:
        loss = tp_model(x, y)
        loss.backward()
    check_close(loss, loss_ref, f"parallelize_model, TP rank {rank} of {world}: the loss")
    # what tp_comm_per_layer promises: 4 all-reduces of [batch, seq, d_model] per layer and step
    per_layer = tp.tp_comm_per_layer(2, 16, 64, world, bytes_per_elem=4)
    want = [("all_reduce", 2 * 16 * 64 * 4)] * (per_layer["allreduces"] * model.config.n_layers)
    assert traffic.log() == want, (
        f"one TP step of the tiny model called {len(traffic.log())} collectives (first {traffic.log()[:3]}), expected "
        f"{len(want)} all-reduces of the [2, 16, 64] activations, tp_comm_per_layer's {per_layer['allreduces']} per layer")
    assert per_layer["activation_bytes"] == 2 * 16 * 64 * 4, (
        f"tp_comm_per_layer gives {per_layer['activation_bytes']} bytes per all-reduce, expected 2 x 16 x 64 x 4")
    full = dict(model.named_parameters())
    got, want = {}, {}
    for name, p in tp_model.named_parameters():
        grad = full[name].grad
        if p.shape != grad.shape:  # sharded: rows (wq wk wv w1 w3) or columns (wo w2)
            grad = block(grad, rank, world, 0 if p.shape[1] == grad.shape[1] else 1)
        got[name], want[name] = p.grad, grad
    # the first parameter (in the model's order) whose gradient differs, and by how much
    diagnose.assert_same_named(got, want, "parameter gradient", f"rank {rank} of {world}")
    return True


@pytest.mark.exercise("ParallelMLP", needs=("ColumnParallelLinear", "RowParallelLinear"))
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_parallelize_model_tiny_loss_and_every_gradient_equal(world):
    assert launch(_whole_model, world, timeout=TIMEOUT) == [True] * world


def _not_divisible(rank, world, what):
    tp = impl("tensor_parallel")
    if what == "ColumnParallelLinear":
        tp.ColumnParallelLinear(nn.Linear(3, 4))  # divisible: must work
        tp.ColumnParallelLinear(nn.Linear(4, 3))
    elif what == "RowParallelLinear":
        tp.RowParallelLinear(nn.Linear(4, 3))
        tp.RowParallelLinear(nn.Linear(3, 4))
    elif what == "ParallelMLP":
        tp.ParallelMLP(SwiGLU(get_config("tiny")))
        tp.ParallelMLP(SwiGLU(get_config("tiny", hidden_dim=7 * world + 1)))
    else:
        tp.ParallelAttention(Attention(get_config("tiny")))  # 4 heads
        tp.ParallelAttention(Attention(get_config("tiny", d_model=48, n_heads=3)))


@pytest.mark.parametrize("what,match", [
    pytest.param("ColumnParallelLinear", "out_features=3", marks=pytest.mark.exercise("ColumnParallelLinear")),
    pytest.param("RowParallelLinear", "in_features=3", marks=pytest.mark.exercise("RowParallelLinear")),
    pytest.param("ParallelMLP", "=15", marks=pytest.mark.exercise("ParallelMLP")),
    pytest.param("attention", "n_heads=3", marks=pytest.mark.exercise("ColumnParallelLinear", "RowParallelLinear")),
])
def test_dimension_not_divisible_by_tp_size_raises_value_error(what, match):
    with pytest.raises(Exception) as info:
        launch(_not_divisible, 2, what, timeout=TIMEOUT)
    if isinstance(info.value, NotImplementedError):
        raise info.value  # an unimplemented stub fails as such, not as a wrong error
    assert "ValueError" in str(info.value) and match in str(info.value), str(info.value)


# --- group=: two disjoint TP groups of 2 in 4 ranks, each with its own layer; one launch -------
GROUPS = {(1, 3): 1, (0, 2): 2}  # ranks: seed of the group's full layer and data
GROUP_CASES = {"ColumnParallelLinear": _column, "RowParallelLinear": _row, "ParallelMLP": _mlp}


def _run_group_cases(rank, world_size):
    groups = {ranks: dist.new_group(list(ranks)) for ranks in GROUPS}  # collective: every rank, same order
    ranks = next(r for r in GROUPS if rank in r)

    def body(name, check):
        with diagnose.watch_groups(groups[ranks], name):
            check(ranks.index(rank), len(ranks), group=groups[ranks], seed=GROUPS[ranks])
    return run_cases({name: functools.partial(body, name, check) for name, check in GROUP_CASES.items()})


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.exercise(name)) for name in GROUP_CASES])
def test_group_two_disjoint_tp_groups_of_4_ranks(name):
    expect_case(launch_cases(_run_group_cases, 4, timeout=TIMEOUT), name,
                f"{name} with group=[1, 3] and group=[0, 2] on 4 ranks (each group its own layer)")
