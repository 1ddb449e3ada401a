"""A distributed job from scratch, without labkit (notebook 00_setup).

The boilerplate every PyTorch distributed script has, in three short functions:

    spawn_job(world_size)     the launcher: torch.multiprocessing.spawn starts world_size
                              processes, each calls rank_worker(local_rank, ...)
    rank_worker(local_rank)   one process: setup_rank(), the work (one all-reduce),
                              destroy_process_group()
    setup_rank(rank, ...)     join the job: torch.cuda.set_device(local_rank) on GPUs, then
                              dist.init_process_group; returns this process's device

The file is also a script, so you can run it as such:

    python exercises/from_scratch.py --world-size 4                  # spawns 4 processes
    torchrun --nproc-per-node 4 exercises/from_scratch.py            # torchrun starts them instead

Its last line is one JSON object: {"world_size": N, "backend": ..., "sums": [every rank's sum]}
(under torchrun, rank 0 prints it with its own sum only: the processes share nothing else).
The rendezvous is `env://`: MASTER_ADDR and MASTER_PORT come from the environment (spawn_job() sets
them; torchrun sets them itself, with RANK, LOCAL_RANK and WORLD_SIZE).
"""
import argparse
import json
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

NOTEBOOK = "00_setup"


def choose_backend(nprocs_per_node: int) -> str:
    """nccl when every process of this node can have its own GPU, gloo otherwise (CPU).

    Every rank must pick the same backend, so the choice depends only on the node's GPU count.
    """
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= nprocs_per_node else "gloo"


def free_port() -> int:
    """A TCP port no socket is bound to right now (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_rank(rank: int, world_size: int, local_rank: int, backend: str) -> torch.device:
    """Join the job as `rank` of `world_size` and return this process's device.

    backend "nccl": first torch.cuda.set_device(local_rank) (each process drives the GPU of
    its local rank; without it every process would use GPU 0), device cuda:local_rank.
    backend "gloo": device cpu. Then dist.init_process_group(backend, rank=rank,
    world_size=world_size), which reads MASTER_ADDR and MASTER_PORT from the environment
    (the default init_method, "env://") and waits until all world_size processes have joined.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' (CPU) or 'nccl' (one GPU per process), got {backend!r}")
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise ValueError(f"{' and '.join(missing)} not set: the launcher (spawn_job() or torchrun) sets them; "
                         "by hand: os.environ['MASTER_ADDR'] = '127.0.0.1', os.environ['MASTER_PORT'] = '29500'")
    ### BEGIN SOLUTION
    if backend == "nccl":
        torch.cuda.set_device(local_rank)  # before init: NCCL binds this process to its GPU
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    return device
    ### END SOLUTION


def rank_worker(local_rank: int, world_size: int, backend: str, results=None) -> float:
    """One process of the job (torch.multiprocessing.spawn calls it with local_rank first).

    rank = $RANK when set (torchrun, several nodes), else local_rank (spawn on one node).
    Joins with setup_rank(), all-reduces (SUM) the tensor [rank + 1.0] on its device, puts
    (rank, sum) on `results` (a queue, when given) and returns the sum; the process group is
    destroyed (dist.destroy_process_group) before returning, even when the work raised.
    """
    rank = int(os.environ.get("RANK", local_rank))
    ### BEGIN SOLUTION
    device = setup_rank(rank, world_size, local_rank, backend)
    try:
        t = torch.tensor([rank + 1.0], device=device)
        dist.all_reduce(t)
        total = t.item()
        if results is not None:
            results.put((rank, total))
        return total
    finally:
        dist.destroy_process_group()
    ### END SOLUTION


def spawn_job(world_size: int, backend: str | None = None) -> list[float]:
    """Start `world_size` processes on this machine with torch.multiprocessing.spawn.

    Sets MASTER_ADDR=127.0.0.1 and MASTER_PORT (a free port) in the environment (the
    children inherit it), picks the backend with choose_backend(world_size) unless given,
    spawns rank_worker(local_rank, world_size, backend, queue) and waits for all of them
    (mp.spawn raises if one fails). Returns every rank's sum, in rank order.
    world_size < 1: ValueError.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ### BEGIN SOLUTION
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    backend = backend or choose_backend(world_size)
    results = mp.get_context("spawn").SimpleQueue()  # spawned children cannot share forked objects
    mp.spawn(rank_worker, args=(world_size, backend, results), nprocs=world_size, join=True)
    return [total for _, total in sorted(results.get() for _ in range(world_size))]
    ### END SOLUTION


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="processes to spawn (ignored under torchrun)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one thread per process, as torchrun does
    try:
        if "LOCAL_RANK" in os.environ:  # torchrun started this process: it is one rank
            world_size = int(os.environ["WORLD_SIZE"])
            backend = args.backend or choose_backend(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
            total = rank_worker(int(os.environ["LOCAL_RANK"]), world_size, backend)
            if int(os.environ["RANK"]) == 0:
                print(json.dumps({"world_size": world_size, "backend": backend, "sums": [total]}))
        else:
            backend = args.backend or choose_backend(args.world_size)
            sums = spawn_job(args.world_size, backend)
            print(json.dumps({"world_size": args.world_size, "backend": backend, "sums": sums}))
    except (NotImplementedError, mp.ProcessRaisedException) as error:
        stub = [line for line in str(error).splitlines() if "is not implemented yet" in line]
        if not stub:
            raise
        raise SystemExit(stub[0].split("NotImplementedError: ")[-1])  # an unwritten stub: one line


RENAMED = {"setup": "setup_rank", "worker": "rank_worker", "run": "spawn_job"}  # old names (labkit/renames.py lists them)


def __getattr__(name: str):
    """For one release, an old name fails naming its replacement (this file imports nothing of labkit)."""
    if name in RENAMED:
        raise AttributeError(f"from_scratch.{name} was renamed: use {RENAMED[name]} "
                             "(renamed in the core's reorganisation; the old name goes in the next release)")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    main()
