"""An independent float64 numpy forward of the hybrid family (qwen3next, qwen35moe) over a GGUF file: the oracle the
JAX model's Gated DeltaNet / gated-attention layers are checked against.

Like tests/ref_forward.py (whose numerics helpers it imports) nothing here comes from `model/`, `ops/` or `decode/`:
the file is read with `gguf.GGUFReader`, every tensor is dequantized with `gguf.quants.dequantize` and cast to
float64, and the graph follows llama.cpp 0.3.36 (src/models/qwen3next.cpp, qwen35moe.cpp, delta-net-base.cpp,
ggml-cpu `ssm_conv`, `gated_delta_net`, `rope` multi). Slow and simple on purpose: the delta rule runs token by
token, attention is recomputed from position 0, no cache.

    ref = HybridRefModel("tiny.gguf")
    logits, hidden = ref.forward(tokens)                   # [T, V], [T, D] (hidden after output_norm)
    logits, hidden, states = ref.forward(tokens, return_states=True)   # + per DeltaNet layer (conv window, S)
    mtp_logits, h = ref.mtp_forward(h_in, tokens, start_pos=0)        # the NextN block over a sequence

Semantics (llama.cpp's, the points that are easy to get wrong):
- Block: h = x + mixer(rms_norm(x, attn_norm)); out = h + ffn(rms_norm(h, post_attention_norm)). Mixer: a Gated
  DeltaNet layer where the layout says recurrent (`attention.recurrent_layers`, else `full_attention_interval` k:
  layer i recurrent iff (i + 1) % k != 0, default 4; NextN blocks never), else gated attention.
- Gated DeltaNet (Hk key heads, Hv value heads, Dk = Dv = ssm.state_size, Kc = ssm.conv_kernel):
  qkv = x @ attn_qkv.T (rows q [Hk Dk] | k [Hk Dk] | v [Hv Dv]), z = x @ attn_gate.T (legacy qwen3next files: one
  ssm_in, per key head q | k | v | z); beta = sigmoid(b), g = softplus(a + ssm_dt.bias) * ssm_a (ssm_a holds
  -exp(A_log), so g < 0 is the log-decay), b / a from ssm_ba (qwen3next: per key head Hv/Hk betas then Hv/Hk alphas)
  or ssm_beta / ssm_alpha (qwen35moe); causal conv: c[t] = sum_k qkv[t - Kc + 1 + k] * ssm_conv1d[:, k] (zeros
  before position 0, no bias), then SiLU; q, k L2-normalised per head with eps inside the root
  (x / sqrt(sum x^2 + eps), eps = the RMS eps); value head h reads key head h // (Hv / Hk) (qwen3next) or h % Hk
  (qwen35moe); per value head a state S [Dk, Dv]: S = exp(g) S; d = (v - S^T k) beta; S = S + k d^T;
  o = S^T q / sqrt(Dk); then RMSNorm over each head's Dv with ssm_norm, times silu(z); ssm_out.
- Gated attention: attn_q gives per head [query (Dh) | gate (Dh)]; q / k RMSNorm per head (attn_q_norm /
  attn_k_norm) before RoPE; RoPE on the first rope_dim dims, NEOX pairing (i, i + rope_dim / 2); qwen3next NEOX,
  qwen35moe IMROPE with rope.dimension_sections on text positions (p, p, p, 0): pair i, sector s = i % sum(sections),
  takes position p when s % 3 == r and s < 3 * sections[r] for its residue r, else 0 (no rotation); scale
  1 / sqrt(Dh); output * sigmoid(gate) before attn_output.
- FFN: softmax router, top-k, weights renormalised (clamped sum), no scale; plus the shared expert
  down(silu(gate x) * up x) times sigmoid(x . ffn_gate_inp_shexp).
- NextN block (llama.cpp's graph_mtp): x = eh_proj(concat(rms_norm(emb, enorm), rms_norm(h, hnorm))), a gated
  attention block over its own entries, then shared_head_norm (else output_norm) and shared_head_head (else the
  output head).
"""
from __future__ import annotations

import math

import numpy as np

