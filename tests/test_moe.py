"""labkit.model.moe: the reference mixture-of-experts layer and the tiny-moe config (a few seconds)."""
import math

import pytest
import torch

from labkit.model import moe
from labkit.model import build_model, get_config, lm_loss


def layer(E=4, k=2, cf=1.25, d=8, hidden=12, seed=0):
    torch.manual_seed(seed)
    return moe.MoE(get_config("tiny-moe", d_model=d, n_heads=1, hidden_dim=hidden, n_experts=E, top_k=k,
                              capacity_factor=cf)).double()


def naive_moe(m, x):
    """Token by token, pick by pick: what the sorted implementation must equal."""
    r = moe.route(x, m.router.weight, m.top_k, m.capacity_factor)
    y = torch.zeros_like(x)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            for slot in range(m.top_k):
                if r.keep[b, t, slot]:
                    y[b, t] += r.gate[b, t, slot] * m.experts[int(r.expert[b, t, slot])](x[b, t])
    return y


def test_capacity_formula():
    assert moe.capacity(64, 4, 2, 1.25) == 40  # ceil(1.25 * 64 * 2 / 4)
    assert moe.capacity(10, 8, 1, 1.0) == 2  # ceil(1.25) rounds up
    assert moe.capacity(4, 2, 2, 100.0) == 4  # never more than T: a token picks an expert once
    assert moe.capacity(4, 64, 1, 0.01) == 1


@pytest.mark.parametrize("kwargs,words", [(dict(top_k=5, n_experts=4), "top_k=5"),
                                          (dict(top_k=0), "top_k=0"),
                                          (dict(capacity_factor=0.0), "capacity_factor=0.0"),
                                          (dict(capacity_factor=-1), "capacity_factor=-1")])
def test_bad_moe_config_raises_clear_error(kwargs, words):
    with pytest.raises(ValueError, match=words):
        build_model("tiny-moe", **kwargs)


def test_sorted_dispatch_equals_token_by_token_loop():
    m = layer(E=4, k=2, cf=0.75)
    x = torch.randn(2, 8, 8, dtype=torch.float64)
    y = m(x)
    assert m.routing.dropped_fraction() > 0  # the case drops picks
    torch.testing.assert_close(y, naive_moe(m, x), rtol=1e-12, atol=1e-14)


def test_drops_lowest_position_first_and_dropped_tokens_get_zero():
    """Every token prefers experts 0 then 1: only the first C positions of each sequence are kept."""
    m = layer(E=4, k=2, cf=1.0)
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[0, 0], m.router.weight[1, 0] = 3.0, 2.0
    x = torch.randn(2, 12, 8, dtype=torch.float64)
    x[..., 0] = x[..., 0].abs() + 1
    y = m(x)
    C = moe.capacity(12, 4, 2, 1.0)  # 6
    r = m.routing
    assert torch.equal(r.expert[..., 0], torch.zeros(2, 12, dtype=torch.long))
    assert torch.equal(r.keep, (torch.arange(12) < C)[None, :, None].expand(2, 12, 2))
    assert torch.equal(y[:, C:], torch.zeros_like(y[:, C:])), "a token with every pick dropped gets exactly 0"
    assert r.kept_counts().tolist() == [2 * C, 2 * C, 0, 0] and r.routed_counts().tolist() == [24, 24, 0, 0]


def test_drops_do_not_depend_on_how_the_batch_is_split():
    m = layer(E=4, k=2, cf=0.75)
    x = torch.randn(4, 10, 8, dtype=torch.float64)
    whole = m(x)
    keep = m.routing.keep
    first, keep0 = m(x[:2]), m.routing.keep
    second, keep1 = m(x[2:]), m.routing.keep
    assert torch.equal(torch.cat([keep0, keep1]), keep)
    torch.testing.assert_close(torch.cat([first, second]), whole, rtol=1e-12, atol=1e-14)


def test_aux_loss_is_one_when_balanced_and_larger_when_not():
    m = layer(E=4, k=1)
    with torch.no_grad():
        m.router.weight.zero_()  # uniform probabilities: E * sum_e f_e / E = 1 whatever the picks
    m(torch.randn(2, 8, 8, dtype=torch.float64))
    torch.testing.assert_close(m.aux_loss, torch.tensor(1.0, dtype=torch.float64))
    with torch.no_grad():
        m.router.weight[0, 0] = 50.0
    x = torch.randn(2, 8, 8, dtype=torch.float64)
    x[..., 0] = 1.0
    m(x)  # every token on expert 0 with probability ~1: aux ~ E
    assert m.aux_loss > 3.9


def test_aux_loss_reaches_the_model_loss_and_the_router_gradient():
    x = torch.randint(0, 4096, (2, 16))
    model = build_model("tiny-moe", seed=0, aux_loss_coef=0.5)
    loss = model(x, x)
    logits = model(x)
    torch.testing.assert_close(loss, lm_loss(logits, x) + 0.5 * moe.aux_loss(model))
    assert len(moe.moe_layers(model)) == model.config.n_layers
    grads = {}
    for coef in (0.0, 0.5):
        model = build_model("tiny-moe", seed=0, aux_loss_coef=coef)
        model(x, x).backward()
        grads[coef] = model.layers[0].feed_forward.router.weight.grad
    assert not torch.allclose(grads[0.0], grads[0.5]), "the aux loss must change the router's gradient"


def test_dense_config_is_unchanged():
    model = build_model("tiny")
    assert model.config.n_experts == 0
    assert not moe.moe_layers(model)
    assert "layers.0.feed_forward.w1.weight" in dict(model.named_parameters())
    moe_model = build_model("tiny-moe")
    names = dict(moe_model.named_parameters())
    assert "layers.0.feed_forward.router.weight" in names and "layers.1.feed_forward.experts.3.w2.weight" in names


def test_tiny_moe_loss_falls_on_tinystories():
    from labkit.data import get_batch, load_tokens

    torch.manual_seed(0)
    tokens = load_tokens("tinystories")
    model = build_model("tiny-moe", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(12):
        x, y = get_batch(tokens, 4, 32, step)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert math.isfinite(losses[-1])
    assert sum(losses[-3:]) / 3 < losses[0] - 0.8, losses  # ln(4096) = 8.3 at the start


@pytest.mark.parametrize("E,ep,rank,words", [(3, 2, 0, "does not divide"), (4, 2, 2, "not in range")])
def test_ep_moe_with_experts_not_dividing_over_ep_raises_before_any_communication(E, ep, rank, words):
    from labkit.grading import impl

    layer = moe.MoE(get_config("tiny-moe", n_experts=E))
    with pytest.raises(ValueError, match=words):  # no process group: it must fail before any collective
        impl("expert_parallel").EPMoE(layer, group=None, ep_rank=rank, ep_size=ep)
