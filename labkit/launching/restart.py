"""Training through failures: a restart loop around `labkit.launch`, and a training run that resumes.

    from labkit.launching.restart import launch_with_restarts, elastic_train
    results, restarts = launch_with_restarts(elastic_train, 2, "ckpts", kill_at=5, max_restarts=1)

`launch_with_restarts` is torchrun's elastic agent in miniature: when a launch fails (a rank
raised, crashed or was killed), every rank is stopped (`labkit.launch` does that) and the whole
job is launched again, up to `max_restarts` times. The ranks read the attempt number with
`restart_count()`, which also reads torchrun's TORCHELASTIC_RESTART_COUNT, so the same code runs
under `torchrun --max-restarts 1 -m labkit.launching.restart ...` (this module's command line).

`elastic_train` is a small DP training run that resumes from `labkit.training.checkpoint.save_state`
checkpoints: data order from the step (labkit.data's seed rule), each rank's RNG from the
checkpoint. It consumes RNG on purpose (random token dropout), so a resume that forgot the RNG
would differ. With `kill_at=k`, the last rank SIGKILLs itself at the start of step k on the
first attempt only: the restart resumes from the newest checkpoint and ends with the same
weights, bit for bit, as a run never killed.
"""
from __future__ import annotations

import argparse
import os
import signal

RESTART_VARS = ("TORCHELASTIC_RESTART_COUNT", "LABKIT_RESTART_COUNT")


def restart_count() -> int:
    """How many times this job was restarted (0 on the first attempt): torchrun's count or labkit's."""
    for var in RESTART_VARS:
        if var in os.environ:
            return int(os.environ[var])
    return 0


def launch_with_restarts(fn, world_size, *args, max_restarts: int = 1, timeout: float = 120.0, **kwargs):
    """``labkit.launch(fn, world_size, *args, **kwargs)``, launched again after a failure.

    Returns (results, restarts). Raises the last `LaunchError` when attempt `max_restarts` + 1
    fails too. Each attempt's ranks see ``restart_count()`` = the attempt number.
    """
    from labkit.launching.launcher import LaunchError, launch

    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
    saved = os.environ.get("LABKIT_RESTART_COUNT")
    try:
        for attempt in range(max_restarts + 1):
            os.environ["LABKIT_RESTART_COUNT"] = str(attempt)  # the forked ranks inherit it
            try:
                return launch(fn, world_size, *args, timeout=timeout, **kwargs), attempt
            except LaunchError as err:
                if attempt == max_restarts:
                    raise
                first = str(err).strip().splitlines()[0]
                print(f"attempt {attempt} failed ({first[:160]}); restart {attempt + 1} of {max_restarts}")
    finally:
        if saved is None:
            os.environ.pop("LABKIT_RESTART_COUNT", None)
        else:
            os.environ["LABKIT_RESTART_COUNT"] = saved


def small_config():
    from labkit.model import get_config

    return get_config("tiny", d_model=32, n_heads=2, n_layers=1, context=32, hidden_dim=64)


def elastic_train(rank, world_size, directory, steps: int = 8, every: int = 2, kill_at: int | None = None,
                  batch_size: int = 8, seq_len: int = 16, config=None, restore_rng: bool = True, out=None):
    """DP training that checkpoints every `every` steps into `directory` and resumes from it.

    Returns {"weights": state dict, "start": the step it resumed at, "skipped": corrupt files}.
    `out`: rank 0 also saves the final weights there (for torchrun, which returns nothing).
    """
    import torch

    from labkit.training.checkpoint import load_state, save_state
    from labkit.data import get_batch, load_tokens
    from labkit.model import build_model
    from labkit.parallel.flat import allreduce_mean_

    config = config or small_config()
    tokens = load_tokens()
    model = build_model(config, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(1000 + rank)  # each rank its own stream (for the dropout below)
    rng = torch.get_rng_state()
    resumed = load_state(directory, model, opt, config=config)
    if resumed is not None and not restore_rng:
        torch.set_rng_state(rng)  # the mistake the notebook shows: data order right, RNG wrong
    start = resumed["step"] if resumed else 0
    for step in range(start, steps):
        if step == kill_at and rank == world_size - 1 and restart_count() == 0:
            os.kill(os.getpid(), signal.SIGKILL)  # a rank dies: no exception, no clean-up
        x, y = get_batch(tokens, batch_size, seq_len, step, rank=rank, world_size=world_size)
        x = x * (torch.rand(x.shape) > 0.1)  # token dropout: uses this rank's RNG
        opt.zero_grad(set_to_none=True)
        model(x, y).backward()
        allreduce_mean_([p.grad for p in model.parameters()])
        opt.step()
        if (step + 1) % every == 0:
            save_state(directory, step + 1, model, opt, config=config)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if out is not None and rank == 0:
        torch.save(weights, out)
    return {"weights": weights, "start": start, "skipped": resumed["skipped"] if resumed else []}


def main(argv=None):
    """Command line for torchrun: ``torchrun --standalone --nproc-per-node 2 --max-restarts 1 -m labkit.launching.restart --dir D --out W``."""
    import labkit

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="checkpoint directory")
    parser.add_argument("--out", required=True, help="where rank 0 writes the final weights")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", "2")))
    a = parser.parse_args(argv)
    store = _init_for_this_attempt()
    labkit.launch(elastic_train, a.world_size, a.dir, steps=a.steps, every=a.every, kill_at=a.kill_at, out=a.out)
    if store is not None:  # leave together (store keys, not a collective), then tear down
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store.set(f"exit/{rank}", "1")
        store.wait([f"exit/{r}" for r in range(size)])
        import torch.distributed as dist

        dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"restart {restart_count()}: done, weights in {a.out}")


def _init_for_this_attempt():
    """Under torchrun: the process group on keys of this attempt only. Returns the store (or None).

    torchrun's agent keeps one store across restarts; the keys a process group writes there
    (each rank's gloo address) would survive a restart, and a restarted rank could read its
    dead peer's old address ("Connection refused"). A prefix per attempt keeps attempts apart.
    """
    import datetime

    import torch.distributed as dist

    if "TORCHELASTIC_RESTART_COUNT" not in os.environ or dist.is_initialized():
        return None
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    hosted_by_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size,
                          is_master=rank == 0 and not hosted_by_agent, timeout=datetime.timedelta(seconds=120))
    store = dist.PrefixStore(f"labkit/attempt-{restart_count()}", store)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
    return store


if __name__ == "__main__":
    main()
