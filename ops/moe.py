"""Routed-expert FFN: for T tokens and their top-k experts, sum_k w_k * down_k(silu(gate_k x) * up_k x).

`moe_ref` is the reference over packed expert tensors (QTensor [E, F, D] / [E, D, F], or dense arrays):
  - few tokens (T*k <= E, decode): `_moe_gather` gathers only the routed experts' packed slabs, dequantizes
    them, dots;
  - many tokens (T*k > E, prefill): `_moe_grouped` computes only the T*k routed (token, expert) pairs: the pairs
    are sorted by expert, cut into fixed-size row tiles that each belong to one expert, and a scan runs one tile
    per step (that expert's three [M, D] x [D, F]-sized dots), so the work is ~T*k rows, not T*E.
`_moe_dense` (every expert on every token, weighted by a combine weight that is zero for tokens that did not pick
it: E/k times the FLOPs) is kept as a second reference. `moe` dispatches on the experts' `kernel` field:
"pallas" / "interpret" run the fused Pallas kernels of ops/moe_pallas.py (gate+up+SiLU, then down with the
router-weighted sum) for T <= 16 tokens and the grouped tensor-core GEMM of ops/moe_grouped_pallas.py (the
tiles of `ops.moe_layout.tile_layout`, 16-128 rows each) for more, when the types have kernels (gate and up of one
type); the reference otherwise.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ops import moe_grouped_pallas, moe_pallas, qmatmul_pallas, router_pallas
from ops.moe_layout import combine, grouped_tile_rows, tile_layout
from ops.qtensor import QTensor, as_dense, weight_shape
from ops.tuning import Tunings, pick

HIGHEST = jax.lax.Precision.HIGHEST


def _take(w, ids):
  return w[ids] if isinstance(w, QTensor) else jnp.asarray(w)[ids]


def _moe_gather(x_TD, ids_TX, w_TX, gate, up, down):
  g = as_dense(_take(gate, ids_TX))          # [T, X, F, D]
  u = as_dense(_take(up, ids_TX))
  d = as_dense(_take(down, ids_TX))          # [T, X, D, F]
  x = x_TD.astype(jnp.float32)
  h = jax.nn.silu(jnp.einsum("td,tkfd->tkf", x, g)) * jnp.einsum("td,tkfd->tkf", x, u)
  y = jnp.einsum("tkf,tkdf->tkd", h, d)
  return jnp.einsum("tkd,tk->td", y, w_TX.astype(jnp.float32))


def _moe_dense(x_TD, ids_TX, w_TX, gate, up, down, n_experts):
  """Every expert on every token (a scan over experts), weighted by its combine weight (0 where not routed)."""
  x = x_TD.astype(jnp.float32)
  # combine weight of every expert for every token: [E, T]
  comb = jnp.zeros((n_experts, x.shape[0]), jnp.float32)
  comb = comb.at[ids_TX.T, jnp.arange(x.shape[0])[None, :]].add(w_TX.T.astype(jnp.float32))

  def one(acc, e):
    g, u, d = as_dense(_take(gate, e)), as_dense(_take(up, e)), as_dense(_take(down, e))
    h = jax.nn.silu(x @ g.T) * (x @ u.T)
    return acc + (h @ d.T) * comb[e][:, None], None

  out, _ = jax.lax.scan(one, jnp.zeros_like(x), jnp.arange(n_experts))
  return out


# ------------------------------------------------------------------------------------------ grouped (prefill)

# Largest float32 copy of all of a layer's experts (bytes) that `_moe_grouped` makes up front instead of
# dequantizing one expert per tile.
GROUPED_DEQUANT_BUDGET = 256 << 20


def grouped_tiles_per_step() -> int:
  """Default tiles per scan step: 1 on CPU (a step's dots are already large enough for its cores), 16 on an
  accelerator, where a step's ~10 small kernels are launch-bound and NT (up to ~2.5 E: 1,000+ for 512 experts)
  sequential steps per layer would dominate a prefill. Not yet measured on the GPU (docs/PERF.md, "Prefill")."""
  return 1 if jax.default_backend() == "cpu" else 16


def _expert_fn(w, n_experts, predequantize):
  """e -> expert e of `w` as dense float32: indexed from a copy of all experts dequantized up front when
  `predequantize` and w is packed, else dequantized on the spot (plain arrays: indexed and cast)."""
  if predequantize and isinstance(w, QTensor):
    dense = as_dense(w)
    return lambda e: dense[e]
  return lambda e: as_dense(_take(w, e))


def _moe_grouped(x_TD, ids_TX, w_TX, gate, up, down, n_experts, *, rows_per_tile=None, dequant_budget=None,
                 tiles_per_step=None):
  """The routed pairs only: P = T*X (token, expert) pairs, sorted by expert (stable); float32, dots at HIGHEST.

  The sorted pairs are laid out in row tiles of M rows (`rows_per_tile`, default `grouped_tile_rows(P, E)`), each
  tile holding pairs of one expert (an expert's last tile is padded; ops.moe_layout.tile_layout), and a
  `lax.scan` runs G tiles per step (`tiles_per_step`, default `grouped_tiles_per_step()`: 1 on CPU, 16 on an
  accelerator) over NT = (P + min(E, P) * (M - 1)) // M tiles rounded up to a multiple of G: gather the tiles'
  token rows, silu(x g^T) * (x u^T), h d^T as batched dots over the G tiles' experts, and write the rows back at
  their pair index t*X + k (a scatter with unique indices; padding rows are dropped). Then y [T, X, D] times the
  router weights, summed over k. Work: NT*M <= P + min(E, P) * (M - 1) rows, vs T*E for `_moe_dense`.
  Dequantization (QTensor.dense, bit-exact): when all experts as float32 fit `dequant_budget` bytes
  (E*3*F*D*4 <= budget; default GROUPED_DEQUANT_BUDGET), each expert is dequantized once up front and the
  steps index that copy; otherwise each step dequantizes its tile's expert (NT < 2.5 E with the default M).
  Peak temporary memory, float32 bytes: the pair outputs P*D*4 (the scan carry), plus either the up-front
  copy (<= dequant_budget) or G experts per step, G*3*F*D*4 (and the dequantizer's same-sized temporaries),
  plus O(NT*M) int32 indices and one step's activations, G*M*(D+2F)*4. Qwen3-30B-A3B shapes (E=128, X=8,
  D=2048, F=768: all experts 2.4 GB, over the default budget), T=1024: 67 MB + 19 MB.

  Deterministic: every scatter writes unique indices (nothing is scatter-added) and the sum over k has a fixed
  order, as in `_moe_gather`.
  """
  T, X = ids_TX.shape
  P, E, D = T * X, n_experts, x_TD.shape[-1]
  F = weight_shape(gate)[-2]
  M = int(rows_per_tile or grouped_tile_rows(P, E))
  G = int(tiles_per_step or grouped_tiles_per_step())
  budget = GROUPED_DEQUANT_BUDGET if dequant_budget is None else int(dequant_budget)
  x = x_TD.astype(jnp.float32)
  NT, tile_e, row_tok, row_pair, _ = tile_layout(ids_TX, E, M, G)

  pre = 4 * E * 3 * F * D <= budget
  gate_e, up_e, down_e = (_expert_fn(w, E, pre) for w in (gate, up, down))

  def one(y_PD, tile):
    e, tok, pair = tile                                                          # [G], [G, M], [G, M]
    g, u, d = gate_e(e), up_e(e), down_e(e)                                      # [G, F, D], [G, F, D], [G, D, F]
    xt = x[tok]                                                                  # [G, M, D]
    h = (jax.nn.silu(jnp.einsum("gmd,gfd->gmf", xt, g, precision=HIGHEST))
         * jnp.einsum("gmd,gfd->gmf", xt, u, precision=HIGHEST))
    yt = jnp.einsum("gmf,gdf->gmd", h, d, precision=HIGHEST)
    return y_PD.at[pair.reshape(-1)].set(yt.reshape(-1, D), unique_indices=True, mode="drop"), None  # pair order

  tiles = (tile_e.reshape(NT // G, G), row_tok.reshape(NT // G, G, M), row_pair.reshape(NT // G, G, M))
  y, _ = jax.lax.scan(one, jnp.zeros((P, D), jnp.float32), tiles)                # [P, D], pair order
  return combine(y, w_TX)


def moe_ref(x_TD, ids_TX, w_TX, gate, up, down, *, n_experts: int | None = None):
  """The gather path when T * X <= n_experts, else the grouped one. n_experts: the model's routed experts (default
  gate's leading dim; expert parallel passes the model's count while `gate` holds a device's share, so each device
  takes the path one device takes)."""
  n_experts = n_experts or gate.shape[0]
  T, X = ids_TX.shape
  if T * X <= n_experts:
    return _moe_gather(x_TD, ids_TX, w_TX, gate, up, down)
  return _moe_grouped(x_TD, ids_TX, w_TX, gate, up, down, gate.shape[0])


def wants_x8(T: int, gate, tunings: Tunings | None = None) -> bool:
  """Whether `moe` on T tokens reads its x rounded to 8 bits (the decode kernel's gate/up tile x8 for the gate's
  type): then the norm before it makes that rounding in its own program and passes it as `moe(..., x8=)`."""
  return (isinstance(gate, QTensor) and gate.kernel in ("pallas", "interpret") and 1 <= T <= qmatmul_pallas.MAX_B
          and moe_pallas.gateup_x8(gate.qtype, pick(tunings, "moe", gate.qtype)) is not None)


def moe(x_TD, ids_TX, w_TX, gate, up, down, *, tunings: Tunings | None = None, precision: str = "auto",
        n_experts: int | None = None, owned=None, x8=None, parts: bool = False):
  """Dispatch on the experts' `kernel` field: "pallas" / "interpret" take the decode kernels (ops/moe_pallas)
  for T <= 16 tokens and the grouped tensor-core GEMM (ops/moe_grouped_pallas: row tiles of one expert) for more,
  when the types have kernels; everything else takes `moe_ref`. tunings (static): the kernels' pieces (`moe`,
  `grouped`, by the gate/up type); precision: the grouped GEMM's ("auto" | "f32" | "bf16"; the decode kernels and
  the reference run float32); n_experts: as moe_ref's (the reference's path choice); owned (expert parallel,
  model.mesh): bool [T, X], False for a pair routed to an expert this device does not hold (its weight must be 0,
  its id any local one): the decode kernels skip it (no expert rows read), the other paths compute it with weight 0.
  None: every pair is computed (the one-device path, unchanged). x8: x rounded to 8 bits by the norm before
  (wants_x8; an ops.dot8.X8), for the decode kernel's gate/up; the other paths read x. parts: the decode kernel
  returns each token's X weighted rows unsummed, [T, X, D] (moe_pallas's parts); the other paths return [T, D]."""
  if all(isinstance(w, QTensor) for w in (gate, up, down)) and gate.kernel in ("pallas", "interpret"):
    interpret = gate.kernel == "interpret"
    if moe_pallas.supported(x_TD, ids_TX, gate, up, down):
      ids = ids_TX if owned is None else jnp.where(owned, ids_TX, -1)
      return moe_pallas.moe_pallas(x_TD, ids, w_TX, gate, up, down, interpret=interpret,
                                   tuning=pick(tunings, "moe", gate.qtype), skip=owned is not None, x8=x8,
                                   parts=parts)
    if moe_grouped_pallas.supported(gate, up, down):
      return moe_grouped_pallas.moe_grouped_pallas(x_TD, ids_TX, w_TX, gate, up, down, interpret=interpret,
                                                   tuning=pick(tunings, "grouped", gate.qtype), precision=precision)
  return moe_ref(x_TD, ids_TX, w_TX, gate, up, down, n_experts=n_experts)


def routes_itself(T: int, router, gate, up, down, top_k: int) -> bool:
  """Whether the decode kernels can route T tokens for themselves (`moe_routed`): packed experts on the Pallas
  kernels, a float router the route kernel takes (ops.router_pallas.supported)."""
  return (all(isinstance(w, QTensor) for w in (gate, up, down)) and gate.kernel in ("pallas", "interpret")
          and not isinstance(router, QTensor) and len(gate.shape) == 3
          and router_pallas.supported(T, router.shape[0], gate.shape[2], top_k)
          and moe_pallas.supported(None, jax.ShapeDtypeStruct((T, top_k), jnp.int32), gate, up, down))


def moe_routed(x_TD, logits_TE, bias_E, gate, up, down, *, routing: str, top_k: int, norm_topk: bool,
               routed_scale: float, tunings: Tunings | None = None, x8=None, parts: bool = False):
  """`moe` on the decode kernels with the routing made inside them from the router logits (moe_pallas's Route:
  ops.router_pallas's top-k ops run by gate/up's programs; bias_E the sigmoid selection bias or None): one launch
  fewer than routing first. Where `routes_itself`; x8 and parts as `moe`'s."""
  has_bias = routing != "softmax" and bias_E is not None
  route = moe_pallas.Route(routing, top_k, norm_topk, routed_scale, has_bias)
  return moe_pallas.moe_pallas(x_TD, logits_TE, bias_E if has_bias else None, gate, up, down,
                               interpret=gate.kernel == "interpret", tuning=pick(tunings, "moe", gate.qtype), x8=x8,
                               parts=parts, route=route)
