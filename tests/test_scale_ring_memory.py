"""The CP ring's backward memory (labkit.scale.footprint.ring_backward_bytes) against torch's own ring attention.

torch's `_templated_ring_attention_backward` (what torchtitan's CP runs) is called as each cp rank in turn, causal
with its default load balancing, under labkit.measure.activations.LiveBytes, which counts every tensor it makes and
frees, op by op. The process group is torch's fake one (collectives return their outputs' shapes at once): on real
gloo ranks a collective's buffers are released by gloo's worker thread, a few ops early or late by the race, which
moves the measured peak by several bytes per element from run to run. The attention kernel is replaced by one that
returns its outputs' shapes (dq, dk, dv like q, k, v): what is measured is the ring's own buffers, which are what
the formula counts. bf16, b h s dh small; the bytes are exact integers. One process, about 3 s.
"""
import pytest

B, HEADS, S, DH = 1, 4, 64, 16   # q: b h s dh; s divisible by 2 cp (load balancing's two chunks per rank)
LSE_HALF = 2 * B * HEADS * S       # the logsumexp half a rank before the last copies at its peak (fp32), left out


def _kernel(query, key, value, out, logsumexp, is_causal, **kwargs):
    """The attention backward's outputs, at their shapes (dq, dk, dv), without its arithmetic."""
    import torch
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def ring_peaks(rotation: str, kv_heads: int, cp: int) -> list[int]:
    """Each cp rank's peak bytes above what it was given, in torch's ring attention backward."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.experimental._context_parallel import _attention as A
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from labkit.measure.activations import LiveBytes

    assert not dist.is_initialized()
    saved = A._cp_options.rotate_method, A._cp_options.enable_load_balance
    A._cp_options.rotate_method = A._RotateMethod.ALL_GATHER if rotation == "allgather" else A._RotateMethod.ALL_TO_ALL
    A._cp_options.enable_load_balance = True
    peaks = []
    try:
        for rank in range(cp):
            dist.init_process_group("fake", rank=rank, world_size=cp, store=FakeStore())
            try:
                q, out, dout = (torch.randn(B, HEADS, S, DH, dtype=torch.bfloat16) for _ in range(3))
                k, v = (torch.randn(B, kv_heads, S, DH, dtype=torch.bfloat16) for _ in range(2))
                lse = torch.randn(B, HEADS, S)
                with LiveBytes() as live:
                    start = live.mark()
                    A._templated_ring_attention_backward(dist.group.WORLD, 2, _kernel, dout, "grad_out", q, k, v,
                                                         out, lse, True)
                peaks.append(live.rise(start))
            finally:
                dist.destroy_process_group()
    finally:
        A._cp_options.rotate_method, A._cp_options.enable_load_balance = saved
    return peaks


@pytest.mark.parametrize("rotation", ["allgather", "p2p"])
@pytest.mark.parametrize("kv_heads", [HEADS, HEADS // 2], ids=["kv-as-wide-as-q", "kv-half"])
@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_ring_backward_peak_equals_torchs_ring(rotation, kv_heads, cp):
    """The last cp rank's peak equals the formula exactly; every other rank's lies at or under it but for the
    logsumexp half it copies (2 b h s bytes: 1 / (2 dh) byte per q element). Edge cases: cp 2 (p2p: one rotation,
    nothing in flight), cp 3 (odd); K/V as wide as q (torchtitan repeats its heads) and half as wide.
    Planted mistake, checked: the formula without load balancing's fp32 copies of dK and dV (38 -> 30) fails
    every case."""
    from labkit.scale.footprint import ring_backward_bytes

    peaks = ring_peaks(rotation, kv_heads, cp)
    want = ring_backward_bytes(B * HEADS * S * DH, B * kv_heads * S * DH, cp, rotation)
    assert peaks[-1] == want, f"the last rank's peak {peaks[-1]} bytes, the formula {want}; every rank: {peaks}"
    assert all(p <= want + LSE_HALF for p in peaks), peaks


@pytest.mark.parametrize("rotation", ["allgather", "p2p"])
def test_narrow_kv_peaks_elsewhere_by_at_most_what_the_docstring_says(rotation):
    """Edge case: K/V a quarter as wide as q (GQA's 8 of 32 heads, unrepeated): another moment, where q's buffers
    weigh more, peaks above the formula, by no more than 1.625 bytes per q element (ring_backward_bytes' docstring)."""
    from labkit.scale.footprint import ring_backward_bytes

    q = B * HEADS * S * DH
    for cp in (2, 4):
        peak = max(ring_peaks(rotation, HEADS // 4, cp))
        want = ring_backward_bytes(q, q // 4, cp, rotation)
        assert want < peak <= want + 1.625 * q, (cp, peak, want)


def test_the_rotation_is_checked_by_name():
    from labkit.scale.footprint import ring_backward_bytes

    with pytest.raises(ValueError, match="'allgather' or 'p2p'"):
        ring_backward_bytes(1, 1, 2, "ring")
