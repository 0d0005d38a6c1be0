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
tiles of `tile_layout`, 16-128 rows each) for more, when the types have kernels (gate and up of one type); the
reference otherwise.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ops.qtensor import QTensor, as_dense, weight_shape

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
# Largest float32 copy of all of a layer's experts (bytes) that `_moe_grouped` makes up front instead of
# dequantizing one expert per tile (read at trace time).
GROUPED_DEQUANT_BUDGET = 256 << 20
# Rows per tile of `_moe_grouped` (None: `grouped_tile_rows`, from the mean rows per expert; read at trace time).
GROUPED_ROWS_PER_TILE: int | None = None
# Tiles per scan step of `_moe_grouped` (None: `grouped_tiles_per_step()`; read at trace time).
GROUPED_TILES_PER_STEP: int | None = None


def grouped_tiles_per_step() -> int:
  """Default tiles per scan step: 1 on CPU (a step's dots are already large enough for its cores), 16 on an
  accelerator, where a step's ~10 small kernels are launch-bound and NT (up to ~2.5 E: 1,000+ for 512 experts)
  sequential steps per layer would dominate a prefill. Not yet measured on the GPU (docs/PERF.md, "Prefill")."""
  return 1 if jax.default_backend() == "cpu" else 16


def grouped_tile_rows(n_pairs: int, n_experts: int) -> int:
  """Default rows per tile M of `_moe_grouped`: the power of two nearest the mean rows per expert, in [8, 256].

  The scan length is static, NT = (P + min(E, P) * (M - 1)) // M (any expert may end on a partial tile), and
  each step has a fixed cost (launches, and dequantizing its expert unless all were dequantized up front): a
  larger M means fewer steps, a smaller one fewer padding rows. With M within a factor sqrt(2) of the mean,
  NT < 2.5 E and the NT*M rows computed are < 2.5 P.
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
  """Per-pair outputs (pair order t*K + k) times their router weight, summed over k: [T, D]."""
  T, K = w_TK.shape
  return jnp.sum(y_PD.reshape(T, K, -1) * w_TK.astype(jnp.float32)[:, :, None], axis=1)


def _expert_fn(w, n_experts, predequantize):
  """e -> expert e of `w` as dense float32: indexed from a copy of all experts dequantized up front when
  `predequantize` and w is packed, else dequantized on the spot (plain arrays: indexed and cast)."""
  if predequantize and isinstance(w, QTensor):
    dense = as_dense(w)
    return lambda e: dense[e]
  return lambda e: as_dense(_take(w, e))


def tile_layout(ids_TK, n_experts: int, M: int, G: int = 1):
  """Row tiles of the routed pairs, sorted by expert: (NT, tile_e [NT], row_tok [NT*M], row_pair [NT*M], n_used),
  n_used (int32 scalar) the tiles that hold a pair: tiles n_used..NT-1 are all padding.

  Pair p = t*K + k. Expert e owns ceil(count_e / M) consecutive tiles; its j-th sorted pair sits in row
  tile_start[e] * M + j. NT = (P + min(E, P) * (M - 1)) // M rounded up to a multiple of G is a static bound for
  any routing. Padding rows (past an expert's count, or in tiles past the last expert's) carry token 0 and pair
  index P (out of bounds: a scatter with mode="drop" discards them); tiles past the last are given expert E-1."""
  T, K = ids_TK.shape
  P, E = T * K, n_experts
  NT = (P + min(E, P) * (M - 1)) // M
  NT = -(-NT // G) * G
  flat, order, counts, starts = _route_sorted(ids_TK, E)
  n_tiles = (counts + M - 1) // M
  tile_end = jnp.cumsum(n_tiles)
  tile_start = tile_end - n_tiles
  sorted_e = flat[order]
  row_sorted = tile_start[sorted_e] * M + (jnp.arange(P, dtype=jnp.int32) - starts[sorted_e])   # [P], ascending
  row_tok = jnp.zeros((NT * M,), jnp.int32).at[row_sorted].set(order // K, indices_are_sorted=True,
                                                                unique_indices=True)
  row_pair = jnp.full((NT * M,), P, jnp.int32).at[row_sorted].set(order, indices_are_sorted=True,
                                                                  unique_indices=True)
  # expert of tile i: the number of experts whose tiles end at or before i (E past the last: clamped)
  tile_e = jnp.minimum(jnp.sum(tile_end[None, :] <= jnp.arange(NT, dtype=jnp.int32)[:, None], axis=1,
                               dtype=jnp.int32), E - 1)
  return NT, tile_e, row_tok, row_pair, tile_end[-1]


def _moe_grouped_tiles(x_TD, ids_TK, w_TK, gate, up, down, n_experts, rows_per_tile, dequant_budget,
                       tiles_per_step=None):
  T, K = ids_TK.shape
  P, E, D = T * K, n_experts, x_TD.shape[-1]
  F = weight_shape(gate)[-2]
  M = int(rows_per_tile or GROUPED_ROWS_PER_TILE or grouped_tile_rows(P, E))
  G = int(tiles_per_step or GROUPED_TILES_PER_STEP or grouped_tiles_per_step())
  x = x_TD.astype(jnp.float32)
  NT, tile_e, row_tok, row_pair, _ = tile_layout(ids_TK, E, M, G)

  pre = 4 * E * 3 * F * D <= dequant_budget
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
  return _combine(y, w_TK)


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


def _moe_grouped(x_TD, ids_TK, w_TK, gate, up, down, n_experts, *, impl="tiles", rows_per_tile=None,
                 dequant_budget=None, tiles_per_step=None):
  """The routed pairs only: P = T*k (token, expert) pairs, sorted by expert (stable); float32, dots at HIGHEST.

  impl="tiles" (default): the sorted pairs are laid out in row tiles of M rows (`rows_per_tile`, default
  `grouped_tile_rows(P, E)`), each tile holding pairs of one expert (an expert's last tile is padded), and a
  `lax.scan` runs G tiles per step (`tiles_per_step`, default `grouped_tiles_per_step()`: 1 on CPU, 16 on an
  accelerator) over NT = (P + min(E, P) * (M - 1)) // M tiles rounded up to a multiple of G: gather the tiles'
  token rows, silu(x g^T) * (x u^T), h d^T as batched dots over the G tiles' experts, and write the rows back at
  their pair index t*K + k (a scatter with unique indices; padding rows are dropped). Then y [T, K, D] times the router weights, summed over k.
  Work: NT*M <= P + min(E, P) * (M - 1) rows, vs T*E for `_moe_dense`.
  Dequantization (QTensor.dense, bit-exact): when all experts as float32 fit `dequant_budget` bytes
  (E*3*F*D*4 <= budget; default GROUPED_DEQUANT_BUDGET), each expert is dequantized once up front and the
  steps index that copy; otherwise each step dequantizes its tile's expert (NT < 2.5 E with the default M).
  Peak temporary memory, float32 bytes: the pair outputs P*D*4 (the scan carry), plus either the up-front
  copy (<= dequant_budget) or G experts per step, G*3*F*D*4 (and the dequantizer's same-sized temporaries),
  plus O(NT*M) int32 indices and one step's activations, G*M*(D+2F)*4. Qwen3-30B-A3B shapes (E=128, k=8,
  D=2048, F=768: all experts 2.4 GB, over the default budget), T=1024: 67 MB + 19 MB.

  impl="ragged_dot": `jax.lax.ragged_dot_general` over all experts dequantized at once (E*3*F*D*4 bytes: 2.4 GB
  at Qwen3-30B-A3B shapes). In jax 0.11.2 the CPU lowering, and XLA's RaggedDotRewriter on NVIDIA GPUs for
  float32 operands, turn a ragged dot into a dense dot over an expert-masked [E, P, D] copy of the rows: E times
  the needed FLOPs and an E*P*D*4-byte temporary. Kept for comparison and for a backend with a real grouped GEMM.

  Deterministic: every scatter writes unique indices (nothing is scatter-added) and the sum over k has a fixed
  order, as in `_moe_gather`.
  """
  budget = GROUPED_DEQUANT_BUDGET if dequant_budget is None else int(dequant_budget)
  if impl == "tiles":
    return _moe_grouped_tiles(x_TD, ids_TK, w_TK, gate, up, down, n_experts, rows_per_tile, budget, tiles_per_step)
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
  """Dispatch on the experts' `kernel` field: "pallas" / "interpret" take the decode kernels (ops/moe_pallas)
  for T <= 16 tokens and the grouped tensor-core GEMM (ops/moe_grouped_pallas: row tiles of one expert) for more,
  when the types have kernels; everything else takes `moe_ref`."""
  if all(isinstance(w, QTensor) for w in (gate, up, down)) and gate.kernel in ("pallas", "interpret"):
    from ops import moe_grouped_pallas, moe_pallas
    interpret = gate.kernel == "interpret"
    if moe_pallas.supported(x_TD, ids_TK, gate, up, down):
      return moe_pallas.moe_pallas(x_TD, ids_TK, w_TK, gate, up, down, interpret=interpret)
    if moe_grouped_pallas.supported(gate, up, down):
      return moe_grouped_pallas.moe_grouped_pallas(x_TD, ids_TK, w_TK, gate, up, down, interpret=interpret)
  return moe_ref(x_TD, ids_TK, w_TK, gate, up, down)
