"""A GPU kind's kernel-level figures: what `labkit.scale.kernels` times every op with (notebook 15).

A GPU kind is a JSON file (`labkit/scale/gpus/<name>.json`, or any path) with these fields, in these
units, and a "sources" object giving, for each, the measurement it comes from (URL + table/figure):

    sm_count          int      streaming multiprocessors (wave quantization runs over them)
    peak_bf16_tflops  TFLOP/s  dense bf16 tensor-core peak (989 for H100 SXM)
    peak_fp8_tflops   TFLOP/s  dense fp8 peak; 0 where the GPU has no fp8 tensor cores
    hbm_tbytes_per_s  TB/s     device memory bandwidth (datasheet)
    hbm_fraction      1        the fraction of it a streaming kernel reaches (a measurement)
    mamf_tflops       TFLOP/s  the best measured bf16 GEMM (Maximum Achievable Matmul FLOPS)
    mamf_shape        [m,n,k]  the shape it was measured at (null when the source gives none)
    msmf_tflops       TFLOP/s  optional: the best bf16 GEMM *sustained* once the GPU is power-saturated at its
    msmf_shape        [m,n,k]  TDP and its clock has settled (Maximum Sustainable Matmul FLOPS), at this shape;
                               where given it is the GEMM reference instead of the MAMF (a short burst at the
                               boost clock): "for training-throughput reasoning use MSMF" (its source)
    gemm_tiles        [[m,n]]  the output tiles cuBLAS uses for large GEMMs
    launch_us         us       CPU cost of issuing one kernel from compiled code (torch.compile's wrapper)
    eager_op_us       us       CPU cost per kernel of eager PyTorch (Python, module call, dispatcher,
                               autograd, allocator, launch): what a launch-bound eager model runs at
    attention_scale   1        optional (default 1): the attention tables' figures x this, where they
                               were measured on another power limit than this kind's (see h100-sxm-500w)
    overlap_slowdown  1        optional (default 0): how much slower compute runs while an NCCL collective
                               runs beside it (labkit.scale.cost_kernels.contention), a measured average
    fp8_rowwise_tflops TFLOP/s optional: a measured fp8 GEMM with rowwise scales (torchao's "rowwise" float8
                               recipe runs CUTLASS's rowwise-scaled kernel, not cuBLAS's tensorwise one), at
    fp8_rowwise_shape [m,n,k]  this shape; absent: rowwise GEMMs run at the tensorwise (bf16-derived) rate
    gemm_kernel_us    us       optional (default 0): a GEMM kernel's fixed GPU time, whatever its shape
    gemm_tile_k       k-steps  optional (default 0): what one output tile spends outside its k-loop (its
                               prologue and epilogue), in k-steps of a bf16 tile; both from a measured
                               table of GEMMs over shapes (labkit.scale.kernels.gemm)
    fp8_rowwise_linear {"m", "k", "n": [ints], "speedup": [[x] per (m, k), over n]}: optional, torchao's
                      measured speedup of a rowwise float8 linear over bf16 (LayerNorm -> Linear -> Sigmoid,
                      forward and backward, compiled) on a grid of forward shapes: what times the rowwise
                      casts (`labkit.scale.float8`); absent: the casts' counted bytes at the streaming rate
    attention         {impl: {"forward"|"forward_causal"|"backward": {seq_len: TFLOP/s}}}: published
                      FlashAttention throughput against sequence length at head dim 128
    busy_node         {"ratio", "range", "draws"}: optional, the sustained GEMM measured on every GPU of one
                      node at once: the mean over one GPU's alone (ratio, e.g. 0.9939) and the range of the
                      figures over their mean (range, e.g. 0.045) in that many draws: a synchronous step runs
                      at its slowest GPU's pace (labkit.scale.pace.slowest_gpu); absent: each GPU as alone

Every figure is checked against a plausible range, so a unit off by 1,000 (TB/s given in GB/s,
TFLOP/s in FLOP/s, ms for us) is named with the unit expected. The figures validate, they are never
tuned: none of them is fitted to an end-to-end training run.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

GPU_DIR = Path(__file__).resolve().parent / "gpus"

# field: (type, unit, plausible low, plausible high): about 100x wide, so a factor of 1,000 falls outside
FIELDS = {
    "sm_count": (int, "SMs (e.g. 132 for an H100 SXM)", 8, 1000),
    "peak_bf16_tflops": (float, "TFLOP/s (e.g. 989 for an H100 SXM)", 10, 20000),
    "hbm_tbytes_per_s": (float, "TB/s (e.g. 3.35 for an H100 SXM)", 0.1, 50),
    "hbm_fraction": (float, "a fraction of the datasheet bandwidth (e.g. 0.84)", 0.2, 1.0),
    "mamf_tflops": (float, "TFLOP/s (e.g. 792.1 for an H100 SXM)", 5, 20000),
    "launch_us": (float, "microseconds (e.g. 5)", 0.1, 200),
    "eager_op_us": (float, "microseconds (e.g. 45)", 0.5, 1000),
}
ATTENTION_SCALE = (float, "a fraction of the attention tables' figures (e.g. 0.75)", 0.2, 1.0)
OVERLAP_SLOWDOWN = (float, "a fraction of the compute's time (e.g. 0.189 for 18.9%)", 0.0, 1.0)
FP8_ROWWISE = (float, "TFLOP/s (e.g. 1125.51 for an H100 at 500 W)", 10, 40000)
LINEAR_SPEEDUP = (0.05, 5.0)  # a speedup over bf16 (e.g. 0.42 or 1.48), not a percentage
MSMF = (float, "TFLOP/s (e.g. 708.5 for an H200 SXM)", 5, 20000)
GEMM_KERNEL = (float, "microseconds of GPU time per GEMM kernel (e.g. 6.25)", 0.05, 100)
GEMM_TILE_K = (float, "k-steps of a tile's k-loop (e.g. 136)", 1, 8192)
BUSY_NODE = {"ratio": (float, "a fraction of the alone figure (e.g. 0.9939)", 0.5, 1.0),
             "range": (float, "a fraction of the mean (e.g. 0.045 for 4.5%)", 0.0, 0.5),
             "draws": (int, "figures measured (e.g. 40: 8 GPUs x 5 rounds)", 2, 100000)}
ATTENTION_KINDS = ("forward", "forward_causal", "backward")


class GPUError(ValueError):
    """A GPU kind's file with a missing field, a wrong type or an implausible unit."""


