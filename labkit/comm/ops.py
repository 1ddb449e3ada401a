"""The table of every torch.distributed op the lab uses: payload S and bus factor, as nccl-tests counts.

One definition for every op. The payload S of a call is the collective's size in bytes as
nccl-tests names it (its "size" column):

    op                                   S (bytes)                           bus factor, N ranks
    all_reduce                           the tensor                          2(N-1)/N
    broadcast, reduce                    the tensor                          1
    all_gather                           the gathered output (sum of list)   (N-1)/N
    all_gather_single / _into_tensor     the output tensor                   (N-1)/N
    reduce_scatter                       the input (sum of input_list)       (N-1)/N
    reduce_scatter_single / _tensor      the input tensor                    (N-1)/N
    all_to_all                           the input (sum of input list)       (N-1)/N
    all_to_all_single                    the input tensor                    (N-1)/N
    scatter, gather                      N x this rank's tensor              (N-1)/N
    send, recv, isend, irecv             the message                         1
    batch_isend_irecv                    sum of its P2POps' messages          1
    barrier, monitored_barrier           0                                   0
    *_object(_list)                      0 (pickled size unknown: calls only) 0

(`_all_gather_base` and `_reduce_scatter_base`, torch's older private names, count as their
public forms.) The bytes that cross one rank's link for one call, its *wire bytes*, are
always S x bus factor, and 0 when N = 1 (nothing leaves the process) or when this rank is not
in the group. For the collectives this is what a ring sends per rank (all-reduce: a
reduce-scatter then an all-gather, each (N-1)/N of S); for point-to-point ops it is the
message, counted on the side that calls (send: out, recv: in). For an uneven all-to-all it is
nccl-tests' figure, not the exact bytes of that rank.

Add an op: one row in OPS (its name on `torch.distributed`, how S comes from its bound
arguments, its bus factor), then a case in tests/test_comm.py that checks its count.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

RING = "ring"        # (N-1)/N
ALL_REDUCE = "all_reduce"  # 2(N-1)/N
ONE = "one"          # 1
NONE = "none"        # 0


def nbytes(t) -> int:
    """Bytes of a tensor, or of every tensor in a list/tuple; 0 for None."""
    if t is None:
        return 0
    if isinstance(t, (list, tuple)):
        return sum(nbytes(x) for x in t)
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class Op:
    """One op of the table: `payload(arguments, n)` -> S in bytes; `bus`: one of RING, ALL_REDUCE, ONE, NONE."""
    name: str
    payload: Callable[[dict, int], int]
    bus: str

    def bus_factor(self, n: int) -> Fraction:
        """The bus factor for a group of n ranks (0 when n <= 1: nothing leaves the process)."""
        if n <= 1 or self.bus == NONE:
            return Fraction(0)
        return {RING: Fraction(n - 1, n), ALL_REDUCE: Fraction(2 * (n - 1), n), ONE: Fraction(1)}[self.bus]


def _arg(name):
    return lambda a, n: nbytes(a.get(name))


def _times_n(name):
    return lambda a, n: n * nbytes(a.get(name))


def _p2p_list(a, n):
    return sum(nbytes(op.tensor) for op in a.get("p2p_op_list", []))


def _zero(a, n):
    return 0


_ROWS = [
    ("all_reduce", _arg("tensor"), ALL_REDUCE),
    ("broadcast", _arg("tensor"), ONE),
    ("reduce", _arg("tensor"), ONE),
    ("all_gather", _arg("tensor_list"), RING),
    ("all_gather_single", _arg("output_tensor"), RING),
    ("all_gather_into_tensor", _arg("output_tensor"), RING),
    ("_all_gather_base", _arg("output_tensor"), RING),
    ("reduce_scatter", _arg("input_list"), RING),
    ("reduce_scatter_single", _arg("input"), RING),
    ("reduce_scatter_tensor", _arg("input"), RING),
    ("_reduce_scatter_base", _arg("input"), RING),
    ("all_to_all", _arg("input_tensor_list"), RING),
    ("all_to_all_single", _arg("input"), RING),
    ("scatter", _times_n("tensor"), RING),
    ("gather", _times_n("tensor"), RING),
    ("send", _arg("tensor"), ONE),
    ("recv", _arg("tensor"), ONE),
    ("isend", _arg("tensor"), ONE),
    ("irecv", _arg("tensor"), ONE),
    ("batch_isend_irecv", _p2p_list, ONE),
    ("barrier", _zero, NONE),
    ("monitored_barrier", _zero, NONE),
    ("broadcast_object_list", _zero, NONE),
    ("all_gather_object", _zero, NONE),
    ("gather_object", _zero, NONE),
    ("scatter_object_list", _zero, NONE),
]

OPS: dict[str, Op] = {name: Op(name, payload, bus) for name, payload, bus in _ROWS}


def wire(op: str, payload: int, n: int) -> Fraction:
    """Wire bytes of one call: payload x bus factor of `op` on n ranks (exact)."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}: the table labkit.comm.ops.OPS knows {sorted(OPS)}; add a row there")
    return payload * OPS[op].bus_factor(n)
