"""DeepSpeed's ZeRO-3 of 2021, one weight-holding submodule at a time, as Megatron-LM 2021's Table 2 ran it (notebook 15).

FSDP2 (torchtitan's ZeRO-3, `Layout.zero3_unit="block"`) gathers a block ahead on its own stream and the cost model
hides its traffic behind the step's compute. DeepSpeed's ZeRO-3 (`zero3_unit="module"`) does not run that way. Read in
DeepSpeed v0.3.13 (2021-03-16, a week after ZeRO-3 first landed, 'ZeRO 3 Offload (#834)'), with the defaults of
its deepspeed/runtime/zero/constants.py:
    fetch     fetch_sub_module gathers a submodule's parameters if no prefetch brought them, and whenever any were
              gathered or in flight calls _synchronize_communication: torch.cuda.synchronize(), every stream
    gather    every all-gather, fetched or prefetched, goes through partition_parameters.py's _allgather_param,
              which zeroes the weight's buffer and calls torch.cuda.synchronize() before issuing it: no gather
              starts while the GPU still runs the kernels launched before it (the memset is not counted: 2 bytes
              per element at HBM's rate, about 1% of these steps)
    prefetch  prefetch_next_sub_modules, after each fetch, only when no prefetch is in flight and the parameters
              available stay under stage3_max_live_parameters (MAX_LIVE, 1e9 elements): the next parameters of the
              recorded trace that are not available, until stage3_prefetch_bucket_size (PREFETCH, 5e7 elements)
    release   release_sub_module frees a submodule's parameters unless it is used again within
              stage3_max_reuse_distance (MAX_REUSE, 1e9 elements of parameters used in between: _keep_for_later)
    gradients in the parameters' dtype, fp16 (partition_parameters.py, _reduce_scatter_gradient), on the reduction
              stream; a weight over reduce_bucket_size (5e8) is reduced when the next gradient arrives
              (reduce_independent_p_g_buckets_and_remove_grads -> reduce_ipg_grads): one use later
Under full recompute a block's backward replays its forward, so the trace uses each weight three times a step:
forward, recomputed forward, backward. The forward's use is far from the next one and is freed; between the replay
and the backward of the same weight lie the weights after it, twice (replayed, then their backward), so with
MAX_REUSE a weight is kept for its backward only while those are under 1e9 elements: a GPT block's last weight (its
MLP's second matrix) is, its attention's and its MLP's first are gathered a third time once d reaches about 11,200
(175B: d = 12,288). A step's traffic is then (2 + the re-gathered share) gathers and one fp16 reduce-scatter per
weight (`fetch_counts`, which labkit.scale.traffic counts), not FSDP2's two gathers and fp32 reduce-scatter.

`zero3_step` runs the trace use by use on three clocks: the host (it waits at each synchronize; between two it
runs ahead of the GPU, launching kernels and collectives), the GPU (the compute stream: each use's kernels,
`segments`) and the network (every collective, gathers and reduce-scatters, one after another on the data-parallel
group's link; a reduce-scatter no earlier than the backward kernels that make its gradient). A collective overlaps the GPU's work
only between two synchronizes, and where it does the kernels beside it run slower (the cost model's contention rule,
GPU.overlap_slowdown, applied where the two clocks meet).
"""
from __future__ import annotations

MAX_LIVE = 1e9     # stage3_max_live_parameters (ZERO_OPTIMIZATION_MAX_LIVE_PARAMETERS_DEFAULT)
MAX_REUSE = 1e9    # stage3_max_reuse_distance (ZERO_OPTIMIZATION_MAX_REUSE_DISTANCE_DEFAULT)
PREFETCH = 5e7     # stage3_prefetch_bucket_size (ZERO_OPTIMIZATION_PREFETCH_BUCKET_SIZE_DEFAULT)
GRAD_BYTES = 2     # fp16 gradients, reduce-scattered in the parameters' dtype
# a block's weight-holding submodules in forward order, and the forward ops each one's hooks enclose
# (labkit.scale.layer_ops.block_ops's names: an op belongs to the last submodule whose weight ran before it)
SUBMODULES = ("qkv", "wo", "w1", "w3", "w2")
_OWNER = {"wq": "qkv", "wk": "qkv", "wv": "qkv", "wo": "wo", "w1": "w1", "w3": "w3", "w2": "w2"}


