"""Count what a block of code sends: calls and bytes per op and per group, from `labkit.comm.intercept`.

    from labkit.comm.traffic import count_traffic
    with count_traffic(groups={"tp": tp_group, "dp": dp_group}) as traffic:
        loss = model(x, y); loss.backward()
    traffic.by_op()                 # {'all_reduce': 4, 'all_gather_single': 2}
    traffic.payload(op="all_reduce", group="tp")   # S summed, in bytes (labkit.comm.ops)
    traffic.wire()                  # bytes that crossed this rank's link (a Fraction)
    traffic.log()                   # [(op, payload), ...] in call order

Groups are named by `groups` (name -> process group); the default group is "world"; any
other group by its global ranks, "ranks 0,2". Counts are of this rank's calls only.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from fractions import Fraction

from labkit.comm.intercept import Call, Hook, _group_ranks, intercept


@dataclass(frozen=True)
class Record:
    """One counted call: op, group name, payload S (bytes), wire bytes."""
    op: str
    group: str
    payload: int
    wire: Fraction


class Traffic(Hook):
    """The calls counted so far (`records`, in call order) and their sums; see the module docstring."""

    def __init__(self, groups: dict | None = None):
        self.records: list[Record] = []
        self._names = {}
        world, _ = _group_ranks(None)
        self._names[tuple(world)] = "world"
        for name, group in (groups or {}).items():
            ranks, _ = _group_ranks(group)
            if ranks:
                self._names[tuple(ranks)] = name

    def _name(self, call: Call) -> str:
        key = tuple(call.ranks)
        return self._names.get(key) or "ranks " + ",".join(map(str, key))

    def after(self, call: Call, result) -> None:
        self.records.append(Record(call.op, self._name(call), call.payload, call.wire))

    def _select(self, op, group):
        return [r for r in self.records if (op is None or r.op == op) and (group is None or r.group == group)]

    def calls(self, op: str | None = None, group: str | None = None) -> int:
        return len(self._select(op, group))

    def payload(self, op: str | None = None, group: str | None = None) -> int:
        """Sum of the payloads S in bytes (of `op` / on `group` when given)."""
        return sum(r.payload for r in self._select(op, group))

    def wire(self, op: str | None = None, group: str | None = None) -> Fraction:
        """Sum of the wire bytes (exact), of `op` / on `group` when given."""
        return sum((r.wire for r in self._select(op, group)), Fraction(0))

    def by_op(self) -> dict:
        """{op: calls}, in the order of their first call."""
        out = {}
        for r in self.records:
            out[r.op] = out.get(r.op, 0) + 1
        return out

    def by_group(self) -> dict:
        """{(op, group): (calls, payload bytes, wire bytes)}."""
        out = {}
        for r in self.records:
            calls, payload, wire = out.get((r.op, r.group), (0, 0, Fraction(0)))
            out[(r.op, r.group)] = (calls + 1, payload + r.payload, wire + r.wire)
        return out

    def log(self, group: str | None = None) -> list:
        """[(op, payload bytes)] in call order (on `group` when given)."""
        return [(r.op, r.payload) for r in self._select(None, group)]

    def reset(self) -> None:
        self.records.clear()

    def __repr__(self) -> str:
        return f"Traffic({len(self.records)} calls, {self.payload()} B payload, {float(self.wire()):g} B on the wire)"


@contextlib.contextmanager
def count_traffic(groups: dict | None = None):
    """Inside the block, count every op of labkit.comm.ops this rank calls; yields a Traffic."""
    with intercept(Traffic(groups)) as traffic:
        yield traffic
