"""Config defaults, the allowed values of its keys, and values derived from a config.

Every config in `configs/` starts from `default_config()` and overrides fields. The one
validation pass, `config_checks.validate()`, runs before anything is compiled; it raises
`ConfigError` naming the key, the value and the fix, which the CLI prints as one line before
exiting with code 2.
"""

from __future__ import annotations

import importlib.util
import os

import ml_collections
from ml_collections import config_dict

# The offload variants keep what their base policy saves in pinned host memory (model.py).
REMAT_POLICIES = ("none", "full", "minimal", "save_dots", "save_qkv_proj", "minimal_offload",
                  "save_dots_offload", "save_qkv_proj_offload")
ATTENTION_IMPLS = ("xla", "pallas", "cudnn", "auto")
# precision.matmul: ops/fp8.py (per-tensor scales), ops/mxfp8.py (32-element blocks).
MATMUL_PRECISIONS = ("none", "fp8", "mxfp8")
ROPE_SCALING_TYPES = ("none", "llama3", "linear", "yarn")
DTYPES = ("float32", "bfloat16", "float16")
# Adam moments: float16 is refused, its range underflows the second moment of small grads.
STATE_DTYPES = ("float32", "bfloat16")
OPTIMIZERS = ("adamw", "muon")  # optim.name
MUON_ADJUST_LR = ("match_rms_adamw", "original")  # optim.muon.adjust_lr (train/muon.update_scale)
OBJECTIVES = ("lm", "dpo", "grpo", "reward", "ppo")
# grpo.on_reward_error: stop the run, or skip the batch of rollouts (drawing the next prompts).
REWARD_ERROR_POLICIES = ("stop", "skip")
# Projections that can carry LoRA adapters in the shared decoder: attention q/k/v/o and the gated
# MLP's three (each family lists which of them it allows: models/features.py).
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
# Storage of the frozen base weights under LoRA (QLoRA when quantized): int8 and 4-bit codes
# (int4: uniform levels, nf4: the normal-float levels of QLoRA) with per-group scales.
BASE_QUANTIZATIONS = ("none", "int8", "int4", "nf4")


class ConfigError(ValueError):
  """A config value that cannot work; the message names key, value and fix on one line."""


