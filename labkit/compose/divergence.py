"""Where a composed run first parts from one process, in execution order (notebook 14's proofs).

After one step every weight of a wrong run differs, so the first differing WEIGHT says little. This
compares step 1 as it ran: the forward's activations module by module (in the order one process
computes them), the loss, then the gradients in the order its backward produces them, then the weights
after the update, and names the first that differs: its module, its kind, the mesh axis whose collective
made it (and the learner's exercise that ran it: the CP method, ZeRO's or HSDP's sync), by how much, and a
hint when the two differ by a factor that is an axis's size or the micro-batch count.

    rec = record_first_step(stage, opt, tokens, targets, mesh=mesh, microbatches=2)   # in every rank
    ref = reference_first_step(build_model(cfg, seed=0).double(), tokens, targets)     # one process
    print(first_divergence([rec of each rank], ref))   # "first divergence: ..." or "equal to one process: ..."
"""
from __future__ import annotations

import itertools
import math
import re

import torch

from labkit.compose.model import param_class
from labkit.compose.state import full_state, gather_full
from labkit.compose.step import ADAMW, train_step
from labkit.parallel.flat import grads_or_zeros
from labkit.parallel.sharding import all_gather_flat, shard_rows

RECORDED = re.compile(r"^(tok_embeddings|norm|layers\.\d+(\.(attention_norm|attention|ffn_norm|feed_forward))?)$")
SUMMED = {"tp_shard": ("dp", "ep", "cp"), "sp_replica": ("dp", "ep", "cp", "tp"), "expert": ("dp", "cp", "tp")}


def _modules(model):
    return [(n, m) for n, m in model.named_modules() if RECORDED.match(n)]


def record_first_step(stage, optimizer, tokens, targets, *, mesh, microbatches: int = 1) -> dict:
    """One `train_step` on this rank, recorded: every module output with the global rows and positions it
    holds, the gradients summed over their replicas (full shape) and the weights after the update."""
    B, _ = tokens.shape
    rows = shard_rows(torch.arange(B), mesh.index("batch"), mesh.size("batch")).chunk(microbatches)
    acts, calls, handles = {}, {}, []

    def keep(name, out):
        pos, n = stage.positions(), out.shape[1]
        if n != len(pos):  # sequence parallelism: this tp rank's block of the cp rank's positions
            pos = pos.chunk(mesh.size("tp"))[mesh.coord("tp")]
        m = calls[name] = calls.get(name, -1) + 1
        acts.setdefault(name, []).append((rows[m], pos, out.detach().clone()))

    for name, module in _modules(stage):
        handles.append(module.register_forward_hook(lambda mod, args, out, name=name: keep(name, out)))
    if getattr(stage, "is_first", False):
        embed = stage.embed
        stage.embed = lambda x: (lambda out: keep("tok_embeddings", out) or out)(embed(x))
    names = {id(p): n for n, p in stage.named_parameters()}
    grads, sync = {}, optimizer._sync

    def recording_sync(axes, params, opt):
        sync(axes, params, opt)
        if optimizer.zero and axes:  # the summed gradient lives in the ZeRO shards: gather it back
            flat = all_gather_flat(opt.shards[0].grad.detach(), group=optimizer.shard_group(opt))
            for p, g in zip(params, flat[:sum(p.numel() for p in params)].split([p.numel() for p in params])):
                grads[names[id(p)]] = g.view(p.shape)
        else:
            grads.update({names[id(p)]: g.detach() for p, g in zip(params, grads_or_zeros(params))})

    optimizer._sync = recording_sync
    try:
        loss = train_step(stage, optimizer, tokens, targets, mesh=mesh, microbatches=microbatches)
    finally:
        optimizer._sync = sync
        vars(stage).pop("embed", None)
        for h in handles:
            h.remove()
    if optimizer.zero == 3:
        optimizer.begin_step()  # the parameters whole again, to gather them
    named = [(n, grads[n]) for n, _ in stage.named_parameters()]
    hsdp = [names[id(p)] for _, params, opt in optimizer.groups if optimizer.replicas[id(opt)][1] for p in params]
    zero = [names[id(p)] for axes, params, _ in optimizer.groups if optimizer.zero and axes for p in params]
    first = next(iter(stage.layers.values()), None)
    cp_method = getattr(getattr(first, "attention", None), "cp_method", "ring")
    return dict(loss=loss, acts=acts, grads=gather_full(named, mesh=mesh), weights=full_state(stage, mesh=mesh),
                sizes={n: mesh.size(n) for n in mesh.names}, summed=_summed_words(mesh), hsdp=hsdp, zero=zero,
                microbatches=microbatches, cp_method=cp_method)


