"""Grading tests for notebook 08_tensor_parallel: vocabulary-parallel embedding and cross-entropy.

Run: pytest tests/grading/test_vocab_parallel.py   (add --impl=solutions for the reference)
On 2 and 4 ranks (one launch each, labkit.grading.cases), in float64, on every rank: the sharded embedding's
output equals the full one and its weight gradient the rows of the full gradient; the vocab-parallel
loss equals F.cross_entropy of the full logits (ignored targets, logits of 1e4 that overflow exp()
without the max shift) and each rank's logit gradient its block of the full gradient; the whole
tiny model with every matrix sharded gives the unsharded loss and gradients. float64: the ranks sum
the exponentials in another order than one process, so the difference is rounding of ~1e-16
relative, far inside assert_close's float64 tolerance (1e-7), while any wrong term is O(1e-2).
About 15 s on 2 cores.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from labkit.grading import diagnose
from labkit.grading.cases import expect_case, launch_cases, launch_timeout, run_cases
from labkit.grading import impl
from labkit.grading.closeness import check_close
from labkit.model import build_model

TIMEOUT = launch_timeout(30)
WORLD_SIZES = [2, 4]
V = 24  # divides by 2 and 4


def block(t, rank, world, dim):
    return t.chunk(world, dim=dim)[rank]


def edge_tokens(world, n=40, seed=0):
    """Random ids plus every block's first and last id (where an off-by-one shows)."""
    k = V // world
    edges = torch.tensor([i for r in range(world) for i in (r * k, r * k + k - 1)])
    return torch.cat([edges, torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed))])


def check_embedding(rank, world, group=None):
    vp = impl("vocab_parallel")
    rank, world = _in_group(rank, world, group)
    torch.manual_seed(0)
    full = nn.Embedding(V, 6).double()
    tokens = edge_tokens(world).view(4, -1)
    dy = torch.randn(*tokens.shape, 6, dtype=torch.float64)
    full(tokens).backward(dy)
    layer = vp.VocabParallelEmbedding(full, group=group)
    k = V // world
    assert layer.weight.shape == (k, 6), (f"weight has shape {tuple(layer.weight.shape)}, expected {(k, 6)}: "
                                          f"rows [rank*k, (rank+1)*k) of the full weight, k = V // TP size")
    y = layer(tokens)
    check_close(y, full(tokens).detach(), f"the embedding's output on TP rank {rank} of {world}",
                factors={world: f"summed over the {world} ranks more than once, or over the default group"},
                hint="each rank looks up the tokens of its own block (its rank in group= x k ...), zeros elsewhere, "
                     "then one all-reduce over group= (reduce_from_parallel)")
    y.backward(dy)
    check_close(layer.weight.grad, block(full.weight.grad, rank, world, 0),
                f"the gradient of the embedding's rows [{rank * k}, {(rank + 1) * k}) on TP rank {rank} of {world}",
                factors={world: f"summed over the {world} ranks: each rank's rows get only its own tokens' gradient"})


def check_cross_entropy(rank, world, scale=3.0, offset=0.0, ignore=False, group=None):
    vp = impl("vocab_parallel")
    rank, world = _in_group(rank, world, group)
    torch.manual_seed(1)
    targets = edge_tokens(world)
    if ignore:
        targets[::3] = -100
    logits = (scale * torch.randn(len(targets), V, dtype=torch.float64) + offset).requires_grad_()
    want = F.cross_entropy(logits, targets)
    want.backward()
    local = block(logits.detach(), rank, world, -1).clone().requires_grad_()
    got = vp.vocab_parallel_cross_entropy(local, targets, group=group)
    assert got.dim() == 0, f"the loss must be a scalar (the mean over tokens), got shape {tuple(got.shape)}"
    check_close(got, want.detach(), f"the loss on TP rank {rank} of {world}",
                hint="likely the max, the sum of exponentials or the target's logit not all-reduced over group= (one "
                     "number per token each), a target id not shifted by this rank's block start, or the max left out "
                     "of the target's term")
    got.backward()
    n_valid = int((targets != -100).sum())
    check_close(local.grad, block(logits.grad, rank, world, -1), f"the gradient of this rank's logits on TP rank {rank} of {world}",
                factors={n_valid: f"the gradient of the SUM over the {n_valid} valid tokens where their mean was due: "
                                  "divide by the number of valid targets",
                         world: f"summed over the {world} ranks: each rank's logits' gradient is local (softmax minus "
                                "the one-hot target, on its own block)"},
                hint="softmax of this block minus the one-hot target (on its owner's block only), times grad / the "
                     "number of valid targets; ignored targets (-100) get zero")


def _in_group(rank, world, group):
    """(rank, size) in `group`: the block a rank owns is its GROUP rank's, and only the group sums."""
    import torch.distributed as dist

    return (rank, world) if group is None else (dist.get_rank(group), dist.get_world_size(group))


# Two TP groups of 4 ranks, {0, 2} and {1, 3}: a group rank is not the global rank (rank 2 owns block 1),
# and a collective over the default group would add the other group's terms. Made by every rank, in order.
SPLIT = ([0, 2], [1, 3])


def in_split_groups(check):
    def run(rank, world):
        import torch.distributed as dist

        groups = [dist.new_group(ranks) for ranks in SPLIT]
        return check(rank, world, group=groups[rank % 2])
    return run