def default_config() -> ml_collections.ConfigDict:
  """All keys with defaults; a config file overrides what differs."""
  c = ml_collections.ConfigDict()
  # What the config is made for, as jaxtrain.hardware names it: "h100x8", "v5p-128",
  # "l4x1", ... or "cpu" (this host). `--dry_run` compiles for it with its own compiler, the
  # fit verdict is against its memory, and the run table names it.
  c.target = "cpu"

  c.model = ml_collections.ConfigDict()
  # The model family (jaxtrain/models/registry.py): llama, qwen3, qwen2, mistral, gemma3. What
  # it changes in the shared decoder is listed in docs/models.md; the keys below are its sizes.
  c.model.family = "llama"
  c.model.vocab_size = 32000
  c.model.num_layers = 2
  c.model.d_model = 256
  c.model.num_heads = 4
  c.model.num_kv_heads = 4
  c.model.head_dim = 64
  c.model.mlp_dim = 1024
  c.model.norm_eps = 1e-5
  c.model.rope_theta = 10000.0
  c.model.rope_scaling = ml_collections.ConfigDict()
  # "none" | "llama3" (factor, low/high_freq_factor, original_max_position_embeddings) |
  # "linear" (positions / factor) | "yarn" (factor, original_max_position_embeddings, beta_fast,
  # beta_slow, mscale, mscale_all_dim: models/rope.py)
  c.model.rope_scaling.type = "none"
  c.model.rope_scaling.factor = 8.0
  c.model.rope_scaling.low_freq_factor = 1.0
  c.model.rope_scaling.high_freq_factor = 4.0
  c.model.rope_scaling.original_max_position_embeddings = 8192
  c.model.rope_scaling.beta_fast = 32.0
  c.model.rope_scaling.beta_slow = 1.0
  c.model.rope_scaling.mscale = 1.0
  c.model.rope_scaling.mscale_all_dim = 0.0
  c.model.max_position_embeddings = 8192
  # Sliding-window attention: on "sliding" layers a token sees the sliding_window tokens ending at
  # itself (0: no window). layer_types: comma-separated "full"/"sliding", one per layer; empty:
  # every layer sliding when sliding_window > 0, else full (Gemma 3: five sliding, one full).
  c.model.sliding_window = 0
  c.model.layer_types = ""
  # RoPE base of the sliding layers (plain RoPE, no scaling; Gemma 3: 10000); 0: their RoPE is
  # the full layers'.
  c.model.local_rope_theta = 0.0
  # Attention's softmax scale is query_pre_attn_scalar ** -0.5 (Gemma 3); 0: head_dim ** -0.5.
  c.model.query_pre_attn_scalar = 0.0
  # Multi-head latent attention (DeepSeek-V3; jaxtrain/models/mla.py) when kv_lora_rank > 0:
  # keys and values from a kv_lora_rank latent per token, queries through a q_lora_rank
  # bottleneck (0: one projection); head_dim is then the query/key head dim, of which the last
  # qk_rope_head_dim dims carry RoPE, and v_head_dim the values'. Generation caches the latent.
  c.model.q_lora_rank = 0
  c.model.kv_lora_rank = 0
  c.model.qk_rope_head_dim = 0
  c.model.v_head_dim = 0
  # Multi-token prediction (DeepSeek-V3; jaxtrain/models/mtp.py): mtp_depth extra modules, the
  # k-th predicting the token k places past the main model's target; their mean cross-entropies
  # are added to the language-model loss weighted by mtp_loss_weight / mtp_depth (the paper:
  # depth 1, weight 0.3 then 0.1) and reported as mtp_loss. Families that have it only.
  c.model.mtp_depth = 0
  c.model.mtp_loss_weight = 0.3
  c.model.tie_embeddings = False
  # A scalar score head [D, 1] instead of the vocabulary head: a reward model (the
  # `*ForSequenceClassification` checkpoints); the model's call gives [B, T] scores. Implied by
  # train.objective="reward".
  c.model.score_head = False
  # A scalar value head [D, 1] beside the vocabulary head: PPO's critic on the policy's trunk
  # (train.objective="ppo" needs it). A language model's weights lack it: it starts at zero.
  c.model.value_head = False
  c.model.init_std = 0.02
  c.model.scan_layers = True
  c.model.remat_policy = "minimal"
  c.model.param_dtype = "float32"
  # Compute dtype; "auto": bfloat16 on accelerators (GPU, TPU), float32 on CPU.
  c.model.dtype = "auto"

  # Mixture of Experts (jaxtrain/models/moe.py, docs/models.md): num_experts > 0 replaces the
  # gated MLP of the MoE layers by num_experts gated MLPs of expert_mlp_dim each, of which a
  # router picks experts_per_token per token (softmax over the experts, then the top k).
  c.moe = ml_collections.ConfigDict()
  c.moe.num_experts = 0  # 0: a dense model
  c.moe.experts_per_token = 2
  c.moe.expert_mlp_dim = 0  # each expert's hidden size (0: model.mlp_dim)
  # Renormalize the top-k routing weights to sum to 1 (Mixtral always; Qwen3-MoE's
  # norm_topk_prob); False keeps the softmax probabilities as they are.
  c.moe.norm_topk_prob = True
  # Which layers are MoE (Qwen3-MoE's config): layer i is, unless listed in dense_layers
  # (comma-separated indices), when (i + 1) is a multiple of sparse_step. The others keep the
  # dense MLP of model.mlp_dim.
  c.moe.dense_layers = ""
  c.moe.sparse_step = 1
  # DeepSeek-V3's router: "sigmoid" scores (else "softmax"), plus a per-expert correction bias
  # that only chooses experts (router_bias; moved by bias_update_rate below, never by
  # gradients); the experts in n_group groups, of which the topk_group groups with the highest
  # sum of their two best scores are eligible; the routing weights (renormalized when
  # norm_topk_prob) times routed_scaling_factor; num_shared_experts gated MLPs of
  # expert_mlp_dim each (one of num_shared_experts * expert_mlp_dim) that every token passes.
  c.moe.router_score = "softmax"
  c.moe.router_bias = False
  c.moe.n_group = 1
  c.moe.topk_group = 1
  c.moe.routed_scaling_factor = 1.0
  c.moe.num_shared_experts = 0
  # 0: dropless (every token reaches all its experts). > 0: each expert takes at most
  # ceil(capacity_factor * tokens * k / num_experts) of the tokens each device routes (top-1
  # choices first, then in order); the rest skip that expert (the residual carries them), and
  # the share dropped is reported.
  c.moe.capacity_factor = 0.0
  # Auxiliary losses added to the objective (0: off): the Switch/Mixtral load-balancing loss
  # (1.0 at perfect balance) and the router z-loss (mean squared logsumexp of router logits).
  c.moe.aux_loss_coef = 0.01
  c.moe.router_z_loss_coef = 0.001
  # DeepSeek-V3's sequence-wise balance loss (0: off; the paper uses 1e-4): the load-balancing
  # loss per row of the batch (a packed row counts as one sequence) on the normalized router
  # scores, averaged over rows and MoE layers.
  c.moe.seq_aux_loss_coef = 0.0
  # Auxiliary-loss-free balancing of routers with a correction bias (router_bias): after each
  # optimizer step every bias moves by this much against its expert's load error in the step's
  # batch (down when above the layer's mean load, up when below). 0: the biases stay as they
  # are (also under LoRA, where they are part of the frozen base). The paper's 0.001.
  c.moe.bias_update_rate = 0.001
  # The experts' grouped matmul: "ragged" (jax.lax.ragged_dot: the TPU compiler's grouped
  # kernel), "blocked" (a loop of GEMMs over expert-aligned row blocks: CPU, GPU), "auto".
  c.moe.grouped_matmul = "auto"

  c.precision = ml_collections.ConfigDict()
  # The projections' and MLP matmuls: "none" (the compute dtype), "fp8" (per-tensor current
  # scaling: e4m3 forward, e5m2 gradients; jaxtrain/ops/fp8.py; H100, H200, B200, L4, TPU v7x),
  # "mxfp8" (e4m3 with a power-of-two scale per 32 elements; jaxtrain/ops/mxfp8.py; B200). Master
  # weights, optimizer state and the loss are unchanged.
  c.precision.matmul = "none"
  # With precision.matmul="fp8": the output head's matmuls in the loss (training and evals) in
  # FP8 too; generation's logits stay in the compute dtype.
  c.precision.fp8_head = False

  c.attention = ml_collections.ConfigDict()
  # xla (reference einsums), pallas (our flash-attention kernels: GPU, TPU), cudnn (GPU), auto
  # (cudnn on GPU, pallas on TPU, xla on CPU).
  c.attention.impl = "xla"
  # pallas only: run the kernels in the Pallas interpreter (any backend, slow: for tests on CPU).
  c.attention.interpret = False
  # pallas only: query / key rows per kernel block; 0 picks the backend's default.
  c.attention.block_q = 0
  c.attention.block_k = 0
  # With mesh.context > 1: how attention crosses the split sequence. all_gather: each device
  # gathers the whole sequence's keys and values (one collective per layer; cheap under GQA);
  # ring: keys and values pass around the context devices with ppermute, two parts in memory
  # at a time (longest sequences). See docs/parallelism.md.
  c.attention.context_parallel = "all_gather"
  # With mesh.context > 1: reorder each sequence before it is split so every context device
  # has the same causal-attention work (dual chunk swap: device i holds chunks i and 2C-1-i).
  c.attention.load_balance = True

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = 1
  c.mesh.fsdp = -1  # -1: all devices not used by the other axes
  # Context parallelism: the sequence of every activation is split over this many devices, and
  # the weights are sharded over them as over fsdp (attention.context_parallel says how
  # attention crosses the split). Stays within a host group, like tensor.
  c.mesh.context = 1
  # Pipeline parallelism: the stacked layers are split into this many stages, one group of
  # devices each; activations pass from stage to stage (see c.pipeline, docs/parallelism.md).
  c.mesh.stage = 1
  # Expert parallelism (MoE models): the experts of every MoE layer are split over this many
  # devices, and tokens travel to their experts' devices and back by all-to-all. Outside the
  # MoE layers it splits the batch like mesh.data (and shards the other weights like fsdp).
  c.mesh.expert = 1
  c.mesh.tensor = 1
  # Multi-host: how many groups of hosts (TPU slices, else processes) the data, stage and fsdp
  # axes span over the data-center network; each group holds mesh.data/dcn_data x
  # mesh.stage/dcn_stage x mesh.fsdp/dcn_fsdp x mesh.context x mesh.tensor devices linked by
  # ICI/NVLink. All 1 in a multi-process run without slices: one flat mesh over all devices.
  # Pipeline stages suit the slow links best: only one microbatch's activations cross them.
  c.mesh.dcn_data = 1
  c.mesh.dcn_stage = 1
  c.mesh.dcn_fsdp = 1

  c.pipeline = ml_collections.ConfigDict()
  # With mesh.stage > 1: microbatches per pipeline pass (a multiple of mesh.stage; 0: mesh.stage).
  # A step is one pass over the whole batch in this many microbatches, and they are the unit of
  # gradient accumulation: train.grad_accum_steps must divide it. The idle share of the stages
  # (the bubble) is (S-1)/(R*M+S-1).
  c.pipeline.microbatches = 0
  # Circular schedule: each stage holds this many non-contiguous groups of layers and the
  # microbatches go around the stages this many times (smaller bubble, more transfers).
  c.pipeline.repeats = 1
  # FSDP under stages: False gathers each stage's weights for every microbatch (and again in the
  # backward pass), holding one layer's whole weights at a time; True gathers them once per step
  # before the pipeline, holding the stage's whole weights (and their gradients, float32) for
  # the step: far fewer bytes moved for 8 bytes per parameter of the stage.
  c.pipeline.gather_weights_once = False

  c.train = ml_collections.ConfigDict()
  c.train.steps = 1000
  c.train.global_batch_size = 8  # sequences per optimizer step, over all devices and microbatches
  c.train.seq_len = 1024
  c.train.grad_accum_steps = 1
  c.train.seed = 0
  c.train.log_every = 10
  c.train.eval_every = 200
  c.train.eval_batches = 4
  # Tokens per chunk of the cross-entropy; bounds the float32 logits temporary to [B, chunk, V].
  c.train.loss_chunk_size = 512
  # Steps with a NaN/Inf loss or gradient skip their update; this many in a row stop the run.
  c.train.max_consecutive_bad_steps = 10
  # A logged loss more than this many standard deviations above its running mean is reported
  # as a spike (console warning, `loss_spikes` in metrics.jsonl); 0 turns the check off.
  c.train.loss_spike_sigmas = 6.0
  # "lm" (next-token cross-entropy: pre-training, SFT), "dpo" (preference pairs against a frozen
  # reference), "grpo" / "ppo" (online RL on prompts), "reward" (a Bradley-Terry reward model);
  # each has its group below, docs/finetuning.md.
  c.train.objective = "lm"

  # Reward-model training (jaxtrain.objectives.reward.loss, docs/finetuning.md): loss per pair
  # -log sigmoid(r_chosen - r_rejected - margin) + center_coef * (r_chosen + r_rejected)^2.
  c.reward = ml_collections.ConfigDict()
  c.reward.margin = 0.0  # how far the chosen reward must beat the rejected one before the loss rests
  c.reward.center_coef = 0.0  # pulls the rewards toward mean 0 (TRL's default when used: 0.01)

  c.dpo = ml_collections.ConfigDict()
  # Strength of the implicit KL penalty: larger keeps the policy nearer the reference.
  c.dpo.beta = 0.1

  # Group relative policy optimization (jaxtrain.objectives.grpo.loss, docs/finetuning.md). A step's
  # batch is train.global_batch_size prompts x num_generations completions sampled with the current
  # weights; each prompt and its completion fit train.seq_len tokens.
  c.grpo = ml_collections.ConfigDict()
  c.grpo.num_generations = 8  # G >= 2 completions per prompt: the group advantages compare
  c.grpo.num_iterations = 1  # policy updates (optimizer steps) on each batch of rollouts
  c.grpo.epsilon = 0.2  # clip range of the importance ratio
  c.grpo.beta = 0.04  # KL penalty to the reference; 0 drops the reference (no extra forward)
  c.grpo.max_new_tokens = 64
  c.grpo.temperature = 1.0  # sampling temperature of the rollouts (> 0)
  c.grpo.top_p = 1.0
  # Comma-separated "module:function" names, rewards summed (jaxtrain.objectives.grpo.rewards shows
  # the call).
  c.grpo.reward_fns = "jaxtrain.objectives.grpo.rewards:exact_match"
  # Frozen reward models added to the functions' sum (objectives/grpo/reward_models.py):
  # comma-separated "PATH" or "PATH:WEIGHT", each a reward run, a weights directory or a Hugging
  # Face *ForSequenceClassification directory; every source is logged as reward_<name>_mean.
  c.grpo.reward_models = ""
  # A reward function that raises or returns bad values: "stop" the run (one line naming it),
  # or "skip" that batch of rollouts and draw the next prompts (counted as reward_errors).
  c.grpo.on_reward_error = "stop"
  c.grpo.max_skipped_batches = 10  # with "skip": this many in a row stop the run
  # Supervised warm-up: the first warmup_steps steps train on each record's warmup_column (with
  # EOS) instead of sampled completions, as the GRPO loss with advantage 1; 0: none.
  c.grpo.warmup_steps = 0
  c.grpo.warmup_column = "answer"
  # Each eval writes greedy completions of this many eval prompts to WORKDIR/completions.jsonl.
  c.grpo.sample_prompts = 4
  # An MoE policy (GRPO, PPO): the rollouts record every token's experts in every layer, and the
  # trainer's passes over those rows replay them instead of routing again (routing replay).
  c.grpo.replay_routing = False

  # Proximal policy optimization (jaxtrain.objectives.ppo.loss, docs/finetuning.md): one completion
  # per prompt, sampled and scored with the grpo group's rollout settings (max_new_tokens,
  # temperature, top_p, reward_fns, on_reward_error, sample_prompts); a value head on the policy's
  # trunk (model.value_head) is the critic. A batch of rollouts is train.global_batch_size x
  # minibatches prompts, trained for `epochs` passes of `minibatches` optimizer steps each.
  c.ppo = ml_collections.ConfigDict()
  c.ppo.epochs = 2
  c.ppo.minibatches = 2
  c.ppo.gamma = 1.0  # discount over the completion's tokens
  c.ppo.lam = 0.95  # GAE's lambda: 1 = Monte Carlo returns, 0 = one-step TD
  c.ppo.epsilon = 0.2  # clip range of the policy's importance ratio
  c.ppo.value_clip = 0.2  # clip range of the value update around the rollout's values
  c.ppo.vf_coef = 0.1  # weight of the value loss in the total loss
  c.ppo.kl_coef = 0.05  # per-token KL penalty to the reference in the rewards; 0: no reference

  # Low-rank adapters: rank 0 trains every weight (full fine-tuning); rank > 0 freezes the base
  # weights and trains only adapters W + (alpha / rank) * A @ B on lora.targets, and the
  # objective's new head (a reward model's score head, PPO's value head) beside them. Only those
  # are in the optimizer state and in checkpoints; the base comes from checkpoint.init_from (on
  # every start and resume).
  c.lora = ml_collections.ConfigDict()
  c.lora.rank = 0
  c.lora.alpha = 16.0
  c.lora.dropout = 0.0  # dropout on the adapter's input, training only
  c.lora.targets = "q,k,v,o,gate,up,down"  # comma-separated subset of LORA_TARGETS
  # Frozen base weights stored as "none" (param_dtype), "int8", "int4" or "nf4" (QLoRA),
  # dequantized layer by layer in the forward pass; needs lora.rank > 0.
  c.lora.quantize_base = "none"
  c.lora.quant_group_size = 64  # input-dim elements sharing one scale (int4/nf4/int8)

  c.optim = ml_collections.ConfigDict()  # docs/optimizers.md
  c.optim.name = "adamw"  # or "muon": Muon for the projection matrices (jaxtrain/train/muon.py)
  c.optim.muon = ml_collections.ConfigDict()
  c.optim.muon.ns_steps = 5  # quintic Newton-Schulz iterations
  c.optim.muon.momentum = 0.95
  c.optim.muon.nesterov = True
  c.optim.muon.adjust_lr = "match_rms_adamw"  # 0.2*sqrt(max(in, out)), or "original"
  c.optim.muon.qk_clip_threshold = 0.0  # QK-clip (train/qk_clip.py); 0: off, Kimi K2 used 100
  c.optim.learning_rate = 3e-4
  c.optim.warmup_steps = 100
  c.optim.decay_steps = config_dict.placeholder(int)  # None: train.steps
  c.optim.min_lr_ratio = 0.1
  c.optim.b1 = 0.9
  c.optim.b2 = 0.95
  c.optim.eps = 1e-8
  c.optim.weight_decay = 0.1
  c.optim.grad_clip_norm = 1.0
  # dtype of the Adam moments (mu, nu) and Muon's momentum; updated in float32, stored in this.
  c.optim.state_dtype = "float32"
  # Keep the optimizer state in pinned host memory between steps (it comes to the device for
  # the update): frees 2x the param bytes (float32 moments) of device memory per device.
  c.optim.offload_state = False
  # The step's largest attention logit as attn_max_logit (metrics.jsonl, TensorBoard); on by
  # itself with QK-clip; one more Q.K^T per layer in the forward pass (ops/max_logit.py).
  c.optim.log_max_logit = False

  c.data = ml_collections.ConfigDict()
  # "stdlib_bytes" (the demo corpus), "prepared" (a directory written by `python -m
  # jaxtrain.data.prepare`), or raw "text" files, "jsonl", "parquet" tokenized while training.
  c.data.source = "stdlib_bytes"
  # Raw sources: a path or glob (a list of them in a config file). "prepared": its directory.
  c.data.train_paths = ""
  c.data.eval_paths = ""  # empty: hold out data.eval_fraction of the training documents
  c.data.field = "text"  # JSONL field / Parquet column holding the document
  # JSONL records: "text" (field above), "prompt_completion" ({"prompt", "completion"}: loss on
  # the completion) or "chat" ({"messages": [...]}, the tokenizer's chat template: loss on the
  # assistant turns); "preference" ({prompt, chosen, rejected}) for DPO, "prompt" ({prompt,
  # ...fields for the rewards}) for GRPO.
  c.data.format = "text"
  # Several sources sampled by weight: name -> {data.* keys to override, weight}. Define it in
  # a config file; override weights on the command line (--config.data.mixture.web.weight=0.7).
  c.data.mixture = ml_collections.ConfigDict()
  c.data.tokenizer = "byte"  # "byte", "hf:PATH/tokenizer.json", "sentencepiece:PATH.model"
  c.data.add_bos = False
  c.data.add_eos = True
  c.data.on_bad_record = "fail"  # JSONL: "fail" names file:line; "skip" drops and counts
  c.data.on_decode_error = "fail"  # text files: "fail" on invalid UTF-8, or "replace"
  c.data.eval_fraction = 0.02
  c.data.seed = 0
  # grain worker processes per data shard (raw text; the global stream reads in-process)
  c.data.num_workers = 0
  # 0 (default): sources whose document lengths are known before reading ("prepared",
  # "stdlib_bytes") are read as one global stream: the same global batches for any number of
  # processes, each process reading only its rows, so a checkpoint resumes exactly on another
  # number of hosts; raw text ("text", "jsonl", "parquet") is read one shard per process.
  # S > 0: virtual data shards: shard s reads the pieces (or documents) s::S and gives B/S rows
  # of every global batch of B, in shard order; the batches are the same for any process count
  # dividing S (docs/launch.md). Set it for raw text that must not depend on the host count.
  c.data.num_shards = 0

  # Multi-process runs (jaxtrain/distributed.py); ignored by a single process.
  c.distributed = ml_collections.ConfigDict()
  # A process silent this long (died, hung, lost its network) stops every other process with
  # an error, instead of leaving them waiting in a collective.
  c.distributed.heartbeat_timeout_s = 60
  c.distributed.initialization_timeout_s = 300  # how long to wait for all processes to start
  c.distributed.shutdown_timeout_s = 300  # at the end, how long to wait for the slowest

  c.checkpoint = ml_collections.ConfigDict()
  # Save every N steps and at the end (0: no checkpoints). The same command with the same
  # --workdir then resumes from the latest complete checkpoint.
  c.checkpoint.every_steps = 0
  c.checkpoint.max_to_keep = 3  # 0: keep all
  c.checkpoint.keep_every = 0  # also keep every M-th step for good (0: none)
  c.checkpoint.directory = ""  # default WORKDIR/checkpoints; a local path, gs:// or s3://
  c.checkpoint.async_save = True
  # When no checkpoint in the directory can be read (every step missing files, truncated or
  # failing its checksums): "stop" (the run exits, listing them, and renames nothing) or
  # "restart" (they are set aside and the run trains from step 0). Errors that do not mean a
  # damaged checkpoint (out of memory, permissions, a bug) always stop the run.
  c.checkpoint.on_unreadable = "stop"
  # Initialize the params (only) from another run's checkpoint (a step directory, its
  # checkpoints/ directory or its workdir: the latest step) or from converted weights (a
  # directory with params/, e.g. from `python -m jaxtrain.interop.hf import`). The optimizer
  # starts fresh at step 0. Ignored when --workdir already has a checkpoint to resume from.
  c.checkpoint.init_from = ""

  c.log = ml_collections.ConfigDict()
  c.log.tensorboard = True
  # Weights & Biases (the `wandb` extra: pip install -e ".[wandb]"): the scalars TensorBoard gets,
  # under the same names and steps, and the run table and this config as the W&B run's config;
  # process 0 logs. WANDB_MODE=offline keeps the run in WORKDIR/wandb/ (`wandb sync` uploads it).
  # A run resumed in the same --workdir continues the same W&B run.
  c.log.wandb = False
  c.log.wandb_project = "jaxtrain"
  c.log.wandb_run_name = ""  # "": the --workdir's name (runs/tiny -> tiny)
  c.log.wandb_entity = ""  # "": W&B's default entity for the logged-in user
  return c


