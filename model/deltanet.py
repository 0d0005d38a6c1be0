"""`GatedDeltaNet`: the linear-attention mixer of the hybrid family's recurrent layers (qwen3next, qwen35moe).

  qkv = x Wqkv^T [T, Cc] -> causal depthwise conv over the layer's window (kernel Kc) -> SiLU -> q, k
  (L2-normalised per head), v; z = x Wz^T; beta = sigmoid(x Wbeta^T); g = softplus(x Walpha^T + dt_bias) * a
  (a = -exp(A_log), as the file stores it) -> the gated delta rule over the layer's [Hv, Dk, Dv] state ->
  o [T, Hv, Dv] -> RMSNorm per value head (weight `norm`) times SiLU(z) -> Wo.

The maths and their llama.cpp sources: ops/gated_delta.py. A pass of T <= ops.gated_delta_step_pallas.MAX_T tokens
(decode, verify) runs the conv fused with the one-token update, token by token, so a verify pass reproduces the
steps; longer passes (prefill) the conv over the chunk and the chunked delta rule. Both run the Pallas kernels
when the layer's weights run them ("pallas" | "interpret"), else the jnp references; in decode and verify passes
the gated output norm runs the RMSNorm kernel too (one program per token and head: batch-invariant). The block takes its layer's
`RecurrentLayer` (None: a zero state, training) and returns it; with `keep` the per-token states too. Under a mesh
whose tp divides the heads (model.mesh.delta_heads) the recurrence runs head parallel (model.mesh.delta_parallel),
each device its value heads' rows of the state; the projections, the conv window and the norm stay replicated.

Params (model/gguf_io.py tensor_map): wqkv [Cc, D], wz [Hv Dv, D], wbeta / walpha [Hv, D], conv [Cc, Kc],
dt_bias [Hv], a [Hv], norm [Dv], wo [D, Hv Dv]; after model.api.fuse_qkv (at load, where the four input
projections share a type) `win` [Cc + Hv Dv + 2 Hv, D] in their place: one matmul, split after.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import linen as nn

from model.common import _init, _ones, _op, _param, _zeros, fuses, kernel_mode, x8_kw
from model.config import ModelConfig
from model.mesh import delta_heads, delta_parallel
from model.options import DEFAULT, Options
from model.recurrent import RecurrentLayer
from ops import gated_delta as gd
from ops.gated_delta_step_pallas import MAX_T as STEP_MAX_T
from ops.layers import linear, rms_norm
from ops.rmsnorm_pallas import rms_norm_pallas

CHUNK = 64          # tokens per intra-chunk block of the prefill form


def _a_init(key, shape):
  """ssm_a holds -exp(A_log): a negative decay rate per value head (random init: -exp(U(0, 1)))."""
  return -jnp.exp(jax.random.uniform(key, shape))


class GatedDeltaNet(nn.Module):
  cfg: ModelConfig
  opts: Options = DEFAULT

  @nn.compact
  def __call__(self, x_TD, cache: RecurrentLayer | None, keep: bool = False, x8=None):
    c = self.cfg
    D, Hk, Hv, Dk, Dv, Cc, Kc = c.d_model, c.Hk, c.Hv, c.Dk, c.Dv, c.Cc, c.Kc
    T = x_TD.shape[0]
    lin = _op(self.opts, "linear", linear)
    if self.has_variable("params", "win"):          # fused at load (model.api.fuse_qkv): one matmul, one launch
      wqkv = self.get_variable("params", "win")
      qkv_TCc, z, b_THv, a_THv = jnp.split(lin(x_TD, wqkv, **x8_kw(x8)), [Cc, Cc + Hv * Dv, Cc + Hv * Dv + Hv],
                                           axis=-1)
    else:
      wqkv = _param(self, "wqkv", _init, (Cc, D))
      qkv_TCc = lin(x_TD, wqkv)
      z = lin(x_TD, _param(self, "wz", _init, (Hv * Dv, D)))
      b_THv = lin(x_TD, _param(self, "wbeta", _init, (Hv, D)))
      a_THv = lin(x_TD, _param(self, "walpha", _init, (Hv, D)))
    z_THvDv = z.reshape(T, Hv, Dv)
    conv_CcKc = _param(self, "conv", _init, (Cc, Kc))
    g_THv, beta_THv = gd.gate_and_beta(a_THv, b_THv, _param(self, "dt_bias", _zeros, (Hv,)).astype(jnp.float32),
                                       _param(self, "a", _a_init, (Hv,)).astype(jnp.float32))
    if cache is None:
      cache = RecurrentLayer(jnp.zeros((Cc, Kc - 1), jnp.float32), jnp.zeros((Hv, Dk, Dv), jnp.float32))
    head_map = "tile" if c.gdn_heads_tiled else "interleave"
    impl = kernel_mode(wqkv)
    step = functools.partial(gd.gated_delta_step, eps=c.rms_eps, head_map=head_map, keep_states=keep, impl=impl)
    chunked = functools.partial(gd.gated_delta_chunked, chunk=CHUNK, head_map=head_map, impl=impl)
    mesh = self.opts.mesh
    if delta_heads(mesh, Hk, Hv, c.gdn_heads_tiled):       # head parallel over tp: each device its value heads
      par_step, par_chunked = delta_parallel(mesh, Hk, Hv, Dk, Dv, c.gdn_heads_tiled)
      step, chunked = functools.partial(par_step(step), keep=keep), par_chunked(chunked)
    if T <= STEP_MAX_T:
      out = step(qkv_TCc, cache.conv, conv_CcKc, g_THv, beta_THv, cache.delta)
      o_THvDv, conv, delta = out[:3]
      cache = RecurrentLayer(conv, delta, *(out[3:] if keep else ()))
    else:
      if keep:
        raise ValueError(f"GatedDeltaNet: per-token states are kept for passes of at most {STEP_MAX_T} tokens, got {T}")
      y_TCc, conv = gd.causal_conv1d(qkv_TCc, cache.conv, conv_CcKc)
      q, k, v = gd.split_qkv(y_TCc, Hk, Dk, Hv, Dv, c.rms_eps)
      o_THvDv, delta = chunked(q, k, v, g_THv, beta_THv, cache.delta)
      cache = RecurrentLayer(conv, delta)
    norm = _param(self, "norm", _ones, (Dv,))
    if impl != "ref" and self.opts.glue and T <= STEP_MAX_T and Dv & (Dv - 1) == 0:
      # decode and verify: one program per (token, head) row, the same sums whatever T is (batch invariance)
      # (Tunings.fuse "gated_norm": the silu(z) gate in the same program)
      z = z_THvDv.reshape(T * Hv, Dv) if fuses(self.opts, "gated_norm") else None
      o = rms_norm_pallas(o_THvDv.reshape(T * Hv, Dv), norm, c.rms_eps, interpret=impl == "interpret", gate_TD=z)
      o = o.reshape(T, Hv, Dv)
      if z is None:
        o = o * gd.silu(z_THvDv.astype(jnp.float32))
    else:
      o = rms_norm(o_THvDv, norm, c.rms_eps) * gd.silu(z_THvDv.astype(jnp.float32))
    return cache, lin(o.reshape(T, Hv * Dv), _param(self, "wo", _init, (D, Hv * Dv)))
