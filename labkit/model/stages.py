"""The model cut into pipeline stages that share its parameters (notebooks 05-07).

    from labkit.model import build_model, make_stages
    stages = make_stages(build_model("tiny", seed=0), 2)   # stage 0: embedding + layers; 1: layers + head

The first stage owns the embedding, the last the final norm, the head and the loss; layers are
split as evenly as possible, the first stages taking the extra ones (`split_layers`).
"""
from __future__ import annotations

import torch.nn as nn

from labkit.model.llama import Transformer, check_tokens, lm_loss, run_block


def split_layers(n_layers: int, n_stages: int) -> list[range]:
    """Which layers each stage runs: contiguous ranges, as even as possible.

    When n_layers does not divide by n_stages, the FIRST n_layers % n_stages stages get
    one extra layer (6 layers on 4 stages: 2, 2, 1, 1), because the last stage also
    carries the head and the loss. Every stage gets at least one layer.
    """
    if not isinstance(n_stages, int) or not 1 <= n_stages <= n_layers:
        raise ValueError(f"n_stages must be an int between 1 and n_layers={n_layers} (every stage "
                         f"needs at least one layer), got {n_stages!r}")
    per, extra = divmod(n_layers, n_stages)
    ranges, start = [], 0
    for s in range(n_stages):
        size = per + (1 if s < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


class Stage(nn.Module):
    """Stage `stage` of `n_stages`: shares its parameters with the model it was cut from.

    Stage 0 takes token ids [B, T] (and owns the embedding); later stages take the hidden
    states [B, T, d_model] the previous stage returned. The last stage owns the final norm
    and the head: it returns logits, or the mean loss when given targets. Other stages
    return hidden states [B, T, d_model] and ignore targets.
    """

    def __init__(self, model: Transformer, stage: int, n_stages: int):
        super().__init__()
        if not 0 <= stage < n_stages:
            raise ValueError(f"stage must be in [0, {n_stages}), got {stage}")
        self.config = model.config
        self.stage, self.n_stages = stage, n_stages
        self.layer_ids = split_layers(model.config.n_layers, n_stages)[stage]
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        self.tok_embeddings = model.tok_embeddings if self.is_first else None
        self.rope = model.rope
        self.layers = nn.ModuleList(model.layers[i] for i in self.layer_ids)
        self.norm = model.norm if self.is_last else None
        self.output = model.output if self.is_last else None

    def forward(self, x, targets=None):
        if self.is_first:
            check_tokens(x, self.config)
            x = self.tok_embeddings(x)
        for layer in self.layers:
            x = run_block(layer, x, self.rope, self.config.recompute)
        if not self.is_last:
            return x
        logits = self.output(self.norm(x))
        return logits if targets is None else lm_loss(logits, targets)


def make_stage(model: Transformer, stage: int, n_stages: int) -> Stage:
    return Stage(model, stage, n_stages)


def make_stages(model: Transformer, n_stages: int) -> list[Stage]:
    return [Stage(model, s, n_stages) for s in range(n_stages)]