def accelerator_config(*, target: str, global_batch_size: int) -> ml_collections.ConfigDict:
  """default_config() with the training defaults of the accelerator configs in configs/ (8K
  sequences, scanned layers under `minimal` remat, float32 master weights with bfloat16 compute,
  the best attention kernel of the target); each config then gives its model's sizes."""
  c = default_config()
  c.target = target
  m = c.model
  m.scan_layers, m.remat_policy = True, "minimal"
  m.param_dtype, m.dtype = "float32", "auto"
  c.attention.impl = "auto"
  c.train.global_batch_size, c.train.seq_len, c.train.steps = global_batch_size, 8192, 10000
  c.train.loss_chunk_size = 1024
  c.optim.learning_rate, c.optim.warmup_steps = 3e-4, 1000
  return c


def llama3_config(*, num_layers: int, d_model: int, num_heads: int, head_dim: int, mlp_dim: int,
                  tie_embeddings: bool, rope_factor: float, global_batch_size: int,
                  target: str) -> ml_collections.ConfigDict:
  """What every published Llama 3.x size shares (vocab, 8 kv heads, RoPE theta and llama3
  scaling, norm eps), with training defaults for accelerators; configs/ give the dims and the
  target they are sized for."""
  c = accelerator_config(target=target, global_batch_size=global_batch_size)
  m = c.model
  m.vocab_size, m.num_layers, m.d_model = 128256, num_layers, d_model
  m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim = num_heads, 8, head_dim, mlp_dim
  m.tie_embeddings, m.norm_eps, m.rope_theta = tie_embeddings, 1e-5, 500000.0
  m.rope_scaling.type, m.rope_scaling.factor = "llama3", rope_factor
  m.rope_scaling.low_freq_factor, m.rope_scaling.high_freq_factor = 1.0, 4.0
  m.rope_scaling.original_max_position_embeddings = 8192
  m.max_position_embeddings = 131072
  return c


