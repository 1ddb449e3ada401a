"""Which mesh axis every message of a composed step travels on, when, and how many bytes (notebook 14).

    with axis_spans(mesh, timeline) as spans:            # one rank, inside a launched function
        train_step(stage, opt, x, y, mesh=mesh, timeline=timeline)
    spans.payload_by_axes()     # {("tp",): bytes, ("cp",): ..., ("dp", "cp"): ...}: S summed, labkit.comm.ops
    timeline.spans              # the executor's F/B spans and one span per call, kind "comm:tp", "comm:dp+cp", ...

Built on the one interception point (`labkit.comm.intercept`): a hook's before/after sees every
``dist.<op>`` call with its group's global ranks. A group of the mesh is named by the axes it spans:
for every set of the mesh's axes of size > 1, ``mesh.ranks(axes)`` is this rank's group along them, and
two different sets give two different rank sets, so the ranks alone say the axes (the world is all the
live axes). `axis_colour` maps axes to the five colours of the step's picture: one axis alone is
that axis's traffic (TP collectives, CP ring, EP all-to-all, PP send/recv); a set of several axes
is a reduction over data-parallel replicas (gradient sums, the loss report), coloured "dp".

The formula functions below (parameters per rank, bytes per axis) are the closed forms the notebook
and tests/test_compose_trace.py check the measurements against, exactly.
"""
from __future__ import annotations

import itertools
import time

from labkit.comm.intercept import Hook, intercept
from labkit.mesh import AXES, Mesh

COLOURS = {"tp": "tab:blue", "cp": "tab:orange", "ep": "tab:green", "pp": "tab:red", "dp": "tab:purple"}


def axis_sets(mesh: Mesh) -> dict:
    """{tuple of this rank's group's global ranks: the live axes it spans}, for every non-empty set of live axes."""
    live = [a for a in AXES if mesh.size(a) > 1]
    out = {}
    for n in range(1, len(live) + 1):
        for axes in itertools.combinations(live, n):
            out[tuple(sorted(mesh.ranks(axes)))] = axes
    return out


def axis_colour(axes: tuple) -> str:
    """The key of `COLOURS` a call on `axes` is drawn in: the axis itself, or "dp" for a multi-axis reduction."""
    return axes[0] if len(axes) == 1 else "dp"


class AxisSpans(Hook):
    """Records (axes, op, payload bytes, start, end) per call of this rank; also into `timeline` if given."""

    def __init__(self, mesh: Mesh, timeline=None):
        self.sets, self.timeline = axis_sets(mesh), timeline
        self.records: list = []
        self._t0: list = []

    def axes_of(self, ranks) -> tuple:
        key = tuple(sorted(ranks))
        if key not in self.sets:
            raise ValueError(f"a call on ranks {list(key)}: not a group of the mesh's live axes "
                             f"{sorted(set(a for s in self.sets.values() for a in s))}")
        return self.sets[key]

    def before(self, call) -> None:
        self._t0.append(time.perf_counter())

    def after(self, call, result):
        t0, t1 = self._t0.pop(), time.perf_counter()
        if not call.member:
            return None
        axes = self.axes_of(call.ranks)
        self.records.append((axes, call.op, call.payload, t0, t1))
        if self.timeline is not None:
            self.timeline.record("comm:" + "+".join(axes), t0, t1)
        return None

    def calls_by_axes(self) -> dict:
        out: dict = {}
        for axes, *_ in self.records:
            out[axes] = out.get(axes, 0) + 1
        return out

    def payload_by_axes(self) -> dict:
        out: dict = {}
        for axes, _, payload, *_ in self.records:
            out[axes] = out.get(axes, 0) + payload
        return out

    def ops_by_axes(self) -> dict:
        """{axes: {op: calls}}."""
        out: dict = {}
        for axes, op, *_ in self.records:
            out.setdefault(axes, {})
            out[axes][op] = out[axes].get(op, 0) + 1
        return out


def axis_spans(mesh: Mesh, timeline=None):
    """Context manager: an `AxisSpans` hook active inside the block (see the module docstring)."""
    return intercept(AxisSpans(mesh, timeline))


# -------------------------------------------------------------------------- the closed forms
def _owner_stage(name: str, n_layers: int, pp: int) -> int:
    """The pipeline stage that holds parameter `name` of the full model (labkit.model.split_layers)."""
    from labkit.model import split_layers
    if name.startswith("layers."):
        layer = int(name.split(".")[1])
        return next(s for s, ids in enumerate(split_layers(n_layers, pp)) if layer in ids)
    return 0 if name.startswith("tok_embeddings.") else pp - 1


