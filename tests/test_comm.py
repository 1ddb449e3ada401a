"""The communication layer (labkit.comm): every op of the table is counted with exactly its formula's bytes.

Each op runs on real gloo ranks inside `count_traffic()` and `SlowLink(inf)` at once (two
hooks of one interception); the count must equal the table's formula, computed here by hand
from the tensors' sizes (exact integers; wire bytes as exact Fractions). An op gloo cannot run
(all_to_all of lists) is checked through a hook that reads the call and stops it before it
runs. One launch per world size (3: a bus factor that is not a power of two; 4), every op a
labkit.grading.cases case. Also: hooks compose and restore torch.distributed, a P2POp list counts once,
and a bypass (an op bound at import) is found in source and missed at run time.
About 6 s on 2 cores.
"""
import functools
import warnings
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from labkit.grading.cases import expect_case, launch_cases, run_cases
from labkit.comm import intercept as icpt
from labkit.comm.bypass import find_bindings, scan
from labkit.comm.ops import OPS
from labkit.comm.traffic import count_traffic
from labkit.links.shaper import SlowLink

E = 6          # elements per rank's tensor
S = E * 4      # its bytes (float32)
RING = lambda n: Fraction(n - 1, n)  # noqa: E731  (N-1)/N


class Stop(Exception):
    """Raised by Probe.before: the op is described, then not run."""


class Probe(icpt.Hook):
    def before(self, call):
        self.call = call
        raise Stop


def t(value=1.0, n=E):
    return torch.full((n,), float(value))


# each op case: (rank, n) -> run the op; returns the expected {op: calls}, payload, wire on this rank
def c_all_reduce(r, n):
    dist.all_reduce(t(r))
    return {"all_reduce": 1}, S, S * Fraction(2 * (n - 1), n)


def c_broadcast(r, n):
    dist.broadcast(t(r), src=n - 1)
    return {"broadcast": 1}, S, Fraction(S)


def c_reduce(r, n):
    dist.reduce(t(r), dst=0)
    return {"reduce": 1}, S, Fraction(S)


def c_all_gather(r, n):
    dist.all_gather([t() for _ in range(n)], t(r))
    return {"all_gather": 1}, n * S, n * S * RING(n)


def _flat_gather(name):
    def case(r, n):
        getattr(dist, name)(t(0, n * E), t(r))
        return {name: 1}, n * S, n * S * RING(n)
    return case


def c_reduce_scatter(r, n):
    dist.reduce_scatter(t(), [t(r) for _ in range(n)])
    return {"reduce_scatter": 1}, n * S, n * S * RING(n)


def _flat_scatter(name):
    def case(r, n):
        getattr(dist, name)(t(), t(r, n * E))
        return {name: 1}, n * S, n * S * RING(n)
    return case


def c_all_to_all(r, n):  # gloo has no all_to_all of lists: read the call, do not run it
    probe = Probe()
    with icpt.intercept(probe), pytest.raises(Stop):
        dist.all_to_all([t() for _ in range(n)], [t(r) for _ in range(n)])
    call = probe.call
    assert (call.op, call.payload, call.wire) == ("all_to_all", n * S, n * S * RING(n))
    return {}, 0, Fraction(0)


def c_all_to_all_single(r, n):
    dist.all_to_all_single(t(0, n * E), t(r, n * E))
    return {"all_to_all_single": 1}, n * S, n * S * RING(n)


def c_scatter(r, n):
    dist.scatter(t(), [t(i) for i in range(n)] if r == 0 else None, src=0)
    return {"scatter": 1}, n * S, n * S * RING(n)


def c_gather(r, n):
    dist.gather(t(r), [t() for _ in range(n)] if r == 0 else None, dst=0)
    return {"gather": 1}, n * S, n * S * RING(n)


def c_send_recv(r, n):  # rank 0 -> rank 1 only: the others call nothing
    if r == 0:
        dist.send(t(r, 2 * E), dst=1)
        return {"send": 1}, 2 * S, Fraction(2 * S)
    if r == 1:
        dist.recv(t(0, 2 * E), src=0)
        return {"recv": 1}, 2 * S, Fraction(2 * S)
    return {}, 0, Fraction(0)


def c_isend_irecv(r, n):  # a ring: send to the next rank, receive from the previous
    works = [dist.isend(t(r), dst=(r + 1) % n), dist.irecv(t(), src=(r - 1) % n)]
    for w in works:
        w.wait()
    return {"isend": 1, "irecv": 1}, 2 * S, Fraction(2 * S)


