"""This rank's piece of the model with all five parallelisms applied (notebook 14).

`parallelize(model, mesh=mesh)` returns this rank's `ComposedStage`, built in torchtitan's order:

    pp   the stage split (`labkit.model.split_layers`): the layers of stage mesh.coord("pp"),
         the embedding on the first stage, the final norm and head on the last
    tp   heads and hidden units sliced by the learner's ColumnParallelLinear / RowParallelLinear,
         the embedding and head by the vocabulary (VocabParallelEmbedding, vocab-parallel
         cross-entropy), with Megatron-SP between the TP regions: gather_sequence in,
         scatter_sequence out, so norms, residuals and the MoE see s / (cp tp) positions
    cp   attention over the mesh's cp axis on the zigzag pieces, with rotary embeddings at the pieces'
         global positions, by `cp_method`: the learner's ring (default), or solutions/cp_methods.py's
         all-gather of K/V, Ulysses all-to-all (the learner's two swaps) or the a2a+p2p hybrid
    ep   each MoE layer the learner's EPMoE over the mesh's ep group (dispatch, compute, combine): a grid
         axis carved out of dp, or folded over dp x cp (x tp) (`labkit.compose.dims`); with `ep_overlap`,
         the learner's TwoBatchEPMoE (solutions/moe_overlap.py): two halves, each all-to-all hidden
         behind the other half's experts where it can be
    dp   nothing in the model: the data-parallel ranks read other rows, and their gradients are
         summed by `labkit.compose.step` over the groups the learner's placement table names

Parameter names are the full model's (``layers.3.attention.wq.weight``, experts keyed by their
global index), so a parameter's name says what it is everywhere: in the placement table, in the
gathered state the proofs compare, in the checkpoints.

Each rank backpropagates its SHARE of the global loss: its tokens' cross-entropy terms divided by
the global token count, plus its share of every MoE layer's load-balancing loss. Summed over the
ranks (each tp group counting its cross-entropy once), the shares are the loss of one process.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from labkit.compose.dims import HYBRID_LOCAL, live_axes
from labkit.grading import impl
from labkit.mesh import Mesh
from labkit.model import causal_attention, check_tokens, split_layers
from labkit.model import moe as moe_lib
from labkit.parallel.context_methods import CPLevels

# -------------------------------------------------------------------------- parameter classes
# which dim of the weight a tp rank slices: rows (output features, or the vocabulary) or columns
_ROWS = ("attention.wq.", "attention.wk.", "attention.wv.", "feed_forward.w1.", "feed_forward.w3.",
         "tok_embeddings.", "output.")
_COLUMNS = ("attention.wo.", "feed_forward.w2.")


def param_class(name: str) -> str:
    """"tp_shard", "sp_replica" or "expert" for a parameter name of the composed (or the full) model."""
    if ".experts." in name:
        return "expert"
    if name.endswith("norm.weight") or ".router." in name:
        return "sp_replica"
    if any(key in name for key in _ROWS + _COLUMNS):
        return "tp_shard"
    raise ValueError(f"{name}: not a parameter of labkit's model (no placement class for it)")


def shard_dim(name: str) -> int | None:
    """The dim a tp rank slices ("tp_shard": 0 for rows, 1 for columns); None for the others."""
    if param_class(name) != "tp_shard":
        return None
    return 0 if any(key in name for key in _ROWS) else 1


def _copy(module: nn.Module) -> nn.Module:
    """A deep copy with its own parameters and buffers, cloned in place of deepcopy's copies: deepcopy of
    a fake tensor makes it a new FakeTensorMode, and labkit.scale runs this model on fake tensors."""
    memo = {id(p): nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) for p in module.parameters()}
    memo.update({id(b): b.clone() for b in module.buffers()})
    return copy.deepcopy(module, memo)


# -------------------------------------------------------------------------- the layers
class ComposedAttention(nn.Module):
    """Attention with its heads over tp (SP around it) and its sequence over cp (by `cp_method`).

    cp_method: "ring", "allgather", "ulysses" or "hybrid" (`labkit.compose.dims.CP_METHODS`); the hybrid
    needs `levels`, the cp axis as nodes (labkit.parallel.context_methods.CPLevels, built once per stage: collective)."""

    def __init__(self, attention: nn.Module, *, mesh: Mesh, timeline=None, cp_method: str = "ring", levels=None):
        super().__init__()
        tpm, group = impl("tensor_parallel"), mesh.group("tp")
        self.wq, self.wk, self.wv = (tpm.ColumnParallelLinear(w, group=group)
                                     for w in (attention.wq, attention.wk, attention.wv))
        self.wo = tpm.RowParallelLinear(attention.wo, group=group)
        self.local_heads = attention.n_heads // mesh.size("tp")
        self.mesh, self.group, self.timeline = mesh, group, timeline
        self.cp_method, self.levels = cp_method, levels

    def forward(self, x, rope, pos, seq_len: int):
        sp, cp = impl("sequence_parallel"), impl("context_parallel")
        h = sp.gather_sequence(x, group=self.group)  # [b, s/cp, d]: this cp rank's pieces, whole over tp
        B, n, _ = h.shape
        heads = lambda w: F.linear(h, w.weight).view(B, n, self.local_heads, -1).transpose(1, 2)  # noqa: E731
        q, k, v = heads(self.wq), heads(self.wk), heads(self.wv)
        q, k = cp.rotate(q, rope, pos), cp.rotate(k, rope, pos)  # at the pieces' global positions
        if self.mesh.size("cp") > 1 and self.cp_method != "ring":
            methods, where = impl("cp_methods"), {"levels": self.levels} if self.cp_method == "hybrid" else {"mesh": self.mesh}
            attend = getattr(methods, f"{self.cp_method}_attention")
            y = attend(q, k, v, split="zigzag", mask="causal", seq_len=seq_len, **where)
        elif self.mesh.size("cp") > 1:
            ring = impl("ring_attention").ring_attention
            extra = {} if self.timeline is None else {"timeline": self.timeline}
            y = ring(q, k, v, mesh=self.mesh, split="zigzag", mask="causal", seq_len=seq_len, **extra)
        else:
            y = causal_attention(q, k, v)
        out = F.linear(y.transpose(1, 2).reshape(B, n, -1), self.wo.weight)  # partial sums over the heads
        return sp.scatter_sequence(out, group=self.group)  # summed, and this tp rank's positions


class ComposedMLP(nn.Module):
    """The dense SwiGLU with its hidden units over tp, SP around it."""

    def __init__(self, mlp: nn.Module, *, mesh: Mesh):
        super().__init__()
        tpm, group = impl("tensor_parallel"), mesh.group("tp")
        self.w1, self.w3 = tpm.ColumnParallelLinear(mlp.w1, group=group), tpm.ColumnParallelLinear(mlp.w3, group=group)
        self.w2 = tpm.RowParallelLinear(mlp.w2, group=group)
        self.group = group

    def forward(self, x):
        sp = impl("sequence_parallel")
        h = sp.gather_sequence(x, group=self.group)
        hidden = F.silu(F.linear(h, self.w1.weight)) * F.linear(h, self.w3.weight)
        return sp.scatter_sequence(F.linear(hidden, self.w2.weight), group=self.group)


class _AddToLoss(torch.autograd.Function):
    """Identity on y; in backward, d(loss)/d(aux) = 1: the aux share joins the loss where it was computed.

    A pipeline's loss lives on the last stage, but a MoE layer's balancing loss is computed on its
    own stage; Megatron's MoEAuxLossAutoScaler injects its gradient this way, during the backward
    that passes through the layer."""

    @staticmethod
    def forward(ctx, y, aux):
        ctx.like = aux
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones_like(ctx.like)


def aux_share(routing, *, group, seq_len: int, global_batch: int, coef: float) -> torch.Tensor:
    """This rank's share of coef x mean over sequences of E sum_e f_e P_e (labkit.model.moe's balance loss).

    The rank holds some positions of each of its sequences: f_e (the share of a sequence's picks
    that chose e, a count: no gradient) needs every position, so the counts are summed over the
    ranks holding the sequence's pieces (`group`: cp and tp); P_e (mean router probability) is a
    sum over positions: each rank keeps its own positions' part, and the parts add up."""
    probs, expert = routing.probs, routing.expert
    E, k = probs.shape[-1], expert.shape[-1]
    counts = F.one_hot(expert, E).sum(dim=(1, 2)).to(probs.dtype)  # [b, E] picks of this rank's positions
    if group is not None:
        dist.all_reduce(counts, group=group)
    f = counts / (seq_len * k)
    return coef * E * (f * probs.sum(dim=1) / seq_len).sum() / global_batch


