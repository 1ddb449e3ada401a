"""Mistakes planted in the reference code, one at a time, and graded: does a grading test catch each?

    python -m labkit.grading.planted [--topic zero --topic fsdp] [--json results.jsonl]

The catalogue (`MISTAKES`) holds the classes that survived the grading once (issue 36, item 9), planted
in every exercise where they apply: D, the default group where the exercise's group (or mesh axis) is
due (``group=group`` -> ``group=None``); G, the global rank where the rank in the group is due
(``info.rank`` -> ``dist.get_rank()``); F, a frozen or gradient-less parameter mishandled (a None
gradient skipped or counted as a gradient, a frozen parameter included). Each is one text
replacement inside the named exercise's solution blocks (`plant`).

Each run copies the repository (without .git and .venv) to a scratch folder, writes every solution
into its exercises/ with the one mistake planted, and runs that topic's grading file on
``--impl=exercises`` with ``-x``: the ranks the grading tests launch import the planted file from
disk, as they import a learner's, and nothing is patched in any process. A mistake is "caught" when a
test fails; the first failing test and the first line of its message are printed. The learner's own
exercises/ are never touched. About 1-2 minutes per mistake on 2 busy cores: a survey, not a test.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
D, G, F = "default group", "global rank", "frozen/gradless"

# (topic, exercise, class, text in the exercise's solution blocks, what the mistake writes instead)
MISTAKES = [
    ('collectives', 'broadcast', D, 'group=group', 'group=None'),
    ('collectives', 'broadcast', G, 'info.rank', 'dist.get_rank()'),
    ('collectives', 'reduce', D, 'group=group', 'group=None'),
    ('collectives', 'reduce', G, 'info.rank', 'dist.get_rank()'),
    ('collectives', 'all_gather', D, 'group=group', 'group=None'),
    ('collectives', 'all_gather', G, 'info.rank', 'dist.get_rank()'),
    ('collectives', 'scatter', D, 'group=group', 'group=None'),
    ('collectives', 'scatter', G, 'info.rank', 'dist.get_rank()'),
    ('collectives', 'reduce_scatter', D, 'group=group', 'group=None'),
    ('collectives', 'reduce_scatter', G, 'info.rank', 'dist.get_rank()'),
    ('pipeline', 'communicate', G, 'dist.isend(tensor, peer,', 'dist.isend(tensor, group_dst=peer,'),
    ('all_to_all', 'all_to_all_single', D, 'group=group', 'group=None'),
    ('all_to_all', 'all_to_all_single', G, 'info.rank', 'dist.get_rank()'),
    ('cp_methods', 'seq_to_heads', D, 'group=group', 'group=None'),
    ('cp_methods', 'heads_to_seq', D, 'group=group', 'group=None'),
    ('data_parallel', 'sync_gradients', F, 'if count > 0:', 'if True:'),
    ('data_parallel', 'BucketedDataParallel', F, 'if count > 0:', 'if True:'),
    ('expert_parallel', 'dispatch', D, 'group=group', 'group=None'),
    ('expert_parallel', 'combine', D, 'group=group', 'group=None'),
    ('expert_parallel', 'sync_gradients', D, 'group=mesh.group(axes)', 'group=None'),
    ('expert_parallel', 'sync_gradients', F, 'p.grad = torch.zeros_like(p)', 'continue'),
    ('fsdp', 'FlatShard', D, 'group=self.group', 'group=None'),
    ('fsdp', 'FlatShard', G, 'self.rank', 'dist.get_rank()'),
    ('fsdp', 'FlatShard', F, 'grads_or_zeros(self.params)', '[p.grad for p in self.params if p.grad is not None]'),
    ('hierarchical', 'hierarchical_allreduce', D, 'group=inter', 'group=None'),
    ('hsdp', 'hsdp_sync', D, 'group=replica_group', 'group=None'),
    ('hsdp', 'HSDPOptimizer', D, 'group=self.shard_group', 'group=None'),
    ('hsdp', 'HSDPOptimizer', F, 'grads_or_zeros(self.params)', '[p.grad for p in self.params if p.grad is not None]'),
    ('hybrid', 'hybrid_step', D, 'group=mesh.group("dp")', 'group=None'),
    ('mixed_precision', 'DynamicLossScaler', F, 'if p.grad is not None:', 'if True:'),
    ('moe_overlap', 'TwoBatchEPMoE', D, 'group=self.group', 'group=None'),
    ('moe_overlap', 'TwoBatchEPMoE', D, 'ep = dist.get_world_size(self.group)', 'ep = dist.get_world_size()'),
    ('placement', 'local_batch', G, 'mesh.coord("cp")', 'dist.get_rank()'),
    ('sequence_parallel', 'GatherSequence', D, 'group=ctx.group', 'group=None'),
    ('sequence_parallel', 'GatherSequence', D, 'all_gather_sequence(x, group=group)', 'all_gather_sequence(x, group=None)'),
    ('sequence_parallel', 'ScatterSequence', D, 'group=ctx.group', 'group=None'),
    ('sequence_parallel', 'ScatterSequence', D, 'reduce_scatter_sequence(x, group=group)', 'reduce_scatter_sequence(x, group=None)'),
    ('single_device', 'sgd_step', F, 'if p.grad is not None:', 'if True:'),
    ('slow_links', 'average_pseudo_gradients', D, 'group=group', 'group=None'),
    ('slow_links', 'average_pseudo_gradients', F, 'params = _trainable(model)', 'params = list(model.parameters())'),
    ('slow_links', 'DiLoCo', D, 'group=self.group', 'group=None'),
    ('slow_links', 'PowerSGD', D, 'group=self.group', 'group=None'),
    ('tensor_parallel', 'ColumnParallelLinear', G, 'rank, world = tp_world(group)', 'rank, world = dist.get_rank(), tp_world(group)[1]'),
    ('tensor_parallel', 'ColumnParallelLinear', D, 'group=self.group', 'group=None'),
    ('tensor_parallel', 'RowParallelLinear', G, 'rank, world = tp_world(group)', 'rank, world = dist.get_rank(), tp_world(group)[1]'),
    ('tensor_parallel', 'RowParallelLinear', D, 'group=self.group', 'group=None'),
    ('tensor_parallel', 'ParallelMLP', D, 'group=group', 'group=None'),
    ('vocab_parallel', 'VocabParallelCrossEntropy', D, 'group=group', 'group=None'),
    ('vocab_parallel', 'VocabParallelCrossEntropy', G, 'rank, world = tp_world(group)', 'rank, world = dist.get_rank(), tp_world(group)[1]'),
    ('zero_bubble', 'backward_weight', F, '        if grad is None:\n            continue\n', ''),
    ('zero', 'ShardedOptimizer', G, 'self.rank', 'dist.get_rank()'),
    ('zero', 'ShardedOptimizer', D, 'group=self.group', 'group=None'),
    ('zero2', 'Zero2Optimizer', G, 'self.rank', 'dist.get_rank()'),
    ('zero2', 'Zero2Optimizer', D, 'group=self.group', 'group=None'),
    ('allreduce', 'naive_allreduce', D, 'group=group', 'group=None'),
    ('allreduce', 'naive_allreduce', G, 'info.rank', 'dist.get_rank()'),
    ('allreduce', 'ring_allreduce', D, 'left, group)', 'left, None)'),
    ('allreduce', 'ring_allreduce', G, 'n, r = info.size, info.rank', 'n, r = info.size, dist.get_rank()'),
    ('allreduce', 'pipelined_ring_allreduce', D, 'group=group', 'group=None'),
    ('allreduce', 'pipelined_ring_allreduce', G, 'n, r = info.size, info.rank', 'n, r = info.size, dist.get_rank()'),
    ('allreduce', 'tree_allreduce', D, 'group=group', 'group=None'),
    ('allreduce', 'tree_allreduce', G, 'n, r = info.size, info.rank', 'n, r = info.size, dist.get_rank()'),
]


def solution_blocks(lines: list[str], exercise: str) -> list[tuple[int, int]]:
    """(first, last) line index of every BEGIN/END SOLUTION block inside the top-level def/class `exercise`."""
    top, start, spans = None, None, []
    for i, line in enumerate(lines):
        found = re.match(r"(def|class) (\w+)", line)
        if found:
            top = found.group(2)
        if "### BEGIN SOLUTION" in line and top == exercise:
            start = i
        elif "### END SOLUTION" in line and start is not None:
            spans.append((start, i))
            start = None
    return spans


def plant(source: str, exercise: str, old: str, new: str) -> tuple[str, int]:
    """`source` with `old` replaced by `new` inside `exercise`'s solution blocks only; and how many were replaced."""
    lines = source.split("\n")
    count = 0
    for first, last in reversed(solution_blocks(lines, exercise)):
        block = "\n".join(lines[first:last + 1])
        count += block.count(old)
        lines[first:last + 1] = block.replace(old, new).split("\n")
    if not count:
        raise ValueError(f"{old!r} is not in the solution blocks of {exercise}: the catalogue is out of date")
    return "\n".join(lines), count