from tests.ref_forward import _NORM_CLAMP, GGUFMeta, read_gguf, rms_norm, rope_neox, sigmoid, silu, softmax

ARCHS = ("qwen3next", "qwen35moe")


def softplus(x: np.ndarray) -> np.ndarray:
  return np.logaddexp(0.0, x)


def l2_norm(x: np.ndarray, eps: float) -> np.ndarray:
  """x / sqrt(sum(x^2) + eps) over the last axis (llama.cpp's build_gdn_l2_norm: rms_norm(x, eps / n) / sqrt(n))."""
  return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def rope_imrope_text(x: np.ndarray, pos: np.ndarray, rope_dim: int, base: float, sections: list[int],
                     freq_scale: float = 1.0) -> np.ndarray:
  """ggml_rope_multi in IMROPE mode on text tokens (llama.cpp passes positions (p, p, p, 0)): x [T, H, Dh] at
  positions pos [T]. Pair i (dims i, i + rope_dim / 2) rotates by pos_sel * freq_scale * base^(-2i / rope_dim),
  pos_sel the position component ggml's mrope cache picks for the pair's sector."""
  half = rope_dim // 2
  n = sum(sections)
  comp = []                                                    # 0 = t, 1 = h, 2 = w, 3 = e, per pair
  for i in range(half):
    sec = i % n
    if sec % 3 == 1 and sec < 3 * sections[1]:
      comp.append(1)
    elif sec % 3 == 2 and sec < 3 * sections[2]:
      comp.append(2)
    elif sec % 3 == 0 and sec < 3 * sections[0]:
      comp.append(0)
    else:
      comp.append(3)
  p = pos.astype(np.float64)
  p4 = np.stack([p, p, p, np.zeros_like(p)], axis=-1)         # [T, 4]
  inv = base ** (-2.0 * np.arange(half, dtype=np.float64) / rope_dim)
  ang = freq_scale * p4[:, comp] * inv[None, :]               # [T, half]
  cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
  out = x.copy()
  x0, x1 = x[..., :half], x[..., half:rope_dim]
  out[..., :half] = x0 * cos - x1 * sin
  out[..., half:rope_dim] = x0 * sin + x1 * cos
  return out


