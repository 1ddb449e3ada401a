"""labkit.scale.reserve: the memory a GPU holds beyond footprint's tensors, each figure from its source.

Closed forms (labkit/scale/allocator.json's figures):
    block_bytes(n)    max(512, 512 ceil(n / 512))
    segment_bytes(n)  2 MiB if block_bytes(n) <= 1 MiB; 20 MiB if < 10 MiB; else 2 MiB ceil(n / 2 MiB)
    reserve           segment_bytes(cuBLAS workspace) + 287,047,680 (CUDA context)
                      + communicators x 32 channels x 4 MiB (NCCL)
    fits              footprint's peak + reserve <= the GPU's memory
Each constant is checked against its source: the allocator's against the header torch ships
(c10/core/AllocatorConfig.h), the others against the figure their source quotes. Arithmetic only: well
under a second.
"""
import json
from pathlib import Path

import pytest
import torch

from labkit.scale.cluster import load_cluster
from labkit.scale.cost import predict
from labkit.scale.layout import Layout
from labkit.scale.reserve import ALLOCATOR_FILE, AllocatorError, communicators, load_allocator, reserve
from labkit.scale.specs import LLAMA3

MiB = 2**20
RAW = json.loads(ALLOCATOR_FILE.read_text())
A = load_allocator()
HEADER = Path(torch.__file__).parent / "include" / "c10" / "core" / "AllocatorConfig.h"
HEADER_NAMES = {"min_block_bytes": "kMinBlockSize", "small_size_bytes": "kSmallSize",
                "small_buffer_bytes": "kSmallBuffer", "min_large_alloc_bytes": "kMinLargeAlloc",
                "round_large_bytes": "kRoundLarge"}


@pytest.mark.skipif(not HEADER.exists(), reason="this torch build ships no c10 headers")
@pytest.mark.parametrize("field", sorted(HEADER_NAMES))
def test_allocator_figures_are_torchs_own(field):
    """Each allocator constant equals the one in torch's installed header, which its source quotes."""
    text = HEADER.read_text()
    line = next(ln for ln in text.splitlines() if f"size_t {HEADER_NAMES[field]} =" in ln)
    assert int(line.split("=")[1].split(";")[0]) == RAW[field]
    assert HEADER_NAMES[field] in RAW["sources"][field] and str(RAW[field]) in RAW["sources"][field]


def test_other_figures_reproduce_their_sources():
    src = RAW["sources"]
    assert "287,047,680" in src["cuda_context_bytes"] and RAW["cuda_context_bytes"] == 287_047_680
    assert "32768 KiB" in src["cublas_workspace_kib"] and RAW["cublas_workspace_kib"]["sm90"] * 1024 == 32 * MiB
    assert "4096 KiB" in src["cublas_workspace_kib"] and RAW["cublas_workspace_kib"]["sm80"] == 4096
    assert "4 MB" in src["nccl_buffsize_bytes"] and RAW["nccl_buffsize_bytes"] == 4 * MiB
    assert "MAXCHANNELS 32" in src["nccl_max_channels"] and RAW["nccl_max_channels"] == 32
    # the 20 MiB large buffer, as a device showed it: an 8,519,680-byte workspace in a 20,971,520-byte segment
    assert "20,971,520" in src["large_buffer_bytes"] and A.segment_bytes(8_519_680) == 20_971_520 == RAW["large_buffer_bytes"]
    assert set(RAW) - {"description", "sources"} <= set(src)


def test_block_and_segment_closed_forms():
    assert [A.block_bytes(n) for n in (0, 1, 512, 513, 1000)] == [512, 512, 512, 1024, 1024]
    assert A.segment_bytes(MiB) == 2 * MiB                    # the largest small request
    assert A.segment_bytes(MiB + 1) == 20 * MiB               # a large one under 10 MiB
    assert A.segment_bytes(10 * MiB - 512) == 20 * MiB
    assert A.segment_bytes(10 * MiB - 1) == 10 * MiB         # rounded to a block first (torch's round_size)
    assert A.segment_bytes(10 * MiB) == 10 * MiB              # 10 MiB and up: rounded to 2 MiB
    assert A.segment_bytes(10 * MiB + 1) == 12 * MiB
    assert A.segment_bytes(33 * MiB) == 34 * MiB


