"""Names from before the core's renaming, for one release: each fails with an error that names its replacement.

Code written against an older lab (a learner's notebook, a script) then reads, instead of a bare
``AttributeError`` or ``ModuleNotFoundError``, what to write now:

    import labkit.train_loop        -> ModuleNotFoundError: labkit.train_loop moved: use labkit.training.loop ...
    labkit.train_loop               -> AttributeError, the same words
    sequence_parallel.allreduce_norm_grads -> AttributeError: ... renamed: use ParallelBlock.sync_gradients() ...
    ddp.finish()                    -> AttributeError: BucketedDataParallel.finish() was renamed: call ddp.sync_gradients()

`MOVED_MODULES` and `RENAMED` are the only lists (CONTRIBUTING.md's "Renamed names" table is checked
against them by tests/test_renames.py). A module of solutions/ (and so of exercises/) that lost a name
ends with ``__getattr__ = renamed_in(__name__)``; a class that lost a method holds
``old = renamed_method("Class.old")`` (``renamed_attribute`` for an attribute or property).
Delete them after one release.
"""
from __future__ import annotations

import importlib.abc
import sys

RELEASE_NOTE = "(renamed in the core's reorganisation; the old name goes in the next release)"

# old module -> new module (labkit grouped by job, and the applications moved to labkit/apps/)
MOVED_MODULES = {
    "labkit.launch": "labkit.launching.launcher (the function is labkit.launch: `from labkit import launch`)",
    "labkit.scheduled": "labkit.launching.cluster",
    "labkit.forked": "labkit.launching.forked",
    "labkit.failures": "labkit.launching.failures",
    "labkit.magic": "labkit.launching.magic",
    "labkit.notebook": "labkit.launching.notebook",
    "labkit.restart": "labkit.launching.restart",
    "labkit.collective_checks": "labkit.comm.checks",
    "labkit.bandwidth": "labkit.links.bandwidth",
    "labkit.netem": "labkit.links.netem",
    "labkit.shaper": "labkit.links.shaper",
    "labkit.moe": "labkit.model.moe",
    "labkit.train_tokenizer": "labkit.data.train_tokenizer",
    "labkit.train_loop": "labkit.training.loop",
    "labkit.checkpoint": "labkit.training.checkpoint",
    "labkit.timeline": "labkit.measure.timeline",
    "labkit.viz": "labkit.measure.viz",
    "labkit.metrics": "labkit.measure.metrics",
    "labkit.memory": "labkit.measure.memory",
    "labkit.activations": "labkit.measure.activations",
    "labkit.schedules": "labkit.parallel.schedules",
    "labkit.registry": "labkit.grading.registry",
    "labkit.cases": "labkit.grading.cases",
    "labkit.stubgen": "labkit.grading.stubgen",
    "labkit.diagnose": "labkit.grading.diagnose",
    "labkit.pytest_plugin": "labkit.grading.plugin",
    "labkit.readme": "labkit.apps.readme",
    "labkit.train": "labkit.apps.train (python -m labkit.apps.train)",
    "labkit.collective_figures": "labkit.apps.collective_figures",
}

