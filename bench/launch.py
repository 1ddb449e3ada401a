"""Wall time of a no-op 4-rank launch: labkit.launch against torch.multiprocessing.spawn.

    python bench/launch.py [--quick]

Both start 4 processes, initialise a gloo process group in each, run a no-op and
tear down. Repeated alternately in one run (the machine is noisy); the figure to
read is the ratio of medians, labkit / spawn (aim: <= 0.05: ranks fork from the warm zygote, where
spawn starts an interpreter and imports torch per rank).
Last line: one JSON object.
"""
import argparse
import json
import os
import socket
import statistics
import sys
import time
import warnings

import torch.distributed as dist
import torch.multiprocessing as tmp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import labkit  # noqa: E402
from labkit.launching.launcher import OversubscriptionWarning  # noqa: E402


def noop(rank, world_size):
    return None


def spawn_worker(rank, world_size, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    noop(rank, world_size)
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_labkit(world_size):
    start = time.perf_counter()
    labkit.launch(noop, world_size, timeout=120)
    return time.perf_counter() - start


def time_spawn(world_size):
    start = time.perf_counter()
    tmp.spawn(spawn_worker, args=(world_size, free_port()), nprocs=world_size, join=True)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--world-size", type=int, default=4)
    options = parser.parse_args()
    warnings.simplefilter("ignore", OversubscriptionWarning)
    repeats = 3 if options.quick else 10
    labkit_times, spawn_times = [], []
    time_labkit(options.world_size)  # warm-up: first imports, page cache
    for _ in range(repeats):
        labkit_times.append(time_labkit(options.world_size))
        spawn_times.append(time_spawn(options.world_size))
    lk, sp = statistics.median(labkit_times), statistics.median(spawn_times)
    print(f"no-op launch of {options.world_size} ranks, median of {repeats} (seconds)")
    print(f"{'launcher':<28}{'median s':>10}{'min s':>10}")
    print(f"{'labkit.launch (zygote)':<28}{lk:>10.3f}{min(labkit_times):>10.3f}")
    print(f"{'torch.multiprocessing.spawn':<28}{sp:>10.3f}{min(spawn_times):>10.3f}")
    print(f"ratio labkit/spawn: {lk / sp:.3f}")
    print(json.dumps({"bench": "launch", "world_size": options.world_size, "repeats": repeats,
                      "labkit_s": round(lk, 4), "spawn_s": round(sp, 4), "ratio": round(lk / sp, 4)}))


if __name__ == "__main__":
    main()
