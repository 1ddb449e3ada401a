"""Ring attention (context parallelism): ring step vs one rank, and the causal balance of the splits.

    python bench/context_parallel.py [--quick] [--impl solutions|exercises]

c ranks (labkit.launch, gloo), causal attention of B x H heads over s positions (head dim 32),
forward only. For the contiguous split and the zigzag split, each rank runs
`ring_attention_forward` (k/v blocks passed with isend/irecv while the block in hand is
computed) a few times after a warm-up; the reported step is the median. Columns:

    split       contiguous (rank r takes block r) or zigzag (chunks r and 2c-1-r of 2c)
    work min/max  query x key pairs computed per rank (dense blocks), smallest / largest
    balance     min / max over the ranks: of the pairs computed (work, FLOPs); of each rank's
                pairs computed in one process, in CPU time (cpu: robust on a shared machine);
                and of the ring's measured compute (wall: the 'F' spans of each rank, summed
                over the ring's steps, in wall time, so noisy when other programs run)
    ring ms     wall time of one ring step (the slowest rank)
    one-rank ms the same pairs computed by ONE process, no communication (the c ranks' work
                done one after the other): the same total work
    ratio       ring / one-rank; with perfect balance and free communication it is 1/c

For reference, ring-flash-attention (zhuzilin) reports about 90% of ideal balance for zigzag
and 54% for the naive ring on GPUs. On a shared CPU the time balance is noisy: the pairs column
is the exact figure. The last line is one JSON object with every figure.
--quick: c = 2, s = 1024, 5 measured steps (full: c = 4, s = 4096, 5 steps).
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

B, H, HD = 1, 4, 32
SPLITS = ("contiguous", "zigzag")


def inputs(s, seed=0):
    import torch
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, s, HD, generator=g) for _ in range(3)]


def one_rank(ra, cpm, q, k, v, s, c, split):
    """Every rank's block pairs, computed one after the other in this process (no messages).

    Returns each rank's share in CPU seconds (time.process_time: what another program on the
    same cores takes does not count, unlike wall time).
    """
    import torch
    pieces = [cpm.SPLITS[split](s, c, r) for r in range(c)]
    cpu = []
    for rank in range(c):
        start = time.process_time()
        ql = cpm.take(q, pieces[rank])
        out = None
        for src in range(c):
            kl, vl = cpm.take(k, pieces[src]), cpm.take(v, pieces[src])
            for qp, qs in cpm.local_slices(pieces[rank]):
                for kp, ks in cpm.local_slices(pieces[src]):
                    kind = cpm.pair_kind(qp, kp, "causal")
                    if kind == "none":
                        continue
                    pos = (torch.arange(*qp), torch.arange(*kp)) if kind == "some" else (None, None)
                    o, lse = ra.block_attention(ql[..., qs, :], kl[..., ks, :], vl[..., ks, :], *pos)
                    out = (o, lse) if out is None else ra.merge_partials(out[0], out[1], o, lse)
        cpu.append(time.process_time() - start)
    return cpu


def run_rank(rank, c, s, steps):
    import torch.distributed as dist

    from labkit.grading import impl
    from labkit.measure.timeline import Timeline, busy_time

    ra, cpm = impl("ring_attention"), impl("context_parallel")
    q, k, v = inputs(s)
    out = {}
    for split in SPLITS:
        pieces = cpm.SPLITS[split](s, c, rank)
        mine = [cpm.take(t, pieces) for t in (q, k, v)]
        walls, compute = [], []
        tl = Timeline()
        for i in range(1 + steps):  # the first is a warm-up (it also opens the connections)
            tl.sync()
            start = time.perf_counter()
            ra.ring_attention_forward(*mine, split=split, timeline=tl)
            wall = time.perf_counter() - start
            spans = tl.all_gather()
            if i:
                walls.append(wall)
                compute.append(busy_time(spans))
        out[split] = dict(wall=walls, compute=compute, work=cpm.attention_work(s, c, split))
    baseline = {}
    if rank == 0:
        for split in SPLITS:
            times, cpu = [], []
            for i in range(1 + steps):
                start = time.perf_counter()
                cpu.append(one_rank(ra, cpm, q, k, v, s, c, split))
                times.append(time.perf_counter() - start)
            baseline[split] = statistics.median(times[1:])
            baseline[split, "cpu"] = [statistics.median(run[r] for run in cpu[1:]) for r in range(c)]
    dist.barrier()
    return out, baseline


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="c = 2, s = 1024, 5 measured steps")
    parser.add_argument("--impl", default=os.environ.get("LABKIT_IMPL", "solutions"),
                        choices=["solutions", "exercises"], help="whose ring attention (default: solutions)")
    args = parser.parse_args()
    os.environ["LABKIT_IMPL"] = args.impl

    import warnings

    from labkit.launching.launcher import OversubscriptionWarning, launch

    warnings.simplefilter("ignore", OversubscriptionWarning)
    c, s, steps = (2, 1024, 5) if args.quick else (4, 4096, 5)
    results = launch(run_rank, c, s, steps, timeout=600)
    baseline = results[0][1]
    rows = []
    for split in SPLITS:
        per_rank = [r[0][split] for r in results]
        work = per_rank[0]["work"]
        wall = statistics.median(max(r["wall"][i] for r in per_rank) for i in range(steps))
        # compute time per rank, median over the steps of each rank's summed F spans
        busy = [statistics.median(step[r] for step in per_rank[0]["compute"]) for r in range(c)]
        cpu = baseline[split, "cpu"]
        rows.append(dict(split=split, work=work, work_balance=round(min(work) / max(work), 4),
                         cpu_balance=round(min(cpu) / max(cpu), 4), cpu_ms=[round(1e3 * t, 2) for t in cpu],
                         time_balance=round(min(busy) / max(busy), 4), compute_ms=[round(1e3 * b, 2) for b in busy],
                         ring_ms=round(1e3 * wall, 2), one_rank_ms=round(1e3 * baseline[split], 2),
                         ratio=round(wall / baseline[split], 4)))
    print(f"ring attention forward, c={c} ranks, causal, B={B} H={H} s={s} head dim {HD} ({args.impl})")
    print(f"{'split':11s} {'work min/max':>17s} {'balance: work':>14s} {'cpu':>6s} {'wall':>6s} "
          f"{'ring ms':>9s} {'one-rank ms':>12s} {'ratio':>7s}")
    for r in rows:
        print(f"{r['split']:11s} {min(r['work']):>8d}/{max(r['work']):<8d} {r['work_balance']:>14.2f} "
              f"{r['cpu_balance']:>6.2f} {r['time_balance']:>6.2f} {r['ring_ms']:>9.1f} {r['one_rank_ms']:>12.1f} "
              f"{r['ratio']:>7.2f}")
    print(f"ideal ratio 1/c = {1 / c:.2f}; GPU reference (ring-flash-attention): zigzag ~0.90, naive ~0.54 of ideal")
    zig = rows[1]
    print(json.dumps({"bench": "context_parallel", "c": c, "seq_len": s, "heads": H, "head_dim": HD,
                      "zigzag_balance": zig["work_balance"], "zigzag_cpu_balance": zig["cpu_balance"],
                      "zigzag_time_balance": zig["time_balance"], "contiguous_cpu_balance": rows[0]["cpu_balance"],
                      "contiguous_balance": rows[0]["work_balance"],
                      "contiguous_time_balance": rows[0]["time_balance"],
                      "ring_over_one_rank": zig["ratio"], "rows": rows}))


if __name__ == "__main__":
    main()
