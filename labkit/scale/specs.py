"""Model shapes for the cost model: Llama-3-like decoders, their parameters and FLOPs (notebook 15).

`ModelSpec` is labkit.model's architecture (RMSNorm, RoPE attention, SwiGLU, untied head) with
two additions the published models need: grouped-query attention (`n_kv_heads` < `n_heads`:
wk and wv are d x (d * n_kv_heads / n_heads)) and, optionally, mixture-of-experts MLPs
(`n_experts` SwiGLU experts of width `hidden_dim`, `top_k` per token, plus a d x n_experts
router). `spec_from_config` turns a labkit `ModelConfig` into one (n_kv_heads = n_heads).

FLOPs per token (Kaplan et al. 2020; PaLM, Chowdhery et al. 2022, appendix B, as torchtitan
counts them): forward + backward = 6 N + 12 L d s, where N is the parameters a token
multiplies by (every matrix except the embedding lookup; for MoE only the top_k active
experts) and 12 L d s is attention's scores and weighted sum (2 matmuls of s x d per token
and layer, x 3 for backward, x 2 FLOPs per multiply-add; the causal mask's half is not
subtracted, as in torchtitan's and the Playbook's MFU). Recomputation adds forward work that
is not model FLOPs: `recompute_flops_per_token`.

GPT-3-shaped models (Megatron-LM's, `GPT_MEGATRON`): `mlp="gelu"` (two d x 4d matrices, Brown et al.
2020), full multi-head attention, vocabulary 51,200, `attention="materialized"` (the s x s scores
and softmax are saved for backward, as Megatron-LM did in 2021-22) and `dropout=True` (one byte
masks saved). Their FLOPs by Narayanan et al. 2021 (arXiv 2104.04473), eq. 3, with full
recomputation: F = 96 B s l h^2 (1 + s / (6 h) + V / (16 l h)) per iteration of B sequences; without
recomputation (3 passes instead of 4) 72 B s l h^2 (1 + s / (6 h) + V / (12 l h)), which is
6 N + 12 l h s per token with N = 12 l h^2 + V h: our `flops_per_token` counts N from the
spec's matrices, 12 h^2 per block (2 h^2 more FLOPs-free norm and bias weights: 13 h per block,
which eq. 3 leaves out; `paper_flops_per_token` is eq. 3 itself, for the published TFLOP/s).

Recompute policies (`RECOMPUTE`): "none"; "full" (each block's input only, the block's forward
run again in backward); "selective-attn" (Korthikanti et al. 2022, arXiv 2205.05198, sec. 4:
only the attention core, the scores, softmax, its dropout and the weighted sum, is recomputed);
"selective-op" (torchtitan's op-level policy: every other matmul's output kept).
`fused_kernels=True`: a fused RMSNorm (saves its input and 1/rms) and a fused SwiGLU (saves w1's and
w3's outputs and their product; silu is recomputed inside the kernel), as production stacks run them;
False: labkit.model's eager modules, whose saved tensors labkit.measure.activations counts. "selective",
torchtitan's name, means "selective-op" (`normalize_recompute`).
`megatron_fusions=True`: the kernels Megatron-LM runs its GPT with, by its paper's own account (Narayanan et al.
2021, sec. 4.2, 'Computation Optimizations': fused bias + GeLU and bias + dropout + add, and a fused scale,
mask and softmax) and its code (Apex's FusedLayerNorm; learned absolute positions, added once to the
embedding, so no rotary in the blocks): their time only (`labkit.scale.layer_ops`), not what they save; and its
vocabulary-parallel cross-entropy, in place on fp32 logits: its time and its logits' memory (`labkit.scale.footprint`).
`kv_repeated=True`: the K/V heads repeated to n_heads before the attention call, as torchtitan's Llama did
(torchtitan/models/llama/model.py: `repeat_kv` before `F.scaled_dot_product_attention`); its CP shards that
call's inputs, so its ring moves and holds n_heads / tp K/V heads, not GQA's n_kv_heads / tp.
`sp_saves_shard=True`: sequence parallelism as Megatron-LM runs it (Korthikanti et al. 2022, sec. 4.2.2: each
column-parallel linear saves its input's shard and all-gathers it again in backward); False: torchtitan's
plan, whose linears save the whole all-gathered input (labkit.scale.footprint).
MPT-shaped models (MosaicML's llm-foundry, `MPT`): GPT's block (GeLU MLP of width 4 d, full multi-head attention)
run by FlashAttention, with `norm="layernorm"` (torch's LayerNorm: one kernel a pass, the bytes of a fused RMSNorm),
`positions="learned"` (added once to the embedding: no rotary in the blocks) and `tied_embedding=True` (the head
multiplies by the embedding's matrix: its FLOPs stay, its parameters are held, gathered and stepped once).
`unpadded_attention=True`: llm-foundry's flash path (attn_impl 'flash'), which unpads q, k and v through
flash_attn's bert_padding before the kernel, with two host syncs each, and pads the output back
(`labkit.scale.kernels.unpadded_attention`): their time only.
"""
from __future__ import annotations

