"""The decoder as Flax Linen modules: attention, block, NextN (MTP) block, decoder (the FFNs, dense and MoE, are
model/ffn.py's).

Applied functionally, `Decoder(cfg, opts).apply({"params": params}, tokens, pos, ring)`; no mutable collections:
the state goes in as an argument and comes back updated. A block takes its own layer's state and returns it,
`Block(...)(x_TD, pos_T, cache, experts) -> (cache, experts, x_TD)`, where `cache` is its layer's `KVLayer` (the
ring's slots and, with a host tier, the tier's rows) and `experts` the expert cache the MoE blocks share (None:
every expert resident). Weights are dense arrays (training, `init`) or packed `QTensor`s read from GGUF
(inference); every matmul goes through ops.layers.linear / ops.moe.moe, which accept both.

Parameter tree (GGUF names in brackets, see model/gguf_io.py):
  token_embd [token_embd], output_norm [output_norm], output [output, absent when tied],
  blk_i/{attn_norm, ffn_norm [ffn_norm | post_attention_norm],
         attn/{wq, wk, wv, wo, bq, bk, bv, q_norm, k_norm},
         ffn/{router [ffn_gate_inp], router_bias [exp_probs_b], gate_exps, up_exps, down_exps,
              gate_shexp, up_shexp, down_shexp, shexp_gate [ffn_gate_inp_shexp]}   (MoE blocks)
         ffn/{gate, up, down}                                                        (dense blocks)}
  mtp_j/{enorm, hnorm, eh_proj, embed_tokens?, shared_head_norm, shared_head_head?, blk/...}  (NextN)
After model.api.fuse_qkv (load_model applies it): wq/wk/wv -> wqkv, gate_shexp/up_shexp -> gateup_shexp,
gate/up -> gateup, a DeltaNet layer's input projections -> win, where the parts share a type.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import linen as nn

from model.common import _init, _ones, _op, _param, _zeros, fuses, kernel_mode, x8_kw
from model.deltanet import GatedDeltaNet
from model.ffn import DenseMLP, MoE
from model.config import ModelConfig
from model.host_tier import tier_block, tier_span
from model.kv_ring import KVLayer
from model.mesh import head_parallel, heads_split
from model.options import DEFAULT, Options
from ops import attention as attn_ops
from ops import qmatmul as qmatmul_ops
from ops import moe as moe_ops
from ops import norm_router_pallas, rope_attention_pallas, rope_write_pallas
from ops import rmsnorm_pallas
from ops.rmsnorm_pallas import add_rms_norm
from ops.layers import linear, rms_norm, rope_neox
from ops.qtensor import QTensor
from ops.tuning import pick


def _rope(x_THDh, pos_T, c: ModelConfig):
  """RoPE in the model's mode: NEOX over the first rope_dim dims, or llama.cpp's IMROPE on text positions (qwen35moe):
  the same NEOX pairs, with the pairs ModelConfig.rope_text_pairs leaves out not rotated."""
  if c.rope_mode == "neox":
    return rope_neox(x_THDh, pos_T, c.rope_dim, c.rope_theta)
  return rope_neox(x_THDh, pos_T, c.rope_dim, c.rope_theta, pairs=c.rope_text_pairs)


def _causal_attention(q_THDh, k_THkvDh, v_THkvDh, scale):
  """Plain causal attention over T tokens (training / no cache)."""
  T, H, Dh = q_THDh.shape
  Hkv = k_THkvDh.shape[1]
  q = q_THDh.reshape(T, Hkv, H // Hkv, Dh) * scale
  s = jnp.einsum("tkgd,skd->tkgs", q, k_THkvDh)
  mask = jnp.tril(jnp.ones((T, T), bool))
  s = jnp.where(mask[:, None, None, :], s, -1e30)
  p = jax.nn.softmax(s, axis=-1)
  return jnp.einsum("tkgs,skd->tkgd", p, v_THkvDh).reshape(T, H, Dh)


class Attention(nn.Module):
  """GQA attention over its layer's `KVLayer` (None: plain causal attention over the pass, for training)."""
  cfg: ModelConfig
  opts: Options = DEFAULT
  rope_offset: int = 0     # RoPE position = ring position + offset (the NextN ring's entry j sits at position j+1)

  @nn.compact
  def __call__(self, x_TD, pos_T, cache: KVLayer | None, attn_block: int, x8=None):
    c = self.cfg
    D, H, Hkv, Dh = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim
    wo = _param(self, "wo", _init, (D, H * Dh))
    T = x_TD.shape[0]
    split = cache is not None and cache.tier is None and heads_split(self.opts.mesh, Hkv)
    glue = _rope_write_impl(self, c) if cache is not None and not split else "ref"
    if glue != "ref":                                 # q/k norm, RoPE and the ring write in one kernel
      qkv = self._fused_qkv(x_TD, x8)
      qn = _param(self, "q_norm", _ones, (Dh,)) if c.qk_norm else None
      kn = _param(self, "k_norm", _ones, (Dh,)) if c.qk_norm else None
      kw = dict(n_heads=H, n_kv_heads=Hkv, head_dim=Dh, rope_dim=c.rope_dim, theta=c.rope_theta,
                offset=self.rope_offset, eps=c.rms_eps)
      if self._folds_rope(T, cache, attn_block):      # ... inside the attention kernel (Tunings.fuse "rope")
        return self._rope_attend(x_TD, qkv, qn, kn, pos_T, cache, attn_block, wo, glue, kw)
      q, arrays = rope_write_pallas.rope_write(qkv, qn, kn, pos_T, cache.arrays, impl=glue,
                                               tuning=pick(self.opts.tunings, "rope_write"), **kw)
      cache = cache.with_arrays(arrays)
      return cache, self._attend(x_TD, q, pos_T, cache, attn_block, wo)
    if self.has_variable("params", "wqkv"):          # fused at load (model.api.fuse_qkv): one matmul, one launch
      q, k, v = jnp.split(self._fused_qkv(x_TD, x8), [H * Dh, (H + Hkv) * Dh], axis=-1)
    else:
      wq = _param(self, "wq", _init, (H * Dh, D))
      wk = _param(self, "wk", _init, (Hkv * Dh, D))
      wv = _param(self, "wv", _init, (Hkv * Dh, D))
      bq = bk = bv = None
      if c.qkv_bias:
        bq, bk, bv = (_param(self, n, _zeros, (s,)) for n, s in (("bq", H * Dh), ("bk", Hkv * Dh), ("bv", Hkv * Dh)))
      q, k, v = self._linear(x_TD, wq, bq), self._linear(x_TD, wk, bk), self._linear(x_TD, wv, bv)
    q, k, v = q.reshape(T, H, Dh), k.reshape(T, Hkv, Dh), v.reshape(T, Hkv, Dh)
    if c.qk_norm:
      q = self._head_norm(q, _param(self, "q_norm", _ones, (Dh,)), cache)
      k = self._head_norm(k, _param(self, "k_norm", _ones, (Dh,)), cache)
    q = _rope(q, pos_T + self.rope_offset, c)
    k = _rope(k, pos_T + self.rope_offset, c)
    if cache is None:
      o = _op(self.opts, "causal_attention", _causal_attention)(q, k, v.astype(jnp.float32), 1.0 / float(Dh) ** 0.5)
      return None, self._out(x_TD, o.reshape(T, H * Dh), wo)
    if split:                                         # head parallel over the mesh's tp axis (model.mesh)
      def write_attend(q, k, v, arrays, pos, length):
        layer = cache.replace(length=length).with_arrays(arrays).write(pos, k, v)
        return layer.arrays, self._ring_attention(q, pos, layer, attn_block)
      arrays, o = head_parallel(write_attend, self.opts.mesh)(q, k, v, cache.arrays, pos_T, cache.length)
      return cache.with_arrays(arrays), self._out(x_TD, o.reshape(T, H * Dh), wo)
    cache = cache.write(pos_T, k, v)
    return cache, self._attend(x_TD, q, pos_T, cache, attn_block, wo)

  def _linear(self, x, w, b=None):
    return _op(self.opts, "linear", linear)(x, w, b)

  def _head_norm(self, x_THDh, w_Dh, cache):
    """The per-head q/k RMSNorm where the fused rope + write kernel does not take the shape: in decode and verify
    passes on the RMSNorm kernel (one program per token and head, batch-invariant) when the block's weights run
    the kernels, else the jnp op."""
    T, H, Dh = x_THDh.shape
    impl = glue_impl(self.variables.get("params", {}), self.opts) if cache is not None else "ref"
    if impl != "ref" and T <= rmsnorm_pallas.MAX_T and Dh & (Dh - 1) == 0:
      return rmsnorm_pallas.rms_norm_pallas(x_THDh.reshape(T * H, Dh), w_Dh, self.cfg.rms_eps,
                                            interpret=impl == "interpret").reshape(T, H, Dh)
    return rms_norm(x_THDh, w_Dh, self.cfg.rms_eps)

  def _fused_qkv(self, x_TD, x8=None):
    return _op(self.opts, "linear", linear)(x_TD, self.get_variable("params", "wqkv"),
                                            self.get_variable("params", "bqkv") if self.cfg.qkv_bias else None,
                                            **x8_kw(x8))

  def _out(self, x_TD, o_TN, wo):
    """The output projection of the heads' outputs [T, H Dh], gated by sigmoid(x Wgate^T) first when the model's
    attention is gated (attn_output_gate: the hybrid family)."""
    if self.cfg.attn_output_gate:
      c = self.cfg
      gate = self._linear(x_TD, _param(self, "wgate", _init, (c.n_heads * c.head_dim, c.d_model)))
      o_TN = o_TN * jax.nn.sigmoid(gate)
    return self._linear(o_TN, wo)

  def _ring_attention(self, q_THDh, pos_T, cache: KVLayer, attn_block):
    """Attention of q [T, Hq, Dh] over the layer's ring alone (its new rows written): [T, Hq, Dh] float32."""
    T, _, Dh = q_THDh.shape
    length, _ = self._ring_window(pos_T, cache, T)                 # no tier here: written + T + scratch
    return attn_ops.ring_attention(q_THDh, *cache.arrays, pos_T, length, block=attn_block,
                                   scale=1.0 / float(Dh) ** 0.5, tunings=self.opts.tunings)

  def _folds_rope(self, T: int, cache: KVLayer, attn_block: int) -> bool:
    """Whether this pass runs RoPE and the ring write inside the attention kernel: Tunings.fuse "rope", a decode
    or verify pass whose attention runs the kernel (ops.attention.default_impl), and shapes the folded kernel
    takes (for decode passes alike at every T <= MAX_T: a step and a verify pass of one request both fold or both
    do not, as their rows agree bitwise only within one kernel)."""
    c, tun = self.cfg, self.opts.tunings
    return (fuses(self.opts, "rope") and attn_ops.default_impl(T, tun) != "ref"
            and rope_attention_pallas.supported(T, c.n_heads, c.n_kv_heads, c.head_dim, c.rope_dim, attn_block,
                                                cache.k) is None)

  def _rope_attend(self, x_TD, qkv, qn, kn, pos_T, cache: KVLayer, attn_block, wo, impl: str, kw: dict):
    """`_attend` with the ring's part from the folded kernel (ops.rope_attention_pallas), which also writes the
    pass's rows: (the layer's cache, the block's output)."""
    T, Dh = x_TD.shape[0], self.cfg.head_dim
    length, lo = self._ring_window(pos_T, cache, T)
    tier = cache.tier is not None
    res = rope_attention_pallas.rope_attention(
        qkv, qn, kn, pos_T, cache.arrays, length, lo, impl=impl, block=attn_block, scale=1.0 / float(Dh) ** 0.5,
        with_lse=tier, with_q=tier, tuning=pick(self.opts.tunings, "attention"), **kw)
    cache = cache.with_arrays(res[1])
    q = res[2].reshape(T, self.cfg.n_heads, Dh) if tier else None
    return cache, self._attend(x_TD, q, pos_T, cache, attn_block, wo, ring=res[0])

  @staticmethod
  def _ring_window(pos_T, cache: KVLayer, T: int):
    """(length, lo_T) of a decode or verify pass's attention over the ring: beside a host tier row t sees the ring
    from lo_t = pos_t + 1 - window and the tier below it, the split of the step that decodes pos_t alone, so a
    verify pass's rows are that step's bitwise (DESIGN invariant 3; lo_t is at least written - R: older slots are
    overwritten); without a tier every row sees the whole ring (lo None, length = written + scratch)."""
    if cache.tier is None:
      # "length" = written + scratch: keys older than (written - window) are masked (see KVRing.scratch)
      return cache.length + T + cache.scratch, None
    return cache.length + T, jnp.maximum(pos_T + 1 - cache.window, cache.length + T - cache.capacity)

  def _attend(self, x_TD, q_THDh, pos_T, cache: KVLayer, attn_block, wo, ring=None):
    """Attention of q [T, H, Dh] over the layer's ring (its new rows already written) and host tier, then the
    output projection. ring: the ring's part when computed already (the folded kernel's out, or (out, lse)
    beside a tier)."""
    T, H, Dh = q_THDh.shape if q_THDh is not None else (x_TD.shape[0], self.cfg.n_heads, self.cfg.head_dim)
    scale = 1.0 / float(Dh) ** 0.5
    tun = self.opts.tunings
    if cache.tier is None:
      o = ring if ring is not None else self._ring_attention(q_THDh, pos_T, cache, attn_block)
    else:
      # The ring's part (on the decode kernel where it takes the call, as without a tier) and the tier's, each
      # with its log-sum-exp. Decode and verify (T <= MAX_T): each row's own window (`_ring_window`). Prefill
      # chunks: every row sees the ring from written - window, the tier below.
      if T <= attn_ops.attention_pallas.MAX_T:
        length, lo = self._ring_window(pos_T, cache, T)
        o1, lse1 = ring if ring is not None else attn_ops.ring_attention(
            q_THDh, *cache.arrays, pos_T, length, block=attn_block, scale=scale, with_lse=True, lo_T=lo, tunings=tun)
        q_hi = lo - 1
      else:
        o1, lse1 = attn_ops.ring_attention(q_THDh, *cache.arrays, pos_T, cache.length + T + cache.scratch,
                                           block=attn_block, scale=scale, with_lse=True, tunings=tun)
        q_hi = jnp.minimum(pos_T, cache.length + T - cache.window - 1)
      tb = tier_block(cache.window, attn_block, tun and tun.tier_block)
      o2, lse2 = attn_ops.tier_attention(q_THDh, *cache.tier, q_hi, tier_block=tb, block=attn_block, scale=scale,
                                         tier_span=tier_span(tb, tun and tun.tier_span), tunings=tun)
      o = attn_ops.merge_lse(o1.reshape(T, H, Dh), lse1, o2.reshape(T, H, Dh), lse2)
    return self._out(x_TD, o.reshape(T, H * Dh), wo)


