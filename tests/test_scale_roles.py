"""labkit.apps.sim_roles: the lab's FSDP, TP, 1F1B pipeline and MoE steps as one rank of a large world on
fake tensors and the fake process group, measured by torch's tools, equal to the closed forms. Exact: every
figure is an integer count (bytes: ring factors as fractions of whole tensors, compared as floats of the same
arithmetic). A few seconds on 2 cores."""
import pytest

from labkit.apps import sim_roles
from labkit.model import ModelConfig

CFG = ModelConfig(vocab_size=512, d_model=64, n_heads=4, n_layers=4, context=64, hidden_dim=128)
MOE = ModelConfig(vocab_size=512, d_model=64, n_heads=4, n_layers=2, context=64, hidden_dim=64, n_experts=4,
                  top_k=2, capacity_factor=4.0)  # capacity 4 x fair share: no pick is dropped, FLOPs exact


@pytest.fixture(autouse=True)
def _reference(monkeypatch):
    monkeypatch.setenv("LABKIT_IMPL", "solutions")


def _assert_exact(rows):
    wrong = [r for r in rows if r[1] != r[2]]
    assert not wrong, f"measured != formula: {wrong}"
    return {r[0] for r in rows}


@pytest.mark.parametrize("role,cfg,batch,world,size,stage", [
    ("fsdp", CFG, 2, 1024, 1, 0),
    ("tp", CFG, 2, 1024, 4, 0),
    ("pp", CFG, 2, 1024, 4, 0), ("pp", CFG, 2, 1024, 4, 1), ("pp", CFG, 2, 1024, 4, 3),
    ("moe", MOE, 2, 16, 1, 0),
])
def test_each_role_equals_its_closed_forms(role, cfg, batch, world, size, stage):
    names = _assert_exact(sim_roles.check_role(role, cfg, batch, 64, world, size, stage))
    assert "FLOPs" in names and any(n.startswith("bytes") for n in names)


def test_flops_within_a_hair_of_labkit_scale():
    """labkit.scale's 6N + 12 L d s counts the norm weights in N: the only gap, below 0.5% here."""
    for role, size, stage in (("fsdp", 1, 0), ("tp", 4, 0), ("pp", 4, 3)):
        got = sim_roles.check_role(role, CFG, 2, 64, 64, size, stage)[0][1]
        assert abs(got / sim_roles.spec_flops(role, CFG, 2, 64, size, stage) - 1) < 0.005


def test_a_planted_mistake_is_caught(monkeypatch):
    """TP's gradient all-reduce over the whole world instead of the dp axis: the bytes rows differ."""
    monkeypatch.setattr(sim_roles, "_all_reduce_grads", lambda params, group: sim_roles.dist.all_reduce(
        sim_roles.torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])))
    rows = sim_roles.check_role("tp", CFG, 2, 64, 64, 4, 0)
    assert [r[0] for r in rows if r[1] != r[2]] == ["bytes all_reduce over 16", "bytes all_reduce over 64"]


def test_bad_role_is_named():
    with pytest.raises(ValueError, match="role must be one of"):
        sim_roles.check_role("zero9", CFG, 2, 64, 8)