@dataclass(frozen=True, eq=False)  # hashed by identity: kernels.py caches op times per GPU object
class GPU:
    name: str
    sm_count: int
    peak_bf16_tflops: float
    peak_fp8_tflops: float
    hbm_tbytes_per_s: float
    hbm_fraction: float
    mamf_tflops: float
    mamf_shape: tuple | None
    gemm_tiles: tuple
    launch_us: float
    eager_op_us: float
    attention: dict = field(default_factory=dict)  # impl -> kind -> ((seq, TFLOP/s), ...) ascending
    description: str = ""
    attention_scale: float = 1.0
    overlap_slowdown: float = 0.0
    fp8_rowwise_tflops: float = 0.0   # 0: not measured (rowwise GEMMs at the tensorwise rate)
    fp8_rowwise_shape: tuple | None = None
    msmf_tflops: float = 0.0          # 0: not measured (GEMMs reference the MAMF)
    msmf_shape: tuple | None = None
    fp8_rowwise_linear: tuple | None = None  # (m grid, k grid, n grid, {(m, k, n): speedup}); None: not measured
    gemm_kernel_us: float = 0.0       # a GEMM kernel's fixed GPU time; 0: not measured
    gemm_tile_k: float = 0.0          # an output tile's prologue and epilogue, in k-steps; 0: not measured
    busy_node: tuple | None = None    # (ratio, range, draws) of the MSMF with the whole node busy; None: not measured
    clock_factor: float = 1.0         # the tensor cores' rate x this: set by the cost model (pace.paced), not a file

    def host_us(self, compile: bool) -> float:
        """CPU microseconds per kernel: eager PyTorch's per-op cost, or compiled code's launch."""
        return self.launch_us if compile else self.eager_op_us

    def peak_flops(self, dtype: str = "bf16") -> float:
        """FLOP/s of the tensor cores for `dtype` ("bf16", "fp8" or "fp8_rowwise": the same fp8 peak);
        GPUError for fp8 on a GPU without it."""
        if dtype == "bf16":
            return self.peak_bf16_tflops * 1e12
        if dtype in ("fp8", "fp8_rowwise"):
            if not self.peak_fp8_tflops:
                raise GPUError(f"{self.name} has no fp8 tensor cores (peak_fp8_tflops=0): run float8=False on it")
            return self.peak_fp8_tflops * 1e12
        raise GPUError(f"dtype={dtype!r}: choose 'bf16', 'fp8' or 'fp8_rowwise'")

    @property
    def hbm_bytes_per_s(self) -> float:
        """The bandwidth a streaming kernel reaches: datasheet x measured fraction."""
        return self.hbm_tbytes_per_s * 1e12 * self.hbm_fraction