def params_by_axes(model, dims, coords: dict) -> dict:
    """{live axes its gradient is summed over: elements} this rank holds, from the full `model`, the layout and
    labkit's placement classes: a tp shard is 1/tp of its tensor, an expert lives on ep rank e // (E/ep) only,
    nothing is on two stages. The sum of the values is this rank's parameter count."""
    from labkit.compose.dims import live_axes, summed_axes
    from labkit.compose.model import param_class
    cfg, mesh = model.config, dims.layout_mesh()
    out: dict = {}
    for name, p in model.named_parameters():
        if _owner_stage(name, cfg.n_layers, dims.pp) != coords["pp"]:
            continue
        kind = param_class(name)
        if kind == "expert" and int(name.split(".experts.")[1].split(".")[0]) // (cfg.n_experts // dims.ep) != coords["ep"]:
            continue
        key = live_axes(summed_axes(kind, mesh), mesh)
        out[key] = out.get(key, 0) + p.numel() // (dims.tp if kind == "tp_shard" else 1)
    return out


def bytes_by_axes(model, dims, coords: dict, *, batch: int, seq_len: int, element: int) -> dict:
    """{live axes: payload bytes S (labkit.comm.ops) this rank sends or receives in one training step} of a DENSE
    model, zero=0, with the solutions' collectives (one k/v message per ring step, dK/dV going round once):

      tp  per micro-batch and layer: 2 SP all-gathers + 2 reduce-scatters forward (attention, MLP) and the
          same backward, each of [b, s/cp, d]; the embedding's reduce-scatter and the head's all-gather,
          forward and backward; the vocab-parallel cross-entropy's 3 all-reduces of [b, s/cp] (max, sum, target)
      cp  per micro-batch and layer, with kv = [2, b, h/tp, s/cp, hd] (K and V of this rank's pieces) and one
          all-gather of the 5 shape integers, by `dims.cp_method`: the ring's c - 1 k/v exchanges forward, c - 1
          k/v and c dK/dV backward (each an isend + an irecv of kv); all-gather: one all-gather of c kv forward,
          one reduce-scatter of c kv backward; Ulysses: 8 all-to-alls of kv / 2 (q, k, v, out and their
          gradients). The hybrid's groups are no mesh axis (pairs inside cp): refused
      pp  per micro-batch, each activation [b, s/(cp tp), d] sent forward and its gradient back
      dp  the gradient sum: one all-reduce of each group's flat gradients (`params_by_axes`), and the loss
          report: one all-reduce of a scalar over every live axis
    """
    from labkit.compose.dims import live_axes
    cfg = model.config
    if cfg.n_experts:
        raise ValueError("bytes_by_axes covers dense models: a MoE's all-to-all sizes depend on the routing")
    from labkit.model import split_layers
    mesh = dims.layout_mesh()
    m, tp, cp, pp = dims.microbatches, dims.tp, dims.cp, dims.pp
    b = batch // dims.dp // m
    first, last = coords["pp"] == 0, coords["pp"] == pp - 1
    layers = len(split_layers(cfg.n_layers, pp)[coords["pp"]])
    out: dict = {}

    def add(axes, n):
        key = live_axes(axes, mesh)
        if key and n:
            out[key] = out.get(key, 0) + n

    loss_elem = 8 if element == 8 else 4  # the cross-entropy runs in float64 or float32
    if tp > 1:
        big = b * (seq_len // cp) * cfg.d_model * element
        calls = 8 * layers + 2 * first + 2 * last
        add(("tp",), m * (calls * big + 3 * last * b * (seq_len // cp) * loss_elem))
    if cp > 1:
        kv = 2 * b * (cfg.n_heads // tp) * (seq_len // cp) * (cfg.d_model // cfg.n_heads) * element
        per_layer = {"ring": 2 * ((cp - 1) + (cp - 1) + cp) * kv, "allgather": 2 * cp * kv, "ulysses": 8 * kv // 2}
        if dims.cp_method not in per_layer:
            raise ValueError(f"bytes_by_axes: cp_method={dims.cp_method!r} is not covered (the hybrid's all-to-all "
                             "and ring run on sub-groups of cp that are no mesh axis); use ring, allgather or ulysses")
        add(("cp",), m * layers * (per_layer[dims.cp_method] + cp * 5 * 8))
    if pp > 1:
        act = b * (seq_len // cp // tp) * cfg.d_model * element
        add(("pp",), m * 2 * act * ((not first) + (not last)))
    for axes, n in params_by_axes(model, dims, coords).items():
        add(axes, n * element)
    add(("dp", "pp", "ep", "cp", "tp"), loss_elem)  # the loss report: one scalar over the world
    return out
