"""Tokens/s of the lab's training step against a plain PyTorch loop, in one run.

    python bench/single_device.py [--quick] [--config tiny] [--device cpu|cuda] [--dtype fp32|bf16]

The lab's step is `labkit.training.loop.train_step` as notebook 01 uses it (AdamW with
parameter groups, learning-rate schedule, gradient clipping, input checks). The plain loop
is what one writes first: logits, F.cross_entropy, zero_grad, backward, AdamW.step.
Both train the same model (same seed) on the same batches; the timed segments alternate
(lab, plain, lab, plain, ...) so that a busy machine slows both alike, and the ratio is the
median over rounds of lab tokens/s / plain tokens/s (aim: >= 0.95). On a CPU, time is the
process's CPU time (tokens per CPU-second), which other jobs on a shared machine do not
distort; on a GPU it is the wall clock.
On a GPU the table adds MFU (labkit.measure.metrics), and without --quick the `seed` config too.
Last line of stdout: one JSON object.
"""
import argparse
import json
import os
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads distort timings on a busy machine

import torch
import torch.nn.functional as F

from labkit.data import get_batch, load_tokens
from labkit.measure.metrics import format_rate, mfu
from labkit.model import build_model, get_config
from labkit.training.loop import TrainConfig, lr_at, make_optimizer, train_step


SIZES = {"wide": get_config("seed", d_model=768, n_heads=12, n_layers=12)}  # the seed model at GPT-2 small's width


def plain_loop(model, opt, batches, autocast):
    for x, y in batches:
        with autocast:
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss


def lab_loop(model, opt, batches, autocast, cfg, first_step):
    for i, (x, y) in enumerate(batches):
        with autocast:
            loss = train_step(model, opt, x, y, lr=lr_at(first_step + i, cfg), grad_clip=cfg.grad_clip)
    return loss


def measure(config, batch_size, seq_len, rounds, steps, device, dtype, tokens):
    cfg = TrainConfig(steps=rounds * steps + 2, batch_size=batch_size, seq_len=seq_len, warmup=2)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bf16" else nullcontext()
    lab_model, plain_model = build_model(config, seed=0, device=device), build_model(config, seed=0, device=device)
    lab_opt = make_optimizer(lab_model, cfg)
    plain_opt = torch.optim.AdamW(plain_model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    batches = [get_batch(tokens, batch_size, seq_len, s, device=device) for s in range(steps)]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    # On a CPU the clock is this process's CPU time (all its threads): other people's jobs on a
    # shared machine then slow neither side. On a GPU it is the wall clock, after a sync.
    clock = time.perf_counter if device.type == "cuda" else time.process_time

    def timed(fn):
        sync()
        start = clock()
        loss = fn()
        loss.item()  # waits for the device
        return steps * batch_size * seq_len / (clock() - start)

    timed(lambda: lab_loop(lab_model, lab_opt, batches[:2], autocast, cfg, 0))  # warm-up both
    timed(lambda: plain_loop(plain_model, plain_opt, batches[:2], autocast))
    lab, plain = [], []
    for r in range(rounds):
        lab.append(timed(lambda: lab_loop(lab_model, lab_opt, batches, autocast, cfg, 2 + r * steps)))
        plain.append(timed(lambda: plain_loop(plain_model, plain_opt, batches, autocast)))
    ratio = statistics.median(a / b for a, b in zip(lab, plain))
    return statistics.median(lab), statistics.median(plain), ratio, lab_model.config


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a minute on 2 CPU cores)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default=None, help="default: bf16 on cuda, fp32 on cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    torch.backends.cuda.matmul.allow_tf32 = True
    tokens = load_tokens("tinystories")
    runs = [("tiny", 16, 128, 7, 2)] if args.quick or device.type == "cpu" else [("tiny", 64, 128, 5, 20)]
    if device.type == "cuda":  # three sizes: launch-bound (tiny) to matmul-bound (wide, GPT-2 small's shape)
        runs.append(("seed", 32, 256, 3, 5) if args.quick else ("seed", 64, 256, 5, 20))
        runs.append(("wide", 16, 256, 3, 5) if args.quick else ("wide", 32, 256, 5, 10))
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else f'{os.cpu_count()} CPU cores, {torch.get_num_threads()} threads'}), {dtype}")
    print(f"{'config':<7}{'batch':>7}{'seq':>6}{'lab':>16}{'plain':>16}{'ratio':>8}{'MFU':>8}")
    results = {"bench": "single_device", "device": str(device), "dtype": dtype}
    for config, b, t, rounds, steps in runs:
        lab, plain, ratio, cfg = measure(SIZES.get(config, config), b, t, rounds, steps, device, dtype, tokens)
        util = mfu(lab, cfg, t, device, torch.bfloat16 if dtype == "bf16" else torch.float32)
        shown = "-" if util is None else f"{100 * util:.1f}%"
        print(f"{config:<7}{b:>7}{t:>6}{format_rate(lab):>16}{format_rate(plain):>16}{ratio:>8.3f}{shown:>8}")
        results[config] = {"batch_size": b, "seq_len": t, "lab_tokens_per_s": round(lab, 1),
                           "plain_tokens_per_s": round(plain, 1), "ratio": round(ratio, 4), "mfu": util}
    results["ratio"] = results["tiny"]["ratio"]
    print(f"lab, plain: median tokens/s over rounds ({'wall clock' if device.type == 'cuda' else 'per CPU-second'}); "
          "ratio: median of lab/plain per round; MFU: '-' on a CPU or an unknown GPU")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