def c_batch_isend_irecv(r, n):  # P2POps built inside the interception; counted once, not per isend
    got = t()
    ops = [dist.P2POp(dist.isend, t(r), (r + 1) % n), dist.P2POp(dist.irecv, got, (r - 1) % n)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert got[0].item() == (r - 1) % n, "the message arrived"
    return {"batch_isend_irecv": 1}, 2 * S, Fraction(2 * S)


def _zero_bytes(name, call):
    def case(r, n):
        call(r, n)
        return {name: 1}, 0, Fraction(0)
    return case


OP_CASES = {
    "all_reduce": c_all_reduce, "broadcast": c_broadcast, "reduce": c_reduce, "all_gather": c_all_gather,
    **{name: _flat_gather(name) for name in ("all_gather_single", "all_gather_into_tensor", "_all_gather_base")},
    "reduce_scatter": c_reduce_scatter,
    **{name: _flat_scatter(name) for name in ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base")},
    "all_to_all": c_all_to_all, "all_to_all_single": c_all_to_all_single, "scatter": c_scatter, "gather": c_gather,
    "send": c_send_recv, "recv": c_send_recv, "isend": c_isend_irecv, "irecv": c_isend_irecv,
    "batch_isend_irecv": c_batch_isend_irecv,
    "barrier": _zero_bytes("barrier", lambda r, n: dist.barrier()),
    "monitored_barrier": _zero_bytes("monitored_barrier", lambda r, n: dist.monitored_barrier()),
    # the object ops run collectives inside torch: counted once, with 0 bytes (control plane)
    "broadcast_object_list": _zero_bytes("broadcast_object_list", lambda r, n: dist.broadcast_object_list([r], src=0)),
    "all_gather_object": _zero_bytes("all_gather_object", lambda r, n: dist.all_gather_object([None] * n, r)),
    "gather_object": _zero_bytes("gather_object", lambda r, n: dist.gather_object(r, [None] * n if r == 0 else None, dst=0)),
    "scatter_object_list": _zero_bytes("scatter_object_list", lambda r, n: dist.scatter_object_list(
        [None], list(range(n)) if r == 0 else None, src=0)),
}


def op_case(name, rank, n):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # all_gather_into_tensor & co. are deprecated aliases
        with SlowLink(float("inf")) as link, count_traffic() as traffic:
            calls, payload, wire = OP_CASES[name](rank, n)
    assert traffic.by_op() == calls and link.by_op == calls, (traffic.by_op(), link.by_op, calls)
    assert traffic.payload() == payload == link.payload_bytes, (traffic.payload(), payload)
    assert traffic.wire() == wire, (traffic.wire(), wire)
    assert link.wire_bytes == float(wire) and link.seconds == 0.0
    assert not icpt.installed() and dist.all_reduce is icpt.dist.distributed_c10d.all_reduce, "restored"


def groups_named_and_hooks_nested(rank, n):
    """A subgroup's calls carry its size (bus factor of 2 ranks) and its name; nested hooks each count all."""
    pairs = [dist.new_group([0, 1]), dist.new_group(list(range(2, n)))]  # collective: every rank makes both
    mine = pairs[0] if rank < 2 else pairs[1]
    size = 2 if rank < 2 else n - 2
    with count_traffic(groups={"pair": mine}) as outer:
        with count_traffic() as inner:
            dist.all_reduce(t(rank), group=mine)
        dist.all_reduce(t(rank))
    share = S * Fraction(2 * (size - 1), size) if size > 1 else Fraction(0)
    assert inner.log() == [("all_reduce", S)] and inner.wire() == share
    assert outer.log() == [("all_reduce", S)] * 2
    assert outer.by_group() == {("all_reduce", "pair"): (1, S, share),
                                ("all_reduce", "world"): (1, S, S * Fraction(2 * (n - 1), n))}


def bound_at_import_is_not_seen(rank, n):
    """What the layer cannot see, which is why solutions call dist.<op> at call time."""
    bound = dist.all_reduce  # as `_ar = dist.all_reduce` at import
    with count_traffic() as traffic:
        bound(t(rank))
        dist.all_reduce(t(rank))
    assert traffic.calls() == 1


def run_all(rank, n):
    cases = {("op", name): functools.partial(op_case, name, rank, n) for name in OP_CASES}
    cases[("groups",)] = functools.partial(groups_named_and_hooks_nested, rank, n)
    cases[("bypass",)] = functools.partial(bound_at_import_is_not_seen, rank, n)
    return run_cases(cases, watch_recvs=False)  # this file checks the interception is off outside its blocks


@pytest.fixture(scope="module", params=[3, 4], ids=lambda n: f"{n}ranks")
def outcomes(request):
    return launch_cases(run_all, request.param, timeout=90)


def test_every_op_of_the_table_has_a_case():
    assert sorted(OP_CASES) == sorted(OPS)


@pytest.mark.parametrize("name", sorted(OP_CASES))
def test_op_counted_with_its_formula(outcomes, name):
    expect_case(outcomes, ("op", name), f"dist.{name} counted as labkit.comm.ops says")


def test_groups_named_and_hooks_nested(outcomes):
    expect_case(outcomes, ("groups",), "a subgroup's traffic, nested counters")


def test_an_op_bound_before_the_block_is_not_seen(outcomes):
    expect_case(outcomes, ("bypass",), "an op bound at import bypasses the layer")


def test_no_op_is_bound_at_import_in_the_lab():
    """The static half of the rule: no `from torch.distributed import <op>`, no module-level dist.<op>."""
    assert scan("solutions", "exercises", "labkit", "bench") == []


def test_planted_bindings_are_found():
    planted = ("import torch.distributed as dist\n"
               "from torch.distributed import all_reduce\n"
               "_rs = getattr(dist, 'reduce_scatter_single', None) or dist.reduce_scatter_tensor\n"
               "class Shard:\n    gather = dist.all_gather_single\n"
               "def fine(t):\n    dist.all_reduce(t)\n    return dist.P2POp(dist.isend, t, 1)\n")
    found = find_bindings(planted, "planted.py")
    assert [f.split(":")[1] for f in found] == ["2", "3", "3", "5"], found
    assert "dist.reduce_scatter_single bound outside a function" in found[1]


def test_a_hook_without_methods_is_refused_and_nothing_is_patched():
    with pytest.raises(TypeError, match="not a hook"):
        with icpt.intercept(object()):
            pass
    assert not icpt.installed()
