"""Qwen3-MoE: Qwen3's decoder (per-head q/k RMSNorm) with Mixtures of Experts.

A layer is MoE unless listed in `mlp_only_layers`, when (i + 1) is a multiple of
`decoder_sparse_step` (1 in the released models: every layer). Its router takes the top
`num_experts_per_tok` of `num_experts` experts (8 of 128) from the softmax, renormalized when
`norm_topk_prob` (true in the released models); each expert is a SwiGLU MLP of
`moe_intermediate_size`, and the dense layers keep `intermediate_size`.
"""

from jaxtrain.models.features import ExpertNames, Family, Features

FAMILY = Family(
    name="qwen3_moe",
    features=Features(qk_norm=True),
    hf_model_types=("qwen3_moe",),
    hf_architecture="Qwen3MoeForCausalLM",
    # Qwen3MoeConfig's defaults.
    hf_defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
                 "tie_word_embeddings": False, "rope_theta": 10000.0, "head_dim": None,
                 "num_key_value_heads": 4, "use_sliding_window": False, "sliding_window": 4096,
                 "num_experts": 128, "num_experts_per_tok": 8,
                 "moe_intermediate_size": 768, "norm_topk_prob": False,
                 "decoder_sparse_step": 1, "mlp_only_layers": []},
    hf_window="all",
    hf_export_fields={"attention_bias": False, "output_router_logits": False},
    summary="Qwen3-MoE: Qwen3's decoder, MLPs as top-k Mixtures of Experts",
    hf_experts=ExpertNames(block="mlp", router="gate", gate="gate_proj", up="up_proj",
                           down="down_proj", num_experts_key="num_experts",
                           expert_mlp_key="moe_intermediate_size"),
)
