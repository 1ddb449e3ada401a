"""Checkpoints for data-parallel training: save on rank 0, load on rank 0 and broadcast.

    from labkit.checkpoint import save_checkpoint, load_checkpoint
    save_checkpoint("ckpt.pt", model, optimizer, step=step)        # every rank calls it
    ...                                                            # crash, restart
    step = load_checkpoint("ckpt.pt", model, optimizer)["step"]    # every rank calls it

The replicas are identical, so one copy is enough: rank 0 writes it, and on restart
rank 0 reads it and sends it to the others. The file only needs to be visible to
rank 0. With deterministic data (batches chosen by step, e.g. `labkit.data.get_batch`)
a resumed run reproduces the uninterrupted one bit for bit.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


def save_checkpoint(path, model, optimizer=None, step: int = 0, extra=None, src: int = 0, group=None) -> None:
    """Rank `src` writes {"model", "optimizer", "step", "extra"} to `path`; every rank returns
    after the file is complete (a barrier), so no rank can race ahead and crash before it exists.

    The write goes to `path + ".tmp"` first, then is renamed: a crash mid-write never
    leaves a half checkpoint under `path`.
    """
    if dist.get_rank() == src:
        state = {"model": model.state_dict(), "step": int(step), "extra": extra,
                 "optimizer": optimizer.state_dict() if optimizer is not None else None}
        tmp = f"{path}.tmp"
        torch.save(state, tmp)
        os.replace(tmp, path)
    dist.barrier(group=group)


def load_checkpoint(path, model, optimizer=None, src: int = 0, group=None) -> dict:
    """Rank `src` reads `path`; its model and optimizer state are broadcast to every rank.

    Returns {"step": ..., "extra": ...} on every rank. Raises FileNotFoundError on
    every rank (not only on `src`) when the file is missing, so no rank hangs waiting.
    """
    state = None
    if dist.get_rank() == src:
        state = torch.load(path, map_location="cpu") if os.path.exists(path) else {"missing": True}
    # Small things (step, extra, optimizer state) travel as one pickled object ...
    header = [None]
    if state is not None:
        header = [{k: v for k, v in state.items() if k != "model"}]
    dist.broadcast_object_list(header, src=src, group=group)
    (header,) = header
    if header.get("missing"):
        raise FileNotFoundError(f"no checkpoint at {path!r} on rank {src}: train from scratch or fix the path")
    # ... the weights as tensors, straight into the model (every rank has the same structure).
    with torch.no_grad():
        if state is not None:
            model.load_state_dict(state["model"])
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=src, group=group)
    if optimizer is not None:
        if header["optimizer"] is None:
            raise ValueError(f"checkpoint {path!r} holds no optimizer state, but an optimizer was given")
        optimizer.load_state_dict(header["optimizer"])
    return {"step": header["step"], "extra": header["extra"]}
