"""One interception of torch.distributed: hooks run around every op of `labkit.comm.ops.OPS`.

    from labkit.comm.intercept import Hook, intercept
    class Printer(Hook):
        def after(self, call, result):
            print(call.op, call.payload, call.wire, call.ranks)
    with intercept(Printer()):
        dist.all_reduce(t)          # -> all_reduce 16 16 [0, 1]   (4 floats, 2 ranks: 2(N-1)/N x 16)

How: on entry of the first `intercept`, each table op is replaced ONCE on the
`torch.distributed` module by a dispatcher; the dispatcher calls every active hook's
`before(call)` (outermost first; raising there stops the op before it runs), the real op,
then every hook's `after(call, result)` (innermost first; one that returns something other
than None replaces the result, e.g. a Work that notes its wait()). Nested `intercept` blocks compose
(a SlowLink inside a count_traffic: both see every call). When the last block ends the
real functions are put back. `dist.P2POp` is swapped too, so that a P2POp built with the
dispatcher of isend/irecv holds the real function (torch checks `op is isend`).

What it sees: look-ups through the module at call time, ``dist.all_reduce(...)``, as the
lab's code writes them. It cannot see an op bound before the block (``from
torch.distributed import all_reduce``, or ``_ar = dist.all_reduce`` at import), nor calls
torch makes inside its own functions (DDP's C++ reducer; all_gather_into_tensor calling
all_gather_single), nor a call made while a hook or another op runs (a
batch_isend_irecv counts once, not once more per isend inside it).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from dataclasses import dataclass
from fractions import Fraction

import torch.distributed as dist

from labkit.comm.ops import OPS


@dataclass
class Call:
    """One op call: its name, bound arguments, group (as passed), the group's global ranks,
    whether this rank is in it, its payload S and wire bytes (labkit.comm.ops)."""
    op: str
    arguments: dict
    group: object
    ranks: list
    member: bool
    payload: int
    wire: Fraction


class Hook:
    """Base class of a hook: override before(call) and/or after(call, result)."""

    def before(self, call: Call) -> None:
        pass

    def after(self, call: Call, result):
        """Return None to keep the result, or a replacement (a wrapper around it)."""
        return None


_hooks: list = []            # active hooks, outermost first
_real: dict = {}             # op name -> the real function, while installed
_local = threading.local()   # .busy: a dispatched call (or a hook) is running in this thread


def _group_ranks(group):
    """The global ranks of `group` (None: the default group), and whether this rank is one of them."""
    try:
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    except (ValueError, RuntimeError, AttributeError, TypeError):
        return [], False  # e.g. GroupMember.NON_GROUP_MEMBER: new_group's answer on a rank outside it
    return ranks, dist.get_rank() in ranks


def describe(op: str, arguments: dict) -> Call:
    """The Call record of `op` with these bound arguments (the payload and wire of labkit.comm.ops)."""
    group = arguments.get("group")
    if op == "batch_isend_irecv" and arguments.get("p2p_op_list"):
        group = arguments["p2p_op_list"][0].group
    ranks, member = _group_ranks(group)
    payload = OPS[op].payload(arguments, len(ranks))
    wire = payload * OPS[op].bus_factor(len(ranks)) if member else Fraction(0)
    return Call(op, arguments, group, ranks, member, payload, wire)


def _dispatcher(op: str, real):
    signature = inspect.signature(real)

    @functools.wraps(real)
    def dispatched(*args, **kwargs):
        if getattr(_local, "busy", False) or not _hooks or not dist.is_initialized():
            return real(*args, **kwargs)
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return real(*args, **kwargs)  # torch's own error message for a wrong call
        hooks = list(_hooks)
        _local.busy = True
        try:
            call = describe(op, dict(bound.arguments))
            for hook in hooks:
                hook.before(call)
            result = real(*args, **kwargs)
            for hook in reversed(hooks):
                replaced = hook.after(call, result)
                result = result if replaced is None else replaced  # a hook may hand back a wrapper
            return result
        finally:
            _local.busy = False

    dispatched._labkit_real = real
    return dispatched


class _P2POp(dist.P2POp):
    """dist.P2POp while intercepting: stores the real isend/irecv, not their dispatchers."""

    def __new__(cls, op, *args, **kwargs):
        return super().__new__(cls, getattr(op, "_labkit_real", op), *args, **kwargs)

    def __init__(self, op, *args, **kwargs):
        super().__init__(getattr(op, "_labkit_real", op), *args, **kwargs)


def _install() -> None:
    for name in OPS:
        real = getattr(dist, name, None)
        if real is None:
            continue
        _real[name] = real
        setattr(dist, name, _dispatcher(name, real))
    _real["P2POp"] = dist.P2POp
    dist.P2POp = _P2POp


def _uninstall() -> None:
    for name, real in _real.items():
        setattr(dist, name, real)
    _real.clear()


def installed() -> bool:
    """True while some `intercept` block is active (the table's ops are dispatchers)."""
    return bool(_real)


@contextlib.contextmanager
def intercept(hook: Hook):
    """Inside the block, `hook.before(call)` / `hook.after(call, result)` run around every table op."""
    if not (hasattr(hook, "before") and hasattr(hook, "after")):
        raise TypeError(f"{hook!r} is not a hook: give an object with before(call) and after(call, result) "
                        "(subclass labkit.comm.intercept.Hook)")
    if not _hooks:
        _install()
    _hooks.append(hook)
    try:
        yield hook
    finally:
        del _hooks[max(i for i, h in enumerate(_hooks) if h is hook)]
        if not _hooks:
            _uninstall()