from dataclasses import dataclass

RECOMPUTE = ("none", "selective-op", "selective-attn", "full")
MLPS = ("swiglu", "gelu")
ATTENTION = ("flash", "materialized")
NORMS = ("rmsnorm", "layernorm")
POSITIONS = ("rotary", "learned")


def normalize_recompute(recompute: str) -> str:
    """A recompute policy's canonical name: "selective" (torchtitan's name, what the lab called it) is
    "selective-op"; an unknown name raises ValueError naming the known ones."""
    if recompute == "selective":
        return "selective-op"
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r} is not a policy the model knows: choose one of {RECOMPUTE} "
                         "('selective' is torchtitan's op policy, 'selective-op')")
    return recompute


@dataclass(frozen=True)
class ModelSpec:
    name: str
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    vocab_size: int
    n_experts: int = 0
    top_k: int = 1
    mlp: str = "swiglu"
    attention: str = "flash"
    dropout: bool = False
    fused_kernels: bool = False
    sp_saves_shard: bool = False
    megatron_fusions: bool = False
    kv_repeated: bool = False
    norm: str = "rmsnorm"
    positions: str = "rotary"
    tied_embedding: bool = False
    unpadded_attention: bool = False

    def __post_init__(self):
        for field in ("d_model", "n_layers", "n_heads", "n_kv_heads", "hidden_dim", "vocab_size"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelSpec.{field} must be a positive int, got {value!r}")
        if self.d_model % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(f"{self.name}: d_model={self.d_model} must split into n_heads={self.n_heads}, "
                             f"and n_heads into n_kv_heads={self.n_kv_heads} groups")
        if self.mlp not in MLPS or self.attention not in ATTENTION or not isinstance(self.dropout, bool):
            raise ValueError(f"{self.name}: mlp={self.mlp!r} must be one of {MLPS}, attention={self.attention!r} one of "
                             f"{ATTENTION}, dropout={self.dropout!r} True or False")
        if self.norm not in NORMS or self.positions not in POSITIONS or not isinstance(self.tied_embedding, bool):
            raise ValueError(f"{self.name}: norm={self.norm!r} must be one of {NORMS}, positions={self.positions!r} one "
                             f"of {POSITIONS}, tied_embedding={self.tied_embedding!r} True or False")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"{self.name}: top_k={self.top_k} must be in 1..n_experts={self.n_experts}")

    @property
    def attention_kv_heads(self) -> int:
        """The K/V heads the attention call is given: GQA's n_kv_heads, or n_heads where the model repeats them
        first (`kv_repeated`), which is what a context-parallel ring around that call then moves and holds."""
        return self.n_heads if self.kv_repeated else self.n_kv_heads

    @property
    def kv_dim(self) -> int:
        return self.d_model // self.n_heads * self.n_kv_heads

    @property
    def attention_params(self) -> int:
        d = self.d_model
        return 2 * d * d + 2 * d * self.kv_dim  # wq, wo; wk, wv

    @property
    def expert_params(self) -> int:
        """One MLP: SwiGLU (w1, w3: d x H; w2: H x d), or GeLU (d x H, H x d)."""
        return (3 if self.mlp == "swiglu" else 2) * self.d_model * self.hidden_dim

    @property
    def layer_params(self) -> int:
        """One block: attention, its MLP(s) (all experts and the router for MoE), two norms."""
        mlp = self.expert_params * max(1, self.n_experts) + self.d_model * self.n_experts
        return self.attention_params + mlp + 2 * self.d_model

    @property
    def layer_dense_params(self) -> int:
        """The parameters of a block that are not experts (every TP/DP rank has them)."""
        return self.layer_params - (self.expert_params * self.n_experts)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.d_model

    @property
    def head_params(self) -> int:
        """The output head and the final norm; the final norm alone where the head is the embedding's matrix
        (`tied_embedding`: a pipeline's last stage then holds that matrix too, `stage_head_params`)."""
        return (0 if self.tied_embedding else self.vocab_size * self.d_model) + self.d_model

    def stage_head_params(self, first: bool) -> int:
        """What the last stage holds for the head: `head_params`, plus the tied matrix unless that stage is also the
        first (the embedding's stage), as Megatron-LM keeps a copy of a shared embedding on its last stage."""
        return self.head_params + (self.vocab_size * self.d_model if self.tied_embedding and not first else 0)

    @property
    def n_params(self) -> int:
        return self.embedding_params + self.n_layers * self.layer_params + self.head_params

    @property
    def active_params(self) -> int:
        """Parameters one token multiplies by: all but the embedding; top_k experts of each MoE layer."""
        per_layer = self.layer_params
        if self.n_experts:
            per_layer -= self.expert_params * (self.n_experts - self.top_k)
        return self.n_layers * per_layer + self.vocab_size * self.d_model + self.d_model  # the head multiplies, tied or not

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs of forward + backward for one token: 6 N + 12 L d s."""
        return 6 * self.active_params + 12 * self.n_layers * self.d_model * seq_len

    def recompute_flops_per_token(self, seq_len: int, recompute: str) -> float:
        """Forward FLOPs done again in backward, per token.

        "none": 0. "full": the blocks' whole forward again (2 N_blocks + 4 L d s).
        "selective-attn" (Megatron): the attention core's two matmuls again, 4 L d s.
        "selective-op" (torchtitan's op-level policy, also "selective"), which keeps the output
        of every other matmul of a block (wq, wv, w1, w2 kept; wk, wo, w3 recomputed) and of attention.
        """
        d, L = self.d_model, self.n_layers
        recompute = normalize_recompute(recompute)
        if recompute == "none":
            return 0.0
        mlp_active = self.expert_params * max(1, self.top_k if self.n_experts else 1)
        if recompute == "full":
            return 2 * L * (self.attention_params + mlp_active) + 4 * L * d * seq_len
        if recompute == "selective-attn":
            return 4 * L * d * seq_len
        w3 = mlp_active // 3
        return 2 * L * (d * self.kv_dim + d * d + w3)

    def paper_flops_per_token(self, seq_len: int, recompute: bool) -> float:
        """Narayanan et al. 2021 eq. 3 per token: 96 l h^2 (1 + s/(6h) + V/(16 l h)) with full
        recomputation (4 passes), 72 l h^2 (1 + s/(6h) + V/(12 l h)) without (3 passes). For the
        GPT shape only (MHA, GeLU 4h): it is what Megatron's published TFLOP/s count."""
        if not (self.mlp == "gelu" and self.n_heads == self.n_kv_heads and self.hidden_dim == 4 * self.d_model):
            raise ValueError(f"{self.name}: eq. 3 is for GPT-shaped models (mlp='gelu', MHA, hidden_dim = 4 d_model)")
        h, l, s, V = self.d_model, self.n_layers, seq_len, self.vocab_size
        if recompute:
            return 96 * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
        return 72 * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))


