"""What travels to the ranks: the function, its arguments and the notebook objects they use, by value.

Ranks are born from a clean process (`labkit.launching.zygote`), not from the caller, so nothing
of the caller's memory reaches them except what is sent. `pack` serialises ``(fn, args, kwargs)``
with cloudpickle, as ipyparallel and Ray ship interactive functions:

- a function defined in a notebook cell (or in ``__main__``, or inside another function: a
  closure) travels by value, with the globals and closure variables it uses, classes too;
- a function or class from an importable module (``exercises.allreduce``, ``labkit.mesh``,
  ``torch``) travels by name and is imported in the rank, so the rank runs the file as it is on
  disk now: an edited exercise is seen;
- tensors, models and optimizers travel by value (CPU tensors only, see below).

What cannot travel gets a `ShippingError` that names the variable and says what to do, before
any process starts: an open file, a lock, a socket, a generator, or a CUDA tensor made in the
caller (a CUDA tensor would be re-created on the rank's GPU 0, whatever its rank; make it on the
CPU and move it to ``labkit.rank_device()`` inside the function).

The lines of the caller's notebook cells travel too (`cell_sources`), so that a traceback from a
rank shows the learner's line, as it would in the kernel.
"""
from __future__ import annotations

import importlib
import inspect
import linecache
import pickle
import sys

from labkit.launching.failures import LaunchError


class ShippingError(LaunchError, TypeError):
    """An argument, or a notebook object a function uses, cannot be sent to the ranks."""


def _pickler_class():
    import types

    import cloudpickle
    import torch

    class Pickler(cloudpickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, types.CodeType):  # cloudpickle writes "<dynamic-code>": keep the cell's name
                constructor, args = cloudpickle.cloudpickle._code_reduce(obj)
                return constructor, tuple(obj.co_filename if a == "<dynamic-code>" else a for a in args)
            if isinstance(obj, types.ModuleType) and type(obj) is not types.ModuleType \
                    and sys.modules.get(obj.__name__) is obj:  # torch's config modules: a ModuleType subclass
                return importlib.import_module, (obj.__name__,)  # by name, as cloudpickle does plain modules
            if isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta"):
                raise pickle.PicklingError(
                    f"it holds a {obj.device.type.upper()} tensor (shape {tuple(obj.shape)}): tensors on a GPU "
                    "cannot travel to the ranks")
            return super().reducer_override(obj)

    return Pickler


def dumps(obj) -> bytes:
    import io

    buffer = io.BytesIO()
    _pickler_class()(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def pack(fn, args: tuple, kwargs: dict, namespace_owner: str | None = None) -> bytes:
    """``(fn, args, kwargs)`` as bytes for the ranks; `ShippingError` naming the first thing that cannot travel.

    ``namespace_owner``: where a dict among the arguments came from, for the message (the
    ``%%ranks`` magic passes the notebook variables its cell uses as one dict).
    """
    try:
        return dumps((fn, args, kwargs))
    except Exception as error:  # noqa: BLE001 - find which piece, then say so
        label, cause = _culprit(fn, args, kwargs, namespace_owner) or ("the function or its arguments", error)
        raise ShippingError(
            f"{label} cannot be sent to the ranks: {_reason(cause)}.\n"
            "Ranks are fresh processes: the function and the notebook objects it uses are copied to "
            "them by value. Create this object inside the function (or the %%ranks cell) instead, "
            "pass what it is made from (a path, a state_dict, CPU tensors), or `del` it from the "
            "notebook if the cell does not need it.") from None


def _reason(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text.rstrip(".")


def _fails(obj):
    try:
        dumps(obj)
    except Exception as error:  # noqa: BLE001
        return error
    return None


def _culprit(fn, args, kwargs, namespace_owner):
    """The first piece that cannot be pickled alone, with a label a learner recognises."""
    pieces = []
    name = getattr(fn, "__name__", type(fn).__name__)
    if inspect.isfunction(fn):
        try:
            used = inspect.getclosurevars(fn)
        except (TypeError, ValueError):
            used = None
        if used is not None:
            pieces += [(f"the variable `{k}` (captured by {name})", v) for k, v in used.nonlocals.items()]
            pieces += [(f"the global `{k}` (used by {name})", v) for k, v in used.globals.items()]
        defaults = {k: p.default for k, p in inspect.signature(fn).parameters.items()
                    if p.default is not inspect.Parameter.empty}
        pieces += [(f"the default value of `{k}` (in {name})", v) for k, v in defaults.items()]
    for i, arg in enumerate(args):
        if isinstance(arg, dict) and namespace_owner is not None:
            pieces += [(f"the notebook variable `{k}` (used in {namespace_owner})", v) for k, v in arg.items()]
        else:
            pieces.append((f"argument {i + 1} after (rank, world_size) of {name}", arg))
    pieces += [(f"the keyword argument `{k}` of {name}", v) for k, v in kwargs.items()]
    pieces.append((f"the function {name}", fn))
    for label, obj in pieces:
        error = _fails(obj)
        if error is not None:
            return label, error
    return None


def cell_sources() -> dict:
    """The caller's linecache entries that have no file behind them: notebook cells, %%ranks cells."""
    return {name: entry for name, entry in list(linecache.cache.items())
            if isinstance(entry, tuple) and len(entry) == 4 and entry[1] is None}


def unpack(payload: bytes, sources: dict):
    """In the rank: the cells' lines for tracebacks, then ``(fn, args, kwargs)``."""
    linecache.cache.update(sources)
    return pickle.loads(payload)
