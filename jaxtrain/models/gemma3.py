"""Gemma 3 (the text decoder; `gemma3_text`, and the language model of a `gemma3` checkpoint).

What differs from Llama, each a switch or an architecture field:
- RMSNorm scales by (1 + w); four norms per layer (before and after attention and the MLP);
- per-head RMSNorm on queries and keys (before RoPE);
- embeddings times sqrt(D); GeGLU with the tanh GELU; tied embeddings;
- the softmax scale is query_pre_attn_scalar ** -0.5 rather than head_dim ** -0.5;
- local layers attend within a sliding window and use their own RoPE base (10 000, no scaling),
  global layers the main RoPE (base 1e6, linear scaling in the 4B to 27B models), in the pattern
  config.json's `layer_types` gives (the published models: five local, then one global).
"""

from jaxtrain.models.features import Family, Features

# Gemma 3 ties the output head to the embeddings in every published size, and so does our
# export unless the model was untied; the projections LoRA may adapt are the usual seven.
FAMILY = Family(
    name="gemma3",
    features=Features(qk_norm=True, norm_plus_one=True, sandwich_norms=True,
                      scale_embeddings=True, mlp_activation="gelu_tanh"),
    hf_model_types=("gemma3_text", "gemma3"),
    hf_architecture="Gemma3ForCausalLM",
    hf_defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
                 "tie_word_embeddings": True, "rope_theta": 1_000_000.0,
                 "rope_local_base_freq": 10_000.0, "sliding_window": 4096,
                 "query_pre_attn_scalar": 256, "sliding_window_pattern": 6,
                 "hidden_activation": "gelu_pytorch_tanh",
                 # Gemma3TextConfig's sizes: a multimodal checkpoint's text_config may give
                 # only some of them.
                 "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
                 "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                 "head_dim": 256},
    hf_window="typed",
    hf_export_fields={"attention_bias": False, "attn_logit_softcapping": None,
                      "final_logit_softcapping": None, "use_bidirectional_attention": False},
    summary="Gemma 3: (1+w) sandwich norms, q/k norm, GeGLU, 5 local : 1 global layers",
)
