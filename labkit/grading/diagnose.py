"""Say where a wrong result first goes wrong, not only that it is wrong.

Two tools for grading messages:

- Rank tags: in an all-reduce, rank r contributes ``rank_tag(r) = 16 ** r`` (int64). Each
  rank owns one hexadecimal digit of every sum, so any element tells which ranks' values
  it holds and how many times each (a rank added twice shows as a 2, not as another
  rank). `allreduce_mismatch` reads a result that way and names the first wrong place:
  "chunk 2 (elements 6-8) on rank 1 holds the sum of ranks {1, 2} only (missing {0, 3})".
- Named tensors: `first_differences(got, want)` compares two {name: tensor} dicts (weights,
  gradients) in the reference's order, and `assert_same_named` fails with the first
  differing name, by how much, and how many others differ.
- Shards and frozen parameters: `shard_mismatch` says which piece of a flat vector a rank's
  shard holds (its global rank's instead of its group rank's, say); `frozen_changes` names a
  frozen parameter that an optimizer moved.
"""
from __future__ import annotations

import torch

from labkit.grading.closeness import largest_difference

DIGIT_BITS = 4  # up to 15 copies of one rank's value before the digits overflow
MAX_RANKS = 63 // DIGIT_BITS  # int64 holds 15 digits


def rank_tag(rank: int) -> int:
    """The value rank `rank` contributes: one hexadecimal digit of its own."""
    if not 0 <= rank < MAX_RANKS:
        raise ValueError(f"rank tags need rank < {MAX_RANKS} (int64 digits), got rank {rank}")
    return 1 << (DIGIT_BITS * rank)


def tagged(rank: int, numel: int) -> torch.Tensor:
    """A flat int64 tensor of `numel` copies of rank_tag(rank)."""
    return torch.full((numel,), rank_tag(rank), dtype=torch.int64)


def decode(value: int, world_size: int) -> dict | None:
    """{rank: how many times its tag is in value}, or None if value is no such sum."""
    if value < 0 or value >> (DIGIT_BITS * world_size):
        return None
    mask = (1 << DIGIT_BITS) - 1
    return {r: (value >> (DIGIT_BITS * r)) & mask for r in range(world_size) if (value >> (DIGIT_BITS * r)) & mask}


def _set(ranks) -> str:
    return "{" + ", ".join(map(str, sorted(ranks))) + "}"


def describe(value: int, members, world_size: int) -> str:
    """What `value` holds, against the expected sum of one tag per rank in `members`."""
    counts = decode(value, world_size)
    if counts is None:
        return f"the value {value}, which is no sum of the ranks' values (each rank adds 16**rank)"
    if not counts:
        return "0: no rank's value at all"
    extra = [f"rank {r} counted {c} times" for r, c in counts.items() if c > 1]
    outsiders = sorted(set(counts) - set(members))
    missing = sorted(set(members) - set(counts))
    text = f"the sum of ranks {_set(counts)}"
    if missing and not extra and not outsiders:
        return f"{text} only (missing {_set(missing)})"
    notes = extra + ([f"ranks {_set(outsiders)} are not in the group"] if outsiders else [])
    notes += [f"missing {_set(missing)}"] if missing else []
    return f"{text} ({'; '.join(notes)})"


def allreduce_mismatch(result: torch.Tensor, rank: int, members, world_size: int, bounds=None,
                       phase: str = "after the all-reduce") -> str | None:
    """None if every element of `result` (on global rank `rank`) is the sum of one tag per
    rank of `members`; else where it first goes wrong, e.g.
    "after the all-reduce, chunk 2 (elements 6-8) on rank 1 holds the sum of ranks {1, 2}
    only (missing {0, 3})". `bounds`: the ring's chunk bounds (chunk i is
    [bounds[i], bounds[i+1])) to name the chunk; without them the elements are named.
    """
    flat = result.detach().reshape(-1).cpu()
    want = sum(rank_tag(r) for r in members)
    wrong = (flat != want).nonzero().flatten().tolist()
    if not wrong:
        return None
    first = wrong[0]
    value = int(flat[first])
    last = first  # the run of elements holding the same wrong value
    while last + 1 < flat.numel() and int(flat[last + 1]) == value:
        last += 1
    span = lambda a, b: f"element {a}" if a == b else f"elements {a}-{b}"  # noqa: E731
    where = span(first, last)
    if bounds is not None:
        chunk = max(i for i in range(len(bounds) - 1) if bounds[i] <= first)
        lo, hi = bounds[chunk], bounds[chunk + 1] - 1
        last = min(last, hi)
        where = f"chunk {chunk} ({span(lo, hi)})"
        if (first, last) != (lo, hi):
            where = f"{span(first, last)} of chunk {chunk} ({span(lo, hi)})"
    others = len(wrong) - (last - first + 1)
    tail = f"; {others} more wrong element{'s' * (others != 1)} on this rank" if others else ""
    return f"{phase}, {where} on rank {rank} holds {describe(value, members, world_size)}{tail}"


