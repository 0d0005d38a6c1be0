"""The routed (token, expert) pairs laid out for grouped work: sorted by expert and cut into row tiles of one expert.

Shared by the XLA reference of many-token MoE (ops/moe `_moe_grouped`) and the grouped tensor-core GEMM
(ops/moe_grouped_pallas). Pair p = t*X + k is token t's k-th routed expert.
"""
from __future__ import annotations

import math

import jax.numpy as jnp


def grouped_tile_rows(n_pairs: int, n_experts: int) -> int:
  """Default rows per tile M of the reference's tiles: the power of two nearest the mean rows per expert, in [8, 256].

  The scan length is static, NT = (P + min(E, P) * (M - 1)) // M (any expert may end on a partial tile), and
  each step has a fixed cost (launches, and dequantizing its expert unless all were dequantized up front): a
  larger M means fewer steps, a smaller one fewer padding rows. With M within a factor sqrt(2) of the mean,
  NT < 2.5 E and the NT*M rows computed are < 2.5 P.
  """
  mean = max(1.0, n_pairs / n_experts)
  return int(min(256, max(8, 1 << round(math.log2(mean)))))


def route_sorted(ids_TX, n_experts):
  """Pairs sorted by expert (stable): (flat expert ids [P], order [P] pair of each sorted slot, counts [E],
  starts [E])."""
  flat = ids_TX.reshape(-1).astype(jnp.int32)
  order = jnp.argsort(flat, stable=True).astype(jnp.int32)
  counts = jnp.zeros((n_experts,), jnp.int32).at[flat].add(1)
  starts = jnp.cumsum(counts) - counts
  return flat, order, counts, starts


def combine(y_PD, w_TX):
  """Per-pair outputs (pair order t*X + k) times their router weight, summed over k: [T, D]."""
  T, X = w_TX.shape
  return jnp.sum(y_PD.reshape(T, X, -1) * w_TX.astype(jnp.float32)[:, :, None], axis=1)


def tile_layout(ids_TX, n_experts: int, M: int, G: int = 1):
  """Row tiles of the routed pairs, sorted by expert: (NT, tile_e [NT], row_tok [NT*M], row_pair [NT*M], n_used),
  n_used (int32 scalar) the tiles that hold a pair: tiles n_used..NT-1 are all padding.

  Expert e owns ceil(count_e / M) consecutive tiles; its j-th sorted pair sits in row tile_start[e] * M + j.
  NT = (P + min(E, P) * (M - 1)) // M rounded up to a multiple of G is a static bound for any routing. Padding
  rows (past an expert's count, or in tiles past the last expert's) carry token 0 and pair index P (out of
  bounds: a scatter with mode="drop" discards them); tiles past the last are given expert E-1."""
  T, X = ids_TX.shape
  P, E = T * X, n_experts
  NT = (P + min(E, P) * (M - 1)) // M
  NT = -(-NT // G) * G
  flat, order, counts, starts = route_sorted(ids_TX, E)
  n_tiles = (counts + M - 1) // M
  tile_end = jnp.cumsum(n_tiles)
  tile_start = tile_end - n_tiles
  sorted_e = flat[order]
  row_sorted = tile_start[sorted_e] * M + (jnp.arange(P, dtype=jnp.int32) - starts[sorted_e])   # [P], ascending
  row_tok = jnp.zeros((NT * M,), jnp.int32).at[row_sorted].set(order // X, indices_are_sorted=True,
                                                                unique_indices=True)
  row_pair = jnp.full((NT * M,), P, jnp.int32).at[row_sorted].set(order, indices_are_sorted=True,
                                                                  unique_indices=True)
  # expert of tile i: the number of experts whose tiles end at or before i (E past the last: clamped)
  tile_e = jnp.minimum(jnp.sum(tile_end[None, :] <= jnp.arange(NT, dtype=jnp.int32)[:, None], axis=1,
                               dtype=jnp.int32), E - 1)
  return NT, tile_e, row_tok, row_pair, tile_end[-1]
