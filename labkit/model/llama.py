"""The lab's model: a small LLaMA-style decoder (its split into pipeline stages: `labkit.model.stages`).

    from labkit.model import build_model, get_config, make_stages
    model = build_model("tiny", seed=0)        # same seed -> same weights, on every rank
    loss = model(x, y)                         # x, y: [B, T] token ids -> scalar mean loss
    logits = model(x)                          # -> [B, T, vocab_size]
    stages = make_stages(model, 2)             # nn.Modules sharing the model's parameters

The architecture follows LLaMA (and Karpathy's llama2.c, whose 15M "stories" model is
the `seed` config): token embedding, n_layers x [RMSNorm -> causal self-attention with
rotary position embeddings -> residual, RMSNorm -> SwiGLU MLP -> residual], a final
RMSNorm and an output head. The head is *not* tied to the embedding, so that a pipeline's
first stage can own the embedding and its last stage the head with no shared weight.

Named configs (`get_config(name, **overrides)`), vocabulary = the shipped tokenizer's 4096:
    seed  d_model 288, 6 heads, 6 layers, context 256, hidden 768   (8.3M parameters)
    tiny  d_model  64, 4 heads, 4 layers, context 128, hidden 176   (0.73M parameters)
    tiny-moe  d_model 64, 4 heads, 2 layers, context 128, 4 SwiGLU experts of hidden 64, top-2
          (labkit.model.moe: n_experts > 0 swaps each block's MLP for a mixture of experts; the
          load-balancing loss of every MoE layer, times aux_loss_coef, is added to the loss
          that forward(tokens, targets) returns)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch._subclasses.fake_tensor import is_fake


@dataclass
class ModelConfig:
    vocab_size: int = 4096
    d_model: int = 288
    n_heads: int = 6
    n_layers: int = 6
    context: int = 256  # the longest sequence the model accepts
    hidden_dim: int | None = None  # SwiGLU width; None: LLaMA's rule from d_model (see below)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # mixture of experts (labkit.model.moe); n_experts = 0: the dense SwiGLU MLP
    n_experts: int = 0
    top_k: int = 2
    capacity_factor: float = 1.25
    aux_loss_coef: float = 0.01
    recompute: bool = False  # activation recomputation: keep only each block's input, redo its forward in backward

    def __post_init__(self):
        if self.hidden_dim is None:
            # LLaMA: 2/3 of 4*d (SwiGLU has three matrices instead of two), rounded up to 16
            self.hidden_dim = 16 * math.ceil(int(2 * 4 * self.d_model / 3) / 16)
        for name in ("vocab_size", "d_model", "n_heads", "n_layers", "context", "hidden_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(f"d_model={self.d_model} must split into n_heads={self.n_heads} heads "
                             "of even size (rotary embeddings rotate pairs of channels)")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


CONFIGS = {
    "seed": dict(d_model=288, n_heads=6, n_layers=6, context=256, hidden_dim=768),
    "tiny": dict(d_model=64, n_heads=4, n_layers=4, context=128, hidden_dim=176),
    "tiny-moe": dict(d_model=64, n_heads=4, n_layers=2, context=128, hidden_dim=64, n_experts=4, top_k=2),
}


def get_config(name: str, **overrides) -> ModelConfig:
    """The named config ("seed" or "tiny") with `overrides` applied, e.g. vocab_size=65.

    Overriding d_model without hidden_dim recomputes hidden_dim with LLaMA's rule.
    """
    if isinstance(name, ModelConfig):
        return replace(name, **overrides)
    if name not in CONFIGS:
        raise ValueError(f"unknown model config {name!r}; known configs: {sorted(CONFIGS)}")
    known = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown ModelConfig field(s) {unknown}; fields are {sorted(known)}")
    values = dict(CONFIGS[name])
    if "d_model" in overrides and "hidden_dim" not in overrides:
        values.pop("hidden_dim")
    values.update(overrides)
    return ModelConfig(**values)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight: LayerNorm without the mean and the bias."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x if x.dtype == torch.float64 else x.float()  # fp32 even in bf16; float64 proofs stay float64
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class Rotary(nn.Module):
    """Rotary position embedding tables; a module so that every stage can hold and move it."""

    def __init__(self, head_dim: int, context: int, theta: float):
        super().__init__()
        freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(context, dtype=torch.float64), freqs)  # [context, head_dim/2]
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x):
        """Rotate each pair (x[..., i], x[..., i + head_dim/2]) of x [B, H, T, head_dim] by position."""
        T = x.shape[-2]
        cos, sin = self.cos[:T].to(x.dtype), self.sin[:T].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal scaled-dot-product attention; on CPU in bf16/fp16, the math kernel if the fused one refuses.

    torch's CPU flash-attention kernel picks its bf16 code path from the CPU it finds, but under
    ATEN_CPU_CAPABILITY=default or =avx2 on an AVX-512 machine it raises "pack_vnni2 is only
    supported when avx512 is supported". The math backend computes the same attention in plain
    ops, on every CPU; it is used only where the fused kernel refused, so fp32 and GPUs never pay.
    """
    try:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except RuntimeError:
        low_precision = q.dtype in (torch.bfloat16, torch.float16) or torch.is_autocast_enabled("cpu")
        if q.device.type != "cpu" or not low_precision:
            raise
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x, rope: Rotary):
        B, T, D = x.shape
        heads = lambda t: t.view(B, T, self.n_heads, D // self.n_heads).transpose(1, 2)  # [B, H, T, hd]
        q, k, v = heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x))
        q, k = rope(q), rope(k)
        y = causal_attention(q, k, v)
        return self.wo(y.transpose(1, 2).reshape(B, T, D))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.hidden_dim, bias=False)  # gate
        self.w3 = nn.Linear(cfg.d_model, cfg.hidden_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.d_model, bias=False)  # down

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if cfg.n_experts:
            from labkit.model.moe import MoE  # imported here: labkit.model.moe does not import this module
            self.feed_forward = MoE(cfg)
        else:
            self.feed_forward = SwiGLU(cfg)

    def forward(self, x, rope: Rotary):
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


