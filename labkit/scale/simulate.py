"""One rank of a large world, with no real memory and no network: measured FLOPs, memory, bytes (notebook 15).

    from labkit.scale.simulate import measure_step, dp_step
    m = measure_step(dp_step(config, batch=1, seq_len=2048), world_size=1024, rank=0)
    m["flops"], m["memory"]["after_forward"]["ACT"], m["bytes"]

`measure_step(step, world_size, rank)` is the one place a parallel training step plugs into
the simulator. `step` is a `SimStep`: `build()` makes the rank's model, optimizer and batch
(called inside `FakeTensorMode`, so a 405B-shaped model costs no memory; a deepcopy in it stays in
the same fake mode), `run(model, opt, batch)` does one training step (forward, backward, the collectives, the optimizer). The rank
runs on torch's fake process group (`backend="fake"`, torch.testing._internal.distributed.
fake_pg: every collective returns at once, with no data), so one process plays rank `rank`
of `world_size`; ranks with the same role give the same figures, so one run per distinct role
(one per pipeline stage) is enough. torch's own tools measure it:
    FLOPs     torch.utils.flop_counter.FlopCounterMode (matmuls; attention with the math kernel)
    memory    torch.distributed._tools.mem_tracker.MemTracker, by kind (PARAM, GRAD, OPT, ACT,
              TEMP): "after_forward" (the root module's snapshot when forward ends: what
              backward will need), "after_step" (what stays: the model states) and "peak"
              (the whole step's)
    bytes     each collective's bytes sent by this rank (ring formulas of labkit.scale.traffic),
              by op and group size. This counter is a stand-in: the lab's one communication
              layer (labkit.comm, count_traffic) replaces it when it lands.
`fake=False` runs a step on real tensors (still the fake process group): for a step whose shapes
depend on values, as MoE routing does, which fake tensors cannot answer. The lab's FSDP, TP, 1F1B
and MoE steps plug in this way in labkit/apps/sim_roles.py (one rank per distinct role).
So does the composed step of notebook 14 (`labkit.apps.sim_roles.composed_step`: every parallelism
on one Mesh, dense models, one micro-batch); its simulated bytes equal a real run's exactly
(tests/test_compose_simulated.py).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

# torch 2.13 names the flat collectives *_single (the *_tensor names are aliases): one op each here
_CANONICAL = {"all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
              "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
              "all_to_all_single": "all_to_all", "isend": "send"}


@dataclass
class SimStep:
    build: Callable  # () -> (model, optimizer, batch), run under FakeTensorMode
    run: Callable    # (model, optimizer, batch) -> None: one training step
    fake: bool = True  # False: real (small) tensors, for steps whose shapes depend on values (MoE routing)


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0):
    """An initialised fake process group: this process is `rank` of `world_size`."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers backend "fake"

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process: measure_step needs its own "
                           "(run it outside launched ranks)")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must lie in 0..{world_size - 1}")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def count_collectives():
    """{(op, group size): bytes this rank sends} for the collectives called inside.

    The counting is labkit.comm's (`count_traffic`: the one interception, the one table of payloads
    and bus factors), summed here by op and group size: all_reduce 2(n-1)/n of the tensor;
    all_gather (n-1)/n of the gathered output; reduce_scatter and all_to_all (n-1)/n of the input.
    """
    from labkit.comm.traffic import count_traffic

    counts: dict = {}
    with count_traffic() as traffic:
        yield counts  # filled when the block ends
    world = dist.get_world_size()
    for r in traffic.records:
        if r.op in ("recv", "irecv"):  # the other side's send: what this rank receives, not what it sends
            continue
        n = world if r.group == "world" else len(r.group.split(" ", 1)[1].split(","))
        key = (_CANONICAL.get(r.op, r.op), n)
        counts[key] = counts.get(key, 0) + r.wire
    for key, wire in counts.items():  # exact: an int where the bytes are whole
        counts[key] = int(wire) if wire.denominator == 1 else float(wire)


def _by_kind(snapshot: dict) -> dict:
    """MemTracker's {device: {kind: bytes}} summed over devices, keyed 'PARAM', 'GRAD', ... 'Total'."""
    out: dict = {}
    for per_device in snapshot.values():
        for kind, nbytes in per_device.items():
            key = str(kind).rsplit(".", 1)[-1]
            out[key] = out.get(key, 0) + nbytes
    return out


def measure_step(step: SimStep, world_size: int = 1, rank: int = 0) -> dict:
    """Run `step` as `rank` of `world_size` on fake tensors and the fake process group.

    Returns {"flops": FLOPs of the step, "memory": {"after_forward", "after_step", "peak": {kind: bytes}},
    "bytes": {(op, group size): bytes sent}}. Nothing is allocated for real.
    """
    from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker, _ModState
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    # (labkit.model's token check skips fake tensors: they have no values to read)
    with fake_world(world_size, rank), (FakeTensorMode() if step.fake else contextlib.nullcontext()) as fake:
        with FakeCopyMode(fake) if step.fake else contextlib.nullcontext():  # a deepcopy inside build (parallelize_model's) stays in this fake mode
            model, optimizer, batch = step.build()
        tracker = MemTracker()
        # a composite optimizer (labkit.compose's, one per gradient group) is tracked through its torch ones
        tracker.track_external(model, *getattr(optimizer, "torch_optimizers", lambda: [optimizer])())
        with count_collectives() as sent, tracker, FlopCounterMode(display=False) as flops, \
                sdpa_kernel(SDPBackend.MATH):  # the math kernel: its matmuls are counted
            step.run(model, optimizer, batch)
            after_step = _by_kind(tracker.get_tracker_snapshot("current"))
        stats = tracker.memory_tracking[model]
        after_forward = _by_kind(stats.snapshots[_ModState.POST_FW][0])
        return dict(flops=flops.get_total_flops(), bytes=dict(sent),
                    memory=dict(after_forward=after_forward, after_step=after_step,
                                peak=_by_kind(tracker.get_tracker_snapshot("peak"))))


def dp_step(config, batch: int, seq_len: int, lr: float = 1e-4) -> SimStep:
    """Plain data parallelism with labkit's model, fp32: forward, backward, one all-reduce of the
    flat gradient over the world, AdamW. The simplest step to check the simulator against."""
    from labkit.model import build_model

    def build():
        model = build_model(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
        tokens = torch.randint(0, model.config.vocab_size, (batch, seq_len))
        return model, optimizer, tokens

    def run(model, optimizer, tokens):
        model(tokens, tokens).backward()
        params = [p for p in model.parameters() if p.grad is not None]
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        optimizer.step()

    return SimStep(build, run)

