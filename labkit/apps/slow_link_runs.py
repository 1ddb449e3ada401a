"""Training runs over an emulated slow link: DP, DiLoCo, PowerSGD and torch's PowerSGD hook (notebook 13, bench).

    from labkit.apps.slow_link_runs import train_over_link, merge
    per_rank = labkit.launch(train_over_link, 2, "diloco", H=8, bandwidth=5e6, latency=5e-3)
    run = merge(per_rank)        # {"loss", "tokens", "seconds", "wire_bytes", "val_loss", ...}

Every method trains the same model from the same weights on the same global batches
(labkit.data's seed rule, rows sharded by rank), with AdamW, inside one `labkit.links.shaper.SlowLink`
that slows and counts every collective. DiLoCo and PowerSGD come from the learner's
`slow_links` module (or the reference) through the switch.
"""
from __future__ import annotations

import time

METHODS = ("dp", "diloco", "powersgd", "torch_powersgd")


def quick_model_config():
    """Small enough that the link, not the arithmetic, dominates a DP step on a laptop."""
    from labkit.model import get_config

    return get_config("tiny", d_model=32, n_heads=2, n_layers=2, context=64, hidden_dim=96)


def torch_powersgd(model, r: int):
    """The model under DDP with torch's own PowerSGD hook (rank r, from the third step on)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    wrapped = DDP(model)
    state = hook.PowerSGDState(process_group=None, matrix_approximation_rank=r, start_powerSGD_iter=2,
                               min_compression_rate=1.0, random_seed=0)
    wrapped.register_comm_hook(state, hook.powerSGD_hook)
    return wrapped


def load_trainable(model, values) -> None:
    """Copy `values` (one tensor per trainable parameter, in order) into the model's trainable parameters."""
    import torch

    with torch.no_grad():
        for p, v in zip([p for p in model.parameters() if p.requires_grad], values):
            p.copy_(v)


def validation_loss(model, val, seq_len: int, shared=None) -> float:
    """The validation loss of the model one would keep: with `shared` (DiLoCo's outer weights), of those."""
    from labkit.training.loop import evaluate

    if shared is None:
        return evaluate(model, val, batch_size=8, seq_len=seq_len, n_batches=4)
    local = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    load_trainable(model, shared)
    loss = evaluate(model, val, batch_size=8, seq_len=seq_len, n_batches=4)
    load_trainable(model, local)
    return loss


def update(method: str, model, opt, sl, algo=None, comp=None) -> None:
    """After backward: DiLoCo's step, or synchronise the gradients (plain DP, PowerSGD; torch's hook did
    it in backward) and step the optimizer."""
    if method == "diloco":
        algo.step()
        return
    if method == "dp":
        sl.sync_gradients(model)
    elif method == "powersgd":
        comp.sync_gradients()
    opt.step()
    opt.zero_grad(set_to_none=True)


def train_over_link(rank, world_size, method="dp", steps=48, bandwidth=5e6, latency=5e-3, H=8, r=4,
                    lr=3e-3, batch_size=16, seq_len=32, config=None, outer_lr=0.7, eval_every=4):
    """One rank of a run; returns its history (losses are this rank's, on its own rows).

    Every `eval_every` steps (and at the end) the validation loss of the model one would keep
    is measured with the clock stopped: for DiLoCo the *shared* weights (the replicas between
    syncs are not that model), else the model. history["eval"]: [(step, seconds, wire bytes, val)].
    """
    import torch

    from labkit.data import get_batch, load_tokens, split_tokens
    from labkit.grading import impl
    from labkit.model import build_model
    from labkit.links.shaper import SlowLink
    from labkit.training.loop import evaluate

    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: use one of {METHODS}")
    sl = impl("slow_links")
    config = config or quick_model_config()
    train, val = split_tokens(load_tokens())
    model = build_model(config, seed=0)
    forward, extra = (torch_powersgd(model, r) if method == "torch_powersgd" else model), {}
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    algo = sl.DiLoCo(model, opt, H, outer_lr=outer_lr) if method == "diloco" else None
    comp = sl.PowerSGD(model, r) if method == "powersgd" else None
    if comp is not None:
        extra["numbers_sent"] = comp.numbers_sent()
    history = {"loss": [], "seconds": [], "tokens": [], "wire_bytes": [], "eval": []}
    val_loss = lambda: validation_loss(model, val, seq_len, algo.shared if algo else None)  # noqa: E731
    with SlowLink(bandwidth, latency) as link:
        paused = 0.0  # seconds spent evaluating, not counted as training time
        start = time.perf_counter()
        for step in range(steps):
            x, y = get_batch(train, batch_size, seq_len, step, rank=rank, world_size=world_size)
            loss = forward(x, y)
            loss.backward()
            update(method, model, opt, sl, algo, comp)
            history["loss"].append(loss.item())
            history["seconds"].append(time.perf_counter() - start - paused)
            history["tokens"].append((step + 1) * batch_size * seq_len)
            history["wire_bytes"].append(link.wire_bytes)
            if (step + 1) % eval_every == 0 or step + 1 == steps:
                tick = time.perf_counter()
                history["eval"].append((step + 1, history["seconds"][-1], link.wire_bytes, val_loss()))
                paused += time.perf_counter() - tick
    if method == "diloco":  # end on the shared weights (the last sync may be a partial round)
        if steps % H:
            algo.sync()
        load_trainable(model, algo.shared)
    history.update(extra, method=method, H=H, r=r, bandwidth=bandwidth, latency=latency,
                   emulated_seconds=link.seconds, calls=link.calls,
                   val_loss=evaluate(model, val, batch_size=8, seq_len=seq_len, n_batches=4))
    if steps % H == 0 or method != "diloco":
        assert abs(history["val_loss"] - history["eval"][-1][3]) < 1e-6  # the same model, the same batches
    return history


def merge(per_rank: list) -> dict:
    """One run from its ranks: losses averaged over the ranks, time and bytes from rank 0."""
    run = dict(per_rank[0])
    n = len(per_rank)
    run["loss"] = [sum(h["loss"][i] for h in per_rank) / n for i in range(len(run["loss"]))]
    return run


def smoothed(values: list, window: int = 8) -> list:
    """Trailing mean over `window` values: a noisy per-step loss made readable."""
    return [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
            for i in range(len(values))]


def time_to(run: dict, target: float):
    """(seconds, wire bytes) at the first evaluation whose validation loss is <= `target`; (None, None) if none."""
    for step, seconds, sent, loss in run["eval"]:
        if loss <= target:
            return seconds, sent
    return None, None