# --- named tensors: weights, gradients ----------------------------------------------------


def _difference(name, got, want, rtol, atol):
    """None if close, else a short text: what differs and by how much."""
    if want is None or got is None:
        return None if got is None and want is None else \
            f"{name!r} is {'None' if got is None else 'set'} but should be {'None' if want is None else 'set'}"
    if got.shape != want.shape:
        return f"{name!r} has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    try:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, check_dtype=False, check_device=False)
        return None
    except AssertionError:
        pass
    d = largest_difference(got, want)
    scale = want.detach().double().abs().max().item() if want.numel() else 0.0
    return (f"{name!r}: max abs diff {d['max']:.3g} at index {d['where']} "
            f"(got {d['got']:.6g}, expected {d['want']:.6g}; largest expected magnitude {scale:.3g})")


def first_differences(got: dict, want: dict, rtol=None, atol=None) -> list:
    """The names that differ, in `want`'s order, each with a one-line description.

    Missing and unexpected names count as differences. rtol/atol as assert_close
    (None: its defaults for the dtype).
    """
    if (rtol is None) != (atol is None):
        raise ValueError(f"give both rtol and atol, or neither (got rtol={rtol}, atol={atol})")
    out = []
    for name in want:
        if name not in got:
            out.append((name, f"{name!r} is missing"))
            continue
        text = _difference(name, got[name], want[name], rtol, atol)
        if text:
            out.append((name, text))
    out += [(name, f"{name!r} is unexpected") for name in got if name not in want]
    return out


def assert_same_named(got: dict, want: dict, what: str = "tensor", where: str = "", rtol=None, atol=None,
                      hint: str = ""):
    """AssertionError naming the first differing `what` (by name, in want's order) and by how much.

    hint: the likely cause, appended to the message.
    """
    differences = first_differences(got, want, rtol, atol)
    if not differences:
        return
    names = [name for name, _ in differences]
    listed = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
    prefix = f"{where}: " if where else ""
    raise AssertionError(f"{prefix}first differing {what}: {differences[0][1]}; "
                         f"{len(names)} of {len(want)} differ ({listed})" + (f". {hint}" if hint else ""))


# --- shards and frozen parameters -------------------------------------------------------------

def shard_mismatch(shard: torch.Tensor, flat: torch.Tensor, group_rank: int, global_rank: int,
                   world_size: int, what: str = "the shard") -> str | None:
    """None if `shard` is piece `group_rank` of the 1-D `flat` cut into `world_size` equal pieces;
    else which piece it holds, in words, e.g. "the shard on global rank 3 (rank 1 of its group of
    2) has 0 elements, expected 29 (elements 29-57 of the flat vector): its piece is the one of
    its GLOBAL rank 3, ...". `flat` is the whole padded vector (length a multiple of world_size).
    """
    s = flat.numel() // world_size
    lo, hi = group_rank * s, (group_rank + 1) * s
    want = flat[lo:hi]
    got = shard.detach().reshape(-1).to(flat.dtype)
    if got.numel() == s and torch.equal(got, want):
        return None
    where = (f"{what} on global rank {global_rank} (rank {group_rank} of its group of {world_size})")
    expected = f"elements {lo}-{hi - 1} of the flat, padded vector (piece {group_rank} of {world_size})"
    by_global = flat[global_rank * s:(global_rank + 1) * s]
    global_hint = ("its piece is the one of its GLOBAL rank: take the rank in the group, "
                   "dist.get_rank(group), not dist.get_rank()")
    if global_rank != group_rank and got.numel() == by_global.numel() and torch.equal(got, by_global):
        return f"{where} holds {'nothing' if not s or not got.numel() else 'piece ' + str(global_rank)}, " \
               f"expected {expected}: {global_hint}"
    if got.numel() != s:
        cause = global_hint if global_rank != group_rank and global_rank * s >= flat.numel() else \
            f"a shard holds ceil(numel / N) = {s} elements, N the size of the group"
        return f"{where} has {got.numel()} elements, expected {s} ({expected}): {cause}"
    for k in range(world_size):
        if torch.equal(got, flat[k * s:(k + 1) * s]):
            return f"{where} holds piece {k}, expected {expected}: the piece index is the rank in the group"
    return (f"{where} holds no piece of the flat vector, expected {expected}: flatten the TRAINABLE parameters "
            "(requires_grad=True) in order, zero-padded to a multiple of the group's size")


