"""Run a function on N ranks with a process group ready, and never hang silently.

    import labkit
    def hello(rank, world_size):
        return rank * 10
    labkit.launch(hello, 4)          # -> [0, 10, 20, 30]

How it works, in the order things happen:

1. The parent checks the arguments, picks the backend (gloo on CPU, nccl when every
   rank can have its own GPU) and a free TCP port for rank 0's rendezvous store.
2. It *forks* one child per rank. Forking (not spawning) is what lets a function
   defined in a notebook cell run in the children without pickling, and it costs
   milliseconds instead of the seconds a fresh interpreter needs to import torch.
3. Each child makes itself a process-group leader (so the parent can kill it and
   anything it started in one call), asks the kernel to kill it if the parent dies,
   sends its stdout/stderr through pipes that the parent prints with a ``[rank k]``
   prefix, initialises ``torch.distributed`` and calls ``fn(rank, world_size, ...)``.
   The return value (or the traceback) goes back to the parent through a pipe.
4. The parent waits for results, exits and the deadline. On the first failure it
   gives the other ranks a moment to report, then kills the rest and raises
   `LaunchError` with every failed rank's traceback, the earliest marked as the
   root cause. On the deadline it asks the stuck ranks for their Python stacks
   (faulthandler on SIGUSR1), kills everything and raises. Ctrl-C does the same.

Under torchrun, Slurm (srun) or mpiexec the processes already exist: `launch` then
runs ``fn`` in the current process as its rank and gathers every rank's result.

Ranks started by fork run torch with one intra-op thread: GNU OpenMP, which the CPU
build of torch uses, hangs in a forked child whose parent has already used its thread
pool. One thread per rank is also what torchrun sets (OMP_NUM_THREADS=1).
"""
from __future__ import annotations

import faulthandler
import io
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta

BACKENDS = ("auto", "gloo", "nccl")
_warned_sizes: set = set()
GRACE_AFTER_FAILURE = 1.5  # seconds the other ranks get to report their own failure
SCHEDULER_VARS = {  # rank variable, world-size variable, local-rank variable
    "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    "mpich/pbs": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    "slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
}


class LaunchError(RuntimeError):
    """A launch failed: a rank raised, crashed or hung. ``failures`` holds the details."""

    def __init__(self, message: str, failures: list | None = None):
        super().__init__(message)
        self.failures = failures or []


class StubNotImplemented(LaunchError, NotImplementedError):
    """The root cause was an exercise stub that is not implemented yet."""


class OversubscriptionWarning(RuntimeWarning):
    """More ranks than CPU cores: they will take turns, timings will suffer."""


@dataclass
class RankFailure:
    rank: int
    kind: str  # "exception", "crash" or "timeout"
    summary: str  # one line
    details: str  # traceback, exit status or stack
    when: float
    not_implemented: bool = False


# --------------------------------------------------------------------------- public API