def check_whole_model(rank, world):
    vp = impl("vocab_parallel")
    model = build_model("tiny", seed=0).double()
    g = torch.Generator().manual_seed(1)
    n_vocab = model.config.vocab_size
    x, y = torch.randint(0, n_vocab, (2, 12), generator=g), torch.randint(0, n_vocab, (2, 12), generator=g)
    loss_ref = model(x, y)
    loss_ref.backward()
    sharded = vp.parallelize_vocab(model)
    loss = vp.vocab_parallel_loss(sharded, x, y)
    check_close(loss, loss_ref.detach(), f"the vocab-parallel model's loss on rank {rank} of {world}")
    loss.backward()
    full = dict(model.named_parameters())
    got, want = {}, {}
    for name, p in sharded.named_parameters():
        grad = full[name].grad
        if p.shape != grad.shape:  # rows (embedding, head, wq wk wv w1 w3) or columns (wo w2)
            grad = block(grad, rank, world, 0 if p.shape[1] == grad.shape[1] else 1)
        got[name], want[name] = p.grad, grad
    diagnose.assert_same_named(got, want, "parameter gradient", f"rank {rank} of {world}")


CASES = {
    ("VocabParallelEmbedding", "edges and random ids"): check_embedding,
    ("VocabParallelCrossEntropy", "random logits"): check_cross_entropy,
    ("VocabParallelCrossEntropy", "ignored targets (-100)"):
        lambda r, w: check_cross_entropy(r, w, ignore=True),
    ("VocabParallelCrossEntropy", "logits near 1e4: exp overflows without the max"):
        lambda r, w: check_cross_entropy(r, w, scale=30.0, offset=1e4),
    ("VocabParallelCrossEntropy", "whole tiny model, every matrix sharded"): check_whole_model,
}
SPLIT_CASES = {  # on 4 ranks only: the group's rank, not the global one; the group's sum, not the world's
    ("VocabParallelEmbedding", "tp groups {0,2} and {1,3}"): in_split_groups(check_embedding),
    ("VocabParallelCrossEntropy", "tp groups {0,2} and {1,3}"): in_split_groups(check_cross_entropy),
}


def run_all(rank, world):
    cases = {**CASES, **SPLIT_CASES} if world == 4 else CASES
    return run_cases({key: (lambda check=check: check(rank, world)) for key, check in cases.items()})


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("key", [pytest.param(key, marks=pytest.mark.exercise(key[0]), id=key[1])
                                 for key in CASES])
def test_vocab_parallel_equals_unsharded_in_float64(key, world):
    expect_case(launch_cases(run_all, world, timeout=TIMEOUT), key, f"{key[0]} on {world} ranks: {key[1]}")


def _not_divisible(rank, world):
    vp = impl("vocab_parallel")
    vp.VocabParallelEmbedding(nn.Embedding(4 * world, 3))(torch.zeros(1, dtype=torch.long))  # divides: works
    vp.VocabParallelEmbedding(nn.Embedding(4 * world + 1, 3))


@pytest.mark.parametrize("key", [pytest.param(key, marks=pytest.mark.exercise(key[0]), id=key[1])
                                 for key in SPLIT_CASES])
def test_vocab_parallel_uses_its_group_rank_and_sums_over_its_group_only(key):
    expect_case(launch_cases(run_all, 4, timeout=TIMEOUT), key, f"{key[0]} on 4 ranks: {key[1]}")


@pytest.mark.exercise("VocabParallelEmbedding")
def test_vocab_not_divisible_by_tp_size_raises_value_error():
    from labkit.launching.launcher import launch

    with pytest.raises(Exception) as info:
        launch(_not_divisible, 2, timeout=TIMEOUT)
    if isinstance(info.value, NotImplementedError):
        raise info.value
    assert "ValueError" in str(info.value) and "vocab_size=9" in str(info.value), str(info.value)


# --- on fake tensors: notebook 15's simulator runs this loss with no data -------------------------------

def _on_fake_tensors(world=4, rank=1, n=64):
    """The learner's loss and its backward under FakeTensorMode, in a fake world (labkit.scale.simulate):
    the shapes must follow from the input shapes alone. Returns (loss shape, gradient shape)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode

    from labkit.scale.simulate import fake_world

    vp = impl("vocab_parallel")
    with fake_world(world, rank), FakeTensorMode():
        logits = torch.randn(n, V // world, dtype=torch.float64, requires_grad=True)
        targets = torch.randint(0, V, (n,))
        targets[::5] = -100
        try:
            loss = vp.vocab_parallel_cross_entropy(logits, targets)
            loss.backward()
        except (DynamicOutputShapeException, DataDependentOutputException) as error:
            op = getattr(error, "func", None) or str(error).splitlines()[0]
            pytest.fail(
                f"vocab_parallel_cross_entropy cannot run on fake tensors (FakeTensorMode, as notebook 15's simulator "
                f"runs it): it called {op}, whose output shape (or value) depends on the data. Expected shapes that "
                "follow from the input shapes alone: no nonzero(), no boolean-mask indexing (x[mask]), no .item() or "
                "bool() of a tensor. Use masks and torch.where instead: torch.where(mine, targets - start, 0), "
                "gather, multiply by the mask, (per_token * valid).sum() / valid.sum()", pytrace=False)
        return tuple(loss.shape), tuple(logits.grad.shape)


@pytest.mark.exercise("VocabParallelCrossEntropy")
def test_vocab_parallel_cross_entropy_runs_on_fake_tensors_no_data_dependent_shapes():
    loss_shape, grad_shape = _on_fake_tensors()
    assert loss_shape == (), f"on fake tensors the loss has shape {loss_shape}, expected () (a scalar mean)"
    assert grad_shape == (64, V // 4), f"on fake tensors the logits' gradient has shape {grad_shape}, expected {(64, V // 4)}"
