"""labkit.apps.collective_figures and labkit.bandwidth: the recorded moves are the ring's, the
formulas are nccl-tests'. One 4-rank launch per recorded function (about 3 s on 2 cores)."""
import os

import matplotlib
import pytest

matplotlib.use("Agg")

from labkit import bandwidth  # noqa: E402
from labkit.apps import collective_figures  # noqa: E402


@pytest.fixture(scope="module")
def solutions_impl():
    old = os.environ.get("LABKIT_IMPL")
    os.environ["LABKIT_IMPL"] = "solutions"  # the figures are drawn from the reference
    yield
    if old is None:
        del os.environ["LABKIT_IMPL"]
    else:
        os.environ["LABKIT_IMPL"] = old


def test_recorded_ring_moves_follow_the_textbook_schedule(solutions_impl):
    n, numel = 4, 10  # 10 elements: chunks of 3, 3, 2, 2
    moves = collective_figures.record_moves(n, "ring_allreduce", numel, timeout=60)
    assert len(moves) == n * 2 * (n - 1)
    sizes = [3, 3, 2, 2]
    for m in moves:
        r, s = m["src"], m["step"]
        expected_chunk = (r - s) % n if s < n - 1 else (r + 1 - (s - (n - 1))) % n
        assert (m["dst"], m["chunk"], m["bytes"]) == ((r + 1) % n, expected_chunk, 8 * sizes[expected_chunk])
    # the contents carried: reduce-scatter step s carries s+1 ranks' values, all-gather all of them
    for m in moves:
        assert len(m["ranks"]) == (m["step"] + 1 if m["step"] < n - 1 else n)
    final = collective_figures.ring_states(moves, n)[-1]
    assert all(cell == frozenset(range(n)) for row in final for cell in row)
    sent, received = collective_figures.traffic(moves, n)
    assert all(received[(r + 1) % n] == sent[r] for r in range(n))  # only to the right neighbour
    assert sum(sent) == 2 * (n - 1) * numel * 8  # about 2(N-1)/N x S each (chunks differ by one)
    assert max(sent) - min(sent) <= 2 * 8


def test_recorded_naive_root_carries_n_minus_1_tensors_each_way(solutions_impl):
    n, numel = 4, 8
    moves = collective_figures.record_moves(n, "naive_allreduce", numel, timeout=60)
    sent, received = collective_figures.traffic(moves, n)
    S = numel * 8
    assert sent == [(n - 1) * S] + [S] * (n - 1)
    assert received == sent


def test_ring_states_rejects_moves_that_do_not_match_the_sender():
    bogus = [dict(step=0, src=0, dst=1, chunk=0, ranks=[0, 1], bytes=8)]  # rank 0 holds only its own
    with pytest.raises(AssertionError, match="does not match"):
        collective_figures.ring_states(bogus, 2)


@pytest.mark.parametrize("name", list(collective_figures.COLLECTIVES))
def test_every_collective_figure_draws(name):
    fig = collective_figures.draw_collective(name, 4)
    assert len(fig.axes) == 2
    matplotlib.pyplot.close(fig)


def test_busbw_factors_are_nccl_tests():
    assert bandwidth.algbw(1000, 2.0) == 500.0
    assert bandwidth.busbw(1000, 1.0, 4) == pytest.approx(1000 * 2 * 3 / 4)
    assert bandwidth.busbw(1000, 1.0, 4, "all_gather") == pytest.approx(1000 * 3 / 4)
    assert bandwidth.busbw(1000, 1.0, 4, "broadcast") == 1000


def test_ring_model_busbw_equals_link_bandwidth_at_every_world_size():
    S, B = 1 << 30, 1e10
    for n in (2, 3, 8, 64):
        assert bandwidth.busbw(S, bandwidth.ring_model_seconds(S, n, B), n) == pytest.approx(B)
    assert bandwidth.naive_model_seconds(S, 8, B) == pytest.approx(2 * 7 * S / B)
    assert bandwidth.ring_model_seconds(S, 1, B) == 0.0
