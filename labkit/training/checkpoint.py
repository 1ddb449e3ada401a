"""Checkpoints for data-parallel training: save on rank 0, load on rank 0 and broadcast.

    from labkit.training.checkpoint import save_checkpoint, load_checkpoint
    save_checkpoint("ckpt.pt", model, optimizer, step=step)        # every rank calls it
    ...                                                            # crash, restart
    step = load_checkpoint("ckpt.pt", model, optimizer)["step"]    # every rank calls it

The replicas are identical, so one copy is enough: rank 0 writes it, and on restart
rank 0 reads it and sends it to the others. The file only needs to be visible to
rank 0. With deterministic data (batches chosen by step, e.g. `labkit.data.get_batch`)
a resumed run reproduces the uninterrupted one bit for bit.

For training that must survive a crash (notebook 13): `save_state` / `load_state` keep a
directory of checksummed checkpoints with every rank's RNG state, the data position and the
model config, and fall back to the previous file when the newest is damaged (see below).
"""
from __future__ import annotations

import hashlib
import io
import os
import random
import re
import warnings
from dataclasses import asdict, is_dataclass

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


# --------------------------------------------------------------------------- crash-safe training state
#
#   path = save_state("ckpts", step, model, optimizer, config=cfg)    # every rank, every k steps
#   resumed = load_state("ckpts", model, optimizer, config=cfg)       # every rank, at start
#   start = resumed["step"] if resumed else 0
#
# A directory of numbered checkpoints, the newest `keep` kept. Each file starts with a
# header line holding the SHA-256 of the rest, so a file cut short by a crash or damaged
# on disk is *detected* and skipped (the previous checkpoint is used), never loaded.
# Besides weights and optimizer state a checkpoint holds what makes a resumed run equal
# to an uninterrupted one bit for bit:
# - the data position: the step (batches are a function of the step, labkit.data's seed
#   rule) plus anything in `extra` (a loader's offset, say);
# - every rank's RNG state (torch's CPU generator and Python's `random`), gathered to
#   rank `src`, written once, and given back to each rank on load;
# - the model config, so a checkpoint of another model is refused with a clear error.


MAGIC = b"LABKIT-CKPT sha256="
_NAME = re.compile(r"^step-(\d{8})\.ckpt$")


class CorruptCheckpoint(ValueError):
    """A checkpoint file whose checksum or header is wrong (cut short, damaged, or not a checkpoint)."""


def write_verified(path, state) -> None:
    """Write `state` (torch.save) under a checksum header; atomically (tmp file, fsync, rename)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n")
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_verified(path):
    """The state written by `write_verified`; raises CorruptCheckpoint when the checksum does not match."""
    with open(path, "rb") as f:
        data = f.read()
    header, _, payload = data.partition(b"\n")
    if not header.startswith(MAGIC) or len(header) != len(MAGIC) + 64:
        raise CorruptCheckpoint(f"{path}: no checksum header (not a labkit checkpoint, or cut short)")
    want, got = header[len(MAGIC):].decode(), hashlib.sha256(payload).hexdigest()
    if want != got:
        raise CorruptCheckpoint(f"{path}: checksum mismatch (file damaged or partial: "
                                f"{len(payload)} bytes of payload, sha256 {got[:12]}... instead of {want[:12]}...)")
    return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)


def checkpoints(directory) -> list:
    """The checkpoint files in `directory`, newest (highest step) first."""
    if not os.path.isdir(directory):
        return []
    names = sorted((n for n in os.listdir(directory) if _NAME.match(n)), reverse=True)
    return [os.path.join(directory, n) for n in names]


def _config_dict(config):
    if config is None:
        return None
    return asdict(config) if is_dataclass(config) else dict(config)


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def save_state(directory, step: int, model, optimizer=None, *, extra=None, config=None, keep: int = 2,
               src: int = 0, group=None) -> str:
    """Every rank calls it; rank `src` writes ``directory/step-<step>.ckpt``; returns the path.

    The newest `keep` checkpoints are kept (>= 2, so a damaged newest one leaves a good one).
    Every rank's RNG state is gathered into the file. Returns after the file is complete.
    """
    if keep < 2:
        raise ValueError(f"keep={keep}: keep at least 2 checkpoints, so a damaged newest one leaves a good one")
    world = dist.get_world_size(group)
    rngs = [None] * world
    dist.all_gather_object(rngs, _rng_state(), group=group)
    path = os.path.join(directory, f"step-{int(step):08d}.ckpt")
    if dist.get_rank() == src:
        os.makedirs(directory, exist_ok=True)
        write_verified(path, {"step": int(step), "model": model.state_dict(), "extra": extra,
                              "optimizer": optimizer.state_dict() if optimizer is not None else None,
                              "config": _config_dict(config), "rng": rngs, "world_size": world})
        for old in checkpoints(directory)[keep:]:
            os.remove(old)
    dist.barrier(group=group)
    return path


def _check_matches(state, path, model, config, world) -> str | None:
    """Why `state` cannot be loaded into this run, or None."""
    want = _config_dict(config)
    if want is not None and state["config"] is not None and state["config"] != want:
        diff = {k: (state["config"].get(k), v) for k, v in want.items() if state["config"].get(k) != v}
        return (f"{path} was saved for another model config (saved vs this run: {diff}): "
                "point to that model's checkpoint directory, or start this model from scratch")
    for name, tensor in model.state_dict().items():
        saved = state["model"].get(name)
        if saved is None or saved.shape != tensor.shape:
            return (f"{path} holds {name} of shape {None if saved is None else tuple(saved.shape)}, this model "
                    f"has {tuple(tensor.shape)}: it was saved for another model config")
    if state["world_size"] != world:
        return (f"{path} was saved by {state['world_size']} ranks, this run has {world}: its RNG states are "
                "per rank; resume with the same number of ranks")
    return None


def load_state(directory, model, optimizer=None, *, config=None, src: int = 0, group=None):
    """Every rank calls it. Load the newest *valid* checkpoint of `directory`; None when there is none.

    Rank `src` tries the files newest first; a corrupt one (CorruptCheckpoint) is reported with
    a warning and skipped. Weights are broadcast from `src`, optimizer state too, and each rank
    gets its own RNG state back. Returns {"step", "extra", "path", "skipped": [corrupt paths]}.
    Raises ValueError on every rank for a checkpoint of another model config or world size.
    """
    world = dist.get_world_size(group)
    state, header = None, [None]
    if dist.get_rank() == src:
        skipped = []
        for path in checkpoints(directory):
            try:
                state = read_verified(path)
            except CorruptCheckpoint as err:
                warnings.warn(f"skipping a corrupt checkpoint: {err}")
                skipped.append(path)
                continue
            error = _check_matches(state, path, model, config, world)
            header = [{"error": error, "path": path, "skipped": skipped,
                       **{k: v for k, v in state.items() if k != "model"}}]
            break
        else:
            header = [{"none": True, "skipped": skipped}]
    dist.broadcast_object_list(header, src=src, group=group)
    (header,) = header
    if header.get("none"):
        return None
    if header["error"]:
        raise ValueError(header["error"])
    with torch.no_grad():
        if state is not None:
            model.load_state_dict(state["model"])
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=src, group=group)
    if optimizer is not None and header["optimizer"] is not None:
        optimizer.load_state_dict(header["optimizer"])
    rng = header["rng"][dist.get_rank(group)]
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    return {"step": header["step"], "extra": header["extra"], "path": header["path"], "skipped": header["skipped"]}
