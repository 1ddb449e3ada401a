"""Mixture of experts: E small SwiGLU experts behind a top-k softmax router (notebook 12).

    from labkit.model import build_model
    model = build_model("tiny-moe")     # every block's MLP is a MoE (ModelConfig.n_experts > 0)
    loss = model(x, y)                  # LM loss + aux_loss_coef x the sum of the layers' aux_loss

One MoE layer maps x [B, T, D] to y [B, T, D] in five steps; expert parallelism
(solutions/expert_parallel.py) runs the same steps with an all-to-all around step 4.

1. **route**: probs = softmax(x W_router^T) [B, T, E]; each token picks its `top_k` most
   probable experts, and its gates are those probabilities (not renormalised, as in the
   Switch Transformer, so the router learns from the output even with top-1).
2. **capacity**: in each sequence, expert e takes at most
   C = ceil(capacity_factor x T x top_k / E) tokens. The picks queue in position order
   (position 0's picks first, a token's first choice before its second): the lowest positions
   are kept, the picks past C are DROPPED. A dropped pick adds nothing; a token whose every
   pick is dropped gets 0 from this layer, so it passes through the block's residual unchanged.
   Capacity is per SEQUENCE, not per batch, so the dropped tokens do not depend on how a
   batch is split over ranks: one device, DP and EP drop exactly the same tokens.
3. **dispatch**: the kept picks sorted by expert (stable: each expert sees its tokens in order).
4. **compute**: every expert runs once, on its contiguous chunk.
5. **combine**: each output row is added back to its token, weighted by its gate.

The load-balancing loss (Switch Transformer; per sequence as DeepSeek-V3's sequence-wise
balance loss, which again makes it independent of the sharding): for each sequence,
E x sum_e f_e P_e with f_e the share of the sequence's T x top_k picks that chose e (before
dropping; a count, no gradient) and P_e the mean router probability of e; the mean over
sequences. It is 1 when the load is perfectly even, up to E when one expert gets everything.
Each MoE module keeps its last value in `.aux_loss`; `aux_loss(model)` sums them and
`Transformer.forward(tokens, targets)` adds `aux_loss_coef` times that sum to the LM loss.
(Pipeline stages do not add it: MoE is not combined with pipeline parallelism in this lab.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


def check_config(n_experts, top_k, capacity_factor) -> None:
    """ValueError, with the fix, for an impossible MoE configuration."""
    if isinstance(n_experts, bool) or not isinstance(n_experts, int) or n_experts < 1:
        raise ValueError(f"n_experts={n_experts!r}: a MoE layer needs an int >= 1 experts (0 means dense: no MoE)")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k={top_k!r} must be an int between 1 and n_experts={n_experts}: "
                         "a token cannot pick more experts than there are")
    if not isinstance(capacity_factor, (int, float)) or not math.isfinite(capacity_factor) or capacity_factor <= 0:
        raise ValueError(f"capacity_factor={capacity_factor!r} must be a number > 0 (1.0: exactly the even "
                         "share of tokens per expert; 1.25 is usual)")


def capacity(seq_len: int, n_experts: int, top_k: int, capacity_factor: float) -> int:
    """Most picks one expert takes from one sequence: ceil(cf x T x k / E), at least 1, at most T."""
    check_config(n_experts, top_k, capacity_factor)
    return max(1, min(seq_len, math.ceil(capacity_factor * seq_len * top_k / n_experts)))


@dataclass
class Routing:
    """Where every token of x [B, T, D] goes. k = top_k, E = number of experts."""
    probs: torch.Tensor   # [B, T, E] router probabilities
    expert: torch.Tensor  # [B, T, k] the chosen experts, most probable first
    gate: torch.Tensor    # [B, T, k] their probabilities (the weights of their outputs)
    keep: torch.Tensor    # [B, T, k] bool: False for a pick dropped past capacity
    capacity: int         # C, per sequence and expert
    aux_loss: torch.Tensor  # scalar load-balancing loss

    @property
    def n_experts(self) -> int:
        return self.probs.shape[-1]

    def routed_counts(self) -> torch.Tensor:
        """[E] picks per expert before dropping (what the router asked for)."""
        return torch.bincount(self.expert.flatten(), minlength=self.n_experts)

    def kept_counts(self) -> torch.Tensor:
        """[E] picks per expert after dropping (what the experts compute)."""
        return torch.bincount(self.expert[self.keep], minlength=self.n_experts)

    def dropped_fraction(self) -> float:
        return 1.0 - float(self.keep.float().mean()) if self.keep.numel() else 0.0


def route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, capacity_factor: float) -> Routing:
    """Steps 1 and 2 for x [B, T, D] and the router's weight [E, D]; see the module docstring."""
    B, T, _ = x.shape
    E = router_weight.shape[0]
    C = capacity(T, E, top_k, capacity_factor)
    probs = (x @ router_weight.t()).softmax(dim=-1)  # [B, T, E]
    gate, expert = probs.topk(top_k, dim=-1)  # [B, T, k], most probable first
    # Position of each pick in its expert's queue: picks in (position, slot) order, counted per expert.
    onehot = F.one_hot(expert.reshape(B, T * top_k), E)  # [B, T*k, E]
    position = ((onehot.cumsum(dim=1) - 1) * onehot).sum(-1).view(B, T, top_k)
    keep = position < C
    # Sequence-wise balance loss: f (a count: no gradient) times P (differentiable), per sequence.
    f = onehot.sum(dim=1).to(probs.dtype) / (T * top_k)  # [B, E]
    aux = (E * (f * probs.mean(dim=1)).sum(-1)).mean()
    return Routing(probs, expert, gate, keep, C, aux)


