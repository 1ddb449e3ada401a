"""`python -m labkit.apps.train` under real launchers equals single-process training.

The hybrid strategy (dp x pp) runs forked in this process, and its final weights (saved with --save)
and losses must equal `labkit.training.loop.train`'s, run here in one process; so must the single
strategy's. Jobs start the ranks by hand with the variables Slurm's srun (dp) and MPICH's mpiexec
(PBS; the composed strategy) set, which is how those launchers hand a rank its identity. The composed
strategy (notebook 14's layouts: --tp, --cp, --ep, --zero) runs forked, under torchrun and with
mpiexec's variables; a bad layout stops before
any rank starts, with one line naming the flag and the fix. Each axis flag alone (--dp 2, --pp 2, --tp 2,
--cp 2, --zero 1 --dp 2; --ep 2 on tiny-moe; --dp 3, --pp 4) runs that many ranks, as the report and the
summary line say (forked in this process: 1-2 s each).

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
    assert report["tokens_per_s"] > 0
    if report["device"].startswith("cuda"):  # a GPU node: MFU against its known peak, or None for an unknown GPU
        assert report["mfu"] is None or 0 < report["mfu"] < 1
    else:
        assert report["mfu"] is None  # CPU: no honest peak, no MFU
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


def test_train_hybrid_forked_equals_train_loop(reference, tmp_path, monkeypatch):
    # dp 2 x pp 2 (notebook 07's hybrid_step), forked: torchrun's variables are read by the composed job below,
    # the same code for every strategy, and hybrid crosses two hosts under mpiexec in tests/test_multihost.py
    # (a torchrun job here cost about 30 s of CPU: an agent and four workers each import torch)
    monkeypatch.setenv("LABKIT_IMPL", "solutions")
    saved = tmp_path / "weights.pt"
    report = main(["--dp", "2", "--pp", "2", "--microbatches", "2", *COMMON, "--save", str(saved)])
    _check(report, saved, reference, "hybrid", 4)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# srun's variables here; MPICH's (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID) start the composed job further down
# (each such job starts fresh interpreters: about 14 s of CPU)
@pytest.mark.parametrize("launcher", ["slurm_srun"])
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
    assert ("--dp 2 x --pp 2 x --cp 1 x --tp 1 needs 4 processes, but the launcher started 2: change --dp/--pp/--cp/--tp "
            "so that their product is 2, or start 4 processes (torchrun --nproc-per-node 4)") in proc.stderr, proc.stderr[-2000:]


# ---------------------------------------------------------------- the composed strategy (notebook 14)
@pytest.mark.parametrize("extra,world", [
    (["--dp", "2", "--tp", "2"], 4),
    (["--pp", "2", "--cp", "2", "--tp", "2", "--zero", "1"], 8),
    (["--dp", "2", "--zero", "3"], 2),
    (["--cp", "2", "--cp-method", "allgather"], 2),
    (["--cp", "2", "--tp", "2", "--cp-method", "ulysses"], 4),
    (["--cp", "4", "--cp-method", "hybrid"], 4),
    (["--dp-replicate", "2", "--dp-shard", "1"], 2),
], ids=["dp2-tp2", "pp2-cp2-tp2-zero1", "dp2-zero3", "cp2-allgather", "cp2-tp2-ulysses", "cp4-hybrid", "hsdp-2-replicas"])
def test_train_composed_forked_equals_train_loop(extra, world, reference, tmp_path, monkeypatch):
    """Any layout, forked: the same AdamW (no decay on norms), warm-up + cosine and global-norm clipping as the
    loop, so the weights equal one process's in float64."""
    monkeypatch.setenv("LABKIT_IMPL", "solutions")
    saved = tmp_path / "weights.pt"
    _check(main([*extra, *COMMON, "--save", str(saved)]), saved, reference, "composed", world)


@pytest.mark.parametrize("layout,world", [(["--dp", "2", "--ep", "2", "--tp", "2"], 4),
                                          (["--cp", "2", "--ep", "2", "--ep-over", "dp,cp"], 2)],
                         ids=["dp2-ep2-tp2", "cp2-ep2-folded-over-cp"])
def test_train_composed_moe_with_experts_equals_one_process(layout, world, tmp_path, monkeypatch):
    """tiny-moe, dp2 x ep2 x tp2 and cp2 with ep2 folded over it (dropless: tp and cp split the sequences),
    against the single strategy's run of it."""
    monkeypatch.setenv("LABKIT_IMPL", "solutions")
    moe = ["--model", "tiny-moe", "--capacity-factor", "2", *COMMON]
    one = main(["--strategy", "single", *moe, "--save", str(tmp_path / "one.pt")])
    composed = main([*layout, *moe, "--save", str(tmp_path / "composed.pt")])
    assert (composed["strategy"], composed["world_size"], composed["ep"]) == ("composed", world, 2)
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
    # what MPICH's mpiexec (PBS) does for a cp2 layout: two copies, each told its rank by PMI_* alone (the
    # layouts themselves are proven forked, above; each copy here imports torch, seconds of a core)
    saved, port, jobs = tmp_path / "weights.pt", str(_free_port()), []
    for rank in range(2):
        cmd = [sys.executable, "-m", "labkit.apps.train", "--cp", "2", *COMMON, "--save", str(saved)]
        jobs.append((cmd, _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PMI_RANK=str(rank), PMI_SIZE="2",
                               MPI_LOCALRANKID=str(rank))))
    _check(_report(_run(jobs)[0]), saved, reference, "composed", 2)