def qwen3_moe_config(*, num_layers: int, d_model: int, num_heads: int, expert_mlp_dim: int,
                     mlp_dim: int, global_batch_size: int,
                     target: str) -> ml_collections.ConfigDict:
  """What the published Qwen3-MoE sizes share (128 experts, top 8 renormalized, 4 kv heads of
  128, vocab 151936, RoPE base 1e6, untied embeddings), with training defaults for
  accelerators; configs/ give the dims and the target they are sized for."""
  c = accelerator_config(target=target, global_batch_size=global_batch_size)
  m = c.model
  m.family = "qwen3_moe"
  m.vocab_size, m.num_layers, m.d_model, m.mlp_dim = 151936, num_layers, d_model, mlp_dim
  m.num_heads, m.num_kv_heads, m.head_dim = num_heads, 4, 128
  m.norm_eps, m.rope_theta, m.max_position_embeddings = 1e-6, 1e6, 40960
  m.tie_embeddings = False
  c.moe.num_experts, c.moe.experts_per_token, c.moe.expert_mlp_dim = 128, 8, expert_mlp_dim
  c.moe.norm_topk_prob = True
  c.moe.aux_loss_coef = 0.001  # what the published config trains with (router_aux_loss_coef)
  return c


def load_config_file(path: str) -> ml_collections.ConfigDict:
  """`get_config()` of a config file (what `--config=PATH` loads), for scripts and tests."""
  name = "jaxtrain_config_" + os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def lora_targets(config) -> tuple[str, ...]:
  """lora.targets as a tuple of names from LORA_TARGETS, in their canonical order (the family
  may allow fewer: config_checks refuses the others)."""
  names = {n.strip() for n in config.lora.targets.split(",") if n.strip()}
  return tuple(n for n in LORA_TARGETS if n in names)


def resolve_compute_dtype(name: str, platform: str) -> str:
  """`model.dtype` as a dtype name: "auto" is bfloat16 on accelerators, float32 on CPU."""
  if name != "auto":
    return name
  return "float32" if platform == "cpu" else "bfloat16"
