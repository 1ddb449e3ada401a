"""Activation recomputation (ModelConfig.recompute) and the saved-for-backward counter (labkit.measure.activations).

One process, tiny model; a few seconds.
"""
import contextlib

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from labkit.measure.activations import SavedTensors, block_activation_elements, megatron_bytes, recompute_peak_elements
from labkit.model import build_model, get_config


def batch(b, s, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4096, (b, s), generator=g), torch.randint(0, 4096, (b, s), generator=g)


def test_recompute_gradients_exactly_equal_without():
    x, y = batch(2, 32)
    plain = build_model("tiny", seed=0)
    again = build_model("tiny", seed=0, recompute=True)
    assert again.config.recompute and not plain.config.recompute
    plain(x, y).backward()
    loss = again(x, y)
    loss.backward()
    torch.testing.assert_close(loss, plain(x, y), rtol=0, atol=0)
    for (name, p), q in zip(plain.named_parameters(), again.parameters()):
        assert torch.equal(p.grad, q.grad), name  # the same ops on the same numbers: bit for bit


def test_recompute_is_off_without_grad_and_in_eval():
    model = build_model("tiny", seed=0, recompute=True)
    x, _ = batch(1, 8)
    with torch.no_grad():
        assert torch.equal(model(x), build_model("tiny", seed=0)(x))


@pytest.mark.parametrize("flash", [True, False])
@pytest.mark.parametrize("b,s", [(1, 16), (2, 48)])
def test_one_block_saves_exactly_the_formula(b, s, flash):
    model = build_model("tiny", seed=0)
    cfg = model.config
    x = torch.randn(b, s, cfg.d_model, requires_grad=True)
    kernel = contextlib.nullcontext() if flash else sdpa_kernel(SDPBackend.MATH)
    with kernel, SavedTensors(model) as saved:
        model.layers[0](x, model.rope)
    expected = block_activation_elements(b, s, cfg.d_model, cfg.n_heads, cfg.hidden_dim, flash=flash)
    assert saved.nbytes == 4 * expected


def test_recompute_keeps_only_block_inputs():
    b, s = 1, 64
    x, y = batch(b, s)
    held = {}
    for recompute in (False, True):
        model = build_model("tiny", seed=0, recompute=recompute)
        with SavedTensors(model) as saved:
            model(x, y)
        held[recompute] = saved.nbytes
    cfg = get_config("tiny")
    per_layer = 4 * block_activation_elements(b, s, cfg.d_model, cfg.n_heads, cfg.hidden_dim)
    # outside the blocks (embedding ids, final norm, logits) is the same in both runs
    outside = held[False] - cfg.n_layers * per_layer
    assert held[True] == outside + cfg.n_layers * 4 * b * s * cfg.d_model
    assert recompute_peak_elements(b, s, cfg.d_model, cfg.n_heads, cfg.hidden_dim, cfg.n_layers) == \
        cfg.n_layers * b * s * cfg.d_model + per_layer // 4


def test_formulas_bad_input_and_megatron_numbers():
    with pytest.raises(ValueError, match="s must be a positive int"):
        block_activation_elements(1, 0, 64, 4, 176)
    assert megatron_bytes(1, 2048, 4096, 32) == 2048 * 4096 * 34 + 5 * 32 * 2048 ** 2
