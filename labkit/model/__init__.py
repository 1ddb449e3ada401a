"""The lab's model: a small LLaMA-style decoder (`llama`), its pipeline stages (`stages`) and its
mixture-of-experts layer (`moe`).

    from labkit.model import build_model, get_config, make_stages

The names below are `labkit.model.llama`'s and `labkit.model.stages`' public API, re-exported so that `labkit.model.X` reads
as the model's API. Patch or read module state in `labkit.model.llama` itself.
"""
from labkit.model.llama import (CONFIGS, Attention, Block, ModelConfig, RMSNorm, Rotary, SwiGLU,
                                Transformer, build_model, causal_attention, check_tokens, get_config,
                                lm_loss, run_block)
from labkit.model.stages import Stage, make_stage, make_stages, split_layers

__all__ = ["CONFIGS", "Attention", "Block", "ModelConfig", "RMSNorm", "Rotary", "Stage", "SwiGLU",
           "Transformer", "build_model", "causal_attention", "check_tokens", "get_config", "lm_loss",
           "make_stage", "make_stages", "run_block", "split_layers"]