class ComposedBlock(nn.Module):
    def __init__(self, block: nn.Module, *, mesh: Mesh, layer: int, timeline=None, cp_method="ring", levels=None,
                 ep_overlap: bool = False):
        super().__init__()
        self.attention_norm, self.ffn_norm = _copy(block.attention_norm), _copy(block.ffn_norm)
        self.attention = ComposedAttention(block.attention, mesh=mesh, timeline=timeline, cp_method=cp_method,
                                           levels=levels)
        self.is_moe = isinstance(block.feed_forward, moe_lib.MoE)
        if self.is_moe:
            extra = {} if timeline is None else {"timeline": timeline}
            self.feed_forward = impl("expert_parallel").EPMoE(
                _copy(block.feed_forward), group=mesh.group("ep"), ep_rank=mesh.coord("ep"),
                ep_size=mesh.size("ep"), layer=layer, **extra)
            if ep_overlap:  # the same router and experts (same names), run as two overlapped halves
                self.feed_forward = impl("moe_overlap").TwoBatchEPMoE(self.feed_forward, timeline=timeline)
        else:
            self.feed_forward = ComposedMLP(block.feed_forward, mesh=mesh)
        axes = live_axes(("cp", "tp"), mesh)
        self.sequence_group = mesh.group(axes) if axes else None

    def forward(self, x, rope, pos, seq_len: int, stage: "ComposedStage"):
        x = x + self.attention(self.attention_norm(x), rope, pos, seq_len)
        y = self.feed_forward(self.ffn_norm(x))
        if self.is_moe:
            share = aux_share(self.feed_forward.routing, group=self.sequence_group, seq_len=seq_len,
                              global_batch=stage.global_batch, coef=stage.config.aux_loss_coef)
            stage.aux_total = stage.aux_total + share.detach()
            y = _AddToLoss.apply(y, share)
        return x + y


