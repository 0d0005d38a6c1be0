"""`ModelConfig`: the static shape of a model, read from GGUF metadata (or a preset).

Frozen and hashable, so it can be a static argument of jitted functions (tuple fields only, no lists).
"""
from __future__ import annotations

import dataclasses

HYBRID_ARCHS = ("qwen3next", "qwen35moe")
ARCHS = ("qwen3moe", "qwen2moe", "glm4moe") + HYBRID_ARCHS
ROPE_MODES = ("neox", "imrope")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and semantics of one decoder (+ optional NextN/MTP blocks).

  Names follow llama.cpp's hparams; GGUF keys are `{arch}.<key>` (see model/gguf_io.py).

  Hybrid family (qwen3next, qwen35moe; llama.cpp 0.3.36 src/models/qwen3next.cpp, qwen35moe.cpp): trunk layer i
  is a Gated DeltaNet layer when `recurrent[i]`, else a gated full-attention layer (`attn_output_gate`: attn_q
  holds query and gate, out = attention * sigmoid(gate)); the NextN block is a full-attention block. Every
  block's FFN is the MoE (softmax top-k, renormalised) plus the sigmoid-gated shared expert
  (`shared_expert_gate`). Shape letters (docs/SHAPES.md): `Hk`, `Hv`, `Dk`, `Dv`, `Cc`, `Kc` are properties.
  Value head h reads key head `gdn_key_head(h)`: h // (Hv / Hk) for qwen3next (value heads grouped by key head),
  h % Hk for qwen35moe (its converter reorders the value heads to tiled order).
  """
  arch: str                    # one of ARCHS
  vocab_size: int
  d_model: int                 # {arch}.embedding_length
  n_layers: int                # trunk blocks; {arch}.block_count - nextn_predict_layers
  n_heads: int                 # {arch}.attention.head_count
  n_kv_heads: int              # {arch}.attention.head_count_kv
  head_dim: int                # {arch}.attention.key_length (== value_length)
  rope_dim: int                # {arch}.rope.dimension_count; < head_dim means partial rotary (NEOX pairing)
  rope_theta: float            # {arch}.rope.freq_base
  rms_eps: float               # {arch}.attention.layer_norm_rms_epsilon
  n_experts: int               # {arch}.expert_count
  top_k: int                   # {arch}.expert_used_count
  d_ff_expert: int             # {arch}.expert_feed_forward_length
  d_ff: int = 0                # {arch}.feed_forward_length: width of leading dense blocks
  n_dense_lead: int = 0        # {arch}.leading_dense_block_count (glm4moe)
  n_shared_experts: int = 0    # {arch}.expert_shared_count (glm4moe); qwen2moe / hybrid: 1 when shexp tensors exist
  d_ff_shared: int = 0         # shared expert width (glm4moe: d_ff_expert * n_shared; qwen2moe / hybrid: key)
  shared_expert_gate: bool = False   # qwen2moe / hybrid: shared expert output scaled by sigmoid(x . w_gate_shexp)
  routing: str = "softmax"     # "softmax" (qwen*) | "sigmoid" with a selection bias (glm4moe)
  norm_topk: bool = True       # renormalise the top-k weights to sum 1
  routed_scale: float = 1.0    # {arch}.expert_weights_scale (1.0 = none)
  qk_norm: bool = False        # per-head RMSNorm on q and k (attn_q_norm / attn_k_norm)
  qkv_bias: bool = False       # attn_{q,k,v}.bias
  n_nextn: int = 0             # {arch}.nextn_predict_layers: MTP blocks appended after the trunk
  tied_embeddings: bool = False  # no output.weight: the head is token_embd
  context_length: int = 4096   # {arch}.context_length (training context, informative)
  # -- hybrid family (qwen3next / qwen35moe) ---------------------------------------------------------------
  recurrent: tuple[bool, ...] = ()  # per trunk layer: True = Gated DeltaNet layer (no K/V); () = no such layer.
  #                              From {arch}.attention.recurrent_layers, else {arch}.full_attention_interval k
  #                              (layer i recurrent iff (i + 1) % k != 0; llama.cpp's default k = 4)
  ssm_conv_kernel: int = 0     # {arch}.ssm.conv_kernel: Kc, causal conv1d width
  ssm_inner: int = 0           # {arch}.ssm.inner_size: Hv * Dv
  ssm_state: int = 0           # {arch}.ssm.state_size: Dk (llama.cpp requires Dv == Dk)
  ssm_dt_rank: int = 0         # {arch}.ssm.time_step_rank: Hv, value heads
  ssm_groups: int = 0          # {arch}.ssm.group_count: Hk, key heads
  attn_output_gate: bool = False   # attn_q rows hold [query | gate] per head; out = attention * sigmoid(gate)
  rope_mode: str = "neox"      # "neox" | "imrope" (qwen35moe: llama.cpp's LLAMA_ROPE_TYPE_IMROPE)
  rope_sections: tuple[int, int, int, int] = (0, 0, 0, 0)  # {arch}.rope.dimension_sections (imrope only)

  def __post_init__(self):
    for name in ("recurrent", "rope_sections"):    # lists (a JSON round trip) become tuples: hashable
      v = getattr(self, name)
      if not isinstance(v, tuple):
        object.__setattr__(self, name, tuple(v))
    object.__setattr__(self, "recurrent", tuple(bool(r) for r in self.recurrent))
    object.__setattr__(self, "rope_sections", tuple(int(s) for s in self.rope_sections))
    if self.arch not in ARCHS:
      raise ValueError(f"ModelConfig: unsupported arch {self.arch!r}, expected one of {ARCHS}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"ModelConfig: n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
    if self.rope_dim > self.head_dim or self.rope_dim % 2:
      raise ValueError(f"ModelConfig: rope_dim={self.rope_dim} must be even and <= head_dim={self.head_dim}")
    if self.routing not in ("softmax", "sigmoid"):
      raise ValueError(f"ModelConfig: routing={self.routing!r}, expected 'softmax' or 'sigmoid'")
    if self.rope_mode not in ROPE_MODES:
      raise ValueError(f"ModelConfig: rope_mode={self.rope_mode!r}, expected one of {ROPE_MODES}")
    if len(self.rope_sections) != 4 or min(self.rope_sections) < 0:
      raise ValueError(f"ModelConfig: rope_sections={self.rope_sections}, expected 4 counts >= 0")
    if self.rope_mode == "imrope":
      s = self.rope_sections
      if not (s[0] or s[1] or s[2]) or sum(s) > self.rope_dim:
        raise ValueError(f"ModelConfig: rope_sections={s} for imrope: one of the first three > 0 and sum <= "
                         f"rope_dim={self.rope_dim}")
    if self.is_hybrid:
      if len(self.recurrent) != self.n_layers:
        raise ValueError(f"ModelConfig: recurrent has {len(self.recurrent)} entries, expected n_layers={self.n_layers}")
      for k in ("ssm_conv_kernel", "ssm_inner", "ssm_state", "ssm_dt_rank", "ssm_groups"):
        if getattr(self, k) <= 0:
          raise ValueError(f"ModelConfig: {k}={getattr(self, k)} for {self.arch}, expected > 0")
      if self.ssm_inner % self.ssm_dt_rank or self.ssm_inner // self.ssm_dt_rank != self.ssm_state:
        raise ValueError(f"ModelConfig: ssm_inner={self.ssm_inner} must be ssm_dt_rank={self.ssm_dt_rank} x "
                         f"ssm_state={self.ssm_state} (llama.cpp: value head dim == key head dim)")
      if self.ssm_dt_rank % self.ssm_groups:
        raise ValueError(f"ModelConfig: ssm_dt_rank={self.ssm_dt_rank} (value heads) is not a multiple of "
                         f"ssm_groups={self.ssm_groups} (key heads)")
    elif self.recurrent and any(self.recurrent):
      raise ValueError(f"ModelConfig: recurrent layers need a hybrid arch ({HYBRID_ARCHS}), got {self.arch!r}")

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

  # -- layer layout -------------------------------------------------------------------------------------------
  @property
  def is_hybrid(self) -> bool:
    return self.arch in HYBRID_ARCHS

  def is_recurrent(self, i: int) -> bool:
    """Block i is a Gated DeltaNet layer (trunk only: NextN blocks are full-attention blocks)."""
    return 0 <= i < self.n_layers and bool(self.recurrent) and self.recurrent[i]

  @property
  def attention_layers(self) -> tuple[int, ...]:
    """Trunk layers with full attention, in order: the layers that hold K/V (ring layer j is trunk layer
    attention_layers[j])."""
    return tuple(i for i in range(self.n_layers) if not self.is_recurrent(i))

  @property
  def recurrent_layers(self) -> tuple[int, ...]:
    """Trunk layers that are Gated DeltaNet layers, in order (recurrent-state layer j is trunk layer
    recurrent_layers[j])."""
    return tuple(i for i in range(self.n_layers) if self.is_recurrent(i))

  def ring_layer(self, i: int) -> int:
    """The K/V ring layer of trunk attention layer i (its index among attention_layers)."""
    if not 0 <= i < self.n_layers or self.is_recurrent(i):
      raise ValueError(f"ModelConfig: layer {i} holds no K/V (attention layers: {self.attention_layers})")
    return self.attention_layers.index(i)

  def gdn_layer(self, i: int) -> int:
    """The recurrent-state layer of trunk Gated DeltaNet layer i (its index among recurrent_layers)."""
    if not self.is_recurrent(i):
      raise ValueError(f"ModelConfig: layer {i} is not a Gated DeltaNet layer (those: {self.recurrent_layers})")
    return self.recurrent_layers.index(i)

  # -- Gated DeltaNet shape letters (docs/SHAPES.md) -------------------------------------------------------------
  @property
  def Hk(self) -> int:  # noqa: N802
    """Gated DeltaNet key heads (q and k)."""
    return self.ssm_groups

  @property
  def Hv(self) -> int:  # noqa: N802
    """Gated DeltaNet value heads (each owns a [Dk, Dv] state)."""
    return self.ssm_dt_rank

  @property
  def Dk(self) -> int:  # noqa: N802
    return self.ssm_state

  @property
  def Dv(self) -> int:  # noqa: N802
    return self.ssm_inner // self.ssm_dt_rank if self.ssm_dt_rank else 0

  @property
  def Cc(self) -> int:  # noqa: N802
    """Conv channels: q (Hk Dk), k (Hk Dk), v (Hv Dv), in that order along attn_qkv's rows."""
    return 2 * self.Hk * self.Dk + self.Hv * self.Dv

  @property
  def Kc(self) -> int:  # noqa: N802
    """Conv kernel width; the window state keeps Kc - 1 inputs."""
    return self.ssm_conv_kernel

  @property
  def gdn_heads_tiled(self) -> bool:
    """Value head h reads key head h % Hk (qwen35moe) rather than h // (Hv / Hk) (qwen3next)."""
    return self.arch == "qwen35moe"

  def gdn_key_head(self, h: int) -> int:
    """The key head (of q and k) that value head h reads."""
    return h % self.Hk if self.gdn_heads_tiled else h // (self.Hv // self.Hk)

  # -- RoPE -----------------------------------------------------------------------------------------------------
  @property
  def rope_text_pairs(self) -> tuple[bool, ...]:
    """For each rotary pair i < rope_dim / 2 (dims i and i + rope_dim / 2, NEOX pairing in both modes): True when
    llama.cpp rotates it by the text position p (angle p * rope_theta^(-2i / rope_dim)), False when it stays as
    is (angle 0). NEOX: all True. IMROPE (ggml_rope_multi on text tokens, positions (p, p, p, 0)): pair i has
    sector s = i % sum(sections); s % 3 == 0 and s < 3 * sections[0] take p (t), s % 3 == 1 and s < 3 *
    sections[1] take p (h), s % 3 == 2 and s < 3 * sections[2] take p (w), any other the fourth component, 0.
    Qwen3.5's sections (11, 11, 10, 0) over 32 pairs rotate every pair: NEOX for text."""
    half = self.rope_dim // 2
    if self.rope_mode == "neox":
      return (True,) * half
    s = self.rope_sections
    n = sum(s)
    out = []
    for i in range(half):
      sec = i % n
      r = sec % 3
      out.append(sec < 3 * s[r])
    return tuple(out)

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)
