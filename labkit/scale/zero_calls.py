"""How many times each ZeRO stage gathers parameters and reduce-scatters gradients in one step (notebook 15).

One count for the traffic (labkit.scale.traffic.axis_traffic, hsdp_traffic) and for the copies FSDP2 runs
around each call (labkit.scale.kernels.fsdp_copies), and the same cases as the memory that
labkit.scale.footprint holds: a stage whose gradient is sharded must reduce it each micro-batch, and one that
accumulates it whole may reduce it once.
"""
from __future__ import annotations

ZERO3_GRAD_BYTES = 4  # ZeRO-3 reduces its gradients in fp32 (torchtitan's mixed_precision_reduce, FSDP2's reduce_dtype)


def zero3_calls(pp: int, n_micro: int) -> tuple[int, int]:
    """(all-gathers, reduce-scatters) of each ZeRO-3 unit's parameters in one step, as FSDP2 runs them; the same
    two cases as labkit.scale.footprint's, and one count for the traffic and the copies around each call
    (labkit.scale.kernels.fsdp_copies):
      without a pipeline, every micro-batch gathers twice (its forward; its backward, as reshard_after_forward
        freed them) and reduce-scatters its gradient (FSDP2 syncs every backward unless told otherwise: the
        footprint holds no unsharded gradient): 2 m and m;
      inside a pipeline, once each: torchtitan keeps the stage gathered (reshard_after_forward=False, 'to avoid
        per-microbatch all-gathers, which can be expensive and non-overlapped', its parallelize_llama), and
        torch.distributed.pipelining turns off gradient sync and resharding for every backward but the last
        (stage.py, backward_maybe_with_nosync): the footprint's stage gathered and its fp32 gradient accumulated."""
    return (1, 1) if pp > 1 else (2 * n_micro, n_micro)


def zero2_calls(pp: int, n_micro: int) -> tuple[int, int] | None:
    """(all-gathers, reduce-scatters) of ZeRO-2's parameters and gradients in one step where they differ from one
    all-reduce's worth, else None. Its footprint holds the gradient sharded, so without a pipeline each micro-batch's
    backward reduce-scatters its gradient as it comes (notebook 09's in-backward buckets, DeepSpeed's stage 2, FSDP2
    with reshard_after_forward=False), and the updated parameters are gathered once, after the optimizer: 1 and m.
    Inside a pipeline (None) it reduces once a step, as plain DP and ZeRO-1 do (labkit.compose's ZeRO-2 accumulates
    the micro-batches first); the footprint does not count that accumulated gradient."""
    return None if pp > 1 else (1, n_micro)


def dp_calls(zero: str, pp: int, n_micro: int) -> tuple[int, int] | None:
    """(all-gathers, reduce-scatters) a step of ZeRO stage `zero` (`zero3_calls`, `zero2_calls`), or None where
    the stage reduces once a step, an all-reduce's worth (plain DP, ZeRO-1, ZeRO-2 inside a pipeline)."""
    return zero3_calls(pp, n_micro) if zero == "zero3" else zero2_calls(pp, n_micro) if zero == "zero2" else None