# Llama 3 / 3.1 shapes (Meta's model cards and params.json; "The Llama 3 Herd of Models",
# Dubey et al. 2024, table 3): vocabulary 128,256, 8 KV heads
LLAMA3 = {
    "8b": ModelSpec("llama3-8b", d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden_dim=14336,
                    vocab_size=128256),
    "70b": ModelSpec("llama3-70b", d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, hidden_dim=28672,
                     vocab_size=128256),
    "405b": ModelSpec("llama3-405b", d_model=16384, n_layers=126, n_heads=128, n_kv_heads=8, hidden_dim=53248,
                      vocab_size=128256),
    # a Mixtral-8x7B-shaped MoE (Jiang et al. 2024): 8 experts, top 2, Llama-2 vocabulary
    "moe-8x7b": ModelSpec("moe-8x7b", d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden_dim=14336,
                          vocab_size=32000, n_experts=8, top_k=2),
}




def gpt_spec(name: str, d_model: int, n_layers: int, n_heads: int) -> ModelSpec:
    """A GPT-3-shaped model as Megatron-LM trained it (Narayanan et al. 2021, sec. 5.1: vocabulary 51,200,
    sequence 2,048): MHA, GeLU MLP of width 4 d, attention scores materialized, dropout."""
    return ModelSpec(name, d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_heads,
                     hidden_dim=4 * d_model, vocab_size=51200, mlp="gelu", attention="materialized", dropout=True,
                     megatron_fusions=True)


