"""An independent float64 numpy forward pass over a GGUF file: the oracle the JAX model is checked against.

Nothing here comes from the project's `model/`, `ops/` or `decode/` packages: the file is read with
`gguf.GGUFReader`, every tensor is dequantized with `gguf.quants.dequantize` (bit-exact with ggml) and cast to
float64, and the graph follows llama.cpp's (src/models/{qwen3moe,qwen2moe,glm4-moe}.cpp, llama-graph.cpp
`build_moe_ffn` / `build_ffn` / `build_attn`, ggml-cpu `rope`). It is slow and simple on purpose: full causal
attention recomputed from position 0, no cache.

    ref = RefModel("tiny.gguf")
    logits, hidden = ref.forward(tokens)                  # [T, V], [T, D] (hidden after output_norm)
    mtp_logits, h = ref.mtp_forward(hidden[:-1], tokens[1:], start_pos=1)   # NextN block over the sequence

Semantics (from llama.cpp, the points that are easy to get wrong):
- GGUF shapes are numpy shapes reversed: 2-D weights come out [out_features, in_features], y = x @ W.T;
  stacked experts `ffn_{gate,up}_exps` [E, F, D], `ffn_down_exps` [E, D, F].
- RMSNorm x / sqrt(mean(x^2) + eps) * w; the per-head q/k norms (if present) run before RoPE.
- RoPE NEOX on the first rope_dim dims of each head: pairs (i, i + rope_dim/2), angle
  pos * freq_scale * base^(-2i/rope_dim); the rest of the head passes through.
- MoE: probs = softmax (qwen*) or sigmoid (glm4moe) of the router logits; top-k on probs (+ exp_probs_b for
  glm4moe, selection only); weights = unbiased probs at the selected experts; optional renormalisation by
  max(sum, 6.103515625e-5); optional scale (glm4moe only, and only when not 0 or 1).
- qwen3moe/qwen2moe ignore `expert_weights_scale` (llama.cpp does not read it for them); qwen2moe never
  renormalises; qwen3moe always does; glm4moe follows `expert_weights_norm` (default false).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

import gguf
from gguf.quants import dequantize

_ARCHS = ("qwen3moe", "qwen2moe", "glm4moe")
_NORM_CLAMP = 6.103515625e-5          # smallest normal f16: llama.cpp clamps the top-k weight sum to it

# llama_expert_gating_func_type
_GATING_NONE, _GATING_SOFTMAX, _GATING_SIGMOID, _GATING_SOFTMAX_WEIGHT = 0, 1, 2, 3


def _field_value(field) -> Any:
  """A metadata field as a Python value (scalars unwrapped, arrays as lists)."""
  v = field.contents()
  if isinstance(v, np.generic):
    v = v.item()
  return v


def rms_norm(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
  """RMSNorm over the last axis, float64."""
  y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
  return y * w if w is not None else y


def silu(x: np.ndarray) -> np.ndarray:
  return x / (1.0 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
  return 1.0 / (1.0 + np.exp(-x))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
  m = np.max(x, axis=axis, keepdims=True)
  e = np.exp(x - m)
  return e / np.sum(e, axis=axis, keepdims=True)


def rope_neox(x: np.ndarray, pos: np.ndarray, rope_dim: int, base: float, freq_scale: float = 1.0) -> np.ndarray:
  """NEOX RoPE on x [T, H, Dh] at absolute positions pos [T]: pairs (i, i + rope_dim/2) of the first rope_dim
  dims, angle pos * freq_scale * base^(-2i/rope_dim); dims >= rope_dim pass through (ggml's rope, NEOX mode)."""
  half = rope_dim // 2
  inv = base ** (-2.0 * np.arange(half, dtype=np.float64) / rope_dim)          # [half]
  ang = freq_scale * pos.astype(np.float64)[:, None] * inv[None, :]             # [T, half]
  cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
  out = x.copy()
  x0, x1 = x[..., :half], x[..., half:rope_dim]
  out[..., :half] = x0 * cos - x1 * sin
  out[..., half:rope_dim] = x0 * sin + x1 * cos
  return out


class GGUFMeta:
  """Metadata lookups of a reference model: `self.meta`, `self.arch`, `self.n_blocks`, `self.path` set by it."""

  def _key(self, key: str, default: Any = KeyError) -> Any:
    full = f"{self.arch}.{key}"
    if full in self.meta:
      return self.meta[full]
    if default is KeyError:
      raise KeyError(f"{self.path}: GGUF key {full!r} missing")
    return default

  def _per_block(self, key: str, default: Any = KeyError) -> list:
    """A key that llama.cpp reads with get_key_or_arr: a scalar for all blocks, or one value per block."""
    v = self._key(key, default)
    if isinstance(v, list):
      if len(v) != self.n_blocks:
        raise ValueError(f"{self.arch}.{key}: array of {len(v)} for {self.n_blocks} blocks")
      return list(v)
    return [v] * self.n_blocks


def read_gguf(path: str) -> tuple[dict[str, Any], dict[str, np.ndarray], dict[str, gguf.GGMLQuantizationType]]:
  """(metadata, tensors, their types) of a GGUF file: the metadata without the GGUF.* keys and the tokenizer's
  arrays (its model, pre-tokenizer and bos / eos ids kept), every tensor dequantized by gguf-py to float64 in
  numpy's shape (GGUF's reversed)."""
  reader = gguf.GGUFReader(path)
  keep = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")
  meta = {name: _field_value(field) for name, field in reader.fields.items()
          if not name.startswith("GGUF.") and (not name.startswith("tokenizer.ggml.") or name in keep)}
  tensors, types = {}, {}
  for tensor in reader.tensors:
    shape = tuple(int(s) for s in reversed(tensor.shape.tolist()))
    tensors[tensor.name] = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float64).reshape(shape)
    types[tensor.name] = tensor.tensor_type
  return meta, tensors, types


