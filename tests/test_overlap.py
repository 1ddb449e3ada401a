"""labkit.measure.overlap: the hiding arithmetic, on numbers worked out by hand."""
import pytest

from labkit.measure.overlap import (all_gather_seconds, message_seconds, pipeline_exposed_seconds,
                                    zero3_prefetch)


def test_message_and_pipeline_exposed():
    assert message_seconds(1e6, 1e-5, 1e9) == pytest.approx(1e-5 + 1e-3)
    assert pipeline_exposed_seconds(4, 2e-3) == pytest.approx(6 * 2e-3)  # 3 hops down, 3 back up
    assert pipeline_exposed_seconds(1, 2e-3) == 0
    with pytest.raises(ValueError, match="beta > 0"):
        message_seconds(1, 0, 0)


def test_zero3_prefetch_hides_from_min_tokens_on():
    # 1M parameters (4 MB) on 4 ranks, alpha 10 us, beta 1 GB/s: 3 x (10 us + 1 MB / 1 GB/s) = 3.03 ms
    assert all_gather_seconds(4e6, 4, 1e-5, 1e9) == pytest.approx(3 * (1e-5 + 1e-3))
    # at 1 TFLOP/s one token's forward through the layer is 2e6 / 1e12 = 2 us: 1515 tokens hide 3.03 ms
    fig = zero3_prefetch(1_000_000, 4, 1515, 1e12, 1e-5, 1e9)
    assert fig["min_tokens"] == pytest.approx(1515)
    assert zero3_prefetch(1_000_000, 4, 1516, 1e12, 1e-5, 1e9)["hidden"]
    short = zero3_prefetch(1_000_000, 4, 500, 1e12, 1e-5, 1e9)
    assert not short["hidden"] and short["exposed_s"] == pytest.approx(3.03e-3 - 1e-3)
