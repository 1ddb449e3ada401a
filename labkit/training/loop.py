"""The lab's single-device training loop: AdamW, warm-up + cosine learning rate, tokens/s.

    from labkit.training.loop import TrainConfig, train
    history = train(build_model("tiny"), load_tokens(), TrainConfig.quick())
    history["loss"][-1], history["tokens_per_s"]

Kept deliberately plain: a parallel notebook can compare its losses with this loop's,
step for step, as the single-device reference. One step = forward, backward, gradient
clipping, optimizer step; batches come from `labkit.data.get_batch` (the global batch
of each step, so a data-parallel run with the same seed sees the same data).
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch

from labkit.data import check_seq_len, get_batch


@dataclass
class TrainConfig:
    steps: int = 200
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 20
    weight_decay: float = 0.1
    grad_clip: float | None = 1.0
    seed: int = 0  # the data order (labkit.data's seed rule)

    @classmethod
    def quick(cls, **overrides) -> "TrainConfig":
        """The quick setting: the tiny model learns visibly in well under a minute on 2 CPU cores."""
        return cls(**{**dict(steps=120, batch_size=16, seq_len=64, lr=1e-2, min_lr=1e-3, warmup=10), **overrides})

    @classmethod
    def full(cls, **overrides) -> "TrainConfig":
        """For a GPU: the seed model, llama2.c-like batch and length."""
        return cls(**{**dict(steps=2000, batch_size=64, seq_len=256, lr=1e-3, min_lr=1e-4, warmup=100), **overrides})


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on norm weights), as in nanoGPT.

    On a GPU the fused kernel: two parameter groups cost two foreach launches per step otherwise,
    which on a small, launch-bound model is most of the lab's gap to a plain loop.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    fused = True if params and all(p.is_cuda and p.is_floating_point() for p in params) else None
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=fused)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up for cfg.warmup steps, then cosine decay from lr to min_lr at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - 1 - cfg.warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def train_step(model, optimizer, x, y, lr: float | None = None, grad_clip: float | None = None) -> torch.Tensor:
    """One optimizer step on the batch (x, y); returns the (detached) loss."""
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    loss = model(x, y)
    loss.backward()
    if grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


@torch.no_grad()
def evaluate(model, tokens, batch_size: int = 16, seq_len: int = 128, n_batches: int = 4, seed: int = 1234) -> float:
    """Mean loss over `n_batches` batches of `tokens` (a held-out stream, see data.split_tokens)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    losses = [model(*get_batch(tokens, batch_size, seq_len, i, seed=seed, device=device)).item()
              for i in range(n_batches)]
    model.train(was_training)
    return sum(losses) / len(losses)


def train(model, tokens, cfg: TrainConfig, optimizer=None, progress: bool = True, callback=None) -> dict:
    """Train `model` on `tokens` for cfg.steps steps; returns the history.

    callback(step, loss) is called after every step (e.g. a live plot). The history holds
    the per-step losses (floats), the time, the tokens/s of the steps after the first
    (which pays for warm-up), and the config.
    """
    check_seq_len(model.config, cfg.seq_len)
    device = next(model.parameters()).device
    optimizer = optimizer or make_optimizer(model, cfg)
    model.train()
    losses, bar = [], None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.steps, desc="training", unit="step")
    start = first = time.perf_counter()
    for step in range(cfg.steps):
        x, y = get_batch(tokens, cfg.batch_size, cfg.seq_len, step, seed=cfg.seed, device=device)
        loss = train_step(model, optimizer, x, y, lr=lr_at(step, cfg), grad_clip=cfg.grad_clip)
        losses.append(loss.item())  # .item() waits for the GPU: the timings below are real
        if step == 0:
            first = time.perf_counter()
        if bar is not None:
            bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
            bar.update()
        if callback is not None:
            callback(step, losses[-1])
    end = time.perf_counter()
    if bar is not None:
        bar.close()
    timed_steps = cfg.steps - 1
    tokens_per_s = timed_steps * cfg.batch_size * cfg.seq_len / (end - first) if timed_steps else float("nan")
    return {"loss": losses, "seconds": end - start, "tokens_per_s": tokens_per_s, "config": asdict(cfg)}