class HybridRefModel(GGUFMeta):
  """float64 numpy reference of llama.cpp 0.3.36's qwen3next / qwen35moe graphs (+ their NextN block)."""

  def __init__(self, path: str):
    self.path = str(path)
    self.meta, self.t, _ = read_gguf(self.path)
    self._read_hparams()

  def _read_hparams(self) -> None:
    self.arch = str(self.meta["general.architecture"])
    if self.arch not in ARCHS:
      raise NotImplementedError(f"HybridRefModel: arch {self.arch!r} not in {ARCHS}")
    self.n_blocks = int(self._key("block_count"))
    self.n_nextn = int(self._key("nextn_predict_layers", 0))
    self.n_layers = self.n_blocks - self.n_nextn
    self.d_model = int(self._key("embedding_length"))
    self.eps = float(self._key("attention.layer_norm_rms_epsilon"))
    rec = self._key("attention.recurrent_layers", None)
    if rec is not None:
      if len(rec) != self.n_blocks:
        raise ValueError(f"attention.recurrent_layers: {len(rec)} entries for {self.n_blocks} blocks")
      self.recurrent = [bool(r) for r in rec]
    else:
      k = int(self._key("full_attention_interval", 4))
      self.recurrent = [i < self.n_layers and (i + 1) % k != 0 for i in range(self.n_blocks)]
    heads = self._per_block("attention.head_count")
    kv = self._per_block("attention.head_count_kv", heads[0]) if f"{self.arch}.attention.head_count_kv" in self.meta \
        else heads
    attn = [i for i in range(self.n_blocks) if not self.recurrent[i]]
    self.n_heads, self.n_kv_heads = int(heads[attn[0]]), int(kv[attn[0]])
    self.head_dim = int(self._key("attention.key_length", self.d_model // self.n_heads))
    if int(self._key("attention.value_length", self.d_model // self.n_heads)) != self.head_dim:
      raise NotImplementedError("HybridRefModel: key_length != value_length")
    self.rope_dim = int(self._key("rope.dimension_count", self.head_dim))
    self.rope_base = float(self._key("rope.freq_base", 10000.0))
    if str(self._key("rope.scaling.type", "linear")) not in ("none", "linear"):
      raise NotImplementedError("HybridRefModel: rope scaling other than none/linear")
    factor = float(self._key("rope.scaling.factor", self._key("rope.scale_linear", 0.0)))
    self.rope_freq_scale = 1.0 if factor == 0.0 else 1.0 / factor
    if self.arch == "qwen35moe":
      sec = self._key("rope.dimension_sections")
      self.rope_sections = [int(s) for s in (sec if isinstance(sec, list) else [sec] * 4)]
    else:
      self.rope_sections = None
    self.n_experts = int(self._key("expert_count"))
    self.top_k = int(self._per_block("expert_used_count")[0])
    n_ff = int(self._per_block("feed_forward_length", 0)[0])
    self.n_ff_exp = int(self._per_block("expert_feed_forward_length", 0)[0]) or n_ff // self.top_k
    self.n_ff_shexp = int(self._key("expert_shared_feed_forward_length", 0)) or n_ff
    self.d_conv = int(self._key("ssm.conv_kernel"))
    self.d_inner = int(self._key("ssm.inner_size"))
    self.d_state = int(self._key("ssm.state_size"))
    self.n_v_heads = int(self._key("ssm.time_step_rank"))
    self.n_k_heads = int(self._key("ssm.group_count"))
    self.head_v_dim = self.d_inner // self.n_v_heads
    if self.head_v_dim != self.d_state:
      raise NotImplementedError("HybridRefModel: value head dim != key head dim (llama.cpp requires them equal)")
    self.vocab_size = int(self.t["token_embd.weight"].shape[0])
    self.tied_embeddings = "output.weight" not in self.t

  def key_head(self, h: int) -> int:
    """The key head value head h reads: grouped (qwen3next, ggml repeat-interleave) or tiled (qwen35moe)."""
    if self.arch == "qwen35moe":
      return h % self.n_k_heads
    return h // (self.n_v_heads // self.n_k_heads)

  # ---------------------------------------------------------------- pieces

  def rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
    if self.rope_sections is None:
      return rope_neox(x, pos, self.rope_dim, self.rope_base, self.rope_freq_scale)
    return rope_imrope_text(x, pos, self.rope_dim, self.rope_base, self.rope_sections, self.rope_freq_scale)

  def _attention(self, il: int, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Gated attention of block il over x [T, D] (already normed), causal over these T entries."""
    p = f"blk.{il}."
    T = x.shape[0]
    H, Hkv, Dh = self.n_heads, self.n_kv_heads, self.head_dim
    qg = (x @ self.t[p + "attn_q.weight"].T).reshape(T, H, 2, Dh)
    q, gate = qg[:, :, 0], qg[:, :, 1].reshape(T, H * Dh)
    k = (x @ self.t[p + "attn_k.weight"].T).reshape(T, Hkv, Dh)
    v = (x @ self.t[p + "attn_v.weight"].T).reshape(T, Hkv, Dh)
    q = rms_norm(q, self.t[p + "attn_q_norm.weight"], self.eps)
    k = rms_norm(k, self.t[p + "attn_k_norm.weight"], self.eps)
    q, k = self.rope(q, pos), self.rope(k, pos)
    g = H // Hkv
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)     # q head h uses kv head h // g
    s = np.einsum("thd,shd->hts", q, k) / math.sqrt(Dh)
    s = np.where(np.tril(np.ones((T, T), dtype=bool))[None], s, -np.inf)
    o = np.einsum("hts,shd->thd", softmax(s, axis=-1), v).reshape(T, H * Dh)
    return (o * sigmoid(gate)) @ self.t[p + "attn_output.weight"].T

  def _gdn_inputs(self, il: int, x: np.ndarray):
    """qkv [T, Cc], z [T, Hv, Dv], beta [T, Hv], g [T, Hv] (log-decay) of Gated DeltaNet block il."""
    p = f"blk.{il}."
    T = x.shape[0]
    Hk, Hv, Dk, Dv = self.n_k_heads, self.n_v_heads, self.d_state, self.head_v_dim
    r = Hv // Hk
    if p + "attn_qkv.weight" in self.t:
      qkv = x @ self.t[p + "attn_qkv.weight"].T
      z = (x @ self.t[p + "attn_gate.weight"].T).reshape(T, Hv, Dv)
    else:                                                       # legacy qwen3next: ssm_in, per key head q|k|v|z
      m = (x @ self.t[p + "ssm_in.weight"].T).reshape(T, Hk, 2 * Dk + 2 * r * Dv)
      q, k, v, zz = np.split(m, [Dk, 2 * Dk, 2 * Dk + r * Dv], axis=-1)
      qkv = np.concatenate([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], axis=-1)
      z = zz.reshape(T, Hv, Dv)
    if self.arch == "qwen3next":
      ba = (x @ self.t[p + "ssm_ba.weight"].T).reshape(T, Hk, 2 * r)
      b, a = ba[..., :r].reshape(T, Hv), ba[..., r:].reshape(T, Hv)
    else:
      b, a = x @ self.t[p + "ssm_beta.weight"].T, x @ self.t[p + "ssm_alpha.weight"].T
    g = softplus(a + self.t[p + "ssm_dt.bias"]) * self.t[p + "ssm_a"]
    return qkv, z, sigmoid(b), g

  def _gdn(self, il: int, x: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """Gated DeltaNet block il over x [T, D] (already normed) from a zero state: (out [T, D],
    (conv window [Cc, Kc - 1]: the last Kc - 1 inputs of the conv, S [Hv, Dk, Dv] after the last token))."""
    p = f"blk.{il}."
    T = x.shape[0]
    Hk, Hv, Dk, Dv, Kc = self.n_k_heads, self.n_v_heads, self.d_state, self.head_v_dim, self.d_conv
    qkv, z, beta, g = self._gdn_inputs(il, x)
    w = self.t[p + "ssm_conv1d.weight"]                          # [Cc, Kc]
    xp = np.concatenate([np.zeros((Kc - 1, qkv.shape[1])), qkv], axis=0)
    c = sum(xp[j:j + T] * w[:, j] for j in range(Kc))
    c = silu(c)
    q = l2_norm(c[:, :Hk * Dk].reshape(T, Hk, Dk), self.eps)
    k = l2_norm(c[:, Hk * Dk:2 * Hk * Dk].reshape(T, Hk, Dk), self.eps)
    v = c[:, 2 * Hk * Dk:].reshape(T, Hv, Dv)
    kh = np.array([self.key_head(h) for h in range(Hv)])
    q, k = q[:, kh] / math.sqrt(Dk), k[:, kh]                    # [T, Hv, Dk]
    S = np.zeros((Hv, Dk, Dv))
    o = np.zeros((T, Hv, Dv))
    for t in range(T):
      S = S * np.exp(g[t])[:, None, None]
      d = (v[t] - np.einsum("hi,hij->hj", k[t], S)) * beta[t][:, None]
      S = S + k[t][:, :, None] * d[:, None, :]
      o[t] = np.einsum("hi,hij->hj", q[t], S)
    y = rms_norm(o, self.t[p + "ssm_norm.weight"], self.eps) * silu(z)
    out = y.reshape(T, Hv * Dv) @ self.t[p + "ssm_out.weight"].T
    return out, (xp[-(Kc - 1):].T.copy(), S)

  def route(self, il: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Router of block il on x [T, D]: (selected expert ids [T, k], renormalised weights [T, k])."""
    probs = softmax(x @ self.t[f"blk.{il}.ffn_gate_inp.weight"].T)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :self.top_k]
    w = np.take_along_axis(probs, ids, axis=-1)
    return ids, w / np.maximum(np.sum(w, axis=-1, keepdims=True), _NORM_CLAMP)

  def _ffn(self, il: int, x: np.ndarray) -> np.ndarray:
    p = f"blk.{il}."
    ids, w = self.route(il, x)
    gate_e, up_e, down_e = (self.t[p + f"ffn_{n}_exps.weight"] for n in ("gate", "up", "down"))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
      for j in range(ids.shape[1]):
        e = ids[t, j]
        out[t] += w[t, j] * (down_e[e] @ (silu(gate_e[e] @ x[t]) * (up_e[e] @ x[t])))
    sh = (silu(x @ self.t[p + "ffn_gate_shexp.weight"].T) * (x @ self.t[p + "ffn_up_shexp.weight"].T)) \
        @ self.t[p + "ffn_down_shexp.weight"].T
    return out + sh * sigmoid(x @ self.t[p + "ffn_gate_inp_shexp.weight"].reshape(-1))[:, None]

  def block(self, il: int, x: np.ndarray, pos: np.ndarray, states: dict | None = None) -> np.ndarray:
    """Block il on the residual stream x [T, D] at positions pos [T] (from a zero recurrent state); a Gated
    DeltaNet block leaves its final (conv window, S) in states[il] when states is given."""
    p = f"blk.{il}."
    h = rms_norm(x, self.t[p + "attn_norm.weight"], self.eps)
    if self.recurrent[il]:
      mix, st = self._gdn(il, h)
      if states is not None:
        states[il] = st
    else:
      mix = self._attention(il, h, pos)
    h = x + mix
    return h + self._ffn(il, rms_norm(h, self.t[p + "post_attention_norm.weight"], self.eps))

  # ---------------------------------------------------------------- API

  @property
  def output_weight(self) -> np.ndarray:
    return self.t["output.weight"] if not self.tied_embeddings else self.t["token_embd.weight"]

  def forward(self, tokens: list[int], return_states: bool = False):
    """Full causal forward from position 0 and a zero state: (logits [T, V], hidden [T, D] after output_norm),
    plus with return_states {trunk layer: (conv window [Cc, Kc - 1], S [Hv, Dk, Dv])} of the DeltaNet layers."""
    tokens = np.asarray(tokens, dtype=np.int64)
    pos = np.arange(len(tokens))
    x = self.t["token_embd.weight"][tokens]
    states: dict = {}
    for il in range(self.n_layers):
      x = self.block(il, x, pos, states)
    hidden = rms_norm(x, self.t["output_norm.weight"], self.eps)
    logits = hidden @ self.output_weight.T
    return (logits, hidden, states) if return_states else (logits, hidden)

  def mtp_forward(self, hidden: np.ndarray, tokens: list[int], start_pos: int = 1,
                  block: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """NextN block `block` over a sequence: entry j combines hidden[j] with the embedding of tokens[j] (the caller
    shifts), runs at absolute position start_pos + j, attending causally over these entries only. Returns
    (logits [T, V], h_out [T, D] after the head norm)."""
    if not 0 <= block < self.n_nextn:
      raise ValueError(f"HybridRefModel: NextN block {block} of {self.n_nextn}")
    il = self.n_layers + block
    p = f"blk.{il}.nextn."
    hidden = np.asarray(hidden, dtype=np.float64)
    tokens = np.asarray(tokens, dtype=np.int64)
    if hidden.shape != (len(tokens), self.d_model):
      raise ValueError(f"mtp_forward: hidden {hidden.shape} for {len(tokens)} tokens")
    emb_table = self.t.get(p + "embed_tokens.weight", self.t["token_embd.weight"])
    e = rms_norm(emb_table[tokens], self.t[p + "enorm.weight"], self.eps)
    hh = rms_norm(hidden, self.t[p + "hnorm.weight"], self.eps)
    x = np.concatenate([e, hh], axis=-1) @ self.t[p + "eh_proj.weight"].T          # embedding first
    x = self.block(il, x, start_pos + np.arange(len(tokens)))
    h_out = rms_norm(x, self.t.get(p + "shared_head_norm.weight", self.t["output_norm.weight"]), self.eps)
    return h_out @ self.t.get(p + "shared_head_head.weight", self.output_weight).T, h_out