def glue_impl(tree, opts: Options = DEFAULT) -> str:
  """"pallas" | "interpret" when opts.glue and the first QTensor in `tree` runs that kernel mode, else "ref"."""
  return kernel_mode(tree) if opts.glue else "ref"


def _rope_write_impl(m: nn.Module, c: ModelConfig) -> str:
  """The fused rope + ring-write kernel's impl for this block: the fused q/k/v weight's kernel mode ("pallas" |
  "interpret") where the shapes allow and opts.glue, else "ref" (the separate jnp ops)."""
  if not m.has_variable("params", "wqkv"):
    return "ref"
  mode = glue_impl(m.get_variable("params", "wqkv"), m.opts)
  if (mode != "ref" and c.rope_mode == "neox"
      and rope_write_pallas.supported(c.n_heads, c.n_kv_heads, c.head_dim, c.rope_dim) is None):
    return mode
  return "ref"


def _moe_wants_x8(block: nn.Module, T: int) -> bool:
  """Whether this block's routed experts read their input rounded to 8 bits (ops.moe.wants_x8): then the norm
  before them makes the rounding. Only the model's own MoE on one device (a stand-in or expert parallelism
  rounds for itself)."""
  o = block.opts
  if o.mesh is not None or (o.layer_ops is not None and o.layer_ops.moe is not None):
    return False
  gate = block.variables.get("params", {}).get("ffn", {}).get("gate_exps")
  return moe_ops.wants_x8(T, gate, o.tunings)


