"""Each parallelism's traffic per step, measured under SlowLink, equals its closed form.

The reference solutions (impl()) run one step each on 4 gloo ranks inside `SlowLink(inf)` (it
only counts) and `count_traffic()`; calls per op, payload bytes (exact integers) and wire
bytes (exact Fractions: payload x bus factor, labkit.comm.ops) must equal formulas written
here from the sizes alone: DP, bucketed DP, ZeRO-1/2/3, TP, SP, CP, EP, PP and DP x PP.
A planted bypass (ZeRO-2 calling ops bound before the block) makes the same check fail.
One launch (labkit.grading.cases); about 8 s on 2 cores.
"""
import functools
import math
import os
import types
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
from torch import nn

from labkit.grading.cases import expect_case, launch_cases, run_cases
from labkit.comm.traffic import count_traffic
from labkit.grading import impl
from labkit.links.shaper import SlowLink

N = 4  # ranks
F32 = 4
RING, ALL_REDUCE = Fraction(N - 1, N), Fraction(2 * (N - 1), N)


def measure(step):
    with SlowLink(float("inf")) as link, count_traffic() as traffic:
        step()
    return link, traffic


def expect(measured, calls: dict, payload: int, wire, what: str):
    link, traffic = measured
    got, want = (link.by_op, link.payload_bytes, traffic.wire()), (calls, payload, Fraction(wire))
    assert got == want, f"{what}: measured (calls, payload, wire) {got}, closed form {want}"
    assert link.wire_bytes == float(wire), f"{what}: SlowLink's wire {link.wire_bytes} != {float(wire)}"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.frozen = nn.Linear(5, 7), nn.Linear(7, 3, bias=False), nn.Linear(5, 5)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.b(torch.tanh(self.a(self.frozen(x)))).square().mean()


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def numel(params):
    return sum(p.numel() for p in params)


def padded(n):  # the sharding rule: ceil(n / N) per rank
    return math.ceil(n / N) * N


def dp(rank):
    model = Net()
    model(torch.randn(2, 5)).backward()
    m = measure(lambda: impl("data_parallel").sync_gradients(model))
    # one flat buffer: every trainable gradient, then one has-a-gradient flag per parameter
    size = (numel(trainable(model)) + len(trainable(model))) * F32
    expect(m, {"all_reduce": 1}, size, size * ALL_REDUCE, "DP")


def bucketed_dp(rank):
    ddp = impl("data_parallel").BucketedDataParallel(Net(), bucket_size_mb=100 / 2**20)  # ~100 B: several buckets

    def step():
        ddp(torch.randn(2, 5)).backward()
        ddp.sync_gradients()
    m = measure(step)
    assert len(ddp.buckets) > 1
    size = sum((numel(b) + len(b)) * F32 for b in ddp.buckets)
    expect(m, {"all_reduce": len(ddp.buckets)}, size, size * ALL_REDUCE, "bucketed DP")


def zero1(rank):
    model = Net()
    opt = impl("zero").ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1)
    model(torch.randn(2, 5)).backward()
    m = measure(opt.step)
    size = padded(numel(trainable(model))) * F32  # reduce-scatter the gradients, all-gather the parameters
    expect(m, {"reduce_scatter_single": 1, "all_gather_single": 1}, 2 * size, 2 * size * RING, "ZeRO-1")


def zero2_step(module):
    from labkit.model import build_model
    model = build_model("tiny", seed=0)
    opt = module.Zero2Optimizer(model, bucket_size_mb=0.05)
    x = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))

    def step():
        model(x, x).backward()
        opt.step()
    m = measure(step)
    size = sum(padded(numel(b)) for b in opt.buckets) * F32
    k = len(opt.buckets)
    assert k > 1
    expect(m, {"reduce_scatter_single": k, "all_gather_single": k}, 2 * size, 2 * size * RING, "ZeRO-2")


def zero2(rank):
    zero2_step(impl("zero2"))


def planted_bypass_is_caught(rank):
    """ZeRO-2 with its ops looked up on a copy of torch.distributed made before the block: as if bound at import."""
    module = impl("zero2")
    snapshot = types.SimpleNamespace(**{k: getattr(dist, k) for k in dir(dist) if not k.startswith("__")})
    real, module.dist = module.dist, snapshot
    try:
        with pytest.raises(AssertionError, match="ZeRO-2: measured"):
            zero2_step(module)
    finally:
        module.dist = real


