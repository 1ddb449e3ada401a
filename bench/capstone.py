"""Every parallelism composed (notebook 14): tokens/s per layout against one process, bytes per axis against
the formula, and the wall time of the 16-rank proofs.

    python bench/capstone.py [--quick] [--impl solutions|exercises]

1. Tokens/s. One training step (labkit.compose.train_step: 1F1B, gradient sums, AdamW) of each layout in
   float32, every rank one torch thread, against one process training the same model on the same global
   batch (a plain model and torch's AdamW), launched the same way in the same run. A step's time is the
   slowest rank's (the step ends with an all-reduce of the loss, so every rank waits for the last); the
   minimum over repeats, since the machine is shared. On a laptop all ranks share 2 cores, so the ratio
   mostly measures the overhead of splitting a tiny model (messages, Python, oversubscription), not the
   speed-up a GPU per rank would give.
2. Bytes per axis. In each dense layout one more step runs under `labkit.compose.trace.axis_spans`; the
   payload S (labkit.comm.ops) every rank sends or receives on each set of mesh axes is compared with
   `bytes_by_axes` (the closed form): "exact" means equal on every rank. MoE layouts are listed without a
   formula (the EP all-to-all's sizes depend on the routing).
3. Proof wall time: the 16-rank all-five layout (dp2 ep2 pp2 cp2 tp2, tiny-moe) and a 4-axis 16-rank
   layout (dp2 pp2 cp2 tp2, dense), K = 3 AdamW steps in float64, launch included, weights gathered and
   compared with one process (max |difference| printed); minimum over repeats.
Prints a table, then as its last line one JSON object.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def configs(quick):
    from labkit.model import get_config
    if quick:
        dense = get_config("tiny", d_model=32, n_heads=4, n_layers=4, hidden_dim=64, vocab_size=128, context=64)
        moe = get_config("tiny-moe", d_model=32, n_heads=4, hidden_dim=32, vocab_size=128, context=64,
                         capacity_factor=2.0)
        return dense, moe
    dense = get_config("tiny", n_layers=8)
    moe = get_config("tiny-moe", capacity_factor=float(get_config("tiny-moe").n_experts))
    return dense, moe


def batch(cfg, B, S, k, seed=1):
    import torch
    t = torch.randint(0, cfg.vocab_size, (k, B, S + 1), generator=torch.Generator().manual_seed(seed))
    return t[..., :-1], t[..., 1:]


def single_rank(rank, world, cfg, B, S, repeats):
    """Seconds per step of one process on the whole batch (min over repeats), float32."""
    import torch
    from labkit.compose.step import ADAMW
    from labkit.model import build_model
    torch.set_num_threads(1)
    model = build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    X, Y = batch(cfg, B, S, repeats + 1)
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        opt.zero_grad()
        model(X[i], Y[i]).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def layout_rank(rank, world, dims, cfg, B, S, repeats):
    """(seconds per step, min over repeats, slowest rank; measured payload per axes; the formula or None)."""
    import torch
    import torch.distributed as dist
    from labkit.compose.model import parallelize
    from labkit.compose.step import ComposedOptimizer, train_step
    from labkit.compose.trace import axis_spans, bytes_by_axes
    from labkit.model import build_model
    torch.set_num_threads(1)
    dims.check(cfg, batch=B, seq_len=S, world_size=world)
    mesh = dims.build_mesh(world)
    model = build_model(cfg, seed=0)
    stage = parallelize(model, mesh=mesh)
    opt = ComposedOptimizer(stage, mesh=mesh, zero=dims.zero)
    X, Y = batch(cfg, B, S, repeats + 2)
    times = []
    for i in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        train_step(stage, opt, X[i], Y[i], mesh=mesh, microbatches=dims.microbatches)
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    with axis_spans(mesh) as calls:
        train_step(stage, opt, X[-1], Y[-1], mesh=mesh, microbatches=dims.microbatches)
    formula = None if cfg.n_experts or dims.zero else bytes_by_axes(model, dims, mesh.coords(), batch=B, seq_len=S,
                                                                    element=4)
    return min(times[1:]), calls.payload_by_axes(), formula


def proof_rank(rank, world, dims, cfg, B, S, k):
    import torch
    from labkit.compose.model import parallelize
    from labkit.compose.state import full_state
    from labkit.compose.step import ComposedOptimizer, train_step
    from labkit.model import build_model
    torch.set_num_threads(1)
    mesh = dims.build_mesh(world)
    stage = parallelize(build_model(cfg, seed=0).double(), mesh=mesh)
    opt = ComposedOptimizer(stage, mesh=mesh, zero=dims.zero)
    X, Y = batch(cfg, B, S, k)
    losses = [train_step(stage, opt, X[i], Y[i], mesh=mesh, microbatches=dims.microbatches) for i in range(k)]
    opt.begin_step()
    return losses, full_state(stage, mesh=mesh)


def one_process_state(cfg, B, S, k):
    import torch
    from labkit.compose.step import ADAMW
    from labkit.model import build_model
    model = build_model(cfg, seed=0).double()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    X, Y = batch(cfg, B, S, k)
    for i in range(k):
        opt.zero_grad()
        model(X[i], Y[i]).backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--impl", default="solutions", choices=["solutions", "exercises"])
    args = parser.parse_args()
    os.environ["LABKIT_IMPL"] = args.impl
    import warnings

    from labkit.compose.dims import ParallelDims
    from labkit.compose.state import merge
    from labkit.launching.launcher import OversubscriptionWarning, launch
    warnings.filterwarnings("ignore", category=OversubscriptionWarning)

    dense, moe = configs(args.quick)
    B, S, repeats, proof_repeats = (16, 64, 3, 2) if args.quick else (32, 128, 7, 3)
    P = ParallelDims
    layouts = [(P(dp=2), "dense"), (P(tp=2), "dense"), (P(cp=2), "dense"), (P(pp=2, microbatches=2), "dense"),
               (P(dp=2, ep=2), "moe"), (P(dp=2, tp=2), "dense"), (P(pp=2, cp=2, tp=2, microbatches=2), "dense"),
               (P(dp=2, pp=2, cp=2, tp=2, microbatches=2), "dense"),
               (P(dp=2, pp=2, cp=2, tp=2, ep=2, microbatches=2), "moe")]
    if not args.quick:
        layouts += [(P(dp=4, pp=2, tp=2, microbatches=4), "dense"), (P(dp=4, ep=4, pp=2, cp=2, microbatches=2), "moe")]
    start = time.time()
    single = {name: launch(single_rank, 1, cfg, B, S, repeats, timeout=600)[0]
              for name, cfg in (("dense", dense), ("moe", moe))}
    tokens = B * S
    print(f"{B} x {S} tokens per step, float32, one torch thread per rank, impl={args.impl}, "
          f"step time = slowest rank, min over {repeats} repeats")
    print(f"one process: dense {tokens / single['dense']:.0f} tokens/s, moe {tokens / single['moe']:.0f} tokens/s")
    print(f"{'layout':26} {'model':5} {'ranks':>5} {'tokens/s':>9} {'/ one':>6}  bytes per step per axes "
          "(rank 0, payload S) and formula")
    rows = []
    for dims, name in layouts:
        out = launch(layout_rank, dims.world_size, dims, dense if name == "dense" else moe, B, S, repeats, timeout=600)
        seconds = out[0][0]
        payload = out[0][1]
        exact = None if out[0][2] is None else all(measured == formula for _, measured, formula in out)
        rate = tokens / seconds
        axes = " ".join(f"{'+'.join(a)}={n}" for a, n in sorted(payload.items(), key=lambda kv: (len(kv[0]), kv[0])))
        verdict = "no formula (routing)" if exact is None else ("exact" if exact else "DIFFERS")
        print(f"{dims.short():26} {name:5} {dims.world_size:5} {rate:9.0f} {rate * single[name] / tokens:6.2f}  "
              f"{axes}  [{verdict}]")
        rows.append(dict(layout=dims.short(), model=name, ranks=dims.world_size, tokens_per_s=round(rate, 1),
                         over_single=round(rate * single[name] / tokens, 4),
                         bytes_by_axes={"+".join(a): n for a, n in payload.items()}, bytes_exact=exact))
    proofs = {}
    for label, dims, cfg in (("all_five_16", P(dp=2, pp=2, cp=2, tp=2, ep=2, microbatches=2), moe),
                             ("four_axis_16", P(dp=2, pp=2, cp=2, tp=2, microbatches=2), dense)):
        ref = one_process_state(cfg, 8, 16, 3)
        walls, worst = [], None
        for _ in range(proof_repeats):
            t0 = time.perf_counter()
            out = launch(proof_rank, dims.world_size, dims, cfg, 8, 16, 3, timeout=600)
            state = merge(o[1] for o in out)
            worst = max((state[n] - ref[n]).abs().max().item() for n in ref)
            walls.append(time.perf_counter() - t0)
        proofs[label] = dict(layout=dims.short(), wall_s=round(min(walls), 2), max_weight_diff=worst)
        print(f"proof {dims.short():24} ({dims.world_size} ranks, 3 AdamW steps, float64): {min(walls):.1f} s wall "
              f"(min of {proof_repeats}), max |weight - one process| = {worst:.1e}")
    ok = all(r["bytes_exact"] is not False for r in rows) and all(p["max_weight_diff"] < 1e-9 for p in proofs.values())
    print(f"({time.time() - start:.0f} s in all)")
    print(json.dumps({"bench": "capstone", "tokens_per_step": tokens, "quick": args.quick,
                      "single_tokens_per_s": {k: round(tokens / v, 1) for k, v in single.items()},
                      "layouts": rows, "proofs": proofs, "all_exact": ok}))
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