# -------------------------------------------------------------------------- the stage
class ComposedStage(nn.Module):
    """This rank's pipeline stage of a labkit.model.Transformer, every parallelism applied.

    forward(x, targets=None): x is token ids [b, s/cp] on the first stage (this rank's rows and
    zigzag pieces, `local_batch`), else the previous stage's activation [b, s/(cp tp), d]; the last
    stage returns this rank's share of the global loss. Call `begin_step(batch, seq_len)` with the
    GLOBAL batch's shape before each step (`labkit.compose.step.train_step` does).
    """

    def __init__(self, model: nn.Module, *, mesh: Mesh, timeline=None, cp_method: str = "ring",
                 ep_overlap: bool = False):
        super().__init__()
        cfg = model.config
        levels = None
        if cp_method == "hybrid" and mesh.size("cp") > 1:  # its groups, made once (collective over the world)
            levels = CPLevels(mesh, local=HYBRID_LOCAL)
        self.config, self.mesh, self.timeline = cfg, mesh, timeline
        self.stage, self.n_stages = mesh.coord("pp"), mesh.size("pp")
        self.is_first, self.is_last = mesh.is_first("pp"), mesh.is_last("pp")
        self.tp_group = mesh.group("tp")
        self.rope = _copy(model.rope)
        if self.is_first:
            self.tok_embeddings = impl("vocab_parallel").VocabParallelEmbedding(model.tok_embeddings, group=self.tp_group)
        ids = split_layers(cfg.n_layers, self.n_stages)[self.stage]
        self.layers = nn.ModuleDict({str(i): ComposedBlock(model.layers[i], mesh=mesh, layer=i, timeline=timeline,
                                                           cp_method=cp_method, levels=levels, ep_overlap=ep_overlap)
                                     for i in ids})
        if self.is_last:
            self.norm = _copy(model.norm)
            self.output = impl("tensor_parallel").ColumnParallelLinear(model.output, group=self.tp_group)
        self.global_batch, self.seq_len, self.aux_total = None, None, 0.0

    def begin_step(self, global_batch: int, seq_len: int) -> None:
        self.global_batch, self.seq_len, self.aux_total = global_batch, seq_len, 0.0

    def positions(self) -> torch.Tensor:
        """The global positions of this cp rank's pieces, in the order local_batch cut them."""
        cp, c = impl("context_parallel"), self.mesh.size("cp")
        if c == 1:
            return torch.arange(self.seq_len)
        return cp.positions(cp.zigzag_split(self.seq_len, c, self.mesh.coord("cp")))

    def embed(self, tokens):
        """The vocab-parallel lookup entered into SP: each tp rank's rows (zeros for tokens outside its
        block of the vocabulary), reduce-scattered along the sequence: summed, and s/tp positions each."""
        check_tokens(tokens, self.config)
        emb = self.tok_embeddings
        mine = (tokens >= emb.start) & (tokens < emb.end)
        rows = F.embedding(torch.where(mine, tokens - emb.start, 0), emb.weight) * mine.unsqueeze(-1).to(emb.weight.dtype)
        return impl("sequence_parallel").scatter_sequence(rows, group=self.tp_group)

    def forward(self, x, targets=None):
        if self.global_batch is None:
            raise RuntimeError("call stage.begin_step(global_batch, seq_len) before the step's first forward")
        pos = self.positions()
        if self.is_first:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x, self.rope, pos, self.seq_len, self)
        if not self.is_last:
            return x
        h = impl("sequence_parallel").gather_sequence(self.norm(x), group=self.tp_group)
        logits = F.linear(h, self.output.weight)  # [b, s/cp, V/tp]: this rank's block of the vocabulary
        logits = logits if logits.dtype == torch.float64 else logits.float()
        ce = impl("vocab_parallel").vocab_parallel_cross_entropy(logits, targets, group=self.tp_group)
        return ce * targets.numel() / (self.global_batch * self.seq_len)  # mean over b s/cp -> share of B s