# Megatron-LM's GPT shapes, (hidden, layers, heads): Narayanan et al. 2021 (arXiv 2104.04473) Table 1, whose
# hidden sizes and layers NVIDIA/Megatron-LM's README shows (images/cases_april2021.png); the heads are the
# paper's column, not in that image (they set only the attention core's memory). "22b" and "175b" (GPT-3,
# Brown et al. 2020) are Korthikanti et al. 2022's (arXiv 2205.05198) Table 3.
GPT_MEGATRON = {name: gpt_spec(f"gpt-{name}", h, layers, heads) for name, (h, layers, heads) in {
    "1.7b": (2304, 24, 24), "3.6b": (3072, 30, 32), "7.5b": (4096, 36, 32), "18b": (6144, 40, 48),
    "39b": (8192, 48, 64), "76b": (10240, 60, 80), "145b": (12288, 80, 96), "310b": (16384, 96, 128),
    "530b": (20480, 105, 128), "1t": (25600, 128, 160), "22b": (6144, 48, 64), "175b": (12288, 96, 96),
}.items()}


def mpt_spec(name: str, d_model: int, n_layers: int, n_heads: int) -> ModelSpec:
    """An MPT model as llm-foundry's pretraining yamls build it (scripts/train/yamls/pretrain/mpt-*.yaml at
    5e85bd62d, 2024-01-06): MHA, expansion_ratio 4 (GeLU), vocabulary 50,368, and MPTConfig's defaults there: no
    dropout (resid_pdrop = emb_pdrop = 0), learned positions (learned_pos_emb), the embedding tied to the head
    (tie_word_embeddings), biases on (no_bias false: in the GEMMs' epilogues; their d-sized parameters, like the
    learned positions' 2,048 x d, are not counted); FlashAttention."""
    return ModelSpec(name, d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_heads,
                     hidden_dim=4 * d_model, vocab_size=50368, mlp="gelu", norm="layernorm", positions="learned",
                     tied_embedding=True)


# llm-foundry's MPT shapes (d_model, n_layers, n_heads), the yamls above: 1b and 3b with 16 and 20 heads ('so that
# d_head == 128 to satisfy FlashAttention', their comments)
MPT = {f"mpt-{name}": mpt_spec(f"mpt-{name}", d, layers, heads) for name, (d, layers, heads) in {
    "1b": (2048, 24, 16), "3b": (2560, 32, 20), "7b": (4096, 32, 32), "13b": (5120, 40, 40),
    "30b": (7168, 48, 56), "70b": (8192, 80, 64),
}.items()}
MODELS = {**LLAMA3, **GPT_MEGATRON, **MPT}


def spec_from_config(config, name: str = "labkit") -> ModelSpec:
    """A labkit.model ModelConfig (or its name) as a ModelSpec: full multi-head attention."""
    from labkit.model import get_config

    c = get_config(config) if isinstance(config, str) else config
    return ModelSpec(name, d_model=c.d_model, n_layers=c.n_layers, n_heads=c.n_heads, n_kv_heads=c.n_heads,
                     hidden_dim=c.hidden_dim, vocab_size=c.vocab_size, n_experts=c.n_experts,
                     top_k=c.top_k if c.n_experts else 1)
