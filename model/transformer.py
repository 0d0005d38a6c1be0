"""The decoder as Flax Linen modules: attention, MoE / dense FFN, block, NextN (MTP) block, decoder.

Applied functionally, `Decoder(cfg).apply({"params": params}, tokens, ring=ring)`; no mutable collections:
the KV ring goes in as an argument and comes back updated. Weights are dense arrays (training, `init`) or
packed `QTensor`s read from GGUF (inference); every matmul goes through ops.layers.linear / ops.moe.moe,
which accept both.

Parameter tree (GGUF names in brackets, see model/gguf_io.py):
  token_embd [token_embd], output_norm [output_norm], output [output, absent when tied],
  blk_i/{attn_norm, ffn_norm [ffn_norm | post_attention_norm],
         attn/{wq, wk, wv, wo, bq, bk, bv, q_norm, k_norm},
         ffn/{router [ffn_gate_inp], router_bias [exp_probs_b], gate_exps, up_exps, down_exps,
              gate_shexp, up_shexp, down_shexp, shexp_gate [ffn_gate_inp_shexp]}   (MoE blocks)
         ffn/{gate, up, down}                                                        (dense blocks)}
  mtp_j/{enorm, hnorm, eh_proj, embed_tokens?, shared_head_norm, shared_head_head?, blk/...}  (NextN)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from model.host_tier import tier_block
from model.kv_ring import KVRing
from model.config import ModelConfig
from ops import attention as attn_ops
from ops import moe as moe_ops
from ops import rope_write_pallas, router_pallas
from ops.rmsnorm_pallas import add_rms_norm
from ops.layers import linear, rms_norm, rope_neox, swiglu
from ops.qtensor import QTensor, as_dense

# Decode and verify passes (T <= 16) run the per-token Pallas "glue" kernels (RMSNorm with the residual add, routing,
# q/k norm + RoPE + ring write) whenever the block's quantized matmuls run Pallas kernels ("pallas" | "interpret"):
# fewer launches, and every token's row computed the same way whatever T is, so a verify pass reproduces the plain
# steps bitwise on the GPU (DESIGN invariant 3; XLA's reductions are not batch-invariant there). False: the jnp ops
# (the A/B of `bench.step --glue`). Read at trace time.
GLUE_KERNELS = True

_init = nn.initializers.normal(0.02)
_ones = nn.initializers.ones
_zeros = nn.initializers.zeros


def _param(m: nn.Module, name: str, init, shape):
  """m.param, but a loaded param (possibly a packed QTensor, whose leaf is its byte array) is taken as is:
  the loader already checked its logical shape against the GGUF file."""
  if m.has_variable("params", name):
    return m.get_variable("params", name)
  return m.param(name, init, shape)


def _causal_attention(q_THD, k_THD, v_THD, scale):
  """Plain causal attention over T tokens (training / no cache)."""
  T, Hq, Dh = q_THD.shape
  Hkv = k_THD.shape[1]
  q = q_THD.reshape(T, Hkv, Hq // Hkv, Dh) * scale
  s = jnp.einsum("tkgd,skd->tkgs", q, k_THD)
  mask = jnp.tril(jnp.ones((T, T), bool))
  s = jnp.where(mask[:, None, None, :], s, -1e30)
  p = jax.nn.softmax(s, axis=-1)
  return jnp.einsum("tkgs,skd->tkgd", p, v_THD).reshape(T, Hq, Dh)


class Attention(nn.Module):
  cfg: ModelConfig
  ring_layer: int          # this block's layer index in the ring it attends over
  rope_offset: int = 0     # RoPE position = ring position + offset (the NextN ring's entry j sits at position j+1)

  @nn.compact
  def __call__(self, x_TD, pos_T, ring: KVRing | None, attn_block: int, host=None):
    c = self.cfg
    D, Hq, Hkv, Dh = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim
    wo = _param(self, "wo", _init, (D, Hq * Dh))
    T = x_TD.shape[0]
    glue = _rope_write_impl(self, c) if ring is not None else "ref"
    if glue != "ref":                                 # q/k norm, RoPE and the ring write in one kernel
      qkv = self._fused_qkv(x_TD)
      qn = _param(self, "q_norm", _ones, (Dh,)) if c.qk_norm else None
      kn = _param(self, "k_norm", _ones, (Dh,)) if c.qk_norm else None
      L = self.ring_layer
      q, arrays = rope_write_pallas.rope_write(
          qkv, qn, kn, pos_T, ring.layer(L), impl=glue, n_heads=Hq, n_kv_heads=Hkv, head_dim=Dh,
          rope_dim=c.rope_dim, theta=c.rope_theta, offset=self.rope_offset, eps=c.rms_eps)
      ring = ring.with_layer(L, arrays)
      return self._attend(q, pos_T, ring, attn_block, host, wo)
    if self.has_variable("params", "wqkv"):          # fused at load (model.api.fuse_qkv): one matmul, one launch
      q, k, v = jnp.split(self._fused_qkv(x_TD), [Hq * Dh, (Hq + Hkv) * Dh], axis=-1)
    else:
      wq = _param(self, "wq", _init, (Hq * Dh, D))
      wk = _param(self, "wk", _init, (Hkv * Dh, D))
      wv = _param(self, "wv", _init, (Hkv * Dh, D))
      bq = bk = bv = None
      if c.qkv_bias:
        bq, bk, bv = (_param(self, n, _zeros, (s,)) for n, s in (("bq", Hq * Dh), ("bk", Hkv * Dh), ("bv", Hkv * Dh)))
      q, k, v = linear(x_TD, wq, bq), linear(x_TD, wk, bk), linear(x_TD, wv, bv)
    q, k, v = q.reshape(T, Hq, Dh), k.reshape(T, Hkv, Dh), v.reshape(T, Hkv, Dh)
    if c.qk_norm:
      q = rms_norm(q, _param(self, "q_norm", _ones, (Dh,)), c.rms_eps)
      k = rms_norm(k, _param(self, "k_norm", _ones, (Dh,)), c.rms_eps)
    q = rope_neox(q, pos_T + self.rope_offset, c.rope_dim, c.rope_theta)
    k = rope_neox(k, pos_T + self.rope_offset, c.rope_dim, c.rope_theta)
    if ring is None:
      o = _causal_attention(q, k, v.astype(jnp.float32), 1.0 / float(Dh) ** 0.5)
      return linear(o.reshape(T, Hq * Dh), wo), ring, host
    ring = ring.write(self.ring_layer, pos_T, k, v)
    return self._attend(q, pos_T, ring, attn_block, host, wo)

  def _fused_qkv(self, x_TD):
    return linear(x_TD, self.get_variable("params", "wqkv"),
                  self.get_variable("params", "bqkv") if self.cfg.qkv_bias else None)

  def _attend(self, q, pos_T, ring, attn_block, host, wo):
    """Attention of q [T, Hq, Dh] over the ring (its new rows already written), then the output projection."""
    c = self.cfg
    T, Hq, Dh = q.shape
    scale = 1.0 / float(Dh) ** 0.5
    L = self.ring_layer
    # "length" = written + scratch: keys older than (written - window) are masked (see KVRing.scratch)
    length = ring.length + T + ring.scratch
    if host is None:
      o = attn_ops.ring_attention(q, *ring.layer(L), pos_T, length, block=attn_block, scale=scale)
    else:
      # The ring's part (on the decode kernel where it takes the call, as without a tier) and the tier's, each
      # with its log-sum-exp. Decode and verify (T <= MAX_T): row t sees the ring from lo_t = pos_t + 1 - window
      # and the tier below it, the split of the step that decodes pos_t alone, so a verify pass's rows are that
      # step's bitwise (DESIGN invariant 3; lo_t is at least written - R: older slots are overwritten). Prefill
      # chunks: every row sees the ring from written - window, the tier below.
      if T <= attn_ops.attention_pallas.MAX_T:
        lo = jnp.maximum(pos_T + 1 - ring.window, ring.length + T - ring.capacity)
        o1, lse1 = attn_ops.ring_attention(q, *ring.layer(L), pos_T, ring.length + T, block=attn_block, scale=scale,
                                           with_lse=True, lo_T=lo)
        q_hi = lo - 1
      else:
        o1, lse1 = attn_ops.ring_attention(q, *ring.layer(L), pos_T, length, block=attn_block, scale=scale,
                                           with_lse=True)
        q_hi = jnp.minimum(pos_T, ring.length + T - ring.window - 1)
      o2, lse2 = attn_ops.tier_attention(q, *host.layer(L), q_hi, tier_block=tier_block(ring.window, attn_block),
                                         block=attn_block, scale=scale)
      o = attn_ops.merge_lse(o1.reshape(T, Hq, Dh), lse1, o2.reshape(T, Hq, Dh), lse2)
    return linear(o.reshape(T, Hq * Dh), wo), ring, host


def glue_impl(tree) -> str:
  """"pallas" | "interpret" when GLUE_KERNELS and the first QTensor in `tree` runs that kernel mode, else "ref"."""
  if not GLUE_KERNELS:
    return "ref"
  for leaf in jax.tree_util.tree_leaves(tree, is_leaf=lambda v: isinstance(v, QTensor)):
    if isinstance(leaf, QTensor):
      return leaf.kernel if leaf.kernel in ("pallas", "interpret") else "ref"
  return "ref"


def _rope_write_impl(m: nn.Module, c: ModelConfig) -> str:
  """The fused rope + ring-write kernel's impl for this block: the fused q/k/v weight's kernel mode ("pallas" |
  "interpret") where the shapes allow and GLUE_KERNELS, else "ref" (the separate jnp ops)."""
  if not m.has_variable("params", "wqkv"):
    return "ref"
  mode = glue_impl(m.get_variable("params", "wqkv"))
  if mode != "ref" and rope_write_pallas.supported(c.n_heads, c.n_kv_heads, c.head_dim, c.rope_dim) is None:
    return mode
  return "ref"


class DenseMLP(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_TD):
    D, F = self.cfg.d_model, self.cfg.d_ff
    gate = _param(self, "gate", _init, (F, D))
    up = _param(self, "up", _init, (F, D))
    down = _param(self, "down", _init, (D, F))
    return linear(swiglu(linear(x_TD, gate), linear(x_TD, up)), down)


class MoE(nn.Module):
  """Routed experts (softmax top-k, or sigmoid with a selection bias) plus an optional shared expert.

  With an expert cache (model/expert_cache.py) the routed experts are read from its device slots, loading
  misses from the store (the params' expert tensors); prefill-sized steps (T * k > E) read the store directly
  (moved to the device first when it lives in pinned host memory).
  """
  cfg: ModelConfig
  index: int = 0           # block index (the expert cache's row)
  glue: str = "ref"        # routing kernels: "pallas" | "interpret" | "ref" (glue_impl)

  @nn.compact
  def __call__(self, x_TD, ecache=None):
    c = self.cfg
    D, E, F = c.d_model, c.n_experts, c.d_ff_expert
    router = _param(self, "router", _init, (E, D))
    gate = _param(self, "gate_exps", _init, (E, F, D))
    up = _param(self, "up_exps", _init, (E, F, D))
    down = _param(self, "down_exps", _init, (E, D, F))
    bias = _param(self, "router_bias", _zeros, (E,)) if c.routing != "softmax" else None
    ids, w = router_pallas.route(x_TD, router, bias, routing=c.routing, top_k=c.top_k, norm_topk=c.norm_topk,
                                 routed_scale=c.routed_scale, impl=self.glue, logits_fn=lambda x: linear(x, router))
    T, K = ids.shape
    if ecache is None or T * K > E:
      # The direct path reads every expert of the block (no cache, or a step routing more (token, expert) pairs
      # than there are experts: prefill chunks, long MTP passes). A store in pinned host memory
      # (expert_cache.place_store) is moved to the device first: each such step copies the block's whole
      # routed-expert tensors host -> device (for a prefill, once per MoE block per chunk; a transient device
      # buffer of one block's experts, which XLA may overlap with its neighbours'), the cost a host store implies.
      # A no-op when the experts are on the device.
      from model import expert_cache as xc
      gate, up, down = (xc.to_device(t) for t in (gate, up, down))
      y = moe_ops.moe(x_TD, ids, w, gate, up, down)
    else:
      y, ecache = _cached_moe(x_TD, ids, w, gate, up, down, ecache, self.index, E)
    if c.n_shared_experts or c.shared_expert_gate:
      Fs = c.d_ff_shared
      gs = _param(self, "gate_shexp", _init, (Fs, D))
      us = _param(self, "up_shexp", _init, (Fs, D))
      ds = _param(self, "down_shexp", _init, (D, Fs))
      ys = linear(swiglu(linear(x_TD, gs), linear(x_TD, us)), ds)
      if c.shared_expert_gate:
        g = _param(self, "shexp_gate", _init, (D,))          # qwen2moe: one gate logit per token
        ys = ys * jax.nn.sigmoid(x_TD.astype(jnp.float32) @ g.astype(jnp.float32))[:, None]
      y = y + ys
    return y, ecache


def _cached_moe(x_TD, ids_TK, w_TK, gate, up, down, ecache, block, n_experts):
  """The routed experts through the expert cache: all of a step's experts at once when they fit the pool
  (bitwise the computation of the all-resident path), else token by token."""
  from model import expert_cache as xc
  T, K = ids_TK.shape
  S = ecache.pools[ecache.pool_of_block[block]].n_slots
  if T * K <= S:
    slots, ecache = xc.ensure(ecache, block, ids_TK.reshape(-1), gate, up, down, n_experts)
    g, u, d = xc.pool_tensors(ecache, block, gate, up, down)
    return moe_ops.moe(x_TD, slots.reshape(T, K), w_TK, g, u, d), ecache

  def tok(t, carry):
    y, ec = carry
    slots, ec = xc.ensure(ec, block, ids_TK[t], gate, up, down, n_experts)
    g, u, d = xc.pool_tensors(ec, block, gate, up, down)
    xt = jax.lax.dynamic_slice_in_dim(x_TD, t, 1)
    yt = moe_ops.moe(xt, slots[None], jax.lax.dynamic_slice_in_dim(w_TK, t, 1), g, u, d)
    return jax.lax.dynamic_update_slice_in_dim(y, yt, t, 0), ec

  y0 = jnp.zeros(x_TD.shape, jnp.float32)
  return jax.lax.fori_loop(0, T, tok, (y0, ecache))


class Block(nn.Module):
  """Pre-norm decoder block: h = x + attn(norm(x)); out = h + ffn(norm(h))."""
  cfg: ModelConfig
  index: int               # block index in the file (decides dense vs MoE)
  ring_layer: int
  rope_offset: int = 0

  @nn.compact
  def __call__(self, x_TD, pos_T, ring, attn_block, ecache=None, host=None):
    c = self.cfg
    glue = glue_impl(self.variables.get("params", {}).get("attn", {}))
    h = add_rms_norm(x_TD, _param(self, "attn_norm", _ones, (c.d_model,)), c.rms_eps, impl=glue)
    a, ring, host = Attention(c, self.ring_layer, self.rope_offset, name="attn")(h, pos_T, ring, attn_block, host)
    x, h = add_rms_norm(x_TD, _param(self, "ffn_norm", _ones, (c.d_model,)), c.rms_eps, res_TD=a, impl=glue)
    if c.is_moe_layer(self.index):
      y, ecache = MoE(c, self.index, glue, name="ffn")(h, ecache)
    else:
      y = DenseMLP(c, name="ffn")(h)
    return x + y, ring, ecache, host


def _embed(table, tokens_T):
  if isinstance(table, QTensor):
    return table[tokens_T].dense(jnp.float32)
  return jnp.asarray(table)[tokens_T].astype(jnp.float32)


class Decoder(nn.Module):
  """Trunk: embedding, blocks, output norm and head.

  Returns (logits [T, V] (or [1, V] with last_only), hidden [T, D], ring, expert cache, host tier); the caches
  come back updated (None stays None). `hidden` is the final hidden state after output_norm, which is what the
  NextN block consumes.
  """
  cfg: ModelConfig

  @nn.compact
  def __call__(self, tokens_T, pos_T, ring: KVRing | None = None, attn_block: int = 256, last_only: bool = False,
               ecache=None, host=None):
    c = self.cfg
    embed = _param(self, "token_embd", _init, (c.vocab_size, c.d_model))
    x = _embed(embed, tokens_T)
    for i in range(c.n_layers):
      x, ring, ecache, host = Block(c, i, i, name=f"blk_{i}")(x, pos_T, ring, attn_block, ecache, host)
    head = embed if c.tied_embeddings else _param(self, "output", _init, (c.vocab_size, c.d_model))
    hidden = add_rms_norm(x, _param(self, "output_norm", _ones, (c.d_model,)), c.rms_eps, impl=glue_impl(head))
    logits = linear(hidden[-1:] if last_only else hidden, head)
    return logits, hidden, ring, ecache, host


class MTPBlock(nn.Module):
  """NextN block j: predicts token t+2 from the target's hidden state at t and the embedding of token t+1.

  x = eh_proj(concat(enorm(emb(tok)), hnorm(h)))   (embedding first, as llama.cpp's glm4moe MTP graph),
  then a full decoder block over the drafter's own ring (entry j in slot j mod W, RoPE at absolute position
  j + 1, since entry j predicts from position j), then
  shared_head_norm and the head (its own shared_head_head, else the trunk's output).
  `main_params` supplies token_embd / output when the block has none of its own.
  """
  cfg: ModelConfig
  j: int = 0

  @nn.compact
  def __call__(self, hidden_TD, tokens_T, pos_T, ring: KVRing | None, embed, head, attn_block: int = 256,
               ecache=None):
    c = self.cfg
    D = c.d_model
    emb_tbl = self.get_variable("params", "embed_tokens") if self.has_variable("params", "embed_tokens") else embed
    e = rms_norm(_embed(emb_tbl, tokens_T), _param(self, "enorm", _ones, (D,)), c.rms_eps)
    hh = rms_norm(hidden_TD, _param(self, "hnorm", _ones, (D,)), c.rms_eps)
    x = linear(jnp.concatenate([e, hh], axis=-1), _param(self, "eh_proj", _init, (D, 2 * D)))
    x, ring, ecache, _ = Block(c, c.n_layers + self.j, self.j, 1, name="blk")(x, pos_T, ring, attn_block, ecache)
    h = rms_norm(x, _param(self, "shared_head_norm", _ones, (D,)), c.rms_eps)
    if self.has_variable("params", "shared_head_head"):
      head = self.get_variable("params", "shared_head_head")
    return linear(h, head), h, ring, ecache