def parallelize(model: nn.Module, *, mesh: Mesh, timeline=None, cp_method: str = "ring",
                ep_overlap: bool = False) -> ComposedStage:
    """This rank's `ComposedStage` of `model` (left unchanged) on `mesh` (see the module docstring);
    `cp_method` and `ep_overlap` as `ParallelDims`'s (checked there, before any process work). The learner's
    tp slices are checked against `model` first (`check_slices`): a wrong block is named before any step."""
    stage = ComposedStage(model, mesh=mesh, timeline=timeline, cp_method=cp_method, ep_overlap=ep_overlap)
    check_slices(stage, model, mesh=mesh)
    return stage


def check_slices(stage, model, *, mesh: Mesh) -> None:
    """ValueError naming the learner's class when a tp_shard parameter is not block coord("tp") of the full
    weight along its `shard_dim` (a slice by the global rank, a block of another rank, a wrong shape)."""
    full, t, i = dict(model.named_parameters()), mesh.size("tp"), mesh.coord("tp")
    for name, p in stage.named_parameters():
        dim = shard_dim(name)
        if dim is None or name not in full:
            continue
        blocks = full[name].detach().chunk(t, dim)
        fake = is_fake(p) or is_fake(blocks[i])  # labkit.scale's simulated ranks: shapes only
        if p.shape == blocks[i].shape and (fake or torch.equal(p.detach(), blocks[i].to(p.dtype))):
            continue
        owner = ("VocabParallelEmbedding (exercises/vocab_parallel.py)" if name.startswith("tok_embeddings") else
                 f"{'Row' if dim else 'Column'}ParallelLinear (exercises/tensor_parallel.py)")
        held = [j for j, b in enumerate(blocks) if not fake and p.shape == b.shape and torch.equal(p.detach(), b.to(p.dtype))]
        what = f"block {held[0]} (tp rank {held[0]}'s)" if held else f"shape {tuple(p.shape)}, not one of the blocks"
        raise ValueError(f"{owner} built {name} on rank {mesh.rank} (tp rank {i} of {t}) with {what}; due: block {i} "
                         f"of the full weight along dim {dim}, shape {tuple(blocks[i].shape)}: slice by the rank in the "
                         "tp group, dist.get_rank(group), not the global rank")
