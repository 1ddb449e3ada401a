"""One forked rank's life, from the fork in the zygote to its exit.

In order:
1. It makes itself a process-group leader (so the caller can kill it and anything it started in
   one call), asks the kernel to kill it if the zygote dies, and sends its stdout and stderr
   through the pipes the caller made (the caller prints them with a ``[rank k]`` prefix).
2. It takes the caller's environment, ``sys.path`` and working directory *as they are at this
   launch* (an exported variable, ``LABKIT_IMPL`` say, is seen), the caller's notebook cells'
   lines (for tracebacks), then unpacks the function and its arguments
   (`labkit.launching.shipping`): functions from modules are imported here, from the files on disk.
3. It initialises ``torch.distributed`` (gloo; under nccl, gloo for CPU tensors beside nccl for
   CUDA ones, on its own GPU), tells the caller it has started, calls ``fn``, and sends back the
   return value or the traceback of the learner's own frames.

Ranks run torch with one intra-op thread, as torchrun sets (OMP_NUM_THREADS=1): many ranks share
a laptop's cores.
"""
from __future__ import annotations

import faulthandler
import io
import os
import pickle
import signal
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection

from labkit.launching import shipping
from labkit.launching.failures import RankFailure, explain, one_line

NCCL_WITH_CPU = "cpu:gloo,cuda:nccl"  # CPU tensors (grading cases, counters) work beside nccl


def to_cpu(value):
    """Move tensors to the CPU so that unpickling in the caller never initialises CUDA."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)):
        converted = [to_cpu(v) for v in value]
        return type(value)(converted) if not hasattr(value, "_fields") else type(value)(*converted)
    if isinstance(value, dict):
        return type(value)((k, to_cpu(v)) for k, v in value.items())
    return value


def flush_std_streams() -> None:
    """Flush this process's stdout and stderr (before a fork, and before a process exits)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def init_process_group(backend: str, rank: int, world_size: int, local_rank: int, timeout: float,
                       store_path: str | None = None) -> None:
    """The one way a rank joins: gloo, or under nccl gloo for CPU tensors and nccl on its own GPU.
    The ranks meet in a FileStore at ``store_path`` (all on one machine: `labkit.launching.forked.store_path`
    says why), else by env:// (MASTER_ADDR, MASTER_PORT: a cluster launcher's, a session's TCPStore)."""
    import torch
    import torch.distributed as dist

    store = None
    if store_path is not None:
        store = dist.FileStore(store_path, world_size)
        store.set_timeout(timedelta(seconds=timeout))
    kwargs = dict(rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout), store=store)
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group(NCCL_WITH_CPU, device_id=device, **kwargs)
    else:
        dist.init_process_group(backend, **kwargs)


def rank_main(rank: int, request: dict, result_fd: int, out_fd: int, err_fd: int) -> None:
    os.setsid()  # own process group: the caller kills it and its children in one call
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.close(out_fd)
    os.close(err_fd)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, errors="replace")
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, errors="replace")
    faulthandler.enable(file=sys.stderr)  # a crash's Python stack goes through the pipe too
    stack_file = open(request["stack_paths"][rank], "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    result = Connection(result_fd, readable=False)
    world_size = request["world_size"]
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    sys.path[:] = request["path"]
    try:
        os.chdir(request["cwd"])
    except OSError:
        pass
    ok = False
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        fn, args, kwargs = shipping.unpack(request["payload"], request["sources"])
        init_process_group(request["backend"], rank, world_size, rank, request["pg_timeout"], request["store_path"])
        result.send_bytes(pickle.dumps(("started", None)))
        value = fn(rank, world_size, *args, **kwargs)
        try:
            payload = pickle.dumps(("ok", to_cpu(value)))
        except Exception as error:
            raise TypeError(f"the return value of rank {rank} cannot be sent back to the launcher "
                            f"({error}); return plain data or CPU tensors") from None
        result.send_bytes(payload)
        ok = True
        leave_together(rank, world_size)
        dist.destroy_process_group()
    except BaseException as error:  # noqa: BLE001 - everything goes back to the caller
        if not ok:
            tb = error.__traceback__
            while tb is not None and tb.tb_frame.f_code.co_filename in _OWN_FILES:
                tb = tb.tb_next  # the learner's frames only, not the launcher's
            details = "".join(traceback.format_exception(type(error), error, tb or error.__traceback__))
            details += explain(error)
            failure = RankFailure(rank, "exception", one_line(error), details,
                                  time.time(), isinstance(error, NotImplementedError))
            try:
                result.send_bytes(pickle.dumps(("error", failure)))
            except Exception:
                pass
    finally:
        flush_std_streams()
    os._exit(0 if ok else 1)  # skip atexit handlers inherited from the zygote


def leave_together(rank: int, world_size: int) -> None:
    """Wait until every rank has returned before tearing down.

    A rank that exits while a peer is still connecting to it (gloo sets up its connections pair by
    pair) makes that peer fail. A barrier would do, but it could complete a collective that a
    learner's rank skipped; the store keys cannot. Rank 0 hosts the store, so it is also the last
    to leave.
    """
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    store.set(f"labkit/done/{rank}", "1")
    store.wait([f"labkit/done/{r}" for r in range(world_size)])


def _die_with_parent():
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except Exception:
            pass


_OWN_FILES = {__file__, shipping.__file__}