# "topic.name" (a module of solutions/ and exercises/) -> what to write now
RENAMED = {
    "data_parallel.allreduce_gradients": "sync_gradients(model, *, group=None) (group= by keyword)",
    "data_parallel.BucketedDataParallel.finish": "BucketedDataParallel.sync_gradients()",
    "context_parallel.ContextParallel.allreduce_gradients": "ContextParallel.sync_gradients()",
    "expert_parallel.allreduce_ep_gradients": "sync_gradients(model, *, mesh) (mesh= by keyword)",
    "expert_parallel.count_collectives": "labkit.comm.traffic.count_traffic() (`with count_traffic() as traffic:`)",
    "expert_parallel.comm_bytes_per_rank": "labkit.comm.traffic.count_traffic() (its wire bytes per op and group)",
    "sequence_parallel.allreduce_norm_grads": "ParallelBlock.sync_gradients() (on each block; a no-op without "
                                              "sequence parallelism)",
    "sequence_parallel.count_collectives": "labkit.comm.traffic.count_traffic() (`with count_traffic() as traffic:`)",
    "tensor_parallel.count_traffic": "labkit.comm.traffic.count_traffic() (`with count_traffic() as traffic:`)",
    "slow_links.dp_allreduce_gradients": "sync_gradients(model, *, group=None) (group= by keyword)",
    "slow_links.PowerSGD.reduce": "PowerSGD.sync_gradients()",
    "zero.flatten_padded": "labkit.parallel.flat.flatten(tensors, total)",
    "fsdp.ZeRO3.finish": "ZeRO3.sync_gradients()",
    "hierarchical.NodeGroups": "node_mesh(node_size), a labkit.mesh.Mesh with node/local axes "
                               "(hierarchical_allreduce(tensor, *, mesh=...))",
    "hierarchical.node_groups": "node_mesh(node_size) (hierarchical_allreduce(tensor, *, mesh=...))",
    "ring_attention.Ring": "RingPlan(local_len, *, mesh=...) (the ring is the mesh's cp axis)",
    "hybrid.Mesh.is_first_stage": 'Mesh.is_first("pp") (hybrid.Mesh is labkit.mesh.Mesh now)',
    "hybrid.Mesh.is_last_stage": 'Mesh.is_last("pp") (hybrid.Mesh is labkit.mesh.Mesh now)',
    "hybrid.Mesh.dp_rank": 'Mesh.coord("dp") (hybrid.Mesh is labkit.mesh.Mesh now)',
    "hybrid.Mesh.pp_rank": 'Mesh.coord("pp") (hybrid.Mesh is labkit.mesh.Mesh now)',
    "hybrid.Mesh.dp": 'Mesh.size("dp") (hybrid.Mesh is labkit.mesh.Mesh now)',
    "hybrid.Mesh.pp": 'Mesh.size("pp") (hybrid.Mesh is labkit.mesh.Mesh now)',
    "hybrid.Mesh.dp_group": 'Mesh.group("dp") (hybrid.Mesh is labkit.mesh.Mesh now)',
    "hybrid.Mesh.pp_group": 'Mesh.group("pp") (hybrid.Mesh is labkit.mesh.Mesh now)',
    "hybrid.Mesh.dp_ranks": 'Mesh.ranks("dp") (hybrid.Mesh is labkit.mesh.Mesh now)',
    "hybrid.Mesh.pipeline_ranks": 'Mesh.ranks("pp") (hybrid.Mesh is labkit.mesh.Mesh now)',
    "from_scratch.setup": "setup_rank",
    "from_scratch.worker": "rank_worker",
    "from_scratch.run": "spawn_job",
}


def moved_message(old: str) -> str:
    return f"{old} moved: use {MOVED_MODULES[old]} {RELEASE_NOTE}"


def renamed_message(key: str) -> str:
    return f"{key} was renamed: use {RENAMED[key]} {RELEASE_NOTE}"


def renamed_in(module_name: str):
    """A module ``__getattr__`` for a module of solutions/ or exercises/: an old name raises AttributeError naming
    its replacement; any other missing name raises the usual AttributeError."""
    topic = module_name.rsplit(".", 1)[-1]

    def __getattr__(name: str):
        key = f"{topic}.{name}"
        if key in RENAMED:
            raise AttributeError(renamed_message(key))
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
    return __getattr__


class renamed_method:
    """A class attribute standing for a renamed method: reading it works (hasattr is True), calling it raises
    AttributeError naming the new method, e.g. ``finish = renamed_method("BucketedDataParallel.finish")``
    with RENAMED["data_parallel.BucketedDataParallel.finish"]."""

    def __init__(self, qualname: str):
        keys = [k for k in RENAMED if k.split(".", 1)[1] == qualname]
        if len(keys) != 1:
            raise ValueError(f"{qualname!r} is not in labkit.renames.RENAMED: add it there first")
        self.key = keys[0]

    def __get__(self, obj, cls=None):
        def call(*args, **kwargs):
            raise AttributeError(renamed_message(self.key))
        return call


class renamed_attribute(renamed_method):
    """A class attribute standing for a renamed attribute or property: reading it raises AttributeError naming
    the replacement (for classes without their own ``__getattr__``, such as `labkit.mesh.Mesh`)."""

    def __get__(self, obj, cls=None):
        raise AttributeError(renamed_message(self.key))


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Last on sys.meta_path: a module no other finder found that is an old name raises ModuleNotFoundError
    naming the new module."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED_MODULES:  # no name=: `from labkit import viz` would hide the message behind its own
            raise ModuleNotFoundError(moved_message(fullname))
        return None


def install() -> None:
    """Put the finder last on sys.meta_path (once)."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())


def package_getattr(name: str):
    """labkit's module ``__getattr__``: ``labkit.train_loop`` raises AttributeError naming the new module."""
    if f"labkit.{name}" in MOVED_MODULES:
        raise AttributeError(moved_message(f"labkit.{name}"))
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")
