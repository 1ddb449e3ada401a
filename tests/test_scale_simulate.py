"""labkit.scale.simulate: one rank of a 1,024-rank world on fake tensors, measured by torch's own tools,
against the formulas. Exact: every figure is an integer count. About 5 s on 2 cores."""
import pytest
import torch.distributed as dist

from labkit.measure.activations import block_activation_elements
from labkit.measure.memory import memory_per_rank
from labkit.model import ModelConfig
from labkit.scale.simulate import count_collectives, dp_step, fake_world, measure_step
from labkit.scale.specs import spec_from_config

CFG = ModelConfig(vocab_size=4096, d_model=256, n_heads=8, n_layers=2, context=512, hidden_dim=688)
B, S, WORLD = 2, 512, 1024


@pytest.fixture(scope="module")
def measured():
    return measure_step(dp_step(CFG, B, S), world_size=WORLD, rank=517)


def test_flops_are_6n_plus_12lds(measured):
    spec = spec_from_config(CFG)
    norms = 2 * CFG.n_layers * CFG.d_model + CFG.d_model  # in N, but no matmul
    assert measured["flops"] == (spec.flops_per_token(S) - 6 * norms) * B * S


def test_bytes_are_one_ring_all_reduce_of_the_gradients(measured):
    p = spec_from_config(CFG).n_params
    assert measured["bytes"] == {("all_reduce", WORLD): 2 * (WORLD - 1) / WORLD * 4 * p}


def test_memory_after_forward_is_the_activation_formula(measured):
    """Blocks (labkit.measure.activations, math attention: it keeps the s x s probabilities), the final
    norm (3 b s d + b s) and the log-softmax of the loss (b s V), in fp32; plus the int64 targets
    nll_loss keeps and two fp32 scalars (the loss, nll_loss's total weight). Parameters: 4 bytes each."""
    b, s, d, V = B, S, CFG.d_model, CFG.vocab_size
    blocks = CFG.n_layers * block_activation_elements(b, s, d, CFG.n_heads, CFG.hidden_dim, flash=False)
    after = measured["memory"]["after_forward"]
    assert after["ACT"] == 4 * (blocks + 3 * b * s * d + b * s + b * s * V) + 8 * b * s + 2 * 4
    assert after["PARAM"] == memory_per_rank(spec_from_config(CFG).n_params, WORLD, "dp", "fp32")["params"]


def test_model_states_after_the_step_are_the_zero_paper_formulas(measured):
    """labkit.measure.memory, plain DP in fp32 (4 + 4 + 8 bytes/param); AdamW adds a 4-byte step counter per tensor."""
    p = spec_from_config(CFG).n_params
    ref = memory_per_rank(p, WORLD, "dp", "fp32")
    n_tensors = 2 + CFG.n_layers * 9 + 1  # embedding, head; per block 7 matrices + 2 norms; final norm
    after = measured["memory"]["after_step"]
    assert (after["PARAM"], after["GRAD"]) == (ref["params"], ref["grads"])
    assert after["OPT"] == ref["optimizer"] + 4 * n_tensors


def test_counter_follows_the_ring_factors():
    import torch

    with fake_world(8, rank=3), count_collectives() as sent:
        t = torch.zeros(80)  # ops called as dist.<op> at call time: labkit.comm's interception sees them
        dist.all_gather_single(t, torch.zeros(10))
        dist.reduce_scatter_single(torch.zeros(10), t)
        dist.all_reduce(t)
    assert sent == {("all_gather", 8): 7 / 8 * 320, ("reduce_scatter", 8): 7 / 8 * 320,
                    ("all_reduce", 8): 2 * 7 / 8 * 320}
    assert not dist.is_initialized()


def test_fake_world_refuses_a_bad_rank():
    with pytest.raises(ValueError, match="rank=8 must lie in 0..7"):
        with fake_world(8, rank=8):
            pass
