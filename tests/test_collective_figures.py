"""labkit.apps.collective_figures and labkit.links.bandwidth: the recorded moves are the ring's, the
formulas are nccl-tests'; a wrong ring is drawn, its first wrong message marked. One 4-rank launch
per recorded function (about 3 s on 2 cores)."""
import os

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

from labkit.links import bandwidth  # noqa: E402
from labkit.apps import collective_figures, ring_moves  # noqa: E402


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
    moves = ring_moves.record_moves(n, "ring_allreduce", numel, timeout=60)
    assert len(moves) == n * 2 * (n - 1)
    sizes = [3, 3, 2, 2]
    for m in moves:
        r, s = m["src"], m["step"]
        expected_chunk = (r - s) % n if s < n - 1 else (r + 1 - (s - (n - 1))) % n
        assert (m["dst"], m["chunk"], m["bytes"]) == ((r + 1) % n, expected_chunk, 8 * sizes[expected_chunk])
    # the contents carried: reduce-scatter step s carries s+1 ranks' values, all-gather all of them
    for m in moves:
        assert len(m["ranks"]) == (m["step"] + 1 if m["step"] < n - 1 else n)
    final = ring_moves.ring_states(moves, n)[-1]
    assert all(cell == tuple(range(n)) for row in final for cell in row)
    # the recorded states are the replayed ones: the model of notebook 03 is what the ranks did
    replayed = ring_moves.ring_states([{k: v for k, v in m.items() if k != "held"} for m in moves], n)
    assert replayed == ring_moves.ring_states(moves, n)
    assert ring_moves.ring_errors(moves, n) == []
    fig = ring_moves.draw_ring(moves, n)
    assert fig.first_wrong is None and fig.marked is None
    matplotlib.pyplot.close(fig)
    sent, received = ring_moves.traffic(moves, n)
    assert all(received[(r + 1) % n] == sent[r] for r in range(n))  # only to the right neighbour
    assert sum(sent) == 2 * (n - 1) * numel * 8  # about 2(N-1)/N x S each (chunks differ by one)
    assert max(sent) - min(sent) <= 2 * 8


def test_recorded_naive_root_carries_n_minus_1_tensors_each_way(solutions_impl):
    n, numel = 4, 8
    moves = ring_moves.record_moves(n, "naive_allreduce", numel, timeout=60)
    sent, received = ring_moves.traffic(moves, n)
    S = numel * 8
    assert sent == [(n - 1) * S] + [S] * (n - 1)
    assert received == sent


def test_ring_errors_name_a_message_that_does_not_match_the_ring():
    bogus = [dict(step=0, src=0, dst=1, chunk=0, ranks=[0, 1], bytes=8)]  # rank 0 holds only its own
    errors = ring_moves.ring_errors(bogus, 2)
    assert errors[0]["move"] is bogus[0]
    assert errors[0]["reason"] == "reduce-scatter step 1 of 1: rank 0 sent holding A+B instead of A"
    assert "rank 1 sent nothing" in errors[1]["reason"]  # and the other messages the ring sends


def _ring_one_allgather_step_short(tensor, group=None):
    """A WRONG ring (a learner's off-by-one): the all-gather stops one step early."""
    import torch.distributed as dist

    n, r = dist.get_world_size(), dist.get_rank()
    flat = tensor.view(-1)
    size = flat.numel() // n  # numel is a multiple of n here

    def chunk(i):
        i %= n
        return flat[i * size:(i + 1) * size]

    def step(send, recv):
        works = [dist.isend(send, (r + 1) % n), dist.irecv(recv, (r - 1) % n)]
        for work in works:
            work.wait()

    incoming = torch.empty(size, dtype=flat.dtype)
    for s in range(n - 1):
        step(chunk(r - s), incoming)
        chunk(r - s - 1).add_(incoming)
    for s in range(n - 2):  # BUG: range(n - 1)
        step(chunk(r + 1 - s), chunk(r - s))
    return tensor


def test_draw_ring_draws_a_wrong_ring_and_marks_its_first_wrong_message(solutions_impl):
    n, numel = 4, 8
    moves = ring_moves.record_moves(n, numel=numel, fn=_ring_one_allgather_step_short, timeout=60)
    assert len(moves) == n * (2 * (n - 1) - 1)  # recorded as it ran, nothing refused
    # the end state, read off the real tensors: rank r's chunk r+2 misses rank r+1's value
    for r in range(n):
        for c in range(n):
            want = tuple(sorted(set(range(n)) - {(r + 1) % n})) if c == (r + 2) % n else tuple(range(n))
            assert moves.final[r][c] == want, (r, c)
    fig = ring_moves.draw_ring(moves, n)
    # the first wrong "message" is the one never sent: the last all-gather step, rank 0
    assert fig.marked == (2 * (n - 1) - 1, 0, 3)  # the chunk it should have sent
    assert fig.first_wrong["reason"] == ("all-gather step 3 of 3: rank 0 sent nothing; the ring sends "
                                         "chunk 3 (A+B+C+D) to rank 1")
    red = [p for ax in fig.axes for p in ax.patches if p.get_gid() == "first-wrong"]
    assert len(red) == 1 and red[0].axes is fig.axes[2 * (n - 1) - 1]  # in the panel of that step
    assert "first wrong message" in " ".join(t.get_text() for t in fig.texts)
    assert fig.axes[2 * (n - 1)].get_title() == "done: 4 of 16 chunks are NOT the full sum"
    matplotlib.pyplot.close(fig)


def _ring_adds_into_the_chunk_it_sent(tensor, group=None):
    """A WRONG ring: at reduce-scatter step s rank r adds the incoming chunk into chunk r-s
    (the one it just sent) instead of chunk r-s-1: a wrong chunk index."""
    import torch.distributed as dist

    n, r = dist.get_world_size(), dist.get_rank()
    flat = tensor.view(-1)
    size = flat.numel() // n
    chunk = lambda i: flat[(i % n) * size:(i % n + 1) * size]  # noqa: E731
    incoming = torch.empty(size, dtype=flat.dtype)
    for s in range(n - 1):
        works = [dist.isend(chunk(r - s), (r + 1) % n), dist.irecv(incoming, (r - 1) % n)]
        for work in works:
            work.wait()
        chunk(r - s).add_(incoming)  # BUG: chunk(r - s - 1)
    for s in range(n - 1):
        works = [dist.isend(chunk(r + 1 - s), (r + 1) % n), dist.irecv(chunk(r - s), (r - 1) % n)]
        for work in works:
            work.wait()
    return tensor


def test_draw_ring_marks_the_first_message_carrying_the_wrong_sum(solutions_impl):
    n = 4
    moves = ring_moves.record_moves(n, numel=8, fn=_ring_adds_into_the_chunk_it_sent, timeout=60)
    fig = ring_moves.draw_ring(moves, n)
    # step 0 is right (each rank sends its own chunk r); at step 1 rank 0 sends chunk 3, which
    # it never added into (it added into chunk 0): it holds only A, where the ring carries D+A
    assert fig.marked == (1, 0, 3)
    assert fig.first_wrong["reason"] == ("reduce-scatter step 2 of 3: rank 0 sent holding A instead of A+D, "
                                         "missing D")
    matplotlib.pyplot.close(fig)


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