def _refusal(monkeypatch, extra, env_world) -> str:
    """main(extra)'s SystemExit text; a rank started before it fails the test."""
    monkeypatch.setenv("LABKIT_IMPL", "solutions")  # main(--impl) sets it; restored afterwards
    if env_world is not None:  # as torchrun would start it: the world size comes from the launcher
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", env_world)
        monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr("labkit.launching.launcher.launch", lambda *a, **k: pytest.fail("a rank was started"))
    with pytest.raises(SystemExit) as stop:
        main([*extra, *COMMON])
    return str(stop.value)


@pytest.mark.parametrize("extra,env_world,words", [
    (["--dp", "2", "--tp", "2"], "2", "--dp 2 x --pp 1 x --cp 1 x --tp 2 needs 4 processes, but the launcher started 2"),
    (["--tp", "3"], None, "--tp 3 does not divide n_heads=4"),
    (["--dp", "2", "--ep", "2"], None, "--ep 2 on a dense model"),
    (["--cp", "2", "--model", "tiny-moe"], None, "Add --capacity-factor 2 (n_experts / top_k: no token dropped"),
    (["--strategy", "hybrid", "--tp", "2"], None, "--tp belong to the composed strategy"),
    (["--strategy", "single", "--dp", "2"], None, "--strategy single does not run --dp 2: leave --strategy out"),
    (["--strategy", "dp", "--pp", "2"], None, "--strategy dp does not run --pp 2: leave --strategy out"),
    (["--pp", "5"], None, "--pp 5 is more stages than --model tiny's 4 layers"),
    (["--cp", "4", "--tp", "2", "--cp-method", "ulysses"], None,
     "--cp-method ulysses: its all-to-all gives each of 4 ranks heads/4 whole heads, but each tp rank holds 2"),
    (["--cp", "2", "--cp-method", "hybrid"], None, "--cp-method hybrid with --cp 2"),
    (["--dp", "2", "--cp-method", "ulysses"], None, "--cp-method ulysses chooses how attention crosses the "
     "context-parallel ranks, but there are none (--cp 1): add --cp 2 or more"),
    (["--dp", "4", "--dp-replicate", "3"], None, "dp_replicate x dp_shard = 3 x 1 = 3, but --dp 4"),
    (["--dp-replicate", "2", "--dp-shard", "2", "--zero", "0"], None, "--dp-replicate/--dp-shard with --zero 0"),
    (["--ep", "2", "--ep-over", "dp,pp", "--model", "tiny-moe"], None, "--ep-over dp,pp: name the axes ep is folded"),
    (["--cp", "2", "--ep", "4", "--dp", "1", "--ep-over", "dp,cp", "--model", "tiny-moe", "--capacity-factor", "2"],
     None, "--ep 4 does not divide the ranks it is folded over, --dp-shard 1 x --cp 2 = 2"),
    (["--dp", "2", "--ep-overlap", "--model", "tiny-moe"], None,
     "ep_overlap hides expert parallelism's all-to-all, but --ep 1 has none"),
], ids=["product-not-world", "tp-heads", "ep-dense", "moe-drops-under-cp", "flags-of-another-strategy",
        "single-with-dp", "dp-with-pp", "pp-past-layers", "ulysses-heads", "hybrid-one-node", "cp-method-without-cp",
        "replicas-x-shards-not-dp", "hsdp-zero0", "ep-over-pp", "ep-not-dividing-folded", "ep-overlap-without-ep"])
def test_train_bad_layout_fails_before_any_rank(extra, env_world, words, monkeypatch):
    """One line naming the flag and the fix, before any rank is started (in this process: it must not get as far
    as forking)."""
    text = _refusal(monkeypatch, extra, env_world)
    assert words in text, text


PROG = "python -m labkit.apps.train: "