def _proj_wants_x8(block: nn.Module, T: int, recurrent: bool) -> bool:
  """Whether the mixer's input projection (attention's fused wqkv, a DeltaNet layer's fused win) reads its input
  rounded to 8 bits (ops.qmatmul.wants_x8): then the norm before it makes the rounding. Only the model's own
  linear on one device (tensor parallelism splits the projection's rows: it rounds for itself there)."""
  o = block.opts
  if o.mesh is not None or (o.layer_ops is not None and o.layer_ops.linear is not None):
    return False
  mixer = block.variables.get("params", {}).get("gdn" if recurrent else "attn", {})
  return qmatmul_ops.wants_x8(T, mixer.get("win" if recurrent else "wqkv"), o.tunings)


def norm_routes(block: nn.Module, T: int, glue: str) -> bool:
  """Whether this MoE block's FFN norm also makes the router's logits and a shared expert's gate logit
  (Tunings.fuse "router", ops.norm_router_pallas): where the route kernels run (glue on, a float router and gate,
  the kernels' shapes), the model's own MoE on one device."""
  o, c = block.opts, block.cfg
  if glue == "ref" or not fuses(o, "router") or o.mesh is not None or o.layer_ops:
    return False
  ffn = block.variables.get("params", {}).get("ffn", {})
  router, gate = ffn.get("router"), ffn.get("shexp_gate")
  return (router is not None and not isinstance(router, QTensor) and c.top_k <= c.n_experts
          and (not c.shared_expert_gate or (gate is not None and not isinstance(gate, QTensor)))
          and norm_router_pallas.supported(T, c.n_experts, c.d_model))


