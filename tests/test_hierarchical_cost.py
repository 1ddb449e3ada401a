"""The two-level all-reduce's cost model (given code in solutions/hierarchical.py, notebook 03)."""
import pytest

from labkit.grading import impl

S = 1 << 30


def model(**kw):
    args = dict(nbytes=S, n_nodes=4, node_size=8, intra_bw=200e9, inter_bw=50e9)
    return impl("hierarchical").cost_model(**{**args, **kw})


def test_one_node_two_levels_are_the_flat_ring():
    m = model(n_nodes=1, intra_latency=1e-6)
    assert m["flat"] == m["hierarchical"] == pytest.approx(2 * 7 * (1e-6 + S / (8 * 200e9)))
    assert m["flat_network_steps"] == m["hierarchical_network_steps"] == 0


def test_network_steps_drop_from_2_n_minus_1_to_2_m_minus_1():
    m = model()
    assert (m["flat_network_steps"], m["hierarchical_network_steps"]) == (2 * 31, 2 * 3)


def test_latency_bound_gain_is_the_ratio_of_network_steps():
    m = model(nbytes=0, inter_latency=1e-5)  # no bytes: latency only, and none inside the node
    assert m["flat"] / m["hierarchical"] == pytest.approx(31 / 3)


def test_one_nic_per_rank_gives_about_node_size_times_less_network_time():
    one, many = model(intra_bw=float("inf")), model(intra_bw=float("inf"), nics_per_node=8)
    assert one["hierarchical"] == many["hierarchical"] == pytest.approx(2 * 3 / 4 * S / 50e9)
    assert many["flat"] == pytest.approx(8 * one["flat"])
    assert one["flat"] == pytest.approx(2 * 31 / 32 * S / 50e9)


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="n_nodes"):
        model(n_nodes=0)
