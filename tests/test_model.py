"""labkit.model: configs, deterministic init, forward/loss, causality, generation, pipeline stages."""
import math
import textwrap

import pytest
import torch
import torch.nn.functional as F

from labkit.model import (ModelConfig, Transformer, build_model, get_config, make_stage, make_stages,
                          split_layers)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _batch(cfg, B=2, T=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def test_seed_config_is_the_original_labs_model():
    cfg = get_config("seed")
    assert (cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.context, cfg.hidden_dim) == (288, 6, 6, 256, 768)


def test_tiny_config_keeps_at_least_four_layers_for_pipelines():
    cfg = get_config("tiny")
    assert cfg.n_layers >= 4 and cfg.vocab_size == 4096


def test_get_config_unknown_name_raises_listing_names():
    with pytest.raises(ValueError, match=r"known configs: \['seed', 'tiny'"):
        get_config("huge")


def test_get_config_unknown_override_field_raises():
    with pytest.raises(ValueError, match="unknown ModelConfig field"):
        get_config("tiny", n_embd=32)


def test_get_config_override_d_model_recomputes_hidden_dim():
    assert get_config("tiny", d_model=288).hidden_dim == 768  # LLaMA/llama2.c rule
    assert get_config("tiny", vocab_size=65).vocab_size == 65


def test_config_heads_not_dividing_d_model_raises():
    with pytest.raises(ValueError, match="n_heads"):
        ModelConfig(d_model=64, n_heads=3)


def test_build_model_same_seed_same_weights_other_seed_other_weights():
    a, b, c = build_model("tiny", seed=1), build_model("tiny", seed=1), build_model("tiny", seed=2)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name


def test_build_model_does_not_disturb_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model("tiny", seed=0)
    torch.testing.assert_close(torch.rand(3), expected, rtol=0, atol=0)


def test_init_statistics_follow_llama2c():
    model = build_model(get_config("tiny", d_model=128, hidden_dim=512), seed=0)
    std = model.layers[0].attention.wq.weight.std().item()
    std_res = model.layers[0].attention.wo.weight.std().item()
    assert abs(std - 0.02) < 0.002
    assert abs(std_res - 0.02 / math.sqrt(2 * model.config.n_layers)) < 0.001


def test_forward_logits_shape_and_loss_is_mean_cross_entropy():
    model = build_model("tiny")
    x, y = _batch(model.config)
    logits = model(x)
    assert logits.shape == (2, 16, model.config.vocab_size)
    expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    torch.testing.assert_close(model(x, y), expected)


def test_initial_loss_is_about_ln_vocab():
    model = build_model("tiny")
    x, y = _batch(model.config, B=4, T=64)
    assert abs(model(x, y).item() - math.log(model.config.vocab_size)) < 0.1


def test_forward_is_causal_future_tokens_do_not_change_past_logits():
    model = build_model("tiny")
    x, _ = _batch(model.config, T=12)
    x2 = x.clone()
    x2[:, 8:] = (x2[:, 8:] + 1) % model.config.vocab_size
    la, lb = model(x), model(x2)
    torch.testing.assert_close(la[:, :8], lb[:, :8])
    assert not torch.allclose(la[:, 8:], lb[:, 8:])


def test_rope_attention_score_depends_only_on_relative_position():
    rope = build_model("tiny").rope
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16, generator=g), torch.randn(1, 1, 1, 16, generator=g)
    def score(m, n):
        Q = torch.zeros(1, 1, 40, 16); K = torch.zeros(1, 1, 40, 16)
        Q[..., m, :], K[..., n, :] = q[0, 0, 0], k[0, 0, 0]
        return (rope(Q)[..., m, :] * rope(K)[..., n, :]).sum()
    torch.testing.assert_close(score(5, 2), score(35, 32), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(score(5, 2), score(5, 4))


def test_forward_seq_longer_than_context_raises():
    model = build_model("tiny")
    x = torch.zeros(1, model.config.context + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="longer than the model's context"):
        model(x)


def test_forward_token_id_at_vocab_size_raises_vocab_mismatch():
    model = build_model("tiny", vocab_size=65)
    x = torch.full((1, 4), 65)
    with pytest.raises(ValueError, match="vocab_size do not match"):
        model(x)


def test_forward_float_input_raises():
    with pytest.raises(ValueError, match="LongTensor"):
        build_model("tiny")(torch.zeros(1, 4))


def test_generate_greedy_is_argmax_and_seeded_sampling_is_reproducible():
    model = build_model("tiny")
    prompt = torch.tensor([[1, 2, 3]])
    out = model.generate(prompt, 5, temperature=0)
    assert out.shape == (1, 8) and torch.equal(out[:, :3], prompt)
    assert out[0, 3] == model(prompt)[0, -1].argmax()
    s1 = model.generate(prompt, 5, top_k=10, generator=torch.Generator().manual_seed(0))
    s2 = model.generate(prompt, 5, top_k=10, generator=torch.Generator().manual_seed(0))
    assert torch.equal(s1, s2)


def test_generate_longer_than_context_crops_the_input():
    model = build_model("tiny", context=8)
    out = model.generate(torch.zeros(1, 6, dtype=torch.long), 5, temperature=0)
    assert out.shape == (1, 11)


@pytest.mark.parametrize("n_layers,n_stages,sizes", [
    (4, 1, [4]), (4, 2, [2, 2]), (4, 4, [1, 1, 1, 1]),
    (4, 3, [2, 1, 1]), (6, 4, [2, 2, 1, 1]), (7, 3, [3, 2, 2]),  # uneven: the first stages get one more
])
def test_split_layers_contiguous_and_uneven_rule(n_layers, n_stages, sizes):
    ranges = split_layers(n_layers, n_stages)
    assert [len(r) for r in ranges] == sizes
    assert [i for r in ranges for i in r] == list(range(n_layers))


@pytest.mark.parametrize("n_stages", [0, 5, -1])
def test_split_layers_more_stages_than_layers_or_zero_raises(n_stages):
    with pytest.raises(ValueError, match="between 1 and n_layers=4"):
        split_layers(4, n_stages)


def test_make_stage_index_out_of_range_raises():
    with pytest.raises(ValueError, match="stage must be in"):
        make_stage(build_model("tiny"), 2, 2)


def test_stages_share_parameters_with_the_model():
    model = build_model("tiny")
    stages = make_stages(model, 3)
    ids = [id(p) for s in stages for p in s.parameters()]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())  # each parameter in exactly one stage
    assert stages[0].tok_embeddings is model.tok_embeddings and stages[-1].output is model.output


