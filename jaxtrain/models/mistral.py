"""Mistral: Llama's decoder with an optional sliding window on every layer.

Mistral 7B v0.1 attends within a 4096-token window (`sliding_window` in config.json); v0.2 and
later set it to null (full attention), which is then exactly Llama with its own vocabulary and
RoPE base. Mistral NeMo gives an explicit `head_dim` (128 over a hidden size of 5120).
"""

from jaxtrain.models.features import Family, Features

FAMILY = Family(
    name="mistral",
    features=Features(),
    hf_model_types=("mistral",),
    hf_architecture="MistralForCausalLM",
    # MistralConfig's defaults: a 4096 window unless config.json says null.
    hf_defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 4096 * 32,
                 "tie_word_embeddings": False, "rope_theta": 10000.0, "sliding_window": 4096,
                 "num_key_value_heads": 8},
    hf_window="every",
    summary="Mistral: Llama's decoder, optional sliding window on every layer",
)