@pytest.mark.parametrize("extra,env_world,message", [
    (["--dp", "3", "--batch-size", "6"], "2",
     "--dp 3 x --pp 1 x --cp 1 x --tp 1 needs 3 processes, but the launcher started 2: change --dp/--pp/--cp/--tp so "
     "that their product is 2, or start 3 processes (torchrun --nproc-per-node 3); --ep is folded over --dp (and "
     "--ep-over's axes) and is not in the product"),
    (["--dp", "3"], None,
     "--batch-size 8 does not split over --dp 3 x --microbatches 1 = 3 equal parts (each replica's rows, cut into "
     "micro-batches): use --batch-size 6 or 9 (a multiple of 3), or change --dp or --microbatches"),
    (["--dp", "2", "--pp", "2", "--microbatches", "3"], None,
     "--batch-size 8 does not split over --dp 2 x --microbatches 3 = 6 equal parts (each replica's rows, cut into "
     "micro-batches): use --batch-size 6 or 12 (a multiple of 6), or change --dp or --microbatches"),
    (["--tp", "2", "--model", "tiny-moe"], None,
     "--model tiny-moe with --capacity-factor 1.25 (the config's default) drops the tokens past an expert's capacity, "
     "chosen per whole sequence by the lab's MoE; under --cp 1 --tp 2 no rank sees a whole sequence, so this run would "
     "drop other tokens than the one-process run. Add --capacity-factor 2 (n_experts / top_k: no token dropped; the "
     "lab's requirement, so that runs equal one process)"),
    (["--cp", "2", "--model", "tiny-moe", "--capacity-factor", "1.5"], None,
     "--model tiny-moe with --capacity-factor 1.5 drops the tokens past an expert's capacity, "
     "chosen per whole sequence by the lab's MoE; under --cp 2 --tp 1 no rank sees a whole sequence, so this run would "
     "drop other tokens than the one-process run. Add --capacity-factor 2 (n_experts / top_k: no token dropped; the "
     "lab's requirement, so that runs equal one process)"),
], ids=["world-not-product", "batch-not-dp", "batch-not-dp-x-microbatches", "moe-drops-under-tp", "moe-drops-under-cp"])
def test_train_bad_input_is_one_line_naming_flag_and_fix(extra, env_world, message, monkeypatch):
    """The exact line, for the strategies of notebooks 04-07 and the composed one alike, before any rank starts."""
    assert _refusal(monkeypatch, extra, env_world) == PROG + message


# ---------------------------------------------------------------- the flags choose the layout the ranks run
def _layout(report):
    return {k: report[k] for k in ("strategy", "world_size", "dp", "pp", "cp", "tp", "ep", "zero")}


@pytest.mark.parametrize("extra,want", [
    (["--dp", "2"], dict(strategy="dp", world_size=2, dp=2)),
    (["--pp", "2"], dict(strategy="pp", world_size=2, pp=2)),
    (["--tp", "2"], dict(strategy="composed", world_size=2, tp=2)),
    (["--cp", "2"], dict(strategy="composed", world_size=2, cp=2)),
    (["--zero", "1", "--dp", "2"], dict(strategy="composed", world_size=2, dp=2, zero=1)),
], ids=["dp2", "pp2", "tp2", "cp2", "zero1-dp2"])
def test_train_each_flag_alone_runs_its_layout_equal_to_one_process(extra, want, reference, tmp_path, monkeypatch):
    """Every axis flag alone selects a multi-rank run: the report gives the world size and each axis as the
    ranks' meshes ran them, and the run equals one process in float64."""
    monkeypatch.setenv("LABKIT_IMPL", "solutions")
    saved = tmp_path / "weights.pt"
    report = main([*extra, *COMMON, "--save", str(saved)])
    assert _layout(report) == {"dp": 1, "pp": 1, "cp": 1, "tp": 1, "ep": 1, "zero": 0, **want}
    _check(report, saved, reference, want["strategy"], want["world_size"])


# tiny runs: the layout is the question here, not the numbers (those are proved above)
QUICK = ["--steps", "2", "--seq-len", "16", "--quiet", "--impl", "solutions"]


@pytest.mark.parametrize("extra,want", [
    (["--ep", "2", "--model", "tiny-moe", "--batch-size", "4"], dict(strategy="composed", world_size=2, dp=2, ep=2)),
    (["--dp", "3", "--batch-size", "3"], dict(strategy="dp", world_size=3, dp=3)),
    (["--pp", "4", "--batch-size", "4", "--microbatches", "4"], dict(strategy="pp", world_size=4, pp=4)),
], ids=["ep2-tiny-moe", "dp3", "pp4"])
def test_train_flag_alone_runs_that_many_ranks(extra, want, monkeypatch, capsys):
    """--ep 2 borrows 2 data-parallel ranks; --dp 3 and --pp 4 run 3 and 4 ranks (tiny has 4 layers), and the
    summary line says so."""
    monkeypatch.setenv("LABKIT_IMPL", "solutions")
    report = main([*extra, *QUICK])
    assert _layout(report) == {"dp": 1, "pp": 1, "cp": 1, "tp": 1, "ep": 1, "zero": 0, **want}
    axes = " ".join(f"{a}={report[a]}" for a in ("dp", "pp", "cp", "tp", "ep", "zero", "microbatches"))
    assert f"{want['strategy']} on {want['world_size']} rank(s), {axes}, cpu: loss" in capsys.readouterr().out