@pytest.mark.parametrize("n_layers,n_stages", [(4, 1), (4, 2), (4, 3), (4, 4), (6, 4)])
def test_stages_in_sequence_give_exactly_the_full_models_logits_and_gradients(n_layers, n_stages):
    model = build_model("tiny", n_layers=n_layers, seed=3)
    x, y = _batch(model.config, T=16)
    full_logits = model(x)
    model(x, y).backward()
    full_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    # as a pipeline would: each stage's input is a detached leaf, gradients passed back by hand
    stages = make_stages(model, n_stages)
    h, inputs, outputs = x, [], []
    for s in stages[:-1]:
        out = s(h)
        assert out.shape == (*x.shape, model.config.d_model)
        outputs.append(out)
        h = out.detach().requires_grad_()
        inputs.append(h)
    with torch.no_grad():
        logits = stages[-1](h)
    assert torch.equal(logits, full_logits)
    loss = stages[-1](h, y)
    loss.backward()
    for out, inp in zip(reversed(outputs), reversed(inputs)):
        out.backward(inp.grad)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, full_grads[n]), f"{n}: {(p.grad - full_grads[n]).abs().max()}"  # the same kernels, in the same order


# --- labkit.measure.metrics and labkit.training.loop: FLOP counts and the training loop on this model


def test_matmul_params_counts_every_parameter_but_the_embedding():
    from labkit.measure.metrics import matmul_params

    for name in ("tiny", "seed"):
        model = build_model(name)
        assert matmul_params(model.config) == model.num_params(exclude_embedding=True)


