"""`ModelConfig`: the static shape of a model, read from GGUF metadata (or a preset).

Frozen and hashable, so it can be a static argument of jitted functions.
"""
from __future__ import annotations

import dataclasses

ARCHS = ("qwen3moe", "qwen2moe", "glm4moe")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and semantics of one decoder (+ optional NextN/MTP blocks).

  Names follow llama.cpp's hparams; GGUF keys are `{arch}.<key>` (see model/gguf_io.py).
  """
  arch: str                    # "qwen3moe" | "qwen2moe" | "glm4moe"
  vocab_size: int
  d_model: int                 # {arch}.embedding_length
  n_layers: int                # trunk blocks; {arch}.block_count - nextn_predict_layers
  n_heads: int                 # {arch}.attention.head_count
  n_kv_heads: int              # {arch}.attention.head_count_kv
  head_dim: int                # {arch}.attention.key_length (== value_length)
  rope_dim: int                # {arch}.rope.dimension_count; < head_dim means partial rotary (NEOX)
  rope_theta: float            # {arch}.rope.freq_base
  rms_eps: float               # {arch}.attention.layer_norm_rms_epsilon
  n_experts: int               # {arch}.expert_count
  top_k: int                   # {arch}.expert_used_count
  d_ff_expert: int             # {arch}.expert_feed_forward_length
  d_ff: int = 0                # {arch}.feed_forward_length: width of leading dense blocks
  n_dense_lead: int = 0        # {arch}.leading_dense_block_count (glm4moe)
  n_shared_experts: int = 0    # {arch}.expert_shared_count (glm4moe); qwen2moe: 1 when shexp tensors exist
  d_ff_shared: int = 0         # shared expert width (glm4moe: d_ff_expert * n_shared; qwen2moe: key)
  shared_expert_gate: bool = False   # qwen2moe: shared expert output scaled by sigmoid(x . w_gate_shexp)
  routing: str = "softmax"     # "softmax" (qwen*) | "sigmoid" with a selection bias (glm4moe)
  norm_topk: bool = True       # renormalise the top-k weights to sum 1
  routed_scale: float = 1.0    # {arch}.expert_weights_scale (1.0 = none)
  qk_norm: bool = False        # per-head RMSNorm on q and k (attn_q_norm / attn_k_norm)
  qkv_bias: bool = False       # attn_{q,k,v}.bias
  n_nextn: int = 0             # {arch}.nextn_predict_layers: MTP blocks appended after the trunk
  tied_embeddings: bool = False  # no output.weight: the head is token_embd
  context_length: int = 4096   # {arch}.context_length (training context, informative)

  def __post_init__(self):
    if self.arch not in ARCHS:
      raise ValueError(f"ModelConfig: unsupported arch {self.arch!r}, expected one of {ARCHS}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"ModelConfig: n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
    if self.rope_dim > self.head_dim or self.rope_dim % 2:
      raise ValueError(f"ModelConfig: rope_dim={self.rope_dim} must be even and <= head_dim={self.head_dim}")
    if self.routing not in ("softmax", "sigmoid"):
      raise ValueError(f"ModelConfig: routing={self.routing!r}, expected 'softmax' or 'sigmoid'")

  @property
  def n_blocks(self) -> int:
    """All blocks in the file: trunk plus NextN (GGUF block_count)."""
    return self.n_layers + self.n_nextn

  @property
  def q_per_kv(self) -> int:
    return self.n_heads // self.n_kv_heads

  def is_moe_layer(self, i: int) -> bool:
    """Block i (trunk or NextN) uses the MoE FFN; the first n_dense_lead blocks are dense."""
    return i >= self.n_dense_lead

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)