def reference_first_step(model, tokens, targets, **adamw) -> dict:
    """The same step on one process (AdamW as `ComposedOptimizer`'s): activations in forward order,
    gradients in backward order, weights after the update."""
    acts, grads = {}, {}
    handles = [m.register_forward_hook(lambda mod, args, out, name=name: acts.__setitem__(name, out.detach().clone()))
               for name, m in _modules(model)]
    keep = lambda name: lambda p: grads.__setitem__(name, p.grad.detach().clone())  # noqa: E731
    handles += [p.register_post_accumulate_grad_hook(keep(name)) for name, p in model.named_parameters()]
    opt = torch.optim.AdamW(model.parameters(), **{**ADAMW, **adamw})
    loss = model(tokens, targets)
    loss.backward()
    opt.step()
    for h in handles:
        h.remove()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return dict(loss=loss.item(), acts=acts, grads=grads, weights=weights)


def _summed_words(mesh) -> dict:
    """{class: the live names its gradient is summed over} on this mesh (labkit's own rule; folded EP, HSDP)."""
    from labkit.compose.dims import PARAM_CLASSES, live_axes, summed_axes
    return {cls: list(live_axes(summed_axes(cls, mesh), mesh)) for cls in PARAM_CLASSES}


CP_WORDS = {"ring": "the ring (your ring_attention)", "allgather": "the all-gather of K/V",
            "ulysses": "Ulysses' all-to-alls (your seq_to_heads, heads_to_seq)",
            "hybrid": "your all-to-alls inside a node, the ring across"}


def _axes_of(kind, name, sizes, summed=None, cp_method="ring"):
    """The live mesh axes whose collective produced this tensor, in words."""
    live = lambda axes: [a for a in axes if sizes.get(a, 1) > 1]  # noqa: E731
    if kind == "gradient":
        cls = param_class(name)
        axes = summed[cls] if summed else live(SUMMED[cls])
        why = f"{cls}: due summed over {'+'.join(axes) if axes else 'no axis in this layout'}"
        if name.endswith("norm.weight") and sizes.get("tp", 1) > 1:  # its output enters a TP region
            why += "; its output's gradient comes from SP's gather_sequence backward, a reduce-scatter over tp"
        return axes, why
    if kind == "weight":
        axes = live(["tp"] if param_class(name) == "tp_shard" else [])
        return axes, (f"{param_class(name)}, updated from its gradient")
    parts = {"tok_embeddings": [("tp", "vocab-parallel lookup, reduce-scattered")],
             "attention": [("tp", "row-parallel wo, reduce-scattered"), ("cp", CP_WORDS.get(cp_method, cp_method))],
             "feed_forward": [("tp", "row-parallel w2, reduce-scattered"), ("ep", "the all-to-all")]}
    parts = [(a, why) for a, why in parts.get(name.rsplit(".", 1)[-1], []) if sizes.get(a, 1) > 1]
    alone = "no collective of its own" + (": its input is the tokens this rank read (local_batch)"
                                          if name == "tok_embeddings" else "")
    return [a for a, _ in parts], ("; ".join(f"{a}: {why}" for a, why in parts) or alone)


def _hint(got, want, axes, sizes, microbatches=1):
    """'got = 2 x expected, 2 = the size of tp: ...' when one is a multiple of the other by an axis size
    (pp left out: nothing is summed across stages), or by the micro-batch count (each micro-batch's loss scaled)."""
    ww = (want * want).sum().item()
    if not ww:
        return ""
    r = (got * want).sum().item() / ww
    if abs(r - 1) < 1e-6 or (got - r * want).abs().max().item() > 1e-6 * want.abs().max().item():
        return ""
    axes = axes or [a for a, n in sizes.items() if n > 1 and a in ("dp", "ep", "cp", "tp")]
    for factor, what in ((microbatches, "the gradient of every micro-batch summed where its share was due"),
                         (1 / microbatches, "each micro-batch's loss scaled by 1/micro-batches where the step's "
                                            "share was due (run_schedule's loss_scale)")):
        if microbatches > 1 and abs(r - factor) < 1e-6 * factor:
            return f"; got = {r:.4g} x expected, {'' if factor > 1 else '1/'}{microbatches} = the micro-batch count: {what}"
    for k in range(1, len(axes) + 1):
        for combo in itertools.combinations(axes, k):
            n = math.prod(sizes[a] for a in combo)
            for factor, what in ((n, "a sum where a mean was due"), (1 / n, "a mean where a sum was due")):
                if n > 1 and abs(r - factor) < 1e-6 * factor:
                    return (f"; got = {r:.4g} x expected, {'' if factor == n else '1/'}{n} = the size of "
                            f"{'+'.join(combo)}: {what}, or the reverse")
    return f"; got = {r:.4g} x expected"


