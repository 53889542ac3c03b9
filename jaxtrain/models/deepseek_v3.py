"""DeepSeek-V3 (and Kimi K2, the same architecture at 384 experts): multi-head latent attention
and DeepSeek's Mixture of Experts.

Attention is MLA (models/mla.py): a q_lora_rank query bottleneck, keys and values from a
kv_lora_rank latent, RoPE on the last qk_rope_head_dim dims of each query/key head. The first
`first_k_dense_replace` layers keep a dense MLP of `intermediate_size`; every later layer is an
MoE of `n_routed_experts` SwiGLU experts of `moe_intermediate_size` (8 chosen per token by
sigmoid scores plus a correction bias, within the 4 best of 8 groups, weights renormalized and
times `routed_scaling_factor`) beside `n_shared_experts` shared experts every token passes.
The checkpoint keeps the router as `mlp.gate` (with `e_score_correction_bias`), the experts as
`mlp.experts.{j}.{gate,up,down}_proj` and the shared ones as `mlp.shared_experts.*`.
"""

from jaxtrain.models.features import ExpertNames, Family, Features

FAMILY = Family(
    name="deepseek_v3",
    features=Features(),
    hf_model_types=("deepseek_v3",),
    hf_architecture="DeepseekV3ForCausalLM",
    # DeepseekV3Config's defaults.
    hf_defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
                 "tie_word_embeddings": False, "rope_theta": 10000.0, "head_dim": None,
                 "num_key_value_heads": 128, "vocab_size": 129280, "hidden_size": 7168,
                 "intermediate_size": 18432, "num_hidden_layers": 61,
                 "num_attention_heads": 128, "n_routed_experts": 256,
                 "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
                 "norm_topk_prob": True, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
                 "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3,
                 "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
                 "v_head_dim": 128, "qk_nope_head_dim": 128, "rope_interleave": True,
                 "num_nextn_predict_layers": 1},
    hf_export_fields={"attention_bias": False, "attention_dropout": 0.0,
                      "rope_interleave": True, "pretraining_tp": 1},
    # LoRA on MLA's output projection and on the MLPs (dense, shared and every expert).
    lora_targets=("o", "gate", "up", "down"),
    multi_token_prediction=True,
    summary="DeepSeek-V3: latent attention, sigmoid-routed experts with shared experts",
    hf_experts=ExpertNames(block="mlp", router="gate", gate="gate_proj", up="up_proj",
                           down="down_proj", num_experts_key="n_routed_experts",
                           expert_mlp_key="moe_intermediate_size",
                           router_bias="e_score_correction_bias", shared="shared_experts"),
)