class Pending(NamedTuple):
  """The residual stream with a block's FFN output not yet added: x_TD + ops.rmsnorm_pallas.residual_sum(pieces).
  Under Tunings.fuse "residual" a decode or verify pass hands it from block to block and the next norm kernel
  (the next block's attn_norm, or output_norm) makes the sum in its own program: one XLA launch fewer a layer."""
  x_TD: jax.Array
  pieces: tuple


def defers_residual(opts: Options, T: int, glue: str) -> bool:
  """Whether a Decoder over T tokens hands the residual stream on as `Pending` (Tunings.fuse "residual", T within
  the norm kernel's rows, the norms running the kernel: `glue` not "ref")."""
  return fuses(opts, "residual") and T <= rmsnorm_pallas.MAX_T and glue != "ref"


class Block(nn.Module):
  """Pre-norm decoder block: h = x + attn(norm(x)); out = h + ffn(norm(h)).

  Takes its layer's state and returns it: (x_TD, pos_T, cache, experts) -> (cache, experts, x_TD). The mixer is
  attention over the layer's `KVLayer`, or in a hybrid model's recurrent layers the Gated DeltaNet over its
  `RecurrentLayer` (with `keep`, the state after each token too). Where the mixer's input projection or the
  routed experts' gate/up read 8-bit x (a tile's x8, ops/dot8), the norm before them rounds its output in the same
  kernel and hands the rounding on (`x8=`). x_TD may come as `Pending` (the block before deferred its FFN's sum:
  the attn_norm adds it); with `defer` this block returns its own output as `Pending` too."""
  cfg: ModelConfig
  index: int               # block index in the file (decides dense vs MoE, attention vs DeltaNet)
  opts: Options = DEFAULT
  rope_offset: int = 0
  attn_block: int = 256
  keep: bool = False
  defer: bool = False

  @nn.compact
  def __call__(self, x_TD, pos_T, cache, experts=None):
    c, o = self.cfg, self.opts
    recurrent = c.is_recurrent(self.index)
    glue = glue_impl(self.variables.get("params", {}).get("gdn" if recurrent else "attn", {}), o)
    nt = pick(o.tunings, "rmsnorm")
    pending = isinstance(x_TD, Pending)
    x_TD, res = (x_TD.x_TD, x_TD.pieces) if pending else (x_TD, None)
    want8 = glue != "ref" and _proj_wants_x8(self, x_TD.shape[0], recurrent)
    out = add_rms_norm(x_TD, _param(self, "attn_norm", _ones, (c.d_model,)), c.rms_eps, res_TD=res, impl=glue,
                       tuning=nt, x8=want8)
    out = out if isinstance(out, tuple) else (out,)                # ([the stream's sum], norm, [its rounding])
    if pending:
      x_TD, *out = out
    h, h8 = out[0], (out[1] if want8 else None)
    if recurrent:
      cache, a = GatedDeltaNet(c, o, name="gdn")(h, cache, self.keep, x8=h8)
    else:
      cache, a = Attention(c, o, self.rope_offset, name="attn")(h, pos_T, cache, self.attn_block, x8=h8)
    moe_layer = c.is_moe_layer(self.index)
    want8 = moe_layer and glue != "ref" and _moe_wants_x8(self, x_TD.shape[0])
    ffn_norm = _param(self, "ffn_norm", _ones, (c.d_model,))
    logits = gl = None
    if moe_layer and norm_routes(self, x_TD.shape[0], glue):
      ffn = self.variables["params"]["ffn"]
      extra = ffn["shexp_gate"][None] if c.shared_expert_gate else None
      x, h, logits, *rest = norm_router_pallas.norm_logits_pallas(
          x_TD, a, ffn_norm, ffn["router"], c.rms_eps, x8=want8, interpret=glue == "interpret",
          tuning=pick(o.tunings, "router"), extra_ND=extra)
      h8, gl = (rest[:1] if want8 else []), (rest[-1][:, 0] if extra is not None else None)
    else:
      x, h, *h8 = add_rms_norm(x_TD, ffn_norm, c.rms_eps, res_TD=a, impl=glue, tuning=nt, x8=want8)
    if moe_layer:
      y, experts = MoE(c, o, self.index, glue, name="ffn")(h, experts, x8=h8[0] if h8 else None, parts=self.defer,
                                                          logits=logits, gate_logit=gl)
    else:
      y = DenseMLP(c, o, name="ffn")(h)
      y = (y,) if self.defer else y
    return cache, experts, Pending(x, y) if self.defer else x + y