def _full_acts(pieces, like):
    full = torch.full(like.shape, float("nan"), dtype=like.dtype)
    for rows, pos, t in pieces:
        full[rows[:, None], pos[None, :]] = t.to(like.dtype)
    return full


def first_divergence(records, reference, *, rtol: float = 1e-9) -> str | None:
    """None where step 1 equals one process everywhere; else the first differing tensor in execution
    order, in words. `records`: every rank's `record_first_step`; `reference`: `reference_first_step`."""
    records = list(records)
    sizes = records[0]["sizes"]
    by_hsdp = {name for rec in records for name in rec.get("hsdp", ())}  # synced by the learner's hsdp_sync
    got = {"activation": {}, "gradient": {}, "weight": {}}
    for rec in records:
        for name, pieces in rec["acts"].items():
            got["activation"].setdefault(name, []).extend(pieces)
        got["gradient"].update(rec["grads"])
        got["weight"].update(rec["weights"])
    want = {"activation": reference["acts"], "gradient": reference["grads"], "weight": reference["weights"]}
    order = {"activation": "step 1's forward", "gradient": "step 1's backward", "weight": "after step 1"}
    by_zero = {name for rec in records for name in rec.get("zero", ())} - by_hsdp  # synced by the ZeRO optimizer
    cp_method, m = records[0].get("cp_method", "ring"), records[0].get("microbatches", 1)
    for kind in ("activation", "loss", "gradient", "weight"):
        if kind == "loss":  # after the forward, before the backward: computed apart from the gradients
            got_loss, want_loss = records[0]["loss"], reference["loss"]
            if not abs(got_loss - want_loss) <= rtol * max(abs(want_loss), 1e-30):
                return (f"first divergence: the loss of step 1 (every activation equal; the last stage's vocab-parallel "
                        f"cross-entropy summed over tp, plus the MoE balance loss): {got_loss!r}, one process "
                        f"{want_loss!r}" + _hint(torch.tensor(got_loss), torch.tensor(want_loss), [], sizes, m))
            continue
        for name, w in want[kind].items():
            g = got[kind].get(name)
            if g is not None and kind == "activation":
                g = _full_acts(g, w)
            layer = name.removesuffix(".weight") if kind != "activation" else name
            if g is None or g.shape != w.shape or torch.isnan(g).any():
                how = "no rank reported it" if g is None else "some rows or positions were reported by no rank"
                return f"first divergence: the {kind} of {layer} ({order[kind]}): {how}"
            diff, scale = (g.double() - w.double()).abs().max().item(), w.double().abs().max().item()
            if diff > rtol * max(scale, 1e-30):
                axes, why = _axes_of(kind, name, sizes, records[0].get("summed"), cp_method)
                if kind == "gradient" and name in by_zero:
                    why += "; summed by your ZeRO ShardedOptimizer.sync_gradients (exercises/zero.py, notebook 09)"
                if kind == "gradient" and name in by_hsdp:
                    why += (f"; HSDP over {sizes['dp_replicate']} replicas: summed by your hsdp_sync "
                            "(exercises/hsdp.py, notebook 10), reduce-scatter inside a replica, then all-reduce "
                            "across the replicas")
                    axes = list(axes) + ["dp_replicate", "dp_shard"]  # a factor of R or S: hsdp_sync's mean
                return (f"first divergence: the {kind} of {layer} ({order[kind]}; {why}): max abs diff {diff:.3g}, "
                        f"relative {diff / max(scale, 1e-300):.3g}" + _hint(g.double(), w.double(), axes, sizes, m))
    return None


def describe(records, reference) -> str:
    """`first_divergence`'s message, or 'equal to one process: ...' with what was compared."""
    wrong = first_divergence(records, reference)
    n = {k: len(reference[k]) for k in ("acts", "grads", "weights")}
    return wrong or (f"equal to one process at step 1: {n['acts']} activations, {n['grads']} gradients, "
                     f"{n['weights']} weights")