def launch(fn, world_size, *args, backend="auto", timeout=120.0, **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; return the results in rank order.

    ``backend``: "auto" (nccl when CUDA has at least ``world_size`` GPUs, else gloo),
    "gloo" or "nccl". ``timeout``: seconds after which ranks still running are reported
    with their Python stacks, killed, and `LaunchError` is raised.
    Raises ValueError for bad arguments, `LaunchError` for any failure
    (`StubNotImplemented` when an exercise stub was the root cause).
    """
    _check_arguments(fn, world_size, backend, timeout)
    scheduler = _scheduler()
    if scheduler is not None:
        return _run_as_scheduled_rank(scheduler, fn, world_size, args, kwargs, backend)
    backend = _choose_backend(backend, world_size)
    cores = os.cpu_count() or 1
    if world_size > cores and world_size not in _warned_sizes:
        _warned_sizes.add(world_size)  # once per size: a notebook launches the same size many times
        warnings.warn(f"{world_size} ranks on {cores} CPU cores: the ranks take turns on the cores "
                      "(oversubscription), so they run, but slower than they would on their own cores.",
                      OversubscriptionWarning, stacklevel=2)
    _prewarm()
    return _Launcher(fn, world_size, args, kwargs, backend, float(timeout)).run()


_prewarmed = False


def _prewarm():
    """Import, once, in the parent what every rank would otherwise import for itself.

    The first torch.optim optimizer a process builds imports torch._dynamo (seconds on a
    laptop). Imported here, before the fork, the ranks inherit it for free.
    """
    global _prewarmed
    if not _prewarmed:
        import torch._dynamo  # noqa: F401

        _prewarmed = True


def rank_device():
    """The device this rank should use: its own GPU under nccl, else the CPU."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


# --------------------------------------------------------------------------- checks

def _check_arguments(fn, world_size, backend, timeout):
    if not callable(fn):
        raise ValueError(f"fn must be a function taking (rank, world_size, ...); got {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise ValueError(f"world_size must be an int >= 1; got {world_size!r} ({type(world_size).__name__})")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1; got {world_size}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use one of {BACKENDS}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds; got {timeout!r}")


def _cuda_device_count() -> int:
    # The NVML-based check counts GPUs without initialising CUDA in this process,
    # which would make every later fork unable to use CUDA.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _choose_backend(backend: str, world_size: int) -> str:
    gpus = _cuda_device_count()
    if backend == "auto":
        backend = "nccl" if gpus >= world_size else "gloo"
    if backend == "nccl":
        if gpus < world_size:
            raise LaunchError(
                f"backend='nccl' needs one GPU per rank: {world_size} ranks, {gpus} GPU(s) visible. "
                "nccl cannot put two ranks on one GPU. Use backend='gloo' (CPU), fewer ranks, "
                "or a node with more GPUs.")
        import torch

        if torch.cuda.is_initialized():
            raise LaunchError(
                "CUDA is already initialised in this process, and a forked rank cannot use it "
                "('Cannot re-initialize CUDA in forked subprocess'). Restart the kernel and launch "
                "before touching CUDA in the notebook itself (no .cuda() / torch.cuda calls before "
                "labkit.launch), or run the script under torchrun.")
    return backend


def _free_port() -> int:
    # A port no socket is bound to right now. (Serving the store from the parent instead
    # would remove the small window before rank 0 binds it, but a store thread in the
    # parent at fork time made ranks hang in init_process_group now and then.)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- the child

def _child_main(rank, world_size, fn, args, kwargs, backend, port, pg_timeout,
                result_w, out_w, err_w, stack_path, parent_pid):
    os.setsid()  # own process group: the parent kills it and its children in one call
    _die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before we could ask
        os._exit(1)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, errors="replace")
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, errors="replace")
    faulthandler.enable(file=sys.stderr)  # a crash's Python stack goes through the pipe too
    stack_file = open(stack_path, "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    ok = False
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # see the module docstring: libgomp and fork
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout))
        result = fn(rank, world_size, *args, **kwargs)
        try:
            payload = pickle.dumps(("ok", _to_cpu(result)))
        except Exception as error:
            raise TypeError(f"the return value of rank {rank} cannot be sent back to the launcher "
                            f"({error}); return plain data or CPU tensors") from None
        result_w.send_bytes(payload)
        ok = True
        # Leave together: a rank that exits while a peer is still connecting to it (gloo sets up
        # its connections pair by pair) makes that peer fail. A barrier would do, but it could
        # complete a collective that a learner's rank skipped; the store keys cannot. Rank 0
        # hosts the store, so it is also the last to leave.
        store = dist.distributed_c10d._get_default_store()
        store.set(f"labkit/done/{rank}", "1")
        store.wait([f"labkit/done/{r}" for r in range(world_size)])
        dist.destroy_process_group()
    except BaseException as error:  # noqa: BLE001 - everything goes back to the parent
        if not ok:
            tb = error.__traceback__
            while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
                tb = tb.tb_next  # the learner's frames only, not the launcher's
            details = "".join(traceback.format_exception(type(error), error, tb or error.__traceback__))
            failure = RankFailure(rank, "exception", _one_line(error), details,
                                  time.time(), isinstance(error, NotImplementedError))
            try:
                result_w.send_bytes(pickle.dumps(("error", failure)))
            except Exception:
                pass
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
    os._exit(0 if ok else 1)  # skip atexit handlers inherited from the parent (a Jupyter kernel's, say)