def test_reserve_closed_form():
    lay = Layout(dp=8, pp=16, tp=8, zero="zero2", recompute="none", micro_batch=1)
    assert communicators(lay) == 3  # FSDP's dp x cp, tp, pp
    assert communicators(Layout(dp=2, cp=4, tp=2, pp=2, ep=2)) == 5  # dp x cp, cp, tp, pp, ep
    assert communicators(Layout(dp=4, dp_replicate=2)) == 2
    got = reserve(lay, "h100-sxm")
    assert got["cublas_workspace"] == 32 * MiB and got["in_reserved"] == 32 * MiB
    assert got["total"] == 32 * MiB + 287_047_680 + 3 * 32 * 4 * MiB
    # an A100's 4 MiB workspace takes a 20 MiB segment of the caching allocator
    assert reserve(lay, "a100-sxm")["cublas_workspace"] == 20 * MiB
    assert reserve(lay, "unknown-gpu")["cublas_workspace"] == 32 * MiB  # the largest where the kind is not named


def test_fits_counts_the_reserve():
    """A GPU whose memory lies between the tensors' peak and the peak + reserve: the layout does not fit (a model
    that ignored the reserve would say it fits); 1 MiB more than peak + reserve: it fits."""
    base = load_cluster("h100-sxm")
    lay = Layout(dp=8, zero="zero3", recompute="full", micro_batch=1)
    p = predict(LLAMA3["8b"], lay, base, global_batch=8, seq_len=8192)
    fields = {k: getattr(base, k) for k in ("gpus_per_node", "peak_bf16_flops", "nvlink_gbytes_per_s",
                                             "network_gbits_per_s", "nvlink_latency_us", "network_latency_us")}
    fields["gpu"] = base.gpu
    between = dict(fields, memory_gib=(p.peak_bytes + p.reserve["total"] / 2) / 2**30)
    above = dict(fields, memory_gib=(p.peak_bytes + p.reserve["total"] + MiB) / 2**30)
    assert not predict(LLAMA3["8b"], lay, load_cluster(between), global_batch=8, seq_len=8192).fits
    assert predict(LLAMA3["8b"], lay, load_cluster(above), global_batch=8, seq_len=8192).fits
    assert p.reserved_gib == pytest.approx((p.peak_bytes + 32 * MiB) / 2**30, rel=0, abs=0)


@pytest.mark.parametrize("field, value, message", [
    ("cuda_context_bytes", 280_319, r"cuda_context_bytes=280,319 is outside.*off by 1,000.*bytes"),  # KiB for bytes
    ("nccl_buffsize_bytes", 4, r"nccl_buffsize_bytes=4 is outside.*bytes"),                          # MiB for bytes
    ("min_block_bytes", 0.5, r"min_block_bytes=0.5 must be a whole number of bytes"),
])
def test_a_unit_off_is_named(field, value, message):
    with pytest.raises(AllocatorError, match=message):
        load_allocator(dict(RAW, **{field: value}))


def test_a_missing_field_or_source_is_named():
    with pytest.raises(AllocatorError, match=r"missing field 'round_large_bytes'"):
        load_allocator({k: v for k, v in RAW.items() if k != "round_large_bytes"})
    sources = {k: v for k, v in RAW["sources"].items() if k != "cuda_context_bytes"}
    with pytest.raises(AllocatorError, match=r"cuda_context_bytes has no source"):
        load_allocator(dict(RAW, sources=sources))
    with pytest.raises(AllocatorError, match=r"cublas_workspace_kib: sm90=32 is outside.*off by 1,000.*KiB"):
        load_allocator(dict(RAW, cublas_workspace_kib={"sm80": 4096, "sm90": 32}))  # MiB for KiB
