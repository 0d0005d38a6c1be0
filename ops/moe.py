"""Routed-expert FFN: for T tokens and their top-k experts, sum_k w_k * down_k(silu(gate_k x) * up_k x).

`moe_ref` is the reference over packed expert tensors (QTensor [E, F, D] / [E, D, F], or dense arrays):
  - few tokens (T*k <= E, decode): `_moe_gather` gathers only the routed experts' packed slabs, dequantizes
    them, dots;
  - many tokens (T*k > E, prefill): `_moe_grouped` computes only the T*k routed (token, expert) pairs: the pairs
    are sorted by expert, cut into fixed-size row tiles that each belong to one expert, and a scan runs one tile
    per step (dequantize that expert, three [M, D] x [D, F]-sized dots), so the work is ~T*k rows, not T*E.
`_moe_dense` (every expert on every token, weighted by a combine weight that is zero for tokens that did not pick
it: E/k times the FLOPs) is kept as a second reference. `moe` dispatches on the experts' `kernel` field:
"pallas" / "interpret" run the fused Pallas kernels of ops/moe_pallas.py (gate+up+SiLU, then down with the
router-weighted sum) when they apply (T <= 16 tokens, kernel types, gate and up of one type), the reference
otherwise.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ops.qtensor import QTensor, as_dense

HIGHEST = jax.lax.Precision.HIGHEST


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
  """Every expert on every token (a scan over experts), weighted by its combine weight (0 where not routed)."""
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


# ------------------------------------------------------------------------------------------ grouped (prefill)

GROUPED_IMPLS = ("tiles", "ragged_dot")


def grouped_tile_rows(n_pairs: int, n_experts: int) -> int:
  """Default rows per tile M of `_moe_grouped`: the power of two nearest the mean rows per expert, in [8, 256].

  The scan length is static, NT = (P + min(E, P) * (M - 1)) // M (any expert may end on a partial tile), and
  every step dequantizes one expert: a larger M means fewer steps and dequantizations, a smaller one fewer
  padded rows. Near the mean, NT <= 2E and the padded rows at most double the P routed ones.
  """
  mean = max(1.0, n_pairs / n_experts)
  return int(min(256, max(8, 1 << round(math.log2(mean)))))


def _route_sorted(ids_TK, n_experts):
  """Pairs p = t*K + k sorted by expert (stable): (order [P] pair of each sorted slot, counts [E], starts [E])."""
  flat = ids_TK.reshape(-1).astype(jnp.int32)
  order = jnp.argsort(flat, stable=True).astype(jnp.int32)
  counts = jnp.zeros((n_experts,), jnp.int32).at[flat].add(1)
  starts = jnp.cumsum(counts) - counts
  return flat, order, counts, starts


def _combine(y_PD, w_TK):
  """Per-pair outputs (pair order t*K + k) weighted by the router and summed over k, as `_moe_gather`."""
  T, K = w_TK.shape
  return jnp.einsum("tkd,tk->td", y_PD.reshape(T, K, -1), w_TK.astype(jnp.float32), precision=HIGHEST)


def _moe_grouped_tiles(x_TD, ids_TK, w_TK, gate, up, down, n_experts, rows_per_tile):
  T, K = ids_TK.shape
  P, E, D = T * K, n_experts, x_TD.shape[-1]
  M = int(rows_per_tile or grouped_tile_rows(P, E))
  NT = (P + min(E, P) * (M - 1)) // M                       # static bound on the tiles of any routing
  x = x_TD.astype(jnp.float32)
  flat, order, counts, starts = _route_sorted(ids_TK, E)

  # Tiles: expert e owns ceil(counts[e] / M) consecutive tiles from tile_start[e]; its j-th sorted pair sits in
  # row tile_start[e] * M + j of the padded layout [NT * M]. Rows past an expert's count (and tiles past the
  # last expert's) are padding: they run on token 0 and are never read back.
  n_tiles = (counts + M - 1) // M
  tile_end = jnp.cumsum(n_tiles)
  tile_start = tile_end - n_tiles
  sorted_e = flat[order]
  row_sorted = tile_start[sorted_e] * M + (jnp.arange(P, dtype=jnp.int32) - starts[sorted_e])   # [P]
  row_tok = jnp.zeros((NT * M,), jnp.int32).at[row_sorted].set(order // K, indices_are_sorted=True,
                                                                unique_indices=True)
  row_of_pair = jnp.zeros((P,), jnp.int32).at[order].set(row_sorted, unique_indices=True)
  # expert of tile i: the number of experts whose tiles end at or before i (E past the last: clamped)
  tile_e = jnp.minimum(jnp.sum(tile_end[None, :] <= jnp.arange(NT, dtype=jnp.int32)[:, None], axis=1,
                               dtype=jnp.int32), E - 1)

  def one(_, tile):
    e, tok = tile
    g, u, d = as_dense(_take(gate, e)), as_dense(_take(up, e)), as_dense(_take(down, e))
    xt = x[tok]                                                                  # [M, D]
    h = (jax.nn.silu(jnp.einsum("md,fd->mf", xt, g, precision=HIGHEST))
         * jnp.einsum("md,fd->mf", xt, u, precision=HIGHEST))
    return None, jnp.einsum("mf,df->md", h, d, precision=HIGHEST)

  _, y = jax.lax.scan(one, None, (tile_e, row_tok.reshape(NT, M)))              # [NT, M, D]
  return _combine(y.reshape(NT * M, D)[row_of_pair], w_TK)


def _moe_grouped_ragged(x_TD, ids_TK, w_TK, gate, up, down, n_experts):
  T, K = ids_TK.shape
  x = x_TD.astype(jnp.float32)
  _, order, counts, _ = _route_sorted(ids_TK, n_experts)
  xs = x[order // K]                                                             # [P, D] sorted by expert
  # lhs [P, D] (ragged rows) x rhs [E, F, D] (contract D with dim 2) -> [P, F]; the rhs group dim is 0.
  nt = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                                         lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
  rdot = lambda a, w: jax.lax.ragged_dot_general(a, as_dense(w), counts, nt, precision=HIGHEST)
  h = jax.nn.silu(rdot(xs, gate)) * rdot(xs, up)                                 # [P, F]
  ys = rdot(h, down)                                                             # [P, D]
  inv = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32), unique_indices=True)
  return _combine(ys[inv], w_TK)


def _moe_grouped(x_TD, ids_TK, w_TK, gate, up, down, n_experts, *, impl="tiles", rows_per_tile=None):
  """The routed pairs only: P = T*k (token, expert) pairs, sorted by expert; float32, HIGHEST-precision dots.

  impl="tiles" (default): the sorted pairs are laid out in row tiles of M rows (`rows_per_tile`, default
  `grouped_tile_rows(P, E)`), each tile holding pairs of one expert (an expert's last tile is padded), and a
  `lax.scan` of static length NT = (P + min(E, P) * (M - 1)) // M runs one tile per step: dequantize that
  expert (QTensor.dense, bit-exact), gather the tile's token rows, silu(x g^T) * (x u^T), then h d^T. Work:
  NT*M <= P + min(E, P) * (M - 1) rows (vs T*E for `_moe_dense`) and NT expert dequantizations. Peak temporary
  memory, float32: one expert dense per step, 3*F*D*4 bytes (plus the dequantizer's same-sized temporaries),
  the stacked tile outputs NT*M*D*4, their gather back to pair order P*D*4, and O(NT*M) int32 indices;
  independent of E (Qwen3-30B-A3B shapes, T=2048, k=8, M=128: 19 MB + 268 MB + 134 MB).

  impl="ragged_dot": `jax.lax.ragged_dot_general` over all experts dequantized at once (E*3*F*D*4 bytes: 2.4 GB
  at Qwen3-30B-A3B shapes). XLA lowers ragged dot on CPU, and on NVIDIA GPUs for float32, to a dense dot over an
  expert-masked [E, P, D] copy of the rows (E times the needed FLOPs, an E*P*D temporary), so this is only for
  comparison and for backends with a real grouped GEMM.

  Deterministic: every scatter writes unique indices, and the sum over k is the fixed einsum of `_moe_gather`.
  """
  if impl == "tiles":
    return _moe_grouped_tiles(x_TD, ids_TK, w_TK, gate, up, down, n_experts, rows_per_tile)
  if impl == "ragged_dot":
    return _moe_grouped_ragged(x_TD, ids_TK, w_TK, gate, up, down, n_experts)
  raise ValueError(f"grouped MoE impl {impl!r}, expected one of {GROUPED_IMPLS}")


def moe_ref(x_TD, ids_TK, w_TK, gate, up, down):
  n_experts = gate.shape[0]
  T, K = ids_TK.shape
  if T * K <= n_experts:
    return _moe_gather(x_TD, ids_TK, w_TK, gate, up, down)
  return _moe_grouped(x_TD, ids_TK, w_TK, gate, up, down, n_experts)


def moe(x_TD, ids_TK, w_TK, gate, up, down):
  if all(isinstance(w, QTensor) for w in (gate, up, down)) and gate.kernel in ("pallas", "interpret"):
    from ops import moe_pallas
    if moe_pallas.supported(x_TD, ids_TK, gate, up, down):
      return moe_pallas.moe_pallas(x_TD, ids_TK, w_TK, gate, up, down, interpret=gate.kernel == "interpret")
  return moe_ref(x_TD, ids_TK, w_TK, gate, up, down)
