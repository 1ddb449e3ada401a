"""Grading tests for notebook 00_setup: the from-scratch boilerplate (setup_rank, rank_worker,
spawn_job).

Run: pytest tests/grading/test_from_scratch.py   (add --impl=solutions for the reference)

No labkit.launch here: the point of the exercise is to do without it. The multi-process tests
fork their own processes (or run the file as a script, which spawns), each with a timeout,
and kill what is left. The script test starts fresh Python processes that import torch:
about 12 s on 2 cores, the slowest of this file.
"""
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from labkit.grading import REPO_ROOT, impl

TIMEOUT = 60


def free_port():
    return impl("from_scratch").free_port()


def in_forked_ranks(body, world_size, timeout=TIMEOUT):
    """Run body(rank, world_size) in world_size forked processes with MASTER_ADDR/PORT set.

    Returns every rank's value; raises NotImplementedError if a rank met an unwritten stub,
    fails the test with the rank's traceback if one raised, and kills ranks still running
    after `timeout` seconds.
    """
    ctx = multiprocessing.get_context("fork")
    queue = ctx.SimpleQueue()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}

    def child(rank):
        os.environ.update(env)
        torch.set_num_threads(1)
        try:
            queue.put((rank, "ok", body(rank, world_size)))
        except NotImplementedError as e:
            queue.put((rank, "not implemented", str(e)))
        except BaseException:
            queue.put((rank, "failed", traceback.format_exc()))

    procs = [ctx.Process(target=child, args=(r,), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results = {}
    try:
        _wait_or_idle([p.pid for p in procs], lambda: not any(p.is_alive() for p in procs), timeout)
        while not queue.empty():
            rank, status, value = queue.get()
            results[rank] = (status, value)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    for status, value in results.values():
        if status == "not implemented":
            raise NotImplementedError(value)
    failed = [f"rank {r}: {v}" for r, (s, v) in sorted(results.items()) if s != "ok"]
    if failed:
        pytest.fail("\n".join(failed), pytrace=False)
    missing = sorted(set(range(world_size)) - set(results))
    if missing:
        pytest.fail(f"ranks {missing} did not finish: they all waited without using the CPU for {IDLE} s, or ran "
                    f"past {timeout} s (a hang: did every rank join init_process_group with the same "
                    "MASTER_ADDR/MASTER_PORT and world_size?)", pytrace=False)
    return [results[r][1] for r in range(world_size)]


IDLE = 3.0  # seconds every process may sleep without CPU before it is a hang (labkit.launching.progress)


def _wait_or_idle(pids, done, timeout):
    """Wait until done(), `timeout` seconds, or every process of `pids` (and children) asleep for IDLE s."""
    import psutil

    from labkit.launching.progress import IdleWatch

    watch, end = IdleWatch(IDLE), time.monotonic() + timeout
    while not done() and time.monotonic() < end:
        alive = []
        for pid in pids:
            try:
                alive += [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
            except psutil.Error:
                pass
        if alive and watch.all_asleep(alive):
            return
        time.sleep(0.25)


@pytest.mark.exercise("setup_rank")
@pytest.mark.parametrize("world_size", [1, 2])
def test_setup_rank_joins_a_gloo_group(world_size):
    def body(rank, n):
        device = impl("from_scratch").setup_rank(rank, n, rank, "gloo")
        assert device == torch.device("cpu"), f"gloo ranks compute on the CPU, got {device}"
        assert dist.is_initialized(), "setup_rank must call dist.init_process_group"
        got = (dist.get_rank(), dist.get_world_size(), dist.get_backend())
        t = torch.tensor([rank + 1])
        dist.all_reduce(t)
        dist.destroy_process_group()
        return got + (t.item(),)
    results = in_forked_ranks(body, world_size)
    assert results == [(r, world_size, "gloo", world_size * (world_size + 1) // 2) for r in range(world_size)]


@pytest.mark.exercise("setup_rank")
def test_setup_rank_nccl_sets_the_gpu_of_the_local_rank_before_init(monkeypatch):
    """No GPU needed: set_device and init_process_group are replaced by recorders."""
    module = impl("from_scratch")
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend=None, *a, **kw: calls.append(("init", backend, kw.get("rank"), kw.get("world_size"))))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    device = module.setup_rank(5, 8, 1, "nccl")  # rank 5 of 8 = local rank 1 on the second node of 4 GPUs
    assert device == torch.device("cuda", 1), f"rank with local_rank 1 drives cuda:1, got {device}"
    assert calls == [("set_device", 1), ("init", "nccl", 5, 8)], (
        f"expected torch.cuda.set_device(1) then dist.init_process_group('nccl', rank=5, world_size=8); got {calls}")


@pytest.mark.exercise("rank_worker")
def test_rank_worker_all_reduces_and_destroys_the_process_group():
    def body(rank, n):
        queue = []

        class Recorder:  # a queue's put(), in this process
            put = queue.append
        total = impl("from_scratch").rank_worker(rank, n, "gloo", Recorder())
        assert not dist.is_initialized(), "rank_worker must call dist.destroy_process_group() before returning"
        return total, queue
    results = in_forked_ranks(body, 3)
    assert results == [(6.0, [(r, 6.0)]) for r in range(3)], results


@pytest.mark.exercise("rank_worker")
def test_rank_worker_destroys_the_process_group_when_the_work_raises(monkeypatch):
    def body(rank, n):
        def broken(*args, **kwargs):
            raise RuntimeError("the work failed")
        dist.all_reduce = broken  # this forked process only
        try:
            impl("from_scratch").rank_worker(rank, n, "gloo")
        except RuntimeError as e:
            if "the work failed" not in str(e):
                raise
        return dist.is_initialized()
    assert in_forked_ranks(body, 2) == [False, False], "destroy_process_group must run even when the work raises (try/finally)"


@pytest.mark.exercise("spawn_job", needs=("setup_rank", "rank_worker"))
def test_spawn_job_runs_the_script_world_size_2(world_size=2):
    """The file as a script: `python <file> --world-size N --backend gloo`, its last line JSON."""
    path = impl("from_scratch").__file__
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, path, "--world-size", str(world_size), "--backend", "gloo"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=REPO_ROOT, start_new_session=True)
    try:
        _wait_or_idle([proc.pid], lambda: proc.poll() is not None, TIMEOUT)
        out, err = proc.communicate(timeout=0.1 if proc.poll() is None else None)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script and the processes it spawned
        proc.communicate()
        pytest.fail(f"the script did not finish: its processes all waited without using the CPU for {IDLE} s, "
                    f"or it ran past {TIMEOUT} s (are the spawned ranks joined, and do they all rendezvous?)",
                    pytrace=False)
    if "is not implemented yet" in out + err:
        raise NotImplementedError((out + err).strip().splitlines()[-1])
    assert proc.returncode == 0, f"exit code {proc.returncode}:\n{err[-3000:]}"
    report = json.loads(out.strip().splitlines()[-1])
    total = world_size * (world_size + 1) / 2
    assert report == {"world_size": world_size, "backend": "gloo", "sums": [total] * world_size}, report


@pytest.mark.exercise("rank_worker")
def test_rank_worker_on_a_second_node_joins_as_RANK_not_as_its_local_rank():
    """4 ranks as 2 nodes of 2: RANK=0..3, local ranks 0, 1, 0, 1 (as torchrun sets them)."""
    def body(rank, n):
        os.environ["RANK"] = str(rank)
        got = []

        class Queue:
            @staticmethod
            def put(item):
                got.append(item)
        total = impl("from_scratch").rank_worker(rank % 2, n, "gloo", Queue())
        return total, got, os.environ["RANK"]
    said = None
    try:
        results = in_forked_ranks(body, 4, timeout=30)
    except pytest.fail.Exception as error:
        said = str(error).strip().splitlines()
    if said is not None:  # outside the except: the ranks' long tracebacks are not chained above it
        pytest.fail("4 ranks on 2 simulated nodes (RANK 0..3, LOCAL_RANK 0, 1, 0, 1) failed or hung: did two "
                    "processes join with the same rank? rank_worker must pass rank (read from $RANK) to setup_rank "
                    "as the rank, and local_rank only to pick the device.\nThe ranks said (last lines):\n"
                    + "\n".join(said[-6:]), pytrace=False)
    for rank, (total, queued, _) in enumerate(results):
        assert queued == [(rank, 10.0)] and total == 10.0, (
            f"rank {rank} (local rank {rank % 2}) put {queued} and returned {total}: expected [({rank}, 10.0)] "
            "(ranks 0..3 add 1+2+3+4; the queue gets the GLOBAL rank, from $RANK)")


def _spawn_with_failing_ranks(queue):
    try:
        impl("from_scratch").spawn_job(1, backend="no-such-backend")  # the rank's setup_rank raises ValueError
        queue.put(("returned", ""))
    except NotImplementedError as error:
        queue.put(("not implemented", str(error)))
    except BaseException as error:  # mp.spawn's ProcessRaisedException, or a ValueError raised up front
        queue.put(("raised", f"{type(error).__name__}: {error}"))


@pytest.mark.exercise("spawn_job")
def test_spawn_job_raises_when_its_ranks_fail_instead_of_hanging_or_returning():
    ctx = multiprocessing.get_context("fork")
    queue = ctx.SimpleQueue()
    proc = ctx.Process(target=_spawn_with_failing_ranks, args=(queue,), daemon=False)
    proc.start()
    proc.join(30)  # a failing rank ends in seconds; a spawn_job that does not wait for it never returns
    if proc.is_alive():
        for child in _children(proc.pid):
            os.kill(child, signal.SIGKILL)
        proc.kill()
        proc.join()
        pytest.fail(f"spawn_job(1, backend=...) whose rank fails did not return within 30 s: wait for "
                    "the ranks (mp.spawn(..., join=True)), which raises when one of them fails; reading the results "
                    "of ranks that died waits forever", pytrace=False)
    status, detail = queue.get() if not queue.empty() else ("died", f"exit code {proc.exitcode}")
    if status == "not implemented":
        raise NotImplementedError(detail)
    assert status == "raised", (f"spawn_job whose ranks all fail must raise (mp.spawn with join=True does), "
                                f"but it {status} {detail}")


def _children(pid):
    """Every descendant of pid (the processes spawn_job started), from /proc."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            with open(f"/proc/{parent}/task/{parent}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            kids = []
        found += kids
        todo += kids
    return found
