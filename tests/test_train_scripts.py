"""`python -m labkit.apps.train` under real launchers equals single-process training.

Each distributed strategy (dp, pp, hybrid) runs as a separate job under `torchrun
--standalone` on CPU (gloo), as a learner would start it, and its final weights (saved
with --save) and losses must equal `labkit.training.loop.train`'s, run here in one process;
so must the single strategy, run in this process. Two more jobs start the ranks by hand
with the variables Slurm's srun and MPICH's mpiexec (PBS) set, which is how those
launchers hand a rank its identity. The composed strategy (notebook 14's layouts: --tp, --cp,
--ep, --zero) runs forked, under torchrun and with mpiexec's variables; a bad layout stops before
any rank starts.

Every job runs in its own session and is killed, children included, on timeout.
Cost: each job starts fresh interpreters that import torch: about 5-10 s per job on two
idle cores, about a minute for the module (3-4 minutes on a busy machine).
"""
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from labkit.data import load_tokens
from labkit.model import build_model
from labkit.apps.train import main, parse_args, train_config
from labkit.training.loop import train

REPO = Path(__file__).resolve().parent.parent
# float64: N ranks sum gradients in another order than one process, and AdamW's first steps move a
# weight by ~lr whatever its gradient's size, so in float32 a rounding difference in a tiny gradient
# can change a weight by up to 2 lr, differently on every CPU. In float64 the same differences are
# ~1e-16 relative, and after 3 steps the runs agree to ~1e-12: RTOL/ATOL leave 100x room.
COMMON = ["--steps", "3", "--batch-size", "8", "--seq-len", "32", "--quiet", "--impl", "solutions",
          "--dtype", "float64"]
RTOL, ATOL = 1e-9, 1e-10
TIMEOUT = 240  # seconds per job; a hang is killed, not waited for


@pytest.fixture(scope="module")
def reference():
    """Weights and losses of the single-process loop with the scripts' config."""
    cfg = train_config(parse_args(COMMON))
    model = build_model("tiny", seed=0).double()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        history = train(model, load_tokens("tinystories"), cfg, progress=False)
    finally:
        torch.set_num_threads(threads)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, history["loss"]


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith(("SLURM_", "OMPI_", "PMI_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def _run(cmds_envs, timeout=TIMEOUT):
    """Start every (cmd, env) at once, wait for all; kill all on timeout. Returns their outputs."""
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True) for cmd, env in cmds_envs]
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            outputs.append(out)
    except subprocess.TimeoutExpired:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.communicate()
        pytest.fail(f"job did not finish within {timeout} s and was killed: {cmds_envs[0][0]}")
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, f"exit {proc.returncode}:\n{out[-4000:]}"
    return outputs


def _report(output: str) -> dict:
    lines = [line for line in output.splitlines() if line.startswith("{")]
    assert lines, f"no JSON report in the output:\n{output[-4000:]}"
    return json.loads(lines[-1])


def _check(report, saved_path, reference, strategy, world_size):
    ref_weights, ref_losses = reference
    assert (report["strategy"], report["world_size"]) == (strategy, world_size)
    assert report["tokens_per_s"] > 0 and report["mfu"] is None  # CPU: no honest peak, no MFU
    assert report["tokens_per_s_per_device"] == pytest.approx(report["tokens_per_s"] / world_size)
    torch.testing.assert_close(torch.tensor([report["first_loss"], report["final_loss"]], dtype=torch.float64),
                               torch.tensor([ref_losses[0], ref_losses[-1]], dtype=torch.float64),
                               rtol=RTOL, atol=ATOL)
    weights = torch.load(saved_path)
    assert set(weights) == set(ref_weights)
    for name, w in weights.items():
        torch.testing.assert_close(w, ref_weights[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def test_train_single_in_process_equals_train_loop(reference, tmp_path, monkeypatch):
    # the single strategy has no distributed code: run it here (one forked rank), not in a job
    monkeypatch.setenv("LABKIT_IMPL", "solutions")  # main(--impl) sets it; restored afterwards
    saved = tmp_path / "weights.pt"
    report = main(["--strategy", "single", *COMMON, "--save", str(saved)])
    _check(report, saved, reference, "single", 1)


@pytest.mark.parametrize("strategy,nproc,extra", [
    ("dp", 2, []),
    ("pp", 2, ["--microbatches", "4"]),
    ("hybrid", 4, ["--dp", "2", "--pp", "2", "--microbatches", "2"]),
])
def test_train_under_torchrun_standalone_equals_single_process(strategy, nproc, extra, reference, tmp_path):
    saved = tmp_path / "weights.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "labkit.apps.train", "--strategy", strategy, *extra, *COMMON, "--save", str(saved)]
    (output,) = _run([(cmd, _env())])
    _check(_report(output), saved, reference, strategy, nproc)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("launcher", ["slurm_srun", "mpich_mpiexec"])
def test_train_dp_with_scheduler_variables_equals_single_process(launcher, reference, tmp_path):
    # What srun / mpiexec do: start N copies of the command, each told its rank by variables.
    saved = tmp_path / "weights.pt"
    port = str(_free_port())
    jobs = []
    for rank in range(2):
        if launcher == "slurm_srun":
            ids = dict(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank), SLURM_STEP_ID="0")
        else:
            ids = dict(PMI_RANK=str(rank), PMI_SIZE="2", MPI_LOCALRANKID=str(rank))
        cmd = [sys.executable, "-m", "labkit.apps.train", "--strategy", "dp", *COMMON, "--save", str(saved)]
        jobs.append((cmd, _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **ids)))
    outputs = _run(jobs)
    _check(_report(outputs[0]), saved, reference, "dp", 2)


