"""Routed-expert FFN: for T tokens and their top-k experts, sum_k w_k * down_k(silu(gate_k x) * up_k x).

`moe_ref` is the reference over packed expert tensors (QTensor [E, F, D] / [E, D, F], or dense arrays):
  - few tokens (T*k <= E): gather only the routed experts' packed slabs, dequantize them, dot;
  - many tokens (prefill): visit each expert once, run it on every token, weight by its combine weight
    (zero for tokens that did not pick it), so no token x expert slab is ever materialised.
Expert ids arrive as int32 inputs. `moe` dispatches on the experts' `kernel` field: "pallas" / "interpret" run
the fused Pallas kernels of ops/moe_pallas.py (gate+up+SiLU, then down with the router-weighted sum) when they
apply (T <= 16 tokens, kernel types, gate and up of one type), the reference otherwise.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ops.qtensor import QTensor, as_dense


def _take(w, ids):
  return w[ids] if isinstance(w, QTensor) else jnp.asarray(w)[ids]


def _moe_gather(x_TD, ids_TK, w_TK, gate, up, down):
  g = as_dense(_take(gate, ids_TK))          # [T, K, F, D]
  u = as_dense(_take(up, ids_TK))
  d = as_dense(_take(down, ids_TK))          # [T, K, D, F]
  x = x_TD.astype(jnp.float32)
  h = jax.nn.silu(jnp.einsum("td,tkfd->tkf", x, g)) * jnp.einsum("td,tkfd->tkf", x, u)
  y = jnp.einsum("tkf,tkdf->tkd", h, d)
  return jnp.einsum("tkd,tk->td", y, w_TK.astype(jnp.float32))


def _moe_dense(x_TD, ids_TK, w_TK, gate, up, down, n_experts):
  x = x_TD.astype(jnp.float32)
  # combine weight of every expert for every token: [E, T]
  comb = jnp.zeros((n_experts, x.shape[0]), jnp.float32)
  comb = comb.at[ids_TK.T, jnp.arange(x.shape[0])[None, :]].add(w_TK.T.astype(jnp.float32))

  def one(acc, e):
    g, u, d = as_dense(_take(gate, e)), as_dense(_take(up, e)), as_dense(_take(down, e))
    h = jax.nn.silu(x @ g.T) * (x @ u.T)
    return acc + (h @ d.T) * comb[e][:, None], None

  out, _ = jax.lax.scan(one, jnp.zeros_like(x), jnp.arange(n_experts))
  return out


def moe_ref(x_TD, ids_TK, w_TK, gate, up, down):
  n_experts = gate.shape[0]
  T, K = ids_TK.shape
  if T * K <= n_experts:
    return _moe_gather(x_TD, ids_TK, w_TK, gate, up, down)
  return _moe_dense(x_TD, ids_TK, w_TK, gate, up, down, n_experts)


def moe(x_TD, ids_TK, w_TK, gate, up, down):
  if all(isinstance(w, QTensor) for w in (gate, up, down)) and gate.kernel in ("pallas", "interpret"):
    from ops import moe_pallas
    if moe_pallas.supported(x_TD, ids_TK, gate, up, down):
      return moe_pallas.moe_pallas(x_TD, ids_TK, w_TK, gate, up, down, interpret=gate.kernel == "interpret")
  return moe_ref(x_TD, ids_TK, w_TK, gate, up, down)
