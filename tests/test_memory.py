"""labkit.measure.memory: the ZeRO paper's numbers, and parameter counts against the real model."""
import pytest

from labkit.measure import memory
from labkit.model import build_model, get_config


@pytest.mark.parametrize("name", ["tiny", "seed"])
def test_param_count_equals_built_model(name):
    assert memory.param_count(name) == build_model(name).num_params()


def test_param_count_odd_config_equals_built_model():
    cfg = get_config("tiny", vocab_size=65, d_model=24, n_heads=3, n_layers=3, hidden_dim=40)
    assert memory.param_count(cfg) == build_model(cfg).num_params()


def test_param_count_llama_7b_is_6_74_billion():
    # LLaMA-2 7B: 6,738,415,616 parameters (Touvron et al. 2023; the HF checkpoint's count)
    assert memory.param_count(memory.LLAMA_7B) == 6_738_415_616


# The ZeRO paper's figure 1: 7.5B parameters, N = 64 ranks, K = 12, mixed precision,
# in GB = 1e9 bytes: 120, 31.4, 16.6 and 1.88.
@pytest.mark.parametrize("stage,expected_gb", [("dp", 120.0), ("zero1", 31.4), ("zero2", 16.6), ("zero3", 1.88)])
def test_memory_per_rank_matches_zero_paper_figure_1(stage, expected_gb):
    got = memory.memory_per_rank(7_500_000_000, 64, stage, "mixed")["total"] / 1e9
    assert got == pytest.approx(expected_gb, abs=0.05)


def test_memory_per_rank_components_fp32_exact():
    # 10 params on 4 ranks: a shard is ceil(10/4) = 3 elements
    got = memory.memory_per_rank(10, 4, "zero2", "fp32")
    assert got == dict(params=40, grads=12, optimizer=24, total=76)
    assert memory.memory_per_rank(10, 4, "zero3", "fp32")["total"] == (4 + 4 + 8) * 3
    assert memory.memory_per_rank(10, 1, "zero3", "fp32") == memory.memory_per_rank(10, 1, "dp", "fp32")


def test_memory_per_rank_every_stage_16_bytes_per_param_without_sharding():
    for precision in memory.PRECISIONS:
        assert memory.memory_per_rank(1000, 1, "dp", precision)["total"] == 16 * 1000


def test_max_params_inverts_memory_per_rank():
    gpu = 80 * 2**30
    for stage in memory.STAGES:
        n = memory.max_params(gpu, 8, stage)
        assert memory.memory_per_rank(n, 8, stage)["total"] <= gpu
        assert memory.memory_per_rank(n + 1, 8, stage)["total"] > gpu


@pytest.mark.parametrize("kwargs,match", [
    (dict(world_size=0), "world_size"),
    (dict(stage="zero4"), "stage"),
    (dict(precision="fp8"), "precision"),
])
def test_memory_per_rank_bad_argument_raises(kwargs, match):
    args = dict(n_params=100, world_size=2, stage="dp", precision="mixed") | kwargs
    with pytest.raises(ValueError, match=match):
        memory.memory_per_rank(**args)


def test_format_table_lists_every_stage():
    text = memory.format_table(memory.param_count("seed"), 2, "fp32")
    assert text.count("\n") == 1 + len(memory.STAGES)
    assert "8,335,008 parameters" in text and "ZeRO-3" in text


def test_format_bytes_binary_prefixes():
    assert [memory.format_bytes(n) for n in (512, 1536, 3 * 2**30)] == ["512 B", "1.50 KiB", "3.00 GiB"]


def test_calculator_builds_widget():
    import matplotlib
    matplotlib.use("Agg")
    box = memory.calculator(memory.param_count("seed"), world_size=4)
    assert type(box).__name__ == "VBox"


def test_memory_per_rank_offload_moves_optimizer_states_to_host():
    got = memory.memory_per_rank(10, 4, "zero2", "fp32", offload=True)
    assert got == dict(params=40, grads=12, optimizer=0, total=52, offloaded=24)
    mixed = memory.memory_per_rank(1000, 1, "dp", "mixed", offload=True)
    assert mixed["total"] == 4 * 1000 and mixed["offloaded"] == 12 * 1000  # 2 + 2 on the GPU, 12 on the host


def test_suggest_zero3_needs_one_gathered_layer_not_16_bytes_of_it():
    # 3B params, a 2B-parameter layer, 8 x 24 GB (16.8 GB budget): 16 x 2B = 32 GB would call for TP,
    # but under ZeRO-3 only the gathered layer's params + grads (4 x 2B = 8 GB) sit next to 6 GB of shards
    got = memory.suggest(3_000_000_000, 24, 8, largest_layer_params=2_000_000_000)
    assert got["stage"] == "zero3" and "TP" not in got["plan"]
    assert got["per_gpu"] == 16 * 3_000_000_000 // 8 + 4 * 2_000_000_000


@pytest.mark.parametrize("args,kwargs,stage,word", [
    ((memory.param_count("seed"), 8, 1), {}, "dp", "DP"),
    ((7_000_000_000, 80, 8), {}, "zero3", "ZeRO-3"),
    ((3_000_000_000, 24, 8), dict(largest_layer_params=6_000_000_000), "zero3", "TP=4"),
    ((7_000_000_000, 24, 16), dict(gpus_per_node=4, fast_inter_node=False), "zero1", "PP="),
])
def test_suggest_names_the_zero_stage_it_assumes(args, kwargs, stage, word):
    got = memory.suggest(*args, **kwargs)
    assert got["stage"] == stage and word in got["plan"], got
    assert got["per_gpu"] <= 0.7 * args[1] * 1e9


def test_format_table_with_offload_shows_host_bytes():
    text = memory.format_table(memory.param_count(memory.LLAMA_7B), 8, "mixed", offload=True)
    assert "host" in text and "offloaded to the host" in text
    assert text.count("\n") == 1 + len(memory.STAGES)