def _embed(table, tokens_T):
  if isinstance(table, QTensor):
    return table[tokens_T].dense(jnp.float32)
  return jnp.asarray(table)[tokens_T].astype(jnp.float32)


class Decoder(nn.Module):
  """Trunk: embedding, blocks, output norm and head.

  Returns (logits [T, V] (or [1, V] with last_only), hidden [T, D], ring, experts, rec); the ring, the expert
  cache and the recurrent state come back updated (None stays None). Attention layer i uses ring layer
  cfg.ring_layer(i) (with `tier`, a HostTier, also the tier's rows of that layer), DeltaNet layer i recurrent layer
  cfg.gdn_layer(i). With `keep` the DeltaNet layers also return their state after each token
  (`RecurrentLayer.conv_T` / `delta_T`): `rec` is then the tuple of those layers. `hidden` is the final hidden
  state after output_norm, which is what the NextN block consumes.
  """
  cfg: ModelConfig
  opts: Options = DEFAULT
  keep: bool = False

  @nn.compact
  def __call__(self, tokens_T, pos_T, ring=None, attn_block: int = 256, last_only: bool = False, experts=None,
               tier=None, rec=None):
    c = self.cfg
    embed = _param(self, "token_embd", _init, (c.vocab_size, c.d_model))
    x = _embed(embed, tokens_T)
    kept = []
    defer = defers_residual(self.opts, x.shape[0], glue_impl(self.variables.get("params", {}), self.opts))
    for i in range(c.n_layers):
      blk = Block(c, i, self.opts, attn_block=attn_block, keep=self.keep, defer=defer, name=f"blk_{i}")
      if c.is_recurrent(i):
        j = c.gdn_layer(i)
        cache, experts, x = blk(x, pos_T, None if rec is None else rec.cache(j), experts)
        kept.append(cache)
        if rec is not None:
          rec = rec.with_cache(j, cache)
      else:
        j = c.ring_layer(i)
        cache, experts, x = blk(x, pos_T, None if ring is None else ring.cache(j, tier), experts)
        if ring is not None:
          ring = ring.with_cache(j, cache)
    head = embed if c.tied_embeddings else _param(self, "output", _init, (c.vocab_size, c.d_model))
    x, res = (x.x_TD, x.pieces) if defer else (x, None)
    hidden = add_rms_norm(x, _param(self, "output_norm", _ones, (c.d_model,)), c.rms_eps, res_TD=res,
                          impl=glue_impl(head, self.opts), tuning=pick(self.opts.tunings, "rmsnorm"))
    hidden = hidden[1] if defer else hidden                        # (the stream's sum, the norm)
    logits = _op(self.opts, "linear", linear)(hidden[-1:] if last_only else hidden, head)
    return logits, hidden, ring, experts, (tuple(kept) if self.keep and rec is not None else rec)


