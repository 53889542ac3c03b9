"""Qwen2 / Qwen2.5: Llama's decoder with biases on the query, key and value projections.

The output projection and the MLP have none. Qwen2.5 ties the embeddings in its small sizes
(0.5B to 3B). `use_sliding_window` (off in every published Qwen2.5 model) marks layers from
`max_window_layers` on as sliding; import reads it through `layer_types`.
"""

from jaxtrain.models.features import Family, Features

FAMILY = Family(
    name="qwen2",
    features=Features(qkv_bias=True),
    hf_model_types=("qwen2",),
    hf_architecture="Qwen2ForCausalLM",
    hf_defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
                 "tie_word_embeddings": False, "rope_theta": 10000.0,
                 "num_key_value_heads": 32, "use_sliding_window": False, "sliding_window": 4096,
                 "max_window_layers": 28},
    hf_window="qwen",
    summary="Qwen2.5: Llama's decoder with q/k/v biases",
)