def frozen_changes(before: dict, model) -> str | None:
    """None if every frozen parameter named in `before` ({name: value before}) is bit for bit unchanged
    in `model` (a module, or a {name: tensor} dict); else the first that moved, in words."""
    now = dict(model.named_parameters()) if hasattr(model, "named_parameters") else dict(model)
    for name, old in before.items():
        new = now[name].detach()
        if not torch.equal(new, old):
            diff = (new.double() - old.double()).abs().max().item()
            return (f"frozen parameter {name!r} (requires_grad=False) changed: max abs diff {diff:.3g}, "
                    f"expected 0 (unchanged): an optimizer must leave frozen parameters untouched; write back "
                    "into the trainable parameters only (requires_grad=True), the ones that were flattened")
    return None


# --- collectives on the wrong group ---------------------------------------------------------

class WrongGroupError(AssertionError):
    """A collective ran on another group than the one the exercise was given."""


class watch_groups:
    """Inside the block, a torch.distributed op (any of labkit.comm.ops) on any group but `group`
    raises WrongGroupError BEFORE it runs (so it cannot hang or disturb the other ranks):
    "all_reduce on the default group (ranks [0, 1, 2, 3]) ... pass group=group".

    `what`: the exercise, named in the message. Catches code that ignores its group=
    argument; a rank not in `group` must issue no collective at all. A hook of
    labkit.comm.intercept: it composes with SlowLink and count_traffic.
    """

    def __init__(self, group, what: str):
        self.group, self.what, self._block = group, what, None

    def before(self, call) -> None:
        import torch.distributed as dist

        if call.ranks != self.wanted:
            used = call.group
            label = "the default group" if used is None or used is dist.group.WORLD else "a group"
            raise WrongGroupError(
                f"{self.what} was given group= the ranks {self.wanted}, but it called dist.{call.op} on "
                f"{label} (ranks {call.ranks}): pass group=group to every collective, and give "
                f"src/dst as global ranks (or group_src/group_dst as ranks in the group)")

    def after(self, call, result) -> None:
        pass

    def __enter__(self):
        import torch.distributed as dist

        from labkit.comm.intercept import intercept

        self.wanted = dist.get_process_group_ranks(self.group or dist.group.WORLD)
        self._block = intercept(self)
        self._block.__enter__()
        return self

    def __exit__(self, *exc):
        block, self._block = self._block, None
        block.__exit__(*exc)
        return False


# --- averages of rank tags: what a gradient average over a group holds ----------------------


def average_mismatch(result: torch.Tensor, rank: int, members, world_size: int, divisor: int) -> str | None:
    """None if every element of `result` is (the sum of one rank tag per rank of `members`) /
    `divisor`; else what the first wrong element holds, in words, e.g. "the sum of ranks
    {0, 1, 2, 3} (ranks {1, 3} are not in the group), divided by 4", "the right sum divided by
    2, instead of divided by 4", "the sum of ranks {0} only (missing {1}), not divided". Tags up
    to 16**(world-1) and divisors up to the world size are exact enough in float64 to compare.
    """
    flat = result.detach().reshape(-1).double().cpu()
    want = sum(rank_tag(r) for r in members)
    wrong = (flat * divisor != want).nonzero().flatten().tolist()
    if not wrong:
        return None
    value = flat[wrong[0]].item()
    where = "every element" if len(wrong) == len(flat) > 1 else \
        f"element {wrong[0]}" + (f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else "")
    head = f"{where} on rank {rank} holds"
    if value and want and value * divisor == -want:
        return f"{head} the expected average with the opposite sign"
    for by in dict.fromkeys([divisor] + list(range(1, world_size + 1))):  # the likeliest reading first
        total = value * by
        counts = decode(int(round(total)), world_size) if abs(total - round(total)) < 1e-6 else None
        if not counts or set(counts.values()) != {1}:
            continue  # not a plain sum of distinct ranks' values at this divisor
        how = "not divided" if by == 1 else f"divided by {by}"
        if set(counts) == set(members):
            return f"{head} the right sum {how}, instead of divided by {divisor}"
        return f"{head} {describe(int(round(total)), members, world_size)}, {how}"
    total = value * divisor
    if total != round(total):
        return f"{head} {value:g}, which is no sum of the ranks' values divided by {divisor}"
    return f"{head} {describe(int(round(total)), members, world_size)}, divided by {divisor}"
