"""A step's pace: its slowest GPU (notebook 15).

A GPU at its power limit settles at its own clock, lower with its neighbours busy (a node's GPUs share the board's
power and cooling), and a synchronous step waits at every collective for its slowest GPU. The sustained GEMM
figure the kernel model starts from (`GPU.msmf_tflops`) is measured on one GPU with the node idle; `GPU.busy_node`
gives the same figure measured on every GPU of a node at once: its mean over the alone figure and its range over
the figures measured. Here the slowest of a step's GPUs within a node sets the tensor cores' rate
(`GPU.clock_factor`, which labkit.scale.kernels applies to GEMMs and attention, not to HBM-bound or host-bound
work): `paced(gpu, gpus)` is the GPU the cost model times a step's kernels on (labkit.scale.cost_kernels).
"""
from __future__ import annotations

import dataclasses
import math
from functools import lru_cache

from labkit.scale.gpu import GPU


@lru_cache(maxsize=None)
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normal draws] (Tippett 1925: 1.4236 for 8, 2.1608 for 40), by the trapezoid
    rule on [-10, 10], where the density x n phi(x) Phi(x)^(n-1) has no mass left."""
    if n <= 1:
        return 0.0
    h = 1e-3

    def density(x: float) -> float:  # of the largest of n: n phi(x) Phi(x)^(n-1)
        return n * math.exp(-x * x / 2) / math.sqrt(2 * math.pi) * (0.5 * (1 + math.erf(x / math.sqrt(2)))) ** (n - 1)
    return h * sum(x * density(x) for x in (i * h - 10 for i in range(20001)))


def slowest_gpu(gpu: GPU, gpus: int) -> float:
    """The tensor cores' rate of the slowest of `gpus` GPUs of one node, all busy, over one GPU's alone (1 for one GPU
    or a kind without `busy_node`). A synchronous step waits at every collective for its slowest GPU, and a GPU
    at its power limit settles at its own clock, lower with its neighbours busy (the board's shared power and
    cooling): the figures of the node's GPUs measured at once (`busy_node`) have a mean `ratio` of one GPU's alone
    and a `range` over `draws` figures; taken as normal draws, sigma = range / E[range of draws] (E[range] =
    2 E[max]), and the slowest of g = E[max of g] sigma under their mean. Only within the node measured: beyond it
    the tail is not measured, so a run of many nodes takes the node's (a bound on the effect, not its size)."""
    if gpus <= 1 or gpu.busy_node is None:
        return 1.0
    ratio, spread, draws = gpu.busy_node
    sigma = spread / (2 * expected_max_normal(draws))
    return ratio * (1 - expected_max_normal(gpus) * sigma)


@lru_cache(maxsize=64)
def paced(gpu: GPU, gpus: int) -> GPU:
    """`gpu` with its tensor cores at `slowest_gpu`'s rate for a step over `gpus` GPUs of a node (GEMMs and
    attention; HBM-bound and launch-bound work keep their pace): the GPU the cost model times a step's kernels on."""
    factor = slowest_gpu(gpu, gpus)
    return gpu if factor == 1.0 else dataclasses.replace(gpu, clock_factor=gpu.clock_factor * factor)