class MTPBlock(nn.Module):
  """NextN block j: predicts token t+2 from the target's hidden state at t and the embedding of token t+1.

  x = eh_proj(concat(enorm(emb(tok)), hnorm(h)))   (embedding first, as llama.cpp's glm4moe MTP graph),
  then a full decoder block over the drafter's own ring (entry j in slot j mod W, RoPE at absolute position
  j + 1, since entry j predicts from position j), then
  shared_head_norm and the head (its own shared_head_head, else the trunk's output).
  `embed` / `head` are the trunk's token_embd / output, used when the block has none of its own.
  """
  cfg: ModelConfig
  j: int = 0
  opts: Options = DEFAULT

  @nn.compact
  def __call__(self, hidden_TD, tokens_T, pos_T, ring, embed, head, attn_block: int = 256, experts=None):
    c = self.cfg
    D = c.d_model
    emb_tbl = self.get_variable("params", "embed_tokens") if self.has_variable("params", "embed_tokens") else embed
    e = rms_norm(_embed(emb_tbl, tokens_T), _param(self, "enorm", _ones, (D,)), c.rms_eps)
    hh = rms_norm(hidden_TD, _param(self, "hnorm", _ones, (D,)), c.rms_eps)
    lin = _op(self.opts, "linear", linear)
    x = lin(jnp.concatenate([e, hh], axis=-1), _param(self, "eh_proj", _init, (D, 2 * D)))
    cache = None if ring is None else ring.cache(self.j)
    cache, experts, x = Block(c, c.n_layers + self.j, self.opts, 1, attn_block, name="blk")(x, pos_T, cache, experts)
    if ring is not None:
      ring = ring.with_cache(self.j, cache)
    h = rms_norm(x, _param(self, "shared_head_norm", _ones, (D,)), c.rms_eps)
    if self.has_variable("params", "shared_head_head"):
      head = self.get_variable("params", "shared_head_head")
    return lin(h, head), h, ring, experts
