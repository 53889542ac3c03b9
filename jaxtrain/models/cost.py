"""What a model costs, from its Architecture: parameters, and training FLOPs per token.

One definition for every family, reading the same switches the layers read (features.py), so a
family's count changes exactly where its model does. The meter, the run table and the dry run
all use these (through jaxtrain.train.metrics and the objectives).

FLOPs per token = 6 * N_matmul + attention, where

  N_matmul  parameters that take part in a matmul for a token: per layer the q, k, v, o
            projections (latent attention's: q_a, q_b, kv_a, kv_b, o) and the MLP gate/up/down,
            plus the output head (D*V). The embedding
            lookup, norm scales and biases do no matmul FLOPs. With tied embeddings the table
            *is* the head: D*V once. An MoE layer counts its router (D*X) and the k experts a
            token uses (its *active* parameters), not all X.
  6 *       2 FLOPs per multiply-add forward, and the backward costs twice the forward.
  attention QK^T and AV: 2*H*(E + V) FLOPs per (query, visible key) pair forward (V: the values'
            head dim, E unless latent attention gives them their own), times 3 for training,
            times the keys a query sees on average: T/2 for causal attention over T tokens
            (FLOPs on masked pairs are not credited, whatever a kernel computes), and for a
            sliding window W < T: (W(W+1)/2 + (T-W)W) / T.

Not counted: norms, RoPE, softmax, the gate's elementwise product, the loss (all O(D) per token),
nor rematerialization (MFU credits model FLOPs, not recomputed ones).
"""

from __future__ import annotations


def _attention_params(arch) -> int:
  d, h, k, e = arch.d_model, arch.num_heads, arch.num_kv_heads, arch.head_dim
  if arch.kv_lora_rank:  # latent attention (models/mla.py)
    r, p, v, q = arch.kv_lora_rank, arch.qk_rope_head_dim, arch.v_head_dim, arch.q_lora_rank
    query = d * q + q * h * e if q else d * h * e  # through the rank-Q bottleneck, or direct
    return query + d * (r + p) + r * h * (e - p + v) + h * v * d  # + kv_a, kv_b, o
  return d * h * e + 2 * d * k * e + h * e * d  # q, k+v (grouped), o


def _ffn_params(arch, moe: bool, active: bool) -> int:
  """A layer's feed-forward parameters: the gated MLP's three, or an MoE layer's router and
  its experts (all of them, or the k a token uses when `active`)."""
  if not moe:
    return 3 * arch.d_model * arch.mlp_dim
  experts = arch.experts_per_token if active else arch.num_experts
  # The router, the experts, and DeepSeek's shared experts (every token passes them).
  return arch.d_model * arch.num_experts + (experts + arch.num_shared_experts) * (
      3 * arch.d_model * arch.expert_dim)


def _layers_matmul_params(arch, active: bool) -> int:
  return sum(_attention_params(arch) + _ffn_params(arch, moe, active)
             for moe in arch.moe_layers())


def _mtp_matmul_params(arch, active: bool) -> int:
  """Each multi-token-prediction module's projections: [2D, D] and its block's (an MoE block
  when the model has experts)."""
  block = _attention_params(arch) + _ffn_params(arch, bool(arch.num_experts), active)
  return arch.mtp_depth * (2 * arch.d_model * arch.d_model + block)


def param_count(arch, active: bool = False) -> int:
  """Parameters of the model: embedding V*D; per layer the projections, 2 norm scales of D (4 with
  sandwich norms), q/k norms of E each, q/k/v biases; final norm D; head D*V unless tied (a
  score head: D; a value head: D more); each
  multi-token-prediction module's projections, its block's norms and its own three norms.
  `active`: an MoE model's parameters one token uses (its k experts of each MoE layer)."""
  features = arch.features
  d, e = arch.d_model, arch.head_dim
  per_layer = (4 if features.sandwich_norms else 2) * d
  if features.qk_norm:
    per_layer += 2 * e
  if features.qkv_bias:
    per_layer += (arch.num_heads + 2 * arch.num_kv_heads) * e
  per_layer += arch.q_lora_rank + arch.kv_lora_rank  # latent attention's norms of its ranks
  # DeepSeek's router correction bias, one per expert of each MoE layer (not trained by the
  # optimizer, but part of the model).
  moe_layers = sum(arch.moe_layers()) + (arch.mtp_depth if arch.num_experts else 0)
  biases = arch.num_experts * moe_layers if arch.router_bias else 0
  head = d if arch.score_head else 0 if arch.tie_embeddings else d * arch.vocab_size
  head += d if arch.value_head else 0
  mtp = arch.mtp_depth * (per_layer + 3 * d) + _mtp_matmul_params(arch, active)
  return (arch.vocab_size * d + arch.num_layers * per_layer + _layers_matmul_params(arch, active)
          + biases + d + head + mtp)


def matmul_params(arch) -> int:
  """N_matmul: every layer's projections (an MoE layer's active ones) plus the output head
  (once, tied or not; a reward model's score head D); per multi-token-prediction module its
  projections and the head again."""
  head = arch.d_model * (1 if arch.score_head else arch.vocab_size)
  head += arch.d_model if arch.value_head else 0
  return (_layers_matmul_params(arch, active=True) + head
          + _mtp_matmul_params(arch, active=True) + arch.mtp_depth * head)


def keys_per_query(seq_len: int, window: int | None) -> float:
  """Keys an average query sees under causal attention over `seq_len` tokens (T/2, as the
  standard MFU count takes it), within `window` tokens when given."""
  t = float(seq_len)
  if not window or window >= t:
    return t / 2
  w = float(window)
  return (w * (w + 1) / 2 + (t - w) * w) / t


def flops_per_token(arch, seq_len: int) -> float:
  """Training (forward + backward) FLOPs per token at sequence length `seq_len`."""
  window = arch.sliding_window or None
  visible = sum(keys_per_query(seq_len, window if sliding else None)
                for sliding in arch.sliding_layers())
  visible += arch.mtp_depth * keys_per_query(seq_len, None)  # the modules' blocks
  # QK^T over the query/key head dim, AV over the values' (latent attention's differ).
  score_and_mix = arch.head_dim + (arch.v_head_dim or arch.head_dim)
  return 6.0 * matmul_params(arch) + 6.0 * arch.num_heads * score_and_mix * visible
