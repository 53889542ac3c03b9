"""Mixtral: Mistral's decoder with a Mixture of Experts in place of every MLP.

Each layer's router picks 2 of 8 experts (SwiGLU MLPs of `intermediate_size`) per token from
the softmax over its logits, and always renormalizes the two weights to sum to 1 (there is no
`norm_topk_prob` switch in its config). The checkpoint keeps `block_sparse_moe.gate` (the
router) and, per expert, `w1` (gate), `w3` (up) and `w2` (down).
"""

from jaxtrain.models.features import ExpertNames, Family, Features

FAMILY = Family(
    name="mixtral",
    features=Features(),
    hf_model_types=("mixtral",),
    hf_architecture="MixtralForCausalLM",
    # MixtralConfig's defaults (no window unless config.json gives one).
    hf_defaults={"rms_norm_eps": 1e-5, "max_position_embeddings": 4096 * 32,
                 "tie_word_embeddings": False, "rope_theta": 1e6, "sliding_window": None,
                 "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
                 "router_jitter_noise": 0.0},
    hf_window="every",
    hf_export_fields={"router_jitter_noise": 0.0, "output_router_logits": False},
    summary="Mixtral: Mistral's decoder, every MLP a top-2 Mixture of Experts",
    hf_experts=ExpertNames(block="block_sparse_moe", router="gate", gate="w1", up="w3",
                           down="w2", num_experts_key="num_local_experts",
                           expert_mlp_key="intermediate_size"),
)
