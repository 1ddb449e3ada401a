"""torch.distributed ops the lab calls that an older torch lacks, supplied from ones it has.

The lab is pinned to torch 2.13, whose ``all_gather_single`` and ``reduce_scatter_single`` gather
into, and reduce-scatter from, one flat tensor. torch 2.11 (a GPU node's, 2026-11) has neither, but
has ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` with the same arguments and the same
result. `install()` (run when labkit is imported) adds each missing name as a call of the other, so
the solutions, the learner's code and the lab run unchanged on both. The op table
(`labkit.comm.ops`) and `labkit.comm.intercept` see the name the code called: the inner call runs
while an op is already running, which the interception does not count again.

The oldest torch the lab supports is 2.11: its ``init_process_group`` takes the combined backend
``"cpu:gloo,cuda:nccl"`` with ``device_id``, which the launcher uses on a GPU node.
"""
from __future__ import annotations

FALLBACKS = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}


def _calling(existing: str, missing: str):
    import inspect

    import torch.distributed as dist

    def fallback(*args, **kwargs):
        return getattr(dist, existing)(*args, **kwargs)  # looked up per call: an intercepted op is seen

    # The interception binds a call's arguments by the op's signature (its payload, its group): the
    # stand-in must have the real one, not (*args, **kwargs), or every byte and group reads as None.
    fallback.__signature__ = inspect.signature(getattr(dist, existing))
    fallback.__name__ = fallback.__qualname__ = missing
    fallback.__doc__ = f"labkit's stand-in for torch.distributed.{missing} (absent in this torch): calls {existing}."
    fallback.labkit_fallback_for = existing
    return fallback


def install() -> list[str]:
    """Add the missing ops to torch.distributed; return their names (none on torch 2.13)."""
    import torch.distributed as dist

    added = []
    for missing, existing in FALLBACKS.items():
        if not hasattr(dist, missing) and hasattr(dist, existing):
            setattr(dist, missing, _calling(existing, missing))
            added.append(missing)
    return added
