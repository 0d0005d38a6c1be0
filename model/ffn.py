"""The FFN of a block as Flax Linen modules: the dense SwiGLU MLP and the routed experts (`MoE`: routing, the
expert cache's slots, expert parallelism under a mesh, a shared expert and its gate; under `Tunings.fuse` the
routing made inside the expert kernels and the output handed on in pieces to the next norm kernel). Used by
model.transformer's Block."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import linen as nn

from model import expert_cache as xc
from model.common import _init, _op, _param, _zeros, fuses, x8_kw
from model.config import ModelConfig
from model.mesh import expert_parallel
from model.options import DEFAULT, Options
from ops import moe as moe_ops
from ops import rmsnorm_pallas, router_pallas
from ops.layers import linear, swiglu
from ops.tuning import pick


def swiglu_mlp(m: nn.Module, x_TD, suffix: str, D: int, F: int):
  """down(silu(gate x) * up x) with module m's params gate{suffix}, up{suffix}, down{suffix}, or gate and up fused
  at load into one gateup{suffix} [2F, D] (model.api.fuse_qkv: one matmul, split after)."""
  lin = _op(m.opts, "linear", linear)
  if m.has_variable("params", "gateup" + suffix):
    h_TF2 = lin(x_TD, m.get_variable("params", "gateup" + suffix))
    g_TF, u_TF = h_TF2[..., :F], h_TF2[..., F:]
  else:
    g_TF = lin(x_TD, _param(m, "gate" + suffix, _init, (F, D)))
    u_TF = lin(x_TD, _param(m, "up" + suffix, _init, (F, D)))
  return lin(swiglu(g_TF, u_TF), _param(m, "down" + suffix, _init, (D, F)))


class DenseMLP(nn.Module):
  cfg: ModelConfig
  opts: Options = DEFAULT

  @nn.compact
  def __call__(self, x_TD):
    D, F = self.cfg.d_model, self.cfg.d_ff
    return swiglu_mlp(self, x_TD, "", D, F)


class MoE(nn.Module):
  """Routed experts (softmax top-k, or sigmoid with a selection bias) plus an optional shared expert.

  With an expert cache (model/expert_cache.py) the routed experts are read from its device slots, loading
  misses from the store (the params' expert tensors); prefill-sized steps (T * X > E) read the store directly
  (moved to the device first when it lives in pinned host memory). Under a mesh (Options.mesh) the routed experts
  run expert parallel (model.mesh.expert_parallel: each device its own experts, a psum over "ep").
  """
  cfg: ModelConfig
  opts: Options = DEFAULT
  index: int = 0           # block index (the expert cache's row)
  glue: str = "ref"        # routing kernels: "pallas" | "interpret" | "ref" (glue_impl)

  @nn.compact
  def __call__(self, x_TD, experts=None, x8=None, parts: bool = False, logits=None, gate_logit=None):
    """(y, experts): y [T, D], or with `parts` the pieces of y for the next norm kernel to add (a tuple: the routed
    experts' X weighted rows [T, X, D] where the decode kernel ran, else their sum, then the shared expert's, a
    `Gated` piece where its gate scales it). logits, gate_logit [T]: x's router logits and shared-expert gate logit,
    made by the norm before (`norm_routes`): only the top-k runs here."""
    c = self.cfg
    D, E, F = c.d_model, c.n_experts, c.d_ff_expert
    router = _param(self, "router", _init, (E, D))
    gate = _param(self, "gate_exps", _init, (E, F, D))
    up = _param(self, "up_exps", _init, (E, F, D))
    down = _param(self, "down_exps", _init, (E, D, F))
    bias = _param(self, "router_bias", _zeros, (E,)) if c.routing != "softmax" else None
    lin, moe = _op(self.opts, "linear", linear), _op(self.opts, "moe", moe_ops.moe)

    def with_shared(y):
      """The routed experts' output y with the shared expert's (if any): as pieces with `parts`, else summed."""
      pieces = (y,)
      if c.n_shared_experts or c.shared_expert_gate:
        ys = swiglu_mlp(self, x_TD, "_shexp", D, c.d_ff_shared)
        if c.shared_expert_gate:
          g = _param(self, "shexp_gate", _init, (D,))          # qwen2moe, hybrid: one gate logit per token
          if gate_logit is not None:
            gl = gate_logit
          elif self.glue != "ref" and x_TD.shape[0] <= router_pallas.MAX_T and D & (D - 1) == 0:  # batch invariant
            gl = router_pallas.logits_pallas(x_TD, g[None], interpret=self.glue == "interpret")[:, 0]
          else:
            gl = x_TD.astype(jnp.float32) @ g.astype(jnp.float32)
          if parts:                                # the next norm kernel scales it
            return pieces + (rmsnorm_pallas.Gated(ys, gl),)
          ys = ys * jax.nn.sigmoid(gl)[:, None]
        pieces += (ys,)
      return pieces if parts else functools.reduce(jnp.add, pieces)

    if self._routes_in_kernel(x_TD.shape[0], router, gate, up, down, experts):
      rt = pick(self.opts.tunings, "router")
      if logits is None:
        logits = router_pallas.logits_pallas(x_TD, router, interpret=self.glue == "interpret", tuning=rt)
      y = moe_ops.moe_routed(x_TD, logits, bias, gate, up, down, routing=c.routing, top_k=c.top_k,
                             norm_topk=c.norm_topk, routed_scale=c.routed_scale, tunings=self.opts.tunings,
                             x8=x8, parts=parts)
      return with_shared(y), experts
    ids_TX, w_TX = router_pallas.route(x_TD, router, bias, routing=c.routing, top_k=c.top_k, norm_topk=c.norm_topk,
                                       routed_scale=c.routed_scale, impl=self.glue,
                                       logits_fn=lambda x: lin(x, router), tuning=pick(self.opts.tunings, "router"),
                                       logits=logits)
    T, X = ids_TX.shape
    if self.opts.mesh is not None:                 # expert parallel: each device its share of the experts, a psum
      if experts is not None:
        raise ValueError("MoE: an expert cache under a mesh is not supported, expected every expert resident")
      y = expert_parallel(moe, self.opts.mesh, E)(x_TD, ids_TX, w_TX, gate, up, down)
    elif experts is None or T * X > E:
      # The direct path reads every expert of the block (no cache, or a step routing more (token, expert) pairs
      # than there are experts: prefill chunks, long MTP passes). A store in pinned host memory
      # (expert_cache.place_store) is moved to the device first: each such step copies the block's whole
      # routed-expert tensors host -> device (for a prefill, once per MoE block per chunk), the cost a host store
      # implies. The copy waits for the block's input (`after`), so the device holds a block's experts at a time,
      # overlapping its neighbour's at most (decode.kv_plan "streamed experts"). A no-op on the device.
      gate, up, down = (xc.to_device(t, after=x_TD) for t in (gate, up, down))
      y = moe(x_TD, ids_TX, w_TX, gate, up, down, **x8_kw(x8), **_parts_kw(parts, self.opts))
    else:
      tun = self.opts.tunings
      copies = dict(lanes=pick(tun, "miss_lanes") or 1, eager=pick(tun, "miss_eager") or 0)
      y, experts = _cached_moe(x_TD, ids_TX, w_TX, gate, up, down, experts, self.index, E, moe, x8, copies)
    return with_shared(y), experts

  def _routes_in_kernel(self, T, router, gate, up, down, experts) -> bool:
    """Tunings.fuse "topk": the decode kernels route for themselves (ops.moe.moe_routed) where the route kernel
    would run, every expert resident, the model's own moe on one device."""
    o = self.opts
    return (fuses(o, "topk") and self.glue != "ref" and experts is None
            and o.mesh is None and not o.layer_ops
            and moe_ops.routes_itself(T, router, gate, up, down, self.cfg.top_k))


def _parts_kw(parts: bool, opts: Options) -> dict:
  """ops.moe.moe's parts argument where the FFN's output goes to the next norm kernel in pieces: only the model's
  own moe is given one (a stand-in, opts.layer_ops, returns [T, D])."""
  return {"parts": True} if parts and (opts.layer_ops is None or opts.layer_ops.moe is None) else {}


def _cached_moe(x_TD, ids_TX, w_TX, gate, up, down, experts, block, n_experts, moe, x8=None, copies=None):
  """The routed experts through the expert cache: all of a step's experts at once when they fit the pool
  (bitwise the computation of the all-resident path), else token by token (each rounding its own x8). copies:
  `ensure`'s lanes and eager (Tunings.miss_lanes / miss_eager)."""
  copies = copies or {}
  T, X = ids_TX.shape
  S = experts.pools[experts.pool_of_block[block]].n_slots
  if T * X <= S:
    slots, experts = xc.ensure(experts, block, ids_TX.reshape(-1), gate, up, down, n_experts, **copies)
    g, u, d = xc.pool_tensors(experts, block, gate, up, down)
    return moe(x_TD, slots.reshape(T, X), w_TX, g, u, d, **x8_kw(x8)), experts

  def tok(t, carry):
    y, ec = carry
    slots, ec = xc.ensure(ec, block, ids_TX[t], gate, up, down, n_experts, **copies)
    g, u, d = xc.pool_tensors(ec, block, gate, up, down)
    xt = jax.lax.dynamic_slice_in_dim(x_TD, t, 1)
    yt = moe(xt, slots[None], jax.lax.dynamic_slice_in_dim(w_TX, t, 1), g, u, d)
    return jax.lax.dynamic_update_slice_in_dim(y, yt, t, 0), ec

  y0 = jnp.zeros(x_TD.shape, jnp.float32)
  return jax.lax.fori_loop(0, T, tok, (y0, experts))