def zero3(rank):
    from labkit.model import build_model
    model = build_model("tiny", seed=0)
    z3 = impl("fsdp").ZeRO3(model)
    x = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))

    def step():
        model(x, x).backward()
        z3.sync_gradients()
    m = measure(step)
    blocks = [padded(numel(trainable(b))) * F32 for b in model.layers]
    in_blocks = {p for b in model.layers for p in b.parameters()}
    root = padded(numel([p for p in trainable(model) if p not in in_blocks])) * F32
    # a block: gathered for forward, again for backward, its gradients reduce-scattered;
    # the root: gathered once (kept until its gradients are reduced), reduce-scattered once
    gathered, reduced = 2 * sum(blocks) + root, sum(blocks) + root
    L = len(blocks)
    expect(m, {"all_gather_single": 2 * L + 1, "reduce_scatter_single": L + 1}, gathered + reduced,
           (gathered + reduced) * RING, "ZeRO-3")


def tp(rank):
    from labkit.model import build_model
    model = build_model("tiny", seed=0)
    tp_model = impl("tensor_parallel").parallelize_model(model)
    x = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    m = measure(lambda: tp_model(x, x).backward())
    size = 2 * 8 * model.config.d_model * F32  # [B, T, d]
    calls = 4 * model.config.n_layers  # per layer: attention and MLP, forward and backward
    expect(m, {"all_reduce": calls}, calls * size, calls * size * ALL_REDUCE, "TP")