def test_flops_per_token_is_6n_plus_attention_term():
    from labkit.measure.metrics import flops_per_token, matmul_params

    cfg = get_config("seed")
    assert flops_per_token(cfg, 256) == 6 * matmul_params(cfg) + 12 * 6 * 288 * 256


def test_peak_flops_by_device_name_whole_words_and_none_when_unknown():
    from labkit.measure.metrics import lookup_peak

    assert lookup_peak("NVIDIA H100 80GB HBM3") == 989e12
    assert lookup_peak("NVIDIA H100 PCIe") == 756e12
    assert lookup_peak("NVIDIA A100-SXM4-40GB", "tf32") == 156e12
    assert lookup_peak("NVIDIA L40S") == 362e12 and lookup_peak("NVIDIA L4") == 121e12
    assert lookup_peak("Tesla V100-SXM2-16GB") is None  # no bf16 on a V100
    assert lookup_peak("NVIDIA A10G") is None and lookup_peak("Some Future GPU") is None


def test_mfu_is_none_on_cpu_rather_than_a_made_up_number():
    from labkit.measure.metrics import mfu

    assert mfu(1e4, get_config("tiny"), 128, device="cpu") is None


def test_short_training_run_brings_the_loss_well_below_ln_vocab():
    """30 AdamW steps of 8 x 32 tokens of TinyStories: from ln(4096) = 8.3 to below 6.5 (~2 s)."""
    from labkit.data import load_tokens
    from labkit.training.loop import TrainConfig, train

    cfg = TrainConfig.quick(steps=30, batch_size=8, seq_len=32, warmup=5)
    history = train(build_model("tiny"), load_tokens(), cfg, progress=False)
    assert abs(history["loss"][0] - math.log(4096)) < 0.1
    assert sum(history["loss"][-5:]) / 5 < 6.5


REFUSAL = "pack_vnni2 is only supported when avx512 is supported"


def test_bf16_attention_falls_back_to_math_when_the_fused_cpu_kernel_refuses(monkeypatch):
    """The refusal torch raises under ATEN_CPU_CAPABILITY=default/avx2 on AVX-512 (AMX) CPUs, planted:
    the model's bf16 forward and backward must then be exactly the math backend's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = build_model("tiny")
    x, y = _batch(model.config)

    def run():
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    with sdpa_kernel(SDPBackend.MATH):
        want_loss, want_grads = run()
    real_sdpa = F.scaled_dot_product_attention

    def fused_refuses_bf16(q, k, v, **kwargs):
        if torch.backends.cuda.flash_sdp_enabled():  # the fused kernel would be chosen
            raise RuntimeError(REFUSAL)
        return real_sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", fused_refuses_bf16)
    got_loss, got_grads = run()
    assert torch.equal(got_loss, want_loss)
    assert all(torch.equal(g, w) for g, w in zip(got_grads, want_grads))
    with pytest.raises(RuntimeError, match="pack_vnni2"):  # fp32 never hides a refusal
        model(x, y)


@pytest.mark.parametrize("capability", ["default", "avx2"])
def test_bf16_autocast_forward_backward_runs_under_narrowed_cpu_capability(capability):
    """Notebooks 01 and 09's bf16 cells, in a fresh process with the kernels narrowed by hand
    (the environment variable is read once, at torch's import). The bf16 loss of the untrained
    tiny model must be finite and within 2% of fp32's (measured: 6e-6 relative; bf16 rounds each op by
    at most 2^-8 = 0.4%, and the loss ~ ln(vocab) of an untrained model averages these out)."""
    import os
    import subprocess
    import sys

    code = textwrap.dedent("""
        import torch
        from labkit.model import build_model
        torch.manual_seed(0)
        model = build_model("tiny")
        x = torch.randint(0, model.config.vocab_size, (2, 33))
        fp32 = model(x[:, :-1], x[:, 1:])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = model(x[:, :-1], x[:, 1:])
        bf16.backward()
        assert torch.isfinite(bf16) and abs(bf16.item() - fp32.item()) < 0.02 * fp32.item(), (bf16, fp32)
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        print("ok", bf16.item(), fp32.item())
    """)
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
