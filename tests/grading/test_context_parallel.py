"""Grading tests for notebook 11_long_sequences: zigzag_split (the load-balanced CP split).

Run: pytest tests/grading/test_context_parallel.py   (add --impl=solutions for the reference)
One process, a second. The ring and the whole model with CP are in test_ring_attention.py.
"""
import pytest
import torch

from labkit.grading import impl


@pytest.mark.exercise("zigzag_split")
@pytest.mark.parametrize("c", [2, 4])
def test_zigzag_split_pieces_cover_the_sequence_and_balance_the_causal_work(c):
    cpm = impl("context_parallel")
    s = 8 * c
    pieces = [cpm.zigzag_split(s, c, r) for r in range(c)]
    n = s // (2 * c)
    for rank, got in enumerate(pieces):
        want = [(rank * n, (rank + 1) * n), ((2 * c - 1 - rank) * n, (2 * c - rank) * n)]
        assert got == want, (f"zigzag_split(s={s}, c={c}, rank={rank}) returned {got}, expected {want}: rank r takes "
                             f"chunk r and chunk 2c-1-r of the 2c={2 * c} chunks of {n} positions, the earlier first")
    assert sorted(p for rank in pieces for p in rank) == [(i * n, (i + 1) * n) for i in range(2 * c)]
    x = torch.arange(s)
    assert sorted(torch.cat([cpm.take(x, p, dim=0) for p in pieces]).tolist()) == list(range(s))
    assert len(set(cpm.attention_work(s, c, "zigzag"))) == 1, "every rank the same causal work"
    naive = cpm.attention_work(s, c, "contiguous")
    assert naive == sorted(naive) and naive[-1] == c * naive[0]


@pytest.mark.exercise("zigzag_split")
@pytest.mark.parametrize("s,c", [(12, 4), (10, 2), (6, 4)])
def test_zigzag_split_s_not_splitting_into_2c_chunks_raises_saying_what_would(s, c):
    cpm = impl("context_parallel")
    cpm.zigzag_split(16, 2, 1)  # a good split must work first
    with pytest.raises(ValueError, match=rf"s={s}.*2c={2 * c}.*multiple of {2 * c}"):
        cpm.zigzag_split(s, c, 0)
    with pytest.raises(ValueError, match="rank"):
        cpm.zigzag_split(16, 2, 2)