def sp(rank):
    from labkit.model import build_model
    sp = impl("sequence_parallel")
    model = build_model("tiny", seed=0)
    s, d = 8, model.config.d_model
    pb = sp.ParallelBlock(model.layers[0], sequence_parallel=True)
    xs = torch.randn(2, s // N, d).requires_grad_()

    def step():
        pb(xs, model.rope).backward(torch.ones(2, s // N, d))
        pb.sync_gradients()
    m = measure(step)
    full = 2 * s * d * F32  # S of each all-gather / reduce-scatter: the full [B, s, d]
    norms = 2 * d * F32
    expect(m, {"all_gather_single": 4, "reduce_scatter_single": 4, "all_reduce": 2}, 8 * full + norms,
           8 * full * RING + norms * ALL_REDUCE, "SP")


def cp(rank):
    from labkit.mesh import Mesh
    from labkit.model import build_model
    model = build_model("tiny", seed=0)
    cp = impl("context_parallel").ContextParallel(model, mesh=Mesh(N, cp=N))
    s, d, L = 16, model.config.d_model, model.config.n_layers
    x = torch.randint(0, 256, (1, s), generator=torch.Generator().manual_seed(0))

    def step():
        cp(x, x).backward()
        cp.sync_gradients()
    m = measure(step)
    kv = 2 * (s // N) * d * F32  # one K and V block of this rank's s/N positions
    # per layer: forward passes K,V on N-1 times; backward N-1 times more, and dK,dV travel N times
    p2p = L * (3 * N - 2)
    grads = [p for p in model.parameters() if p.grad is not None]
    ar = numel(grads) * F32
    # each layer's ring first all-gathers every rank's q shape and kv length (5 int64), so that unequal
    # pieces raise a ValueError instead of corrupting the exchange; the all-gather's payload is its output
    shapes = L * N * 5 * 8
    # the gradients: ONE all-reduce of them flattened (one per parameter would pay len(grads) latencies)
    expect(m, {"isend": p2p, "irecv": p2p, "all_reduce": 1, "all_gather": L}, 2 * p2p * kv + ar + shapes,
           2 * p2p * kv + ar * ALL_REDUCE + shapes * RING, "CP")


def ep(rank):
    from labkit.model import moe
    from labkit.mesh import Mesh
    epm = impl("expert_parallel")
    mesh = Mesh(N, ep=N, combined=[("dp", "ep")])
    model = epm.build_ep_model("tiny-moe", mesh=mesh, seed=0)
    x = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(rank))

    def step():
        model(x, x).backward()
        epm.sync_gradients(model, mesh=mesh)
    m = measure(step)
    d, E = model.config.d_model, model.config.n_experts
    layers, local = moe.moe_layers(model), E // N
    kept = torch.stack([layer.routing.kept_counts() for layer in layers]).sum(0)  # [E] this rank's kept picks
    every = [torch.empty_like(kept) for _ in range(N)]
    dist.all_gather(every, kept)
    mine = slice(rank * local, (rank + 1) * local)
    away = int(kept.sum() - kept[mine].sum())
    received = sum(int(every[r][mine].sum()) for r in range(N) if r != rank)
    counts = len(layers) * (N - 1) * local * 8  # before each dispatch: L int64 counts to each other rank
    rows = 2 * (away + received) * d * F32  # dispatch + combine, forward and backward
    params = dict(model.named_parameters())
    shared = sum(p.numel() for n, p in params.items() if not epm.is_expert_parameter(n)) * F32
    experts = sum(p.numel() for n, p in params.items() if epm.is_expert_parameter(n)) * F32  # dp = 1: no wire
    link, traffic = m
    # bytes are the closed form; the number of messages depends on which peers get rows (empty chunks are not sent)
    # every all_to_all_single first all-gathers each rank's sizes (check_splits: 3 + 2N int64) so that bad sizes
    # raise instead of hang; 5 per layer: the counts, dispatch and combine forward, their two backwards
    checks = 5 * len(layers)
    meta = N * (3 + 2 * N) * 8
    calls = {"isend": traffic.calls("isend"), "irecv": traffic.calls("irecv"), "all_reduce": len(params),
             "all_gather": checks}
    p2p = 2 * (rows + counts)  # what a rank sends, it also receives (each exchange is undone by its backward)
    expect(m, calls, p2p + shared + experts + checks * meta, p2p + shared * ALL_REDUCE + checks * meta * RING, "EP")
    assert traffic.payload("isend") == rows + counts


def pipeline_step(rank, dp_size, pp):
    from labkit.model import build_model, make_stage
    hybrid = impl("hybrid")
    mesh = hybrid.make_mesh(N, dp=dp_size, pp=pp)
    model = build_model("tiny", seed=0)
    stage = make_stage(model, mesh.coord("pp"), pp)
    B, T, M = 4, 8, 2
    x = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(0))
    m = measure(lambda: hybrid.hybrid_step(stage, x, x, M, mesh=mesh))
    act = B // dp_size // M * T * model.config.d_model * F32  # one micro-batch's activation (or its gradient)
    neighbours = (not mesh.is_first("pp")) + (not mesh.is_last("pp"))
    params = trainable(stage)
    grads = (numel(params) + len(params)) * F32  # DP's flat buffer (gradients + has-grad flags)
    last = mesh.is_last("pp")
    share = Fraction(2 * (dp_size - 1), dp_size)
    calls = {"all_reduce": 1 + last}
    if neighbours:
        calls.update(isend=M * neighbours, irecv=M * neighbours)
    # each micro-batch: its activation forward and its gradient backward across every boundary of this stage
    p2p = 2 * M * neighbours * act
    expect(m, calls, p2p + grads + last * F32, p2p + (grads + last * F32) * share, f"DP={dp_size} x PP={pp}")


CASES = {
    ("dp",): dp, ("bucketed_dp",): bucketed_dp, ("zero1",): zero1, ("zero2",): zero2, ("zero3",): zero3,
    ("tp",): tp, ("sp",): sp, ("cp",): cp, ("ep",): ep,
    ("pp",): lambda rank: pipeline_step(rank, 1, N), ("hybrid",): lambda rank: pipeline_step(rank, 2, 2),
    ("planted_bypass",): planted_bypass_is_caught,
}


def run_all(rank, world_size):
    os.environ["LABKIT_IMPL"] = "solutions"  # in this rank only: the reference, also inside impl() calls it makes
    return run_cases({key: functools.partial(body, rank) for key, body in CASES.items()}, watch_recvs=False)


@pytest.fixture(scope="module")
def outcomes():
    return launch_cases(run_all, N, timeout=120)


@pytest.mark.parametrize("key", list(CASES), ids=lambda k: k[0])
def test_traffic_per_step_equals_closed_form(outcomes, key):
    expect_case(outcomes, key, f"{key[0]}: traffic per step under SlowLink")