def sort_by_expert(routing: Routing):
    """Step 3's bookkeeping: the kept picks in expert order.

    Returns (tokens [M], picks [M], counts [E]): row i of the sorted input is token
    tokens[i] of x.reshape(-1, D), its gate is routing.gate.reshape(-1)[picks[i]], and
    counts[e] rows in a row go to expert e (experts in order 0..E-1). M = kept picks.
    The sort is stable, so each expert's tokens keep their order in the batch.
    """
    k = routing.expert.shape[-1]
    picks = routing.keep.flatten().nonzero().squeeze(1)  # kept picks, in (batch, position, slot) order
    experts = routing.expert.flatten()[picks]
    order = torch.sort(experts, stable=True).indices
    picks = picks[order]
    return picks // k, picks, torch.bincount(experts, minlength=routing.n_experts)


def run_experts(experts, x_sorted: torch.Tensor, counts) -> torch.Tensor:
    """Step 4: experts[e] on its chunk of counts[e] consecutive rows; the outputs in the same order."""
    chunks = x_sorted.split([int(c) for c in counts])
    return torch.cat([expert(chunk) for expert, chunk in zip(experts, chunks)]) if chunks else x_sorted


def unpermute(rows: torch.Tensor, tokens: torch.Tensor, gates: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Step 5: y[tokens[i]] += gates[i] x rows[i]; y [n_tokens, D] is 0 for a token with no kept pick."""
    y = rows.new_zeros(n_tokens, rows.shape[-1])
    return y.index_add(0, tokens, rows * gates[:, None])


class Expert(nn.Module):
    """One expert: a SwiGLU MLP d_model -> hidden -> d_model (the same layout as labkit.model.SwiGLU)."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)  # gate
        self.w3 = nn.Linear(d_model, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, d_model, bias=False)  # down

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """The single-device reference MoE layer: router, E experts of width cfg.hidden_dim.

    forward(x [B, T, D]) -> [B, T, D]; sets `.aux_loss` (scalar) and `.routing` (the last
    Routing, for statistics: tokens per expert, dropped fraction).
    """

    def __init__(self, cfg):
        super().__init__()
        check_config(cfg.n_experts, cfg.top_k, cfg.capacity_factor)
        self.n_experts, self.top_k, self.capacity_factor = cfg.n_experts, cfg.top_k, cfg.capacity_factor
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(cfg.d_model, cfg.hidden_dim) for _ in range(cfg.n_experts))
        self.aux_loss, self.routing = None, None

    def forward(self, x):
        routing = route(x, self.router.weight, self.top_k, self.capacity_factor)
        self.aux_loss, self.routing = routing.aux_loss, routing
        flat = x.reshape(-1, x.shape[-1])
        tokens, picks, counts = sort_by_expert(routing)
        rows = run_experts(self.experts, flat[tokens], counts)
        return unpermute(rows, tokens, routing.gate.reshape(-1)[picks], flat.shape[0]).view_as(x)


def moe_layers(model: nn.Module) -> list:
    """Every module of `model` that routes tokens (has an `aux_loss` attribute), in order."""
    return [m for m in model.modules() if hasattr(m, "aux_loss") and hasattr(m, "routing")]


def aux_loss(model: nn.Module) -> torch.Tensor:
    """The sum of the MoE layers' load-balancing losses from the last forward pass."""
    losses = [m.aux_loss for m in moe_layers(model) if m.aux_loss is not None]
    if not losses:
        raise ValueError("no MoE layer has run a forward pass: call the model first")
    return torch.stack(losses).sum()