def _die_with_parent():
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except Exception:
            pass


def _to_cpu(value):
    """Move tensors to the CPU so that unpickling in the parent never initialises CUDA."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)):
        converted = [_to_cpu(v) for v in value]
        return type(value)(converted) if not hasattr(value, "_fields") else type(value)(*converted)
    if isinstance(value, dict):
        return type(value)((k, _to_cpu(v)) for k, v in value.items())
    return value


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


# --------------------------------------------------------------------------- the parent

class _Launcher:
    def __init__(self, fn, world_size, args, kwargs, backend, timeout):
        self.fn, self.world_size, self.args, self.kwargs = fn, world_size, args, kwargs
        self.backend, self.timeout = backend, timeout
        self.results: dict[int, object] = {}
        self.failures: list[RankFailure] = []
        self.procs: list[mp.Process] = []
        self.readers: list[threading.Thread] = []
        self.tail: dict[int, list[str]] = {r: [] for r in range(world_size)}

    def run(self) -> list:
        ctx = mp.get_context("fork")
        port = _free_port()
        pg_timeout = max(2 * self.timeout, self.timeout + 60)  # the launcher's deadline comes first
        with tempfile.TemporaryDirectory(prefix="labkit-launch-") as tmp:
            self.stack_paths = [os.path.join(tmp, f"stack-{r}.txt") for r in range(self.world_size)]
            result_readers = []
            try:
                _flush_std_streams()
                for rank in range(self.world_size):
                    result_r, result_w = ctx.Pipe(duplex=False)
                    out_r, out_w = os.pipe()
                    err_r, err_w = os.pipe()
                    proc = ctx.Process(
                        target=_child_main, name=f"labkit-rank-{rank}",
                        args=(rank, self.world_size, self.fn, self.args, self.kwargs, self.backend, port,
                              pg_timeout, result_w, out_w, err_w, self.stack_paths[rank], os.getpid()))
                    proc.start()
                    result_w.close()
                    os.close(out_w)
                    os.close(err_w)
                    self.procs.append(proc)
                    result_readers.append(result_r)
                    self._forward(out_r, rank, "stdout")
                    self._forward(err_r, rank, "stderr")
                self._wait(result_readers)
            except BaseException:
                self._kill_all()
                raise
            finally:
                self._kill_all()
                for reader in self.readers:
                    reader.join(timeout=2)
                for conn in result_readers:
                    conn.close()
        return [self.results[r] for r in range(self.world_size)]

    # -- waiting

    def _wait(self, conns):
        deadline = time.monotonic() + self.timeout
        stop_at = None
        pending = {conn: rank for rank, conn in enumerate(conns)}
        alive = {proc.sentinel: rank for rank, proc in enumerate(self.procs)}
        while pending or alive:
            now = time.monotonic()
            if stop_at is not None and now >= stop_at:
                break
            if now >= deadline:
                if not pending:  # every rank returned; one is slow to exit: the cleanup kills it
                    break
                self._timeout(list(pending.values()))
            wait_until = min(deadline, stop_at or deadline)
            ready = mp.connection.wait(list(pending) + list(alive), timeout=max(0.0, wait_until - now))
            for item in ready:
                if item in pending:
                    self._receive(item, pending.pop(item))
                elif item in alive:
                    rank = alive.pop(item)
                    proc = self.procs[rank]
                    proc.join(timeout=1)
                    conn = next((c for c, r in pending.items() if r == rank), None)
                    if conn is not None:  # read what it sent before dying, if anything
                        pending.pop(conn)
                        if conn.poll():
                            self._receive(conn, rank)
                    if rank not in self.results and rank not in {f.rank for f in self.failures}:
                        self.failures.append(RankFailure(
                            rank, "crash", f"exited with {_describe_exit(proc.exitcode)} without returning",
                            f"rank {rank} exited with {_describe_exit(proc.exitcode)} before returning a "
                            "result (os._exit, a segmentation fault, or killed by the system, e.g. out of "
                            "memory).", time.time()))
            if self.failures and stop_at is None:
                stop_at = time.monotonic() + GRACE_AFTER_FAILURE
        if self.failures:
            self._raise_failures(stopped=[r for r in range(self.world_size)
                                          if r not in self.results and r not in {f.rank for f in self.failures}])

    def _receive(self, conn, rank):
        try:
            status, value = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # it died before reporting: its exit is handled with its sentinel
        if status == "ok":
            self.results[rank] = value
        else:
            self.failures.append(value)

    def _timeout(self, running):
        stuck = sorted(running)
        stacks = self._stacks(stuck)
        finished = sorted(set(range(self.world_size)) - set(stuck))
        parts = [f"timed out after {self.timeout:g} s: rank(s) {_ranks(stuck)} of {self.world_size} "
                 f"were still running" + (f" (rank(s) {_ranks(finished)} had already returned)" if finished else "") + "."]
        for rank in stuck:
            parts.append(f"\n=== rank {rank}: still running; its Python stack ===\n{stacks[rank]}")
            if self.tail[rank]:
                parts.append(f"--- last output of rank {rank} ---\n" + "".join(self.tail[rank][-5:]))
        parts.append("\nA rank that skips a collective, a send without a matching recv, or two ranks that "
                     "both wait to receive first block forever. Compare the stacks above: which call is "
                     "each rank waiting in? Raise timeout= if the work is just slow.")
        failures = [RankFailure(r, "timeout", "still running at the deadline", stacks[r], time.time())
                    for r in stuck]
        self._kill_all()
        raise LaunchError("\n".join(parts), failures)

    def _stacks(self, ranks) -> dict[int, str]:
        for rank in ranks:
            try:
                os.kill(self.procs[rank].pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(0.5)
        stacks = {}
        for rank in ranks:
            try:
                with open(self.stack_paths[rank]) as f:
                    stacks[rank] = _trim_stack(f.read()) or "(no stack: the rank did not answer)"
            except OSError:
                stacks[rank] = "(no stack: the rank did not answer)"
        return stacks

    def _raise_failures(self, stopped):
        # The root cause is the earliest failure that is not just a peer noticing
        # that another rank died (gloo: "Connection reset by peer" and the like).
        failures = sorted(self.failures, key=lambda f: (_is_consequence(f), f.when))
        root = failures[0]
        if root.not_implemented:
            ranks = [f.rank for f in failures if f.not_implemented]
            message = f"{root.summary.split(': ', 1)[-1]}  (raised on rank(s) {_ranks(ranks)})"
            raise StubNotImplemented(message, failures)
        others = failures[1:]
        head = f"rank {root.rank} of {self.world_size} failed: {root.summary}"
        if others:
            head += f"; then rank(s) {_ranks([f.rank for f in others])} failed too"
        if stopped:
            head += f"; rank(s) {_ranks(stopped)} were stopped by the launcher"
        parts = [head + ".", f"\n=== rank {root.rank}: ROOT CAUSE ===\n{root.details.rstrip()}"]
        for failure in others:
            parts.append(f"\n=== rank {failure.rank}: failed after the root cause ===\n{failure.details.rstrip()}")
        raise LaunchError("\n".join(parts), failures)

    # -- output and cleanup

    def _forward(self, fd, rank, stream_name):
        def pump():
            with open(fd, "rb", buffering=0, closefd=True) as pipe:
                buffer = b""
                while True:
                    chunk = pipe.read(65536)
                    if not chunk:
                        break
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\n")
                    for line in lines:
                        self._emit(rank, stream_name, line.decode(errors="replace") + "\n")
                if buffer:
                    self._emit(rank, stream_name, buffer.decode(errors="replace") + "\n")

        thread = threading.Thread(target=pump, daemon=True, name=f"labkit-rank-{rank}-{stream_name}")
        thread.start()
        self.readers.append(thread)

    def _emit(self, rank, stream_name, text):
        self.tail[rank] = (self.tail[rank] + [text])[-20:]
        if self.failures:  # ranks dying after a failure print noise; their tracebacks are in the error
            return
        stream = sys.stdout if stream_name == "stdout" else sys.stderr
        try:
            stream.write(f"[rank {rank}] {text}")
            stream.flush()
        except Exception:
            pass

    def _kill_all(self):
        for proc in self.procs:
            if proc.pid is None:
                continue
            for kill in (os.killpg, os.kill):
                try:
                    kill(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for proc in self.procs:
            if proc.pid is not None:
                proc.join(timeout=5)


def _flush_std_streams():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


CONSEQUENCE_MARKERS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
                       "remote process exited", "Socket Timeout", "recvValue", "Connection refused")


def _is_consequence(failure: RankFailure) -> bool:
    return failure.kind == "exception" and any(m in failure.details for m in CONSEQUENCE_MARKERS)


def _describe_exit(code) -> str:
    if code is None:
        return "an unknown status"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


NOISE_FRAMES = ("labkit/launch.py", "multiprocessing/", "/IPython/", "/ipykernel/", "/tornado/",
                "/asyncio/", "/traitlets/", "/zmq/", "runpy.py", "/_pytest/", "/pluggy/", "/pytest/",
                "/jupyter_client/", "/jupyter_core/", "/nbclient/", "/labkit/magic.py")


def _trim_stack(text: str) -> str:
    # faulthandler lists every frame down to the process's start; the launcher's, the kernel's
    # and pytest's frames are noise to a learner looking for where their rank waits.
    lines = [line for line in text.splitlines() if not any(noise in line for noise in NOISE_FRAMES)]
    return "\n".join(lines).strip()


def _ranks(ranks) -> str:
    return ", ".join(str(r) for r in sorted(ranks))


# --------------------------------------------------------------------------- torchrun / Slurm / mpiexec

def _scheduler():
    forced = os.environ.get("LABKIT_LAUNCH", "").lower()
    if forced == "fork":
        return None
    for name, (rank_var, size_var, _) in SCHEDULER_VARS.items():
        if rank_var in os.environ and size_var in os.environ:
            if name == "slurm" and ("SLURM_STEP_ID" not in os.environ or int(os.environ[size_var]) < 2):
                continue  # a notebook inside an allocation, not one task of an srun step
            return name
    return None


def _run_as_scheduled_rank(scheduler, fn, world_size, args, kwargs, backend):
    import torch
    import torch.distributed as dist

    rank_var, size_var, local_var = SCHEDULER_VARS[scheduler]
    rank, size = int(os.environ[rank_var]), int(os.environ[size_var])
    local_rank = int(os.environ.get(local_var, os.environ.get("LOCAL_RANK", "0")))
    if size != world_size:
        raise LaunchError(f"launch(fn, {world_size}) asks for {world_size} ranks, but {scheduler} started "
                          f"{size} processes: start {world_size} (e.g. torchrun --nproc-per-node {world_size}) "
                          f"or call launch(fn, {size}).")
    if not dist.is_initialized():
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(local_rank))
        os.environ.setdefault("MASTER_ADDR", _first_host())
        os.environ.setdefault("MASTER_PORT", "29500")
        gpus = _cuda_device_count()
        if backend == "auto":
            backend = "nccl" if gpus > local_rank else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend, rank=rank, world_size=size)
        import atexit

        atexit.register(_leave_together, rank, size)
    result = fn(rank, size, *args, **kwargs)
    gathered = [None] * size
    dist.all_gather_object(gathered, _to_cpu(result))
    return gathered


def _leave_together(rank: int, size: int):
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


def _first_host() -> str:
    nodes = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodes:
        return "127.0.0.1"
    try:
        import subprocess

        return subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True,
                              text=True, timeout=10, check=True).stdout.split()[0]
    except Exception:  # no scontrol: "node[01-04],gpu7" -> "node01"
        head = nodes.split(",")[0]
        return head.split("[")[0] + head.split("[")[1].split("-")[0].split(",")[0] if "[" in head else head
