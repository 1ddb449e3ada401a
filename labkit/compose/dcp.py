"""Resharding checkpoints with torch.distributed.checkpoint (DCP): save on one layout, resume on another.

    save(path, stage, optimizer, mesh=mesh, step=k, config=cfg)       # collective over the world
    k = load(path, stage, optimizer, mesh=new_mesh, config=cfg)       # another layout, or mesh=None
    save(path, model, adamw, mesh=None, step=k, config=cfg)           # one process: a labkit Transformer

No rank gathers the model. Each rank hands DCP a state dict of ITS pieces, every piece labelled with
where it sits in the full tensor, and writes only its own bytes; loading, each rank asks for the
boxes its new layout needs and DCP reads them from whichever files hold them.

The labels are DTensors. `to_device_mesh(mesh)` builds torch's `DeviceMesh` with the same grid and
axis names as the lab's `Mesh`, from the process groups the Mesh already has (no new group, no
collective). A parameter of this pipeline stage is a DTensor on the stage's sub-mesh
(dp, ep, cp, tp) with placements from labkit's own table (`labkit.compose.model.param_class`).
Only the grid's axes are DeviceMesh dims: EP folded over dp x cp (x tp) is a slice of those axes, not a
dim (the sub-mesh is then (dp, cp, tp)), and HSDP's replicas x shards split dp; neither needs a dim of
its own, since no DTensor is placed on them (below), so folded and HSDP layouts save and reshard too:
  tp_shard    Shard(shard_dim) on tp, Replicate elsewhere: tp rank i holds rows (or columns) i of tp
  sp_replica  Replicate everywhere
  expert      a plain tensor under its global name (layers.1.feed_forward.experts.3.w1.weight):
              held whole by one ep rank (and its replicas over dp, cp, tp); DCP treats a plain
              tensor as replicated among the ranks that pass it
AdamW's exp_avg and exp_avg_sq get the parameter's placement, its step a plain scalar. DCP writes a
replicated piece once (its save planner de-duplicates equal boxes across ranks), so a checkpoint holds
every element once, whatever the layout. The single-process model passes plain tensors under the
same names: it saves and loads the same format.

ZeRO (zero >= 1): a rank's optimizer state is a range of its group's flat, padded vector, which
cuts tensors at arbitrary elements: not a DTensor placement (those are even boxes along dims; this is
why torch's FSDP2 shards each parameter along dim 0 instead of a flat vector). Saving, each ZeRO
group all-gathers its flat state over its replicas (the bytes of one ZeRO-3 parameter gather per
state tensor) into per-parameter tensors, saved as above; loading, each rank cuts its range back out.

The model config (every `ModelConfig` field but `recompute`, an execution choice) and the step go in
labkit.json beside DCP's files; `load` compares it first and refuses another model before any tensor
is read.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import warnings
import weakref

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from labkit.compose.model import param_class, shard_dim
from labkit.mesh import Mesh
from labkit.parallel.flat import flatten
from labkit.parallel.sharding import all_gather_flat, local_shard

META = "labkit.json"
IGNORED_FIELDS = ("recompute",)  # how the step runs, not which model it trains
STATE_KEYS = ("exp_avg", "exp_avg_sq")
_DEVICE_MESHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# -------------------------------------------------------------------------- the bridge
def to_device_mesh(mesh: Mesh):
    """The lab's Mesh as torch's DeviceMesh: the same grid, the same axis names, the Mesh's own groups.

    ``DeviceMesh(device_type, grid)`` would create a new process group per axis (collective on every
    rank); `DeviceMesh.from_group` wraps the groups the Mesh built already. Cached per Mesh."""
    if mesh in _DEVICE_MESHES:
        return _DEVICE_MESHES[mesh]
    from torch.distributed.device_mesh import DeviceMesh
    device = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"  # DTensors live where the parameters do
    # The grid's axes only: a folded ep (ep_over beyond dp) is a slice of other axes, not a grid dim, and
    # no DTensor needs it (an expert is a plain tensor under its global name); HSDP's dp_replicate x
    # dp_shard is a split of dp, and every non-expert parameter is Replicate over all of dp.
    axes = mesh.grid_axes
    grid = mesh.grid.view(*[mesh.grid.shape[mesh.axes.index(a)] for a in axes])
    groups = [mesh.group(axis) for axis in axes]
    dm = DeviceMesh.from_group(groups, device, mesh=grid, mesh_dim_names=tuple(axes))
    _DEVICE_MESHES[mesh] = dm
    return dm


def stage_mesh(mesh: Mesh):
    """The DeviceMesh of this rank's pipeline stage: every axis but pp (a parameter lives on one stage)."""
    return to_device_mesh(mesh)[tuple(a for a in mesh.grid_axes if a != "pp")]


