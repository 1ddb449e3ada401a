"""HSDP in the composition (labkit/compose/step.py): the bytes of one step equal their closed form.

On 4 ranks, dp = dp_replicate x dp_shard = 2 x 2, the dense model in float64, ZeRO-1, 2 and 3 (one launch),
one `train_step`, counted by `labkit.comm.traffic.count_traffic`. With dp alone every parameter's gradient is
summed over the same ranks ("batch"), so the step has one gradient group of P parameters (this rank's: all of
them), sharded into s = ceil(P / S) elements per rank of a replica (S = dp_shard, R = dp_replicate, e = 8 bytes).
Payloads S as labkit.comm.ops counts them (reduce-scatter: its input; all-gather: its output):

    reduce-scatter inside the replica    S s e     (wire (S-1) s e)     the gradient, summed and sharded
    all-reduce across the replicas       s e       (wire 2(R-1)/R s e)  each shard, summed over the replicas
    all-gather inside the replica        S s e     (wire (S-1) s e)     ZeRO-1/2: the updated shards after the
                                                                        step; ZeRO-3: the parameters before it
    all-reduce of the loss, world        8                              the reported loss (one float64)

so only 1/S of the gradient crosses the replicas (nodes, on a cluster). That every layout equals one process
is proven by tests/test_compose.py's matrix (HSDP 2 x 1 ZeRO-1, 2 x 2 ZeRO-2, and with EP 2 x 2 ZeRO-1).
"""
from __future__ import annotations

import math

import pytest
import torch

from labkit import launch
from labkit.grading.cases import launch_timeout
from labkit.model import build_model, get_config

R, S, E = 2, 2, 8
ZEROS = (1, 2, 3)


def config():
    return get_config("tiny", d_model=32, n_heads=4, n_layers=4, hidden_dim=64, vocab_size=128, context=64)


def counted_steps(rank, world):
    from labkit.comm.traffic import count_traffic
    from labkit.compose.dims import ParallelDims
    from labkit.compose.model import parallelize
    from labkit.compose.step import ComposedOptimizer, train_step

    tokens = torch.randint(0, 128, (8, 17), generator=torch.Generator().manual_seed(1))
    out = {}
    for zero in ZEROS:
        mesh = ParallelDims(dp=R * S, dp_replicate=R, zero=zero).build_mesh(world)
        stage = parallelize(build_model(config(), seed=0).double(), mesh=mesh)
        opt = ComposedOptimizer(stage, mesh=mesh, zero=zero)
        groups = {"shard": mesh.group("dp_shard"), "replicate": mesh.group("dp_replicate")}
        with count_traffic(groups=groups) as traffic:
            train_step(stage, opt, tokens[:, :-1], tokens[:, 1:], mesh=mesh)
        out[zero] = {key: (calls, payload) for key, (calls, payload, _) in traffic.by_group().items()}
    return out


@pytest.fixture(scope="module")
def counted():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LABKIT_IMPL", "solutions")
        return launch(counted_steps, R * S, timeout=launch_timeout(120))


@pytest.mark.parametrize("zero", ZEROS)
def test_hsdp_step_bytes_equal_the_closed_form(zero, counted):
    P = sum(p.numel() for p in build_model(config(), seed=0).parameters())
    s = math.ceil(P / S)
    want = {("reduce_scatter_single", "shard"): (1, S * s * E), ("all_reduce", "replicate"): (1, s * E),
            ("all_gather_single", "shard"): (1, S * s * E), ("all_reduce", "world"): (1, 8)}
    for rank, per_zero in enumerate(counted):
        assert per_zero[zero] == want, f"rank {rank}, zero={zero}: {per_zero[zero]} != {want}"
