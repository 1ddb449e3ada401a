"""Elastic restart: checkpoints with checksums, RNG and data position; a killed rank; torchrun --max-restarts.

Every verdict is about weights (torch.equal), never about time: the kill happens at a fixed
step, after a checkpoint that a barrier made complete. About 40 s on 2 busy cores (five
2-rank launches and one torchrun job of 2 ranks, restarted once).
"""
import os
import signal
import subprocess
import sys

import pytest
import torch

from labkit.training.checkpoint import CorruptCheckpoint, checkpoints, read_verified, save_state, load_state, write_verified
from labkit.launching.launcher import launch
from labkit.launching.restart import elastic_train, launch_with_restarts, small_config

TIMEOUT = 90


def equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    results = launch(elastic_train, 2, str(tmp_path_factory.mktemp("plain")), timeout=TIMEOUT)
    assert results[0]["start"] == 0 and equal(results[0]["weights"], results[1]["weights"])
    return results[0]["weights"]


def test_killed_rank_restart_loop_equals_uninterrupted_bit_for_bit(tmp_path, uninterrupted, capsys):
    results, restarts = launch_with_restarts(elastic_train, 2, str(tmp_path), kill_at=5, max_restarts=1,
                                             timeout=TIMEOUT)
    assert restarts == 1 and "attempt 0 failed" in capsys.readouterr().out
    assert results[0]["start"] == 4  # resumed from the checkpoint written after step 4
    assert equal(results[0]["weights"], uninterrupted)


def test_resume_without_the_rng_state_differs(tmp_path, uninterrupted):
    results, _ = launch_with_restarts(elastic_train, 2, str(tmp_path), kill_at=5, restore_rng=False,
                                      timeout=TIMEOUT)
    assert results[0]["start"] == 4 and not equal(results[0]["weights"], uninterrupted)


def test_corrupt_newest_checkpoint_is_skipped_and_the_previous_used(tmp_path, uninterrupted):
    launch(elastic_train, 2, str(tmp_path), steps=6, timeout=TIMEOUT)  # leaves step 4 and step 6
    newest = checkpoints(tmp_path)[0]
    assert newest.endswith("step-00000006.ckpt")
    with open(newest, "r+b") as f:  # a partial write: cut in the middle
        f.truncate(os.path.getsize(newest) // 2)
    results = launch(elastic_train, 2, str(tmp_path), timeout=TIMEOUT)  # rank 0 warns "skipping a corrupt ..."
    assert results[0]["start"] == 4 and results[0]["skipped"] == [newest]
    assert equal(results[0]["weights"], uninterrupted)


def test_checksum_detects_a_flipped_byte_and_a_foreign_file(tmp_path):
    path = str(tmp_path / "x.ckpt")
    write_verified(path, {"w": torch.arange(100.0)})
    assert torch.equal(read_verified(path)["w"], torch.arange(100.0))
    data = bytearray(open(path, "rb").read())
    data[-10] ^= 1
    open(path, "wb").write(bytes(data))
    with pytest.raises(CorruptCheckpoint, match="checksum mismatch"):
        read_verified(path)
    torch.save({"w": 1}, path)  # a plain torch file: no header
    with pytest.raises(CorruptCheckpoint, match="no checksum header"):
        read_verified(path)


def _load_other_config(rank, world_size, directory):
    from labkit.model import build_model

    small = small_config()
    model = build_model(small)
    save_state(directory, 1, model, config=small)
    other = small_config().__class__(**{**small.__dict__, "d_model": 64, "hidden_dim": 128})
    for config in (other, None):  # by config, then by shapes alone
        try:
            load_state(directory, build_model(other), config=config)
        except ValueError as err:
            assert "another model config" in str(err), err
        else:
            raise AssertionError("a checkpoint of another model config was loaded")
    with pytest.raises(ValueError, match="keep at least 2"):
        save_state(directory, 2, model, keep=1)
    return True


def test_checkpoint_from_another_model_config_raises_on_every_rank(tmp_path):
    assert launch(_load_other_config, 2, str(tmp_path), timeout=TIMEOUT) == [True, True]


def test_torchrun_max_restarts_after_a_killed_rank_equals_uninterrupted(tmp_path, uninterrupted):
    """The real elastic agent: torchrun sees rank 1 die (SIGKILL), stops rank 0, starts both again."""
    out = tmp_path / "final.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", "--monitor-interval", "0.5", "-m", "labkit.launching.restart",
           "--dir", str(tmp_path / "ckpts"), "--out", str(out), "--kill-at", "5"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LABKIT_IMPL": os.environ.get("LABKIT_IMPL", "solutions")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)  # own process group: killed as one below
    try:
        log, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in 240 s:\n{log[-3000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything left behind (nothing, normally)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, log[-3000:]
    assert "restart 1: done" in log, log[-3000:]
    assert equal(torch.load(out), uninterrupted)
