"""Under torchrun, Slurm (srun) or mpiexec: the processes already exist, one per rank.

`labkit.launch` then runs ``fn`` in the current process as its rank and gathers every rank's
result, so a script that calls ``labkit.launch(fn, 8)`` runs unchanged under
``torchrun --nproc-per-node 8``, ``srun -n 8`` or ``mpiexec -n 8``.

``timeout`` means what it means for forked ranks: the process group's own timeout, and a
watchdog that, if ``fn`` is still running after ``timeout`` seconds, prints every thread's
Python stack to stderr and ends the process (exit code 1); the scheduler then stops the others.
"""
from __future__ import annotations

import faulthandler
import os
import subprocess
import sys
from datetime import timedelta

from labkit.launching.failures import LaunchError

# rank variable, world-size variable, local-rank variables, local-world-size variables.
# The local ones are tried in order, then torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE, then 0 / None.
# MPICH-family launchers disagree on the local rank: MPICH's Hydra and Intel MPI set
# MPI_LOCALRANKID, Cray PALS (Polaris, Aurora) sets PALS_LOCAL_RANKID, Cray PMI sets
# PMI_LOCAL_RANK. Reading only one of them would put every rank of a PALS node on cuda:0.
SCHEDULER_VARS = {
    "torchrun": ("RANK", "WORLD_SIZE", ("LOCAL_RANK",), ("LOCAL_WORLD_SIZE",)),
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", ("OMPI_COMM_WORLD_LOCAL_RANK",),
                ("OMPI_COMM_WORLD_LOCAL_SIZE",)),
    "mpich/pbs": ("PMI_RANK", "PMI_SIZE", ("MPI_LOCALRANKID", "PALS_LOCAL_RANKID", "PMI_LOCAL_RANK"),
                  ("MPI_LOCALNRANKS", "PALS_LOCAL_SIZE", "PMI_LOCAL_SIZE")),
    "slurm": ("SLURM_PROCID", "SLURM_NTASKS", ("SLURM_LOCALID",), ("SLURM_NTASKS_PER_NODE",)),
}


def first_set(names) -> str | None:
    """The value of the first of ``names`` set in the environment, else None."""
    return next((os.environ[n] for n in names if n in os.environ), None)


def scheduler_name() -> str | None:
    """Which launcher started this process ("torchrun", "openmpi", "mpich/pbs", "slurm"), or None.

    ``LABKIT_LAUNCH=fork`` forces None (fork the ranks even inside an allocation).
    """
    if os.environ.get("LABKIT_LAUNCH", "").lower() == "fork":
        return None
    for name, (rank_var, size_var, _, _) in SCHEDULER_VARS.items():
        if rank_var in os.environ and size_var in os.environ:
            if name == "slurm" and ("SLURM_STEP_ID" not in os.environ or int(os.environ[size_var]) < 2):
                continue  # a notebook inside an allocation, not one task of an srun step
            return name
    return None


def scheduled_world() -> dict | None:
    """This process's place as set by its launcher, or None when no launcher started it.

    Returns {"scheduler", "rank", "world_size", "local_rank", "local_world_size"}; the local
    world size is None when the launcher does not say it.
    """
    name = scheduler_name()
    if name is None:
        return None
    rank_var, size_var, local_vars, local_size_vars = SCHEDULER_VARS[name]
    local_size = first_set(local_size_vars + ("LOCAL_WORLD_SIZE",))
    try:
        local_size = int(local_size.split("(")[0].split(",")[0]) if local_size else None  # Slurm: "2(x3)"
    except ValueError:
        local_size = None
    return {"scheduler": name, "rank": int(os.environ[rank_var]), "world_size": int(os.environ[size_var]),
            "local_rank": int(first_set(local_vars + ("LOCAL_RANK",)) or 0),
            "local_world_size": local_size}


def run_as_scheduled_rank(world, fn, world_size, args, kwargs, backend, timeout, choose_backend):
    import torch.distributed as dist

    from labkit.launching.rank_main import init_process_group, to_cpu

    rank, size, local_rank = world["rank"], world["world_size"], world["local_rank"]
    if size != world_size:
        raise LaunchError(f"launch(fn, {world_size}) asks for {world_size} ranks, but {world['scheduler']} "
                          f"started {size} processes: start {world_size} (e.g. torchrun --nproc-per-node "
                          f"{world_size}) or call launch(fn, {size}).")
    if not dist.is_initialized():
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(local_rank))
        os.environ.setdefault("MASTER_ADDR", first_host())
        os.environ.setdefault("MASTER_PORT", "29500")
        backend = choose_backend(backend, world["local_world_size"] or local_rank + 1)
        init_process_group(backend, rank, size, local_rank, timeout)  # under nccl, gloo for CPU tensors too
        import atexit

        atexit.register(leave_together, rank, size)
    # The watchdog: every thread's stack to stderr, then exit, if fn outlives its timeout.
    faulthandler.dump_traceback_later(timeout, exit=True, file=sys.stderr)
    try:
        result = fn(rank, size, *args, **kwargs)
    except BaseException:
        # A failed rank leaves at once: waiting at exit for peers that may be dead (or waiting
        # for it) would only hold the job up until the store's own timeout.
        import atexit

        atexit.unregister(leave_together)
        raise
    finally:
        faulthandler.cancel_dump_traceback_later()
    gathered = [None] * size
    dist.all_gather_object(gathered, to_cpu(result))
    return gathered


def leave_together(rank: int, size: int):
    """At exit: wait until every rank is done, then tear the group down.

    A process that exits while its peers still hold connections to it can make them abort
    (gloo tears pairs down in C++ destructors). Store keys, not a barrier, for the same
    reason as in the forked ranks.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"labkit/exit/{rank}", "1")
        store.wait([f"labkit/exit/{r}" for r in range(size)], timedelta(seconds=60))
        dist.destroy_process_group()
    except Exception:
        pass


def first_host() -> str:
    """The first node of a Slurm job (its rendezvous host), else 127.0.0.1."""
    nodes = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodes:
        return "127.0.0.1"
    try:
        return subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True,
                              text=True, timeout=10, check=True).stdout.split()[0]
    except Exception:  # no scontrol: "node[01-04],gpu7" -> "node01"
        head = nodes.split(",")[0]
        return head.split("[")[0] + head.split("[")[1].split("-")[0].split(",")[0] if "[" in head else head