def test_train_wrong_process_count_says_what_to_change():
    # hybrid dp=2 x pp=2 needs 4 processes; started by a launcher with 2 it must say so
    cmd = [sys.executable, "-m", "labkit.apps.train", "--strategy", "hybrid", "--dp", "2", "--pp", "2", *COMMON]
    env = _env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode != 0
    assert "needs 4 processes" in proc.stderr and "started 2" in proc.stderr, proc.stderr[-2000:]


# ---------------------------------------------------------------- the composed strategy (notebook 14)
@pytest.mark.parametrize("extra,world", [
    (["--dp", "2", "--tp", "2"], 4),
    (["--pp", "2", "--cp", "2", "--tp", "2", "--zero", "1"], 8),
    (["--dp", "2", "--zero", "3"], 2),
], ids=["dp2-tp2", "pp2-cp2-tp2-zero1", "dp2-zero3"])
def test_train_composed_forked_equals_train_loop(extra, world, reference, tmp_path, monkeypatch):
    """Any layout, forked: the same AdamW (no decay on norms), warm-up + cosine and global-norm clipping as the
    loop, so the weights equal one process's in float64."""
    monkeypatch.setenv("LABKIT_IMPL", "solutions")
    saved = tmp_path / "weights.pt"
    _check(main([*extra, *COMMON, "--save", str(saved)]), saved, reference, "composed", world)


def test_train_composed_moe_with_experts_equals_one_process(tmp_path, monkeypatch):
    """tiny-moe, dp2 x ep2 x tp2 (dropless: tp splits the sequences), against the single strategy's run of it."""
    monkeypatch.setenv("LABKIT_IMPL", "solutions")
    moe = ["--model", "tiny-moe", "--capacity-factor", "2", *COMMON]
    one = main(["--strategy", "single", *moe, "--save", str(tmp_path / "one.pt")])
    composed = main(["--dp", "2", "--ep", "2", "--tp", "2", *moe, "--save", str(tmp_path / "composed.pt")])
    assert (composed["strategy"], composed["world_size"], composed["ep"]) == ("composed", 4, 2)
    torch.testing.assert_close(torch.tensor([composed["first_loss"], composed["final_loss"]]),
                               torch.tensor([one["first_loss"], one["final_loss"]]), rtol=RTOL, atol=ATOL)
    want, got = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "composed.pt")
    assert set(got) == set(want)
    for name, w in got.items():
        torch.testing.assert_close(w, want[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def test_train_composed_under_torchrun_equals_single_process(reference, tmp_path):
    saved = tmp_path / "weights.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "labkit.apps.train", "--tp", "2", "--zero", "1", *COMMON, "--save", str(saved)]
    (output,) = _run([(cmd, _env())])
    _check(_report(output), saved, reference, "composed", 2)


def test_train_composed_with_mpiexec_variables_equals_single_process(reference, tmp_path):
    # what MPICH's mpiexec (PBS) does for a cp2 x pp2 layout: four copies, each told its rank
    saved, port, jobs = tmp_path / "weights.pt", str(_free_port()), []
    for rank in range(4):
        cmd = [sys.executable, "-m", "labkit.apps.train", "--cp", "2", "--pp", "2", *COMMON, "--save", str(saved)]
        jobs.append((cmd, _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PMI_RANK=str(rank), PMI_SIZE="4",
                               MPI_LOCALRANKID=str(rank))))
    _check(_report(_run(jobs)[0]), saved, reference, "composed", 4)


@pytest.mark.parametrize("extra,env_world,words", [
    (["--dp", "2", "--tp", "2"], "2", "= 4 ranks, but 2 are running"),
    (["--tp", "3"], None, "tp=3 does not divide n_heads=4"),
    (["--dp", "2", "--ep", "2"], None, "ep=2 on a dense model"),
    (["--cp", "2", "--model", "tiny-moe"], None, "dropless"),
    (["--strategy", "hybrid", "--tp", "2"], None, "belong to the composed strategy"),
], ids=["product-not-world", "tp-heads", "ep-dense", "moe-drops-under-cp", "flags-of-another-strategy"])
def test_train_composed_bad_layout_fails_before_any_rank(extra, env_world, words, monkeypatch, capsys):
    """One line naming the fix, before any rank is started (in this process: it must not get as far as forking)."""
    monkeypatch.setenv("LABKIT_IMPL", "solutions")  # main(--impl) sets it; restored afterwards
    if env_world is not None:  # as torchrun would start it: the world size comes from the launcher
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", env_world)
        monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr("labkit.launching.launcher.launch", lambda *a, **k: pytest.fail("a rank was started"))
    with pytest.raises(SystemExit) as stop:
        main([*extra, *COMMON])
    assert words in str(stop.value), str(stop.value)