ENDS = ("embedding", "head")


def numels(model, layout) -> dict:
    """{weight: elements on this GPU}: a block's submodules (`submodules`) and the two ends (no pipeline: DeepSpeed's
    ZeRO-3 runs without one), the embedding and the head with its final norm."""
    tp = layout.tp
    return {**submodules(model, tp), "embedding": model.embedding_params / tp, "head": model.head_params / tp}


def submodules(model, tp: int = 1) -> dict:
    """{name: elements on this GPU} of a block's weight-holding submodules (Megatron's fused QKV, its dense
    output, the MLP's matrices; w3 only for a gated MLP)."""
    m, d = model, model.d_model
    out = {"qkv": d * (d + 2 * m.kv_dim) // tp, "wo": d * d // tp, "w1": d * m.hidden_dim // tp}
    if getattr(m, "mlp", "swiglu") != "gelu":
        out["w3"] = d * m.hidden_dim // tp
    out["w2"] = d * m.hidden_dim // tp
    return out


def segments(blk: dict) -> dict:
    """{"forward", "recompute", "backward"}: {submodule: seconds} of one block's ops (layer_ops.block_ops), each op
    with the submodule whose hooks enclose it in forward order (the norm before the QKV with the QKV; the attention
    core, between the QKV's and the output's, with the QKV); an op's backward and replay go where its forward went."""
    owner, current = {}, "qkv"
    for op in blk["forward"]:
        current = _OWNER.get(op.name, current)
        owner[op.name] = current
    out = {}
    for phase in ("forward", "recompute", "backward"):
        acc = {}
        for op in blk.get(phase, []):
            base = op.name.split()[0]
            who = _OWNER.get(base) or owner.get(op.name) or owner.get(base, "qkv")
            acc[who] = acc.get(who, 0.0) + op.seconds
        out[phase] = acc
    # block_ops's "backward" holds the replay too: keep the backward's own ops there
    replay = out["recompute"]
    out["backward"] = {k: v - replay.get(k, 0.0) for k, v in out["backward"].items()}
    return out


def trace(names: list, layers: int, n_micro: int, recompute: bool) -> list:
    """The step's uses of weights, in order: (key, phase), key = (layer, name) or an end ("embedding", "head");
    phase "f" (forward), "r" (replayed forward) or "b" (backward)."""
    uses = []
    for _ in range(n_micro):
        uses.append((("embedding",), "f"))
        uses += [((layer, n), "f") for layer in range(layers) for n in names]
        uses += [(("head",), "f"), (("head",), "b")]
        for layer in reversed(range(layers)):
            if recompute:
                uses += [((layer, n), "r") for n in names]
            uses += [((layer, n), "b") for n in reversed(names)]
        uses.append((("embedding",), "b"))
    return uses


def _name(key) -> str:
    """A use's weight: an end's name, or a block submodule's (its key is (layer, name))."""
    return key[0] if len(key) == 1 else key[1]


def _kept(uses: list, numels: dict, max_reuse: float) -> list:
    """_keep_for_later for every use: its weight is used again within max_reuse elements of the weights used in
    between (prefix sums over the trace: one pass)."""
    sizes = [numels[_name(key)] for key, _ in uses]
    prefix = [0.0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    nxt, seen = [None] * len(uses), {}
    for i in range(len(uses) - 1, -1, -1):
        nxt[i] = seen.get(uses[i][0])
        seen[uses[i][0]] = i
    return [j is not None and prefix[j] - prefix[i + 1] < max_reuse for i, j in enumerate(nxt)]


def fetch_counts(numels: dict, layers: int, n_micro: int, recompute: bool, max_reuse: float = MAX_REUSE) -> dict:
    """{name: gathers per step} of each weight (a block submodule's over all layers, or an end's): every use whose
    weight its previous use freed (`_kept`), counted by `zero3_step` itself (a prefetch moves a gather earlier, never
    adds one), so the traffic and the clocks share one account."""
    zero = {k: 0.0 for k in numels}
    return zero3_step(numels, {"f": {}, "r": {}, "b": {}}, zero, zero, layers, n_micro, recompute,
                      max_reuse=max_reuse)["gathers"]


def zero3_step(numels: dict, seconds: dict, gather_s: dict, scatter_s: dict, layers: int, n_micro: int,
               recompute: bool, max_live: float = MAX_LIVE, max_reuse: float = MAX_REUSE,
               prefetch: float = PREFETCH, slowdown: float = 0.0) -> dict:
    """One step of the uses' compute and collectives on the host, GPU and network clocks (the module's docstring).
    numels: {name: elements} of each weight (block submodules and the ends); seconds: {phase: {name: seconds}} of
    each use's kernels ("f", "r", "b"); gather_s, scatter_s: {name: seconds} of one fp16 all-gather / reduce-scatter
    of that weight; slowdown: while a collective runs, the kernels beside it run that much slower (GPU.overlap_slowdown,
    the contention rule of labkit.scale.cost_kernels: NCCL's kernels share the SMs), here wherever a use's kernels
    meet the network still busy. Returns {"step_s", "gpu_s" (the compute stream's work, unslowed), "network_s" (every
    collective), "contention_s" (what the slowdown added to the GPU's clock), "gathers" ({name: gathers})}."""
    names = [n for n in SUBMODULES if n in numels]
    uses = trace(names, layers, n_micro, recompute)
    kept = _kept(uses, numels, max_reuse)
    host = gpu = net = busy = comm = slowed = 0.0
    held, flight, live, gathers = set(), set(), 0.0, {}
    pending = None  # the reduce-scatter of the last backward use's weight: issued at the next use

    def collective(s, ready=0.0):  # issued by the host, after the network's earlier calls, and its data's `ready`
        nonlocal net, comm
        net = max(host, net, ready) + s
        comm += s

    def gather(key):  # a weight's all-gather: held (and counted live) from its issue, issued after a synchronize
        nonlocal live, host
        host = max(host, gpu, net)  # _allgather_param's torch.cuda.synchronize, before each all-gather
        collective(gather_s[_name(key)])
        gathers[_name(key)] = gathers.get(_name(key), 0) + 1
        held.add(key)
        live += numels[_name(key)]

    for i, (key, phase) in enumerate(uses):
        name = _name(key)
        if key not in held:  # fetch: gathered now, and waited for
            gather(key)
            host = max(host, gpu, net)  # torch.cuda.synchronize
            flight.clear()
        elif key in flight:  # prefetched: waited for
            host = max(host, gpu, net)
            flight.clear()
        if not flight and live < max_live:  # prefetch the next weights not held, up to the bucket
            want = 0.0
            for j in range(i + 1, len(uses)):
                other = uses[j][0]
                if other not in held:
                    gather(other)
                    flight.add(other)
                    want += numels[_name(other)]
                    if want >= prefetch:
                        break
        if pending is not None:  # the previous backward use's gradient, once its kernels have made it
            collective(*pending)
            pending = None
        t = seconds[phase].get(name, 0.0)
        start = max(host, gpu)
        beside = max(0.0, net - start)  # the network's busy time ahead of these kernels
        took = t * (1 + slowdown) if t * (1 + slowdown) <= beside else beside + t - beside / (1 + slowdown)
        gpu = start + took
        busy += t
        slowed += took - t
        if phase == "b":
            pending = (scatter_s[name], gpu)
        if not kept[i]:
            held.discard(key)
            live -= numels[name]
    if pending is not None:
        collective(*pending)
    return {"step_s": max(host, gpu, net), "gpu_s": busy, "network_s": comm, "contention_s": slowed, "gathers": gathers}
