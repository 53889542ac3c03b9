"""Llama 3.x (and any `model_type: llama` checkpoint): the shared decoder with no switch on.

Pre-norm RMSNorm blocks, grouped-query attention with RoPE (optionally Llama 3's frequency
scaling), a SwiGLU MLP, untied or tied output head.
"""

from jaxtrain.models.features import Family, Features

FAMILY = Family(
    name="llama",
    features=Features(),
    hf_model_types=("llama",),
    hf_architecture="LlamaForCausalLM",
    hf_defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
                 "tie_word_embeddings": False, "rope_theta": 10000.0},
    hf_export_fields={"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1},
    summary="Llama 3.x: GQA, RoPE (llama3 scaling), SwiGLU",
)