def scratch_copy() -> Path:
    """The repository copied to a fresh temporary folder (its exercises/ get overwritten there)."""
    target = Path(tempfile.mkdtemp(prefix="labkit-planted-")) / "repo"
    shutil.copytree(REPO, target, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.bak-*"))
    return target


def grade(copy: Path, topic: str, exercise: str, old: str, new: str, timeout: int = 900) -> dict:
    """Plant one mistake in `copy` (every other exercise: the reference) and run the topic's grading tests."""
    for solution in (copy / "solutions").glob("*.py"):
        shutil.copy(solution, copy / "exercises" / solution.name)
    text, count = plant((copy / "solutions" / f"{topic}.py").read_text(), exercise, old, new)
    (copy / "exercises" / f"{topic}.py").write_text(text)
    env = dict(os.environ, PYTHONPATH=str(copy), LABKIT_QUICK="1", LABKIT_IMPL="exercises")
    start = time.time()
    run = subprocess.run([sys.executable, "-m", "pytest", f"tests/grading/test_{topic}.py", "--impl=exercises", "-x",
                          "-q", "-p", "no:cacheprovider"], cwd=copy, env=env, capture_output=True, text=True,
                         timeout=timeout)
    out = run.stdout + run.stderr
    failed = [line.split(" ", 1)[1] for line in out.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    said = [line.strip() for line in out.splitlines()
            if re.search(r"(Error|Timeout|hung)\b.*:", line) and "Traceback" not in line
            and not line.strip().startswith(("raise ", "E       raise", "^"))]
    return dict(topic=topic, exercise=exercise, replaced=count, caught=run.returncode != 0 and bool(failed),
                test=failed[0] if failed else None, message=said[0][:400] if said else None,
                seconds=round(time.time() - start))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--topic", action="append", help="only these topics (repeatable)")
    parser.add_argument("--json", help="append one JSON line per mistake to this file")
    args = parser.parse_args(argv)
    copy = scratch_copy()
    survivors = 0
    try:
        for topic, exercise, cls, old, new in MISTAKES:
            if args.topic and topic not in args.topic:
                continue
            result = dict(grade(copy, topic, exercise, old, new), cls=cls, planted=f"{old!r} -> {new!r}")
            survivors += not result["caught"]
            verdict = f"caught by {result['test']}" if result["caught"] else "SURVIVED every grading test"
            print(f"{topic}.{exercise} [{cls}] {result['planted']}: {verdict} ({result['seconds']} s)\n"
                  f"    {result['message']}", flush=True)
            if args.json:
                with open(args.json, "a") as out:
                    out.write(json.dumps(result) + "\n")
    finally:
        shutil.rmtree(copy.parent, ignore_errors=True)
    print(json.dumps({"survivors": survivors}))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