class RefModel(GGUFMeta):
  """float64 numpy reference of llama.cpp's qwen3moe / qwen2moe / glm4moe graphs (+ glm4moe NextN)."""

  def __init__(self, path: str):
    self.path = str(path)
    self.meta, self.t, self.tensor_types = read_gguf(self.path)
    self._read_hparams()

  def _read_hparams(self) -> None:
    self.arch = str(self.meta["general.architecture"])
    if self.arch not in _ARCHS:
      raise NotImplementedError(f"RefModel: arch {self.arch!r} not in {_ARCHS}")
    self.n_blocks = int(self._key("block_count"))
    self.n_nextn = int(self._key("nextn_predict_layers", 0))
    self.n_layers = self.n_blocks - self.n_nextn
    self.d_model = int(self._key("embedding_length"))
    self.n_heads = [int(x) for x in self._per_block("attention.head_count")]
    self.n_kv_heads = ([int(x) for x in self._per_block("attention.head_count_kv")]
                       if f"{self.arch}.attention.head_count_kv" in self.meta else list(self.n_heads))
    # head_dim defaults to n_embd / n_head (of block 0, as llama.cpp's n_head() does)
    self.head_dim = int(self._key("attention.key_length", self.d_model // self.n_heads[0]))
    head_dim_v = int(self._key("attention.value_length", self.d_model // self.n_heads[0]))
    if head_dim_v != self.head_dim:
      raise NotImplementedError(f"RefModel: key_length {self.head_dim} != value_length {head_dim_v}")
    self.rope_dim = int(self._key("rope.dimension_count", self.head_dim))
    self.rope_base = float(self._key("rope.freq_base", 10000.0))
    scaling = str(self._key("rope.scaling.type", "linear"))
    factor = float(self._key("rope.scaling.factor", self._key("rope.scale_linear", 0.0)))
    if scaling not in ("none", "linear"):
      raise NotImplementedError(f"RefModel: rope scaling {scaling!r} (only none/linear)")
    self.rope_freq_scale = 1.0 if factor == 0.0 else 1.0 / factor
    sections = self._key("rope.dimension_sections", None)
    if sections is not None and len(sections) >= 2 and int(sections[0]) > 0 and int(sections[1]) > 0:   # use_mrope()
      raise NotImplementedError("RefModel: M-RoPE (rope.dimension_sections) not supported")
    self.eps = float(self._key("attention.layer_norm_rms_epsilon"))
    self.n_ff = [int(x) for x in self._per_block("feed_forward_length", 0)]
    self.n_experts = int(self._key("expert_count", 0))
    self.top_k = [int(x) for x in self._per_block("expert_used_count", 0)]
    if int(self._key("expert_group_count", 0)) > 1:
      raise NotImplementedError("RefModel: group-limited routing (expert_group_count > 1)")
    ff_exp = self._per_block("expert_feed_forward_length", 0)
    # llama.cpp: n_ff_exp = expert_feed_forward_length if set, else n_ff / n_expert_used
    self.n_ff_exp = [int(f) if int(f) else (self.n_ff[i] // max(self.top_k[i], 1)) for i, f in enumerate(ff_exp)]

    # arch-specific (mirrors each arch's load_arch_hparams: keys other archs have are ignored by llama.cpp)
    self.n_dense_lead = 0
    self.n_shared = 0
    self.weights_scale = 0.0
    if self.arch == "qwen3moe":
      self.gating, self.norm_w = _GATING_SOFTMAX, True
    elif self.arch == "qwen2moe":
      self.gating, self.norm_w = _GATING_SOFTMAX, False
      self.n_ff_shexp = int(self._key("expert_shared_feed_forward_length", 0)) or None   # else per-layer n_ff
    else:  # glm4moe
      self.n_dense_lead = int(self._key("leading_dense_block_count", 0))
      self.n_shared = int(self._key("expert_shared_count"))
      self.weights_scale = float(self._key("expert_weights_scale", 0.0))
      self.norm_w = bool(self._key("expert_weights_norm", False))
      g = int(self._key("expert_gating_func", _GATING_NONE))
      self.gating = _GATING_SIGMOID if g == _GATING_NONE else g
    if self.gating not in (_GATING_SOFTMAX, _GATING_SIGMOID):
      raise NotImplementedError(f"RefModel: expert_gating_func {self.gating}")

    self.vocab_size = int(self.t["token_embd.weight"].shape[0])
    self.tied_embeddings = "output.weight" not in self.t
    if self.n_nextn and self.arch != "glm4moe":
      raise NotImplementedError(f"RefModel: NextN blocks for {self.arch}")

  # ---------------------------------------------------------------- pieces

  def _w(self, name: str) -> np.ndarray | None:
    return self.t.get(name + ".weight")

  def _b(self, name: str) -> np.ndarray | None:
    return self.t.get(name + ".bias")

  def _linear(self, x: np.ndarray, name: str, bias: bool = True) -> np.ndarray:
    y = x @ self.t[name + ".weight"].T
    b = self._b(name) if bias else None
    return y + b if b is not None else y

  def _attention(self, il: int, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Self-attention of block il over x [T, D] (already normed), causal over these T entries."""
    p = f"blk.{il}."
    T = x.shape[0]
    H, Hkv, Dh = self.n_heads[il], self.n_kv_heads[il], self.head_dim
    if p + "attn_qkv.weight" in self.t:                       # fused QKV (llama.cpp's build_qkv accepts it)
      qkv = x @ self.t[p + "attn_qkv.weight"].T
      if p + "attn_qkv.bias" in self.t:
        qkv = qkv + self.t[p + "attn_qkv.bias"]
      elif p + "attn_q.bias" in self.t:
        qkv = qkv + np.concatenate([self.t[p + f"attn_{n}.bias"] for n in "qkv"])
      q, k, v = np.split(qkv, [H * Dh, H * Dh + Hkv * Dh], axis=-1)
    else:
      q = self._linear(x, p + "attn_q")
      k = self._linear(x, p + "attn_k")
      v = self._linear(x, p + "attn_v")
    q = q.reshape(T, H, Dh)
    k = k.reshape(T, Hkv, Dh)
    v = v.reshape(T, Hkv, Dh)
    qn, kn = self._w(p + "attn_q_norm"), self._w(p + "attn_k_norm")
    if qn is not None:
      q = rms_norm(q, qn, self.eps)
    if kn is not None:
      k = rms_norm(k, kn, self.eps)
    q = rope_neox(q, pos, self.rope_dim, self.rope_base, self.rope_freq_scale)
    k = rope_neox(k, pos, self.rope_dim, self.rope_base, self.rope_freq_scale)
    g = H // Hkv
    k = np.repeat(k, g, axis=1)                                # q head h uses kv head h // g
    v = np.repeat(v, g, axis=1)
    s = np.einsum("thd,shd->hts", q, k) / math.sqrt(Dh)        # [H, T, T]
    s = np.where(np.tril(np.ones((T, T), dtype=bool))[None], s, -np.inf)
    a = softmax(s, axis=-1)
    o = np.einsum("hts,shd->thd", a, v).reshape(T, H * Dh)
    # glm4moe's graphs pass no output bias; qwen* pass wo_b (absent in practice)
    return self._linear(o, p + "attn_output", bias=self.arch != "glm4moe")

  def _mlp(self, x: np.ndarray, prefix: str, suffix: str = "") -> np.ndarray:
    """down(silu(gate x) * up x) with weights {prefix}ffn_{gate,up,down}{suffix}."""
    gate = x @ self.t[f"{prefix}ffn_gate{suffix}.weight"].T
    up = x @ self.t[f"{prefix}ffn_up{suffix}.weight"].T
    return (silu(gate) * up) @ self.t[f"{prefix}ffn_down{suffix}.weight"].T

  def route(self, il: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Router of block il on x [T, D]: (selected expert ids [T, k], their weights [T, k])."""
    p = f"blk.{il}."
    logits = x @ self.t[p + "ffn_gate_inp.weight"].T                  # [T, E]
    probs = softmax(logits) if self.gating == _GATING_SOFTMAX else sigmoid(logits)
    sel_probs = probs
    bias = self.t.get(p + "exp_probs_b.bias")
    if bias is not None and self.arch == "glm4moe":
      sel_probs = probs + bias                                         # selection only
    k = self.top_k[il]
    # stable descending sort; ties broken by lower index (ggml's argsort order is not specified for ties)
    ids = np.argsort(-sel_probs, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(probs, ids, axis=-1)
    if self.norm_w:
      w = w / np.maximum(np.sum(w, axis=-1, keepdims=True), _NORM_CLAMP)
    if self.weights_scale not in (0.0, 1.0):
      w = w * self.weights_scale
    return ids, w

  def _moe(self, il: int, x: np.ndarray) -> np.ndarray:
    p = f"blk.{il}."
    ids, w = self.route(il, x)
    gate_e, up_e, down_e = (self.t[p + f"ffn_{n}_exps.weight"] for n in ("gate", "up", "down"))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
      for j in range(ids.shape[1]):
        e = ids[t, j]
        h = silu(gate_e[e] @ x[t]) * (up_e[e] @ x[t])
        out[t] += w[t, j] * (down_e[e] @ h)
    if self.arch == "qwen2moe":
      if p + "ffn_up_shexp.weight" in self.t:
        sh = self._mlp(x, p, "_shexp")
        gate_inp = self.t.get(p + "ffn_gate_inp_shexp.weight")
        if gate_inp is not None:
          sh = sh * sigmoid(x @ gate_inp.reshape(-1))[:, None]
        out = out + sh
    elif self.arch == "glm4moe" and self.n_shared > 0:
      out = out + self._mlp(x, p, "_shexp")
    return out

  def block(self, il: int, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Decoder block il on the residual stream x [T, D] at positions pos [T] (causal over these entries)."""
    p = f"blk.{il}."
    h = x + self._attention(il, rms_norm(x, self.t[p + "attn_norm.weight"], self.eps), pos)
    norm2 = "post_attention_norm" if self.arch == "glm4moe" else "ffn_norm"
    y = rms_norm(h, self.t[p + norm2 + ".weight"], self.eps)
    if il < self.n_dense_lead:
      f = self._mlp(y, p)
    else:
      f = self._moe(il, y)
    return h + f

  # ---------------------------------------------------------------- API

  @property
  def output_weight(self) -> np.ndarray:
    return self.t["output.weight"] if not self.tied_embeddings else self.t["token_embd.weight"]

  def forward(self, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Full causal forward from position 0: (logits [T, V], hidden [T, D] after output_norm)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    pos = np.arange(len(tokens))
    x = self.t["token_embd.weight"][tokens]
    for il in range(self.n_layers):
      x = self.block(il, x, pos)
    hidden = rms_norm(x, self.t["output_norm.weight"], self.eps)
    return hidden @ self.output_weight.T, hidden

  def mtp_forward(self, hidden: np.ndarray, tokens: list[int], start_pos: int = 1,
                  block: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """NextN block `block` over a sequence: entry j combines hidden[j] with the embedding of tokens[j] (the
    caller shifts: tokens[j] = t_{j+1}), runs at absolute position start_pos + j, attending causally over
    these entries only. Returns (logits [T, V], h_out [T, D] after shared_head_norm)."""
    if not 0 <= block < self.n_nextn:
      raise ValueError(f"RefModel: NextN block {block} of {self.n_nextn}")
    il = self.n_layers + block
    p = f"blk.{il}.nextn."
    hidden = np.asarray(hidden, dtype=np.float64)
    tokens = np.asarray(tokens, dtype=np.int64)
    if hidden.shape != (len(tokens), self.d_model):
      raise ValueError(f"mtp_forward: hidden {hidden.shape} for {len(tokens)} tokens")
    emb_table = self.t.get(p + "embed_tokens.weight", self.t["token_embd.weight"])
    e = rms_norm(emb_table[tokens], self.t[p + "enorm.weight"], self.eps)
    hh = rms_norm(hidden, self.t[p + "hnorm.weight"], self.eps)
    x = np.concatenate([e, hh], axis=-1) @ self.t[p + "eh_proj.weight"].T        # embedding first
    pos = start_pos + np.arange(len(tokens))
    x = self.block(il, x, pos)
    head_norm = self.t.get(p + "shared_head_norm.weight", self.t["output_norm.weight"])
    h_out = rms_norm(x, head_norm, self.eps)
    head = self.t.get(p + "shared_head_head.weight", self.output_weight)
    return h_out @ head.T, h_out