def checked_number(values: dict, name: str, spec: tuple, where: str, error=None) -> float:
    """values[name] as spec's type, or `error` (GPUError by default) naming the field and its unit.
    spec = (type, unit, plausible low, plausible high): about 100x wide, so a factor of 1,000 (or
    1e12, TFLOP/s for FLOP/s) falls outside it, and the message says which value would fit.
    Shared by the GPU kinds' files and the clusters' (labkit.scale.cluster)."""
    error = error or GPUError
    kind, unit, low, high = spec
    if name not in values:
        raise error(f"{where} has no field {name!r}: give it in {unit}")
    value = values[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error(f"{where}: {name}={value!r} must be a number in {unit}")
    if kind is int and value != int(value):
        raise error(f"{where}: {name}={value!r} must be a whole number of {unit}")
    if not low <= value <= high:
        fixed = [value * f for f in (1e3, 1e-3, 1e12, 1e-12) if low <= value * f <= high]
        hint = f" (a unit off by 1,000? {fixed[0]:g} would fit)" if fixed else ""
        raise error(f"{where}: {name}={value:g} is outside {low:g}..{high:g}{hint}: the unit expected is {unit}")
    return kind(value)


def check_gpu(values: dict, where: str = "the GPU kind") -> dict:
    """The fields of `values`, typed and checked, or GPUError naming the first wrong field and the fix."""
    out = {name: checked_number(values, name, spec, where) for name, spec in FIELDS.items()}
    fp8 = values.get("peak_fp8_tflops")
    if fp8 is None:
        raise GPUError(f"{where} has no field 'peak_fp8_tflops': give it in TFLOP/s, or 0 where the GPU has no fp8")
    if fp8 and not 10 <= fp8 <= 40000:
        raise GPUError(f"{where}: peak_fp8_tflops={fp8:g} is outside 10..40000 (or 0): the unit expected is TFLOP/s")
    out["peak_fp8_tflops"] = float(fp8)
    if out["mamf_tflops"] > out["peak_bf16_tflops"]:
        raise GPUError(f"{where}: mamf_tflops={out['mamf_tflops']:g} exceeds peak_bf16_tflops="
                       f"{out['peak_bf16_tflops']:g}: a measured GEMM cannot beat the peak; check both units")
    shape = values.get("mamf_shape")
    if shape is not None and not (isinstance(shape, list) and len(shape) == 3 and all(isinstance(x, int) and x > 0 for x in shape)):
        raise GPUError(f"{where}: mamf_shape={shape!r} must be [m, n, k] (positive ints) or null")
    out["mamf_shape"] = tuple(shape) if shape else None
    tiles = values.get("gemm_tiles")
    if not (isinstance(tiles, list) and tiles and all(isinstance(t, list) and len(t) == 2 and all(
            isinstance(x, int) and 8 <= x <= 1024 for x in t) for t in tiles)):
        raise GPUError(f"{where}: gemm_tiles={tiles!r} must be a list of [rows, columns] tiles, e.g. [[256, 128], [128, 256]]")
    out["gemm_tiles"] = tuple(tuple(t) for t in tiles)
    attention = {}
    for impl, kinds in (values.get("attention") or {}).items():
        missing = [k for k in ATTENTION_KINDS if k not in kinds]
        if missing:
            raise GPUError(f"{where}: attention[{impl!r}] has no {missing[0]!r} table: give TFLOP/s against sequence length")
        attention[impl] = {}
        for kind in ATTENTION_KINDS:
            points = sorted((int(s), float(v)) for s, v in kinds[kind].items())
            for s, v in points:
                if not 1 <= v <= 20000:
                    raise GPUError(f"{where}: attention[{impl!r}][{kind!r}][{s}]={v:g} is outside 1..20000: "
                                   "the unit expected is TFLOP/s")
            attention[impl][kind] = tuple(points)
    out["attention"] = attention
    if "attention_scale" in values:
        out["attention_scale"] = checked_number(values, "attention_scale", ATTENTION_SCALE, where)
    if "overlap_slowdown" in values:
        out["overlap_slowdown"] = checked_number(values, "overlap_slowdown", OVERLAP_SLOWDOWN, where)
    if "fp8_rowwise_tflops" in values:
        out["fp8_rowwise_tflops"] = checked_number(values, "fp8_rowwise_tflops", FP8_ROWWISE, where)
        if not out["peak_fp8_tflops"] or out["fp8_rowwise_tflops"] > out["peak_fp8_tflops"]:
            raise GPUError(f"{where}: fp8_rowwise_tflops={out['fp8_rowwise_tflops']:g} exceeds peak_fp8_tflops="
                           f"{out['peak_fp8_tflops']:g}: a measured GEMM cannot beat the peak; check both units")
        rshape = values.get("fp8_rowwise_shape")
        if not (isinstance(rshape, list) and len(rshape) == 3 and all(isinstance(x, int) and x > 0 for x in rshape)):
            raise GPUError(f"{where}: fp8_rowwise_shape={rshape!r} must be [m, n, k] (positive ints), the shape "
                           "fp8_rowwise_tflops was measured at")
        out["fp8_rowwise_shape"] = tuple(rshape)
    if "fp8_rowwise_linear" in values:
        out["fp8_rowwise_linear"] = _linear_table(values["fp8_rowwise_linear"], where)
    if "msmf_tflops" in values:
        out["msmf_tflops"] = checked_number(values, "msmf_tflops", MSMF, where)
        if out["msmf_tflops"] > out["mamf_tflops"]:
            raise GPUError(f"{where}: msmf_tflops={out['msmf_tflops']:g} exceeds mamf_tflops={out['mamf_tflops']:g}: "
                           "a GEMM sustained at the power limit cannot beat the best short burst; check both figures")
        mshape = values.get("msmf_shape")
        if not (isinstance(mshape, list) and len(mshape) == 3 and all(isinstance(x, int) and x > 0 for x in mshape)):
            raise GPUError(f"{where}: msmf_shape={mshape!r} must be [m, n, k] (positive ints), the shape "
                           "msmf_tflops was measured at")
        out["msmf_shape"] = tuple(mshape)
    for name, spec in (("gemm_kernel_us", GEMM_KERNEL), ("gemm_tile_k", GEMM_TILE_K)):
        if name in values:
            out[name] = checked_number(values, name, spec, where)
    if "busy_node" in values:
        busy = values["busy_node"]
        if not isinstance(busy, dict):
            raise GPUError(f"{where}: busy_node={busy!r} must be an object with {sorted(BUSY_NODE)}")
        out["busy_node"] = tuple(checked_number(busy, k, spec, f"{where}: busy_node") for k, spec in BUSY_NODE.items())
    if "sources" not in values:
        raise GPUError(f"{where} has no 'sources': every figure needs the measurement it comes from")
    return out


def _linear_table(table, where: str) -> tuple:
    """fp8_rowwise_linear checked: three ascending grids and one speedup per point, each a plausible ratio."""
    name = f"{where}: fp8_rowwise_linear"
    if not isinstance(table, dict) or any(key not in table for key in ("m", "k", "n", "speedup")):
        raise GPUError(f"{name} must be an object with 'm', 'k', 'n' (the grids) and 'speedup' (one row per m, k)")
    grids = []
    for key in ("m", "k", "n"):
        axis = table[key]
        if not (isinstance(axis, list) and axis and all(isinstance(x, int) and x > 0 for x in axis)
                and axis == sorted(set(axis))):
            raise GPUError(f"{name}[{key!r}]={axis!r} must be ascending positive ints, the shapes measured")
        grids.append(tuple(axis))
    rows = table["speedup"]
    ms, ks, ns = grids
    if not (isinstance(rows, list) and len(rows) == len(ms) * len(ks) and all(
            isinstance(r, list) and len(r) == len(ns) for r in rows)):
        raise GPUError(f"{name}['speedup'] must hold {len(ms) * len(ks)} rows (m major, then k) of {len(ns)} "
                       "values (one per n)")
    points = {}
    for i, m in enumerate(ms):
        for j, k in enumerate(ks):
            for n, x in zip(ns, rows[i * len(ks) + j]):
                if not (isinstance(x, (int, float)) and LINEAR_SPEEDUP[0] <= x <= LINEAR_SPEEDUP[1]):
                    raise GPUError(f"{name}: speedup {x!r} at M, K, N = {m}, {k}, {n} is outside "
                                   f"{LINEAR_SPEEDUP[0]}..{LINEAR_SPEEDUP[1]}: give the ratio over bf16 "
                                   "(0.42, not 42 percent)")
                points[(m, k, n)] = float(x)
    return ms, ks, ns, points


def list_gpus() -> list[str]:
    return sorted(p.stem for p in GPU_DIR.glob("*.json"))


_SHIPPED: dict = {}


def load_gpu(name_or_path: str | Path | dict | GPU) -> GPU:
    """A shipped GPU kind by name ("h100-sxm"), a JSON file's path, or a dict of the fields.
    A shipped kind is read once per process (the search predicts ~10^5 layouts)."""
    if isinstance(name_or_path, GPU):
        return name_or_path
    if isinstance(name_or_path, str) and not Path(name_or_path).suffix:
        if name_or_path not in _SHIPPED:
            _SHIPPED[name_or_path] = _load(name_or_path)
        return _SHIPPED[name_or_path]
    return _load(name_or_path)


def _load(name_or_path) -> GPU:
    if isinstance(name_or_path, dict):
        values, where = name_or_path, "the GPU dict"
    else:
        path = Path(name_or_path)
        if not path.suffix:
            path = GPU_DIR / f"{name_or_path}.json"
            if not path.exists():
                raise GPUError(f"no GPU kind named {name_or_path!r}; shipped: {list_gpus()}, or give a path to a JSON file")
        values, where = json.loads(path.read_text()), str(path)
    fields = check_gpu(values, where)
    return GPU(name=values.get("name", "custom"), description=values.get("description", ""), **fields)