def placements(name: str, dm) -> list:
    """The DTensor placements of parameter `name` on a stage mesh (see the module docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    out = [Replicate() for _ in dm.mesh_dim_names]
    if param_class(name) == "tp_shard":
        out[dm.mesh_dim_names.index("tp")] = Shard(shard_dim(name))
    return out


def _labelled(name: str, local: torch.Tensor, dm):
    """`local` (this rank's piece, sharing its storage) as what DCP saves or loads into."""
    if dm is None or param_class(name) == "expert":
        return local
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(local, dm, placements(name, dm), run_check=False)


# -------------------------------------------------------------------------- the optimizers
def _holders(stage, optimizer) -> list:
    """[(params, torch optimizer, ZeRO optimizer or None)]: who holds the stage's AdamW state."""
    groups = getattr(optimizer, "groups", None)
    if groups is None:  # one process: a plain torch optimizer over the whole model
        return [(list(stage.parameters()), optimizer, None)]
    zero = getattr(optimizer, "zero", 0)
    return [(params, None, opt) if zero and axes else (params, opt, None) for axes, params, opt in groups]


def _zero_gathered(params, zopt, shapes) -> dict:
    """{param: {exp_avg, exp_avg_sq, step}} from a ZeRO group's flat ranges, all-gathered (collective)."""
    inner = zopt.optimizer.state.get(zopt.shards[0])
    if not inner:
        return {}
    numels = [shapes[p].numel() for p in params]
    out = {p: {"step": inner["step"]} for p in params}
    for key in STATE_KEYS:
        flat = all_gather_flat(inner[key].detach(), group=zopt.group)[:sum(numels)]
        for p, piece in zip(params, flat.split(numels)):
            out[p][key] = piece.view(shapes[p])
    return out


def _zero_scatter(params, zopt, loaded: dict) -> None:
    """Cut this rank's range out of the loaded per-parameter state (and the parameters, its master copy)."""
    shard, total = zopt.shards[0], zopt.shard_sizes[0] * zopt.world_size
    cut = lambda ts: local_shard(flatten(ts, total), zopt.rank, zopt.world_size).clone()  # noqa: E731
    with torch.no_grad():
        shard.copy_(cut([p.detach() for p in params]))
    if params[0] in loaded:
        state = {key: cut([loaded[p][key] for p in params]) for key in STATE_KEYS}
        zopt.optimizer.state[shard] = {"step": loaded[params[0]]["step"], **state}


# -------------------------------------------------------------------------- the state dict
def _state_dict(stage, optimizer, dm, shapes, *, load_from=None):
    """{key: tensor or DTensor} over this rank's pieces, and a function to call after a load.

    Saving: the live tensors. Loading (`load_from`: the checkpoint's keys and dtypes): tensors DCP
    loads into in place: the parameters, the plain optimizer's state (created if absent), fresh
    per-parameter tensors for a ZeRO group (cut into its flat range afterwards)."""
    sd, names, after = {}, {p: n for n, p in stage.named_parameters()}, []
    for params, opt, zopt in _holders(stage, optimizer):
        if zopt is None:
            state = {p: opt.state[p] for p in params if p in opt.state}
        elif load_from is None:
            state = _zero_gathered(params, zopt, shapes)
        else:
            state = {}
            after.append(lambda params=params, zopt=zopt, state=state: _zero_scatter(params, zopt, state))
        for p in params:
            name = names[p]
            sd[f"model.{name}"] = _labelled(name, p.detach(), dm)
            key = f"optim.{name}.step"
            if load_from is not None and key in load_from and p not in state:
                fresh = {k: torch.zeros(shapes[p], dtype=p.dtype, device=p.device) for k in STATE_KEYS}
                state[p] = {"step": torch.zeros((), dtype=load_from[key]), **fresh}
                if zopt is None:
                    opt.state[p] = state[p]
            if p in state:
                sd[key] = state[p]["step"]
                for k in STATE_KEYS:
                    sd[f"optim.{name}.{k}"] = _labelled(name, state[p][k], dm)
    return sd, lambda: [f() for f in after]


def _setting(stage, optimizer, mesh, config):
    """(stage DeviceMesh or None, parameter shapes, the config's fields), after the cheap checks."""
    own = getattr(stage, "config", None)
    if own is not None and own != config:
        raise ValueError(f"config={config} is not the model's own config {own}: pass model.config")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if mesh is None and world > 1:
        raise ValueError(f"mesh=None (one process) but {world} ranks are running: pass this rank's Mesh")
    dm = stage_mesh(mesh) if mesh is not None and dist.is_initialized() else None
    shapes = getattr(optimizer, "shapes", None) or {p: p.shape for p in stage.parameters()}
    return dm, shapes, _fields(config)


def _fields(config) -> dict:
    fields = {k: v for k, v in dataclasses.asdict(config).items() if k not in IGNORED_FIELDS}
    return json.loads(json.dumps(fields))  # as the file will give them back (tuples become lists)


@contextlib.contextmanager
def _one_process_quiet():
    """DCP warns that it assumes one process when no process group exists: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


# -------------------------------------------------------------------------- save and load
def save(path, stage, optimizer, *, mesh: Mesh | None, step: int, config) -> None:
    """Write the stage's parameters and AdamW state, this rank's pieces only (collective over the world).

    stage: a ComposedStage with its ComposedOptimizer (zero 0-3) and Mesh, or a labkit Transformer
    with a torch AdamW and mesh=None (one process)."""
    dm, shapes, fields = _setting(stage, optimizer, mesh, config)
    path = os.fspath(path)
    if _rank0():  # before DCP's collective save: every rank may read it once save returns
        os.makedirs(path, exist_ok=True)
        layout = dict(mesh.sizes) if mesh is not None else "one process"
        meta = {"format": "labkit.compose.dcp/1", "step": int(step), "config": fields, "saved_on": layout}
        with open(os.path.join(path, META), "w") as f:
            json.dump(meta, f, indent=1)
    zero3 = getattr(optimizer, "zero", 0) == 3
    if zero3:
        optimizer.begin_step()  # ZeRO-3 keeps only shards between steps: gather the parameters
    sd, _ = _state_dict(stage, optimizer, dm, shapes)
    with _one_process_quiet():
        dcp.save(sd, checkpoint_id=path, no_dist=not dist.is_initialized())
    if zero3:
        optimizer._free_parameters()


def read_meta(path) -> dict:
    """The labkit.json of a checkpoint; ValueError if `path` holds none."""
    file = os.path.join(os.fspath(path), META)
    if not os.path.exists(file):
        raise ValueError(f"{path}: no {META} there: not a checkpoint written by labkit.compose.dcp.save")
    with open(file) as f:
        return json.load(f)


def check_config(meta: dict, config) -> None:
    """ValueError naming every field where the checkpoint's model differs from `config`."""
    mine, theirs = _fields(config), meta["config"]
    diff = {k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k)}
    if diff:
        fields = ", ".join(f"{k}: checkpoint {theirs.get(k)!r}, this model {mine.get(k)!r}" for k in sorted(diff))
        raise ValueError(f"the checkpoint holds another model ({fields}): resume with the config it was saved "
                         "with, or start this model from scratch")


def load(path, stage, optimizer, *, mesh: Mesh | None, config) -> int:
    """Load a checkpoint of any layout into this layout's stage and optimizer, in place; returns its step.

    The config is compared first: another model is refused (ValueError) before any tensor is read."""
    dm, shapes, _ = _setting(stage, optimizer, mesh, config)
    meta = read_meta(path)
    check_config(meta, config)
    stored = dcp.FileSystemReader(os.fspath(path)).read_metadata().state_dict_metadata
    dtypes = {k: m.properties.dtype for k, m in stored.items() if hasattr(m, "properties")}
    zero3 = getattr(optimizer, "zero", 0) == 3
    if zero3:
        optimizer.begin_step()  # room for the parameters: the shards are cut from them after the load
    sd, after = _state_dict(stage, optimizer, dm, shapes, load_from=dtypes)
    missing = sorted(k for k in sd if k.startswith("model.") and k not in stored)
    if missing:
        raise ValueError(f"the checkpoint lacks {missing[:3]}: it was not saved from this model")
    with _one_process_quiet():
        dcp.load(sd, checkpoint_id=os.fspath(path), no_dist=not dist.is_initialized())
    after()
    if zero3:
        optimizer._free_parameters()
    return int(meta["step"])