def run_block(block: nn.Module, x: torch.Tensor, rope: Rotary, recompute: bool = False) -> torch.Tensor:
    """block(x, rope); with recompute, through torch.utils.checkpoint: backward redoes the forward.

    Recomputation saves only the block's input for backward (the activations inside are
    recomputed), for one extra forward per block. The gradients are exactly the same.
    """
    if recompute and torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(block, x, rope, use_reentrant=False)
    return block(x, rope)


def check_tokens(tokens: torch.Tensor, cfg: ModelConfig) -> None:
    """Clear errors for what would otherwise be an index error deep in the embedding."""
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype != torch.long:
        got = f"{tuple(tokens.shape)} {tokens.dtype}" if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise ValueError(f"tokens must be a [batch, seq] LongTensor of token ids, got {got}")
    if tokens.shape[1] > cfg.context:
        raise ValueError(f"sequence length {tokens.shape[1]} is longer than the model's context "
                         f"{cfg.context}: use seq_len <= {cfg.context} or a config with a longer context")
    # the value check reads the tensor: on a GPU that would cost a sync every step, and
    # there the embedding's own device-side assert stops out-of-range ids anyway
    # fake tensors (labkit.scale.simulate) have shapes but no values to read
    if tokens.numel() and tokens.device.type == "cpu" and not is_fake(tokens):
        lo, hi = torch.aminmax(tokens)
        if lo < 0 or hi >= cfg.vocab_size:
            raise ValueError(f"token ids must lie in [0, {cfg.vocab_size}), got min {int(lo)} max {int(hi)}: "
                             "the tokenizer and the model's vocab_size do not match (see labkit.data.check_vocab)")


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position (targets == -100 are ignored)."""
    logits = logits if logits.dtype == torch.float64 else logits.float()  # fp32 even in bf16; float64 stays
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.rope = Rotary(cfg.head_dim, cfg.context, cfg.rope_theta)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, tokens, targets=None):
        """tokens [B, T] -> logits [B, T, vocab]; with targets [B, T] -> the scalar mean loss."""
        check_tokens(tokens, self.config)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = run_block(layer, h, self.rope, self.config.recompute)
        logits = self.output(self.norm(h))
        if targets is None:
            return logits
        loss = lm_loss(logits, targets)
        if self.config.n_experts:  # the MoE layers' load-balancing loss reaches the loss here
            from labkit.model.moe import aux_loss
            loss = loss + self.config.aux_loss_coef * aux_loss(self)
        return loss

    def init_weights(self, seed: int = 0) -> None:
        """Deterministic init from `seed` with a private generator (the global RNG is untouched).

        llama2.c's scheme: N(0, 0.02) everywhere, N(0, 0.02/sqrt(2 n_layers)) for the
        matrices that write into the residual stream (wo, w3), norms at 1.
        """
        g = torch.Generator().manual_seed(seed)
        std_residual = 0.02 / math.sqrt(2 * self.config.n_layers)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    std = std_residual if name.endswith(("wo.weight", "w3.weight")) else 0.02
                    # sample on the CPU, then copy: identical weights whatever the device
                    p.copy_(torch.empty(p.shape).normal_(0.0, std, generator=g))

    def num_params(self, exclude_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.tok_embeddings.weight.numel() if exclude_embedding else n

    @torch.no_grad()
    def generate(self, tokens, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None):
        """Append `max_new_tokens` sampled tokens to tokens [B, T]; temperature 0 is greedy.

        Only the last `context` tokens are fed back. Pass a `generator` for a reproducible sample.
        """
        if tokens.dim() == 1:
            tokens = tokens[None]
        for _ in range(max_new_tokens):
            logits = self(tokens[:, -self.config.context:])[:, -1, :].float()
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(logits.softmax(-1), 1, generator=generator)
            tokens = torch.cat([tokens, nxt], dim=1)
        return tokens


def build_model(config_or_name: ModelConfig | str = "tiny", seed: int = 0, device=None, **overrides) -> Transformer:
    """A Transformer with deterministic weights: the same seed gives the same model anywhere.

    `config_or_name`: a ModelConfig or a name for `get_config` (with `overrides`).
    """
    cfg = config_or_name if isinstance(config_or_name, ModelConfig) and not overrides \
        else get_config(config_or_name, **overrides)
    with torch.random.fork_rng(devices=[]):  # nn.Linear's default init draws from the global RNG
        model = Transformer(cfg)
    model.init_weights(seed)
    return model.to(device) if device is not None else model
