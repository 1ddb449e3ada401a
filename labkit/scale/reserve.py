"""What a GPU holds beyond the tensors the cost model counts, stated from torch's and NCCL's sources (notebook 15).

labkit.scale.footprint counts the bytes of tensors (model states, gathered layers, activations, logits).
A GPU holds more; every figure below is read from `allocator.json`, each with its source (torch's
allocator header, the PRs that set the cuBLAS workspace and lazy loading, NCCL's documentation);
none is fitted to a published run:

    block rounding      torch's caching allocator rounds every request up to a multiple of
                        512 B (`block_bytes`: max(512, 512 ceil(n / 512)))
    segments            it takes memory from CUDA in segments (`segment_bytes`): a request of at most
                        1 MiB in a 2 MiB segment of small blocks, 1 to 10 MiB in a 20 MiB segment,
                        larger ones rounded up to a multiple of 2 MiB
    cuBLAS workspace    one per stream that runs matmuls (the compute stream), allocated through the
                        caching allocator: 32 MiB on sm_90 (H100, H200), 4 MiB on sm_80 (A100), in
                        its segment: segment_bytes(workspace) (4 MiB takes a 20 MiB segment)
    CUDA context        287,047,680 B, measured with lazy loading (torch's default): outside torch's
                        counters
    NCCL buffers        per communicator, at most nccl_max_channels x NCCL_BUFFSIZE (32 x 4 MiB =
                        128 MiB, an upper bound); communicators: one per group of more than one rank
                        among FSDP's (dp x cp), cp's, tp's, pp's, HSDP's replicas and ep's: outside
                        torch's counters

    reserve = segment_bytes(workspace) + context + communicators x channels x buffsize
    a layout fits when footprint's peak + reserve <= the GPU's memory (Cluster.memory_bytes, GiB)

What torch reports as "reserved" (torchtitan's memory column, `torch.cuda.max_memory_reserved`) holds
the tensors and the workspace (`in_reserved`), not the context or NCCL's buffers. Not modelled: the
allocator's fragmentation (freed blocks kept in segments that a later, larger request cannot use).
It depends on the order of every allocation of a step, which a closed form does not see; published
reserved figures include it, so the bench's memory error includes it too (`bench/scale.py --memory`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

ALLOCATOR_FILE = Path(__file__).with_name("allocator.json")

# field: (unit, plausible low, plausible high); each range is under 1,000x wide, so a unit off by 1,000
# (KiB written for bytes, MiB for KiB) falls outside it
FIELDS = {
    "min_block_bytes": ("bytes (512 in torch)", 64, 8192),
    "small_size_bytes": ("bytes (1 MiB = 1048576 in torch)", 2**16, 2**24),
    "small_buffer_bytes": ("bytes (2 MiB = 2097152 in torch)", 2**17, 2**25),
    "min_large_alloc_bytes": ("bytes (10 MiB = 10485760 in torch)", 2**20, 2**28),
    "large_buffer_bytes": ("bytes (20 MiB = 20971520 in torch)", 2**20, 2**28),
    "round_large_bytes": ("bytes (2 MiB = 2097152 in torch)", 2**17, 2**25),
    "cuda_context_bytes": ("bytes (287047680 measured with lazy loading)", 2**25, 2**32),
    "nccl_buffsize_bytes": ("bytes (NCCL_BUFFSIZE's default 4194304)", 2**18, 2**27),
    "nccl_max_channels": ("channels (32 in NCCL)", 1, 256),
}
WORKSPACE = ("KiB (32768 for sm_90)", 256, 2**18)


class AllocatorError(ValueError):
    """allocator.json with a missing field, a wrong type or an implausible unit."""


@dataclass(frozen=True)
class Allocator:
    min_block_bytes: int
    small_size_bytes: int
    small_buffer_bytes: int
    min_large_alloc_bytes: int
    large_buffer_bytes: int
    round_large_bytes: int
    cuda_context_bytes: int
    nccl_buffsize_bytes: int
    nccl_max_channels: int
    cublas_workspace_kib: dict
    gpu_arch: dict
    sources: dict

    def block_bytes(self, n: int) -> int:
        """A request of n bytes as the caching allocator rounds it: a multiple of min_block_bytes, at least one."""
        b = self.min_block_bytes
        return max(b, -(-int(n) // b) * b)

    def segment_bytes(self, n: int) -> int:
        """The segment a fresh request of n bytes takes from CUDA (torch's get_allocation_size)."""
        n = self.block_bytes(n)
        if n <= self.small_size_bytes:
            return self.small_buffer_bytes
        if n < self.min_large_alloc_bytes:
            return self.large_buffer_bytes
        r = self.round_large_bytes
        return -(-n // r) * r

    def workspace_bytes(self, gpu_kind: str) -> int:
        """The cuBLAS workspace of one stream on `gpu_kind`; a kind this file does not name gets the largest."""
        arch = self.gpu_arch.get(gpu_kind)
        kib = self.cublas_workspace_kib[arch] if arch else max(self.cublas_workspace_kib.values())
        return kib * 1024


def _checked(values: dict, field: str, spec: tuple, where: str) -> int:
    unit, low, high = spec
    if field not in values:
        raise AllocatorError(f"{where}: missing field {field!r}; give it in {unit}, with its source under 'sources'")
    v = values[field]
    if isinstance(v, bool) or not isinstance(v, int):
        raise AllocatorError(f"{where}: {field}={v!r} must be a whole number of {unit}")
    if not low <= v <= high:
        off = next((f" (a unit off by 1,000? x{k:g} would be plausible)" for k in (1e3, 1e-3, 1024, 1 / 1024)
                    if low <= v * k <= high), "")
        raise AllocatorError(f"{where}: {field}={v:,} is outside {low:,}..{high:,}{off}: the unit expected is {unit}")
    if field not in values.get("sources", {}):
        raise AllocatorError(f"{where}: {field} has no source: add one under 'sources' (URL, file, table)")
    return v


def load_allocator(path: str | Path | dict = ALLOCATOR_FILE) -> Allocator:
    """The figures of `allocator.json` (or another path, or a dict), each checked for its unit and its source."""
    values, where = (path, "the allocator dict") if isinstance(path, dict) else (json.loads(Path(path).read_text()), str(path))
    fields = {f: _checked(values, f, spec, where) for f, spec in FIELDS.items()}
    kib = values.get("cublas_workspace_kib")
    if not isinstance(kib, dict) or not kib:
        raise AllocatorError(f"{where}: cublas_workspace_kib must map an arch ('sm90') to its workspace in KiB")
    for arch, v in kib.items():
        _checked({arch: v, "sources": {arch: 1}}, arch, WORKSPACE, f"{where}: cublas_workspace_kib")
    arches = values.get("gpu_arch", {})
    unknown = sorted(k for k, a in arches.items() if a not in kib)
    if unknown:
        raise AllocatorError(f"{where}: gpu_arch gives {unknown} an arch with no cublas_workspace_kib entry")
    return Allocator(**fields, cublas_workspace_kib=dict(kib), gpu_arch=dict(arches), sources=values["sources"])


@lru_cache(maxsize=1)
def _shipped() -> Allocator:
    return load_allocator()


def communicators(layout) -> int:
    """NCCL communicators one GPU of `layout` holds: one per group of more than one rank among FSDP's (dp x cp),
    cp's (attention), tp's, pp's (send/recv), HSDP's replicas and ep's."""
    groups = (layout.dp_shard * layout.cp, layout.cp, layout.tp, layout.pp, layout.dp_replicate, layout.ep)
    return sum(g > 1 for g in groups)


def reserve(layout, gpu_kind: str, allocator: Allocator | None = None) -> dict:
    """Bytes beyond footprint's tensors, by part: {"cublas_workspace", "cuda_context", "nccl_buffers",
    "in_reserved" (what torch's reserved counter holds of them), "total"}."""
    a = _shipped() if allocator is None else allocator
    out = dict(cublas_workspace=a.segment_bytes(a.workspace_bytes(gpu_kind)), cuda_context=a.cuda_context_bytes,
               nccl_buffers=communicators(layout) * a.nccl_max_channels * a.nccl_buffsize_bytes)
    out["total"] = sum(out.values())
    out["in_reserved"] = out["cublas_workspace"]
    return out
