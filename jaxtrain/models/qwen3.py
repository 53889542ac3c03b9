"""Qwen3 (dense): Llama's decoder with an RMSNorm on each head's queries and keys.

The per-head norms (`q_norm`, `k_norm`, over the head dim) come after the projections and before
RoPE. The head dim is given explicitly (128 in every size, whatever hidden_size / heads is); the
small sizes (0.6B to 4B) tie the embeddings.
"""

from jaxtrain.models.features import Family, Features

FAMILY = Family(
    name="qwen3",
    features=Features(qk_norm=True),
    hf_model_types=("qwen3",),
    hf_architecture="Qwen3ForCausalLM",
    hf_defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
                 "tie_word_embeddings": False, "rope_theta": 10000.0, "head_dim": 128,
                 "num_key_value_heads": 32, "use_sliding_window": False, "sliding_window": 4096,
                 "max_window_layers": 28},
    hf_window="qwen",
    hf_export_fields={"attention_bias": False},
    summary="Qwen3: Llama's decoder with per-head q/k RMSNorm",
)
