"""Routed experts for many tokens (prefill, long verify passes): grouped Pallas kernels over row tiles of one expert.

The routed (token, expert) pairs are sorted by expert and cut into row tiles of M = 16 rows that each belong to
one expert (`ops.moe.tile_layout`, the layout of the XLA reference `_moe_grouped`). Each tile is a batch of up
to 16 tokens for one expert, which is what the decode kernels already do for a batch: a program dequantizes a
[BN rows, S blocks] tile of the expert's packed weights once, in registers (the per-type tiles of
ops/qmatmul_pallas), and every one of the tile's M tokens reuses it (a static loop over tokens). So an expert's
weights are read and dequantized once per tile, not once per token, and nothing dequantized is written.

  1. gate/up: grid (F / BN, NT). Program (i, j) reads rows [i*BN, i*BN + BN) of gate[e] and up[e], e = the
     expert of tile j, over the whole D, and writes h[j, m, rows] = silu(gate . x_m) * (up . x_m) for the tile's
     M token rows x_m, straight into the down type's x layout.
  2. down: grid (D / BN, NT): y[j, m, rows] = down[e] . h[j, m].
Tiles past the last real one (the static bound NT covers any routing) return at once. Outside the kernels, the
rows go back to pair order t*K + k (a scatter with unique indices; padding rows dropped), are weighted by the
router and summed over k in a fixed order (`ops.moe._combine`). Work: NT*M <= P + min(E, P) * 15 rows of
float32 FMAs, each weight value dequantized NT / E ~ P / (16 E) + 1 times per row tile.

Reference: ops/moe.moe_ref (its grouped path has the same tiles). Tile sizes: ops/qmatmul_pallas.config with
batch 16; interpret mode and abstract CUDA/ROCm lowering are tested on CPU (tests/test_kernels.py,
tests/test_lowering.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ops import qmatmul_pallas as qp
from ops import quant, repack

F32, I32 = jnp.float32, jnp.int32
M_ROWS = qp.MAX_B            # rows per tile: the kernels' static token loop


def _token_rows(ref, j, b0, s):
  """Loaders of tile j's M token rows of `ref` ([NT, M, nb, *x layout]) at blocks [b0, b0 + s), one per token."""
  return [functools.partial(lambda m, *idx: ref[(j, m, pl.ds(b0, s), *idx)], m) for m in range(M_ROWS)]


def _gateup_kernel(te_ref, nt_ref, x_ref, tab_ref, *refs, qtype, names, F, BN, S, nb, unroll, down_qtype):
  *w_refs, h_ref = refs
  n = len(names)
  G, U = dict(zip(names, w_refs[:n])), dict(zip(names, w_refs[n:]))
  j = pl.program_id(1)
  rows = jnp.minimum(pl.program_id(0) * BN + jax.lax.iota(I32, BN), F - 1)   # program ids outside pl.when

  @pl.when(j < nt_ref[0])
  def _():
    e = te_ref[j]

    def tile_sums(b0, s):
      xs = _token_rows(x_ref, j, b0, s)
      g = qp.TILES[qtype](lambda name, *idx: G[name][(e, rows, pl.ds(b0, s), *idx)], xs, tab_ref)
      u = qp.TILES[qtype](lambda name, *idx: U[name][(e, rows, pl.ds(b0, s), *idx)], xs, tab_ref)
      return tuple(jnp.sum(v, axis=1) for v in g + u)

    acc = qp.k_loop(nb, S, unroll, tile_sums, tuple(jnp.zeros((BN,), F32) for _ in range(2 * M_ROWS)))
    cols = qp.x_view_index(down_qtype, rows)
    for m in range(M_ROWS):
      g, u = acc[m], acc[M_ROWS + m]
      h_ref[j, m, cols] = g / (1.0 + jnp.exp(-g)) * u


def _down_kernel(te_ref, nt_ref, h_ref, tab_ref, *refs, qtype, names, D, BN, S, nb, unroll):
  *w_refs, o_ref = refs
  W = dict(zip(names, w_refs))
  j = pl.program_id(1)
  rows = jnp.minimum(pl.program_id(0) * BN + jax.lax.iota(I32, BN), D - 1)

  @pl.when(j < nt_ref[0])
  def _():
    e = te_ref[j]

    def tile_sums(b0, s):
      y = qp.TILES[qtype](lambda name, *idx: W[name][(e, rows, pl.ds(b0, s), *idx)], _token_rows(h_ref, j, b0, s),
                          tab_ref)
      return tuple(jnp.sum(v, axis=1) for v in y)

    acc = qp.k_loop(nb, S, unroll, tile_sums, tuple(jnp.zeros((BN,), F32) for _ in range(M_ROWS)))
    for m in range(M_ROWS):
      o_ref[j, m, rows] = acc[m]


def supported(gate, up, down) -> bool:
  return (gate.qtype == up.qtype and gate.qtype in qp.TILES and down.qtype in qp.TILES and len(gate.shape) == 3)


def _cfg(qtype, rows, nb, overrides):
  return tuple(sorted(qp.config(qtype, rows, nb, overrides, batch=M_ROWS).items()))


@functools.partial(jax.jit, static_argnames=("gq", "dq", "D", "F", "E", "interpret", "cg", "cd"))
def _grouped(x_TD, ids_TK, w_TK, gplanes, uplanes, dplanes, *, gq, dq, D, F, E, interpret, cg, cd):
  from ops.moe import _combine, tile_layout
  T, K = ids_TK.shape
  P = T * K
  cg, cd = dict(cg), dict(cd)
  NT, tile_e, row_tok, row_pair, n_used = tile_layout(ids_TK.astype(I32), E, M_ROWS)
  n_real = n_used.reshape(1)
  nbD, nbF = D // quant.GGML_TYPES[gq][0], F // quant.GGML_TYPES[dq][0]
  xv = qp.x_view(x_TD.astype(F32)[row_tok], gq)                                # [NT*M, nbD, *x layout]
  xt = xv.reshape(NT, M_ROWS, *xv.shape[1:])
  gateup = functools.partial(_gateup_kernel, qtype=gq, names=repack.plane_names(gq), F=F, BN=cg["BN"], S=cg["S"],
                             nb=nbD, unroll=cg["unroll"], down_qtype=dq)
  h = pl.pallas_call(
      gateup, out_shape=jax.ShapeDtypeStruct((NT, M_ROWS, F), F32), grid=(pl.cdiv(F, cg["BN"]), NT),
      compiler_params=qp.compiler_params(cg), interpret=interpret, name=f"moe_grouped_gateup_{gq.lower()}",
  )(tile_e, n_real, xt, qp.table(gq), *gplanes, *uplanes)
  h = h.reshape(NT, M_ROWS, nbF, *(qp.XVIEW[dq][i] for i in qp.XPERM[dq]))     # already in the x layout of dq
  down = functools.partial(_down_kernel, qtype=dq, names=repack.plane_names(dq), D=D, BN=cd["BN"], S=cd["S"],
                           nb=nbF, unroll=cd["unroll"])
  y = pl.pallas_call(
      down, out_shape=jax.ShapeDtypeStruct((NT, M_ROWS, D), F32), grid=(pl.cdiv(D, cd["BN"]), NT),
      compiler_params=qp.compiler_params(cd), interpret=interpret, name=f"moe_grouped_down_{dq.lower()}",
  )(tile_e, n_real, h, qp.table(dq), *dplanes)
  y_PD = jnp.zeros((P, D), F32).at[row_pair].set(y.reshape(NT * M_ROWS, D), unique_indices=True, mode="drop")
  return _combine(y_PD, w_TK)


def moe_grouped_pallas(x_TD, ids_TK, w_TK, gate, up, down, *, interpret: bool = False,
                       overrides: dict | None = None):
  """sum_k w[t, k] * down[e](silu(gate[e] x_t) * up[e] x_t), e = ids[t, k], for any number of tokens T, with
  packed QTensor experts gate/up [E, F, D], down [E, D, F] (types in ops/qmatmul_pallas.KERNEL_TYPES).
  overrides: {"gateup": {...}, "down": {...}} tile sizes."""
  if not supported(gate, up, down):
    raise ValueError(f"moe_grouped_pallas: {gate.qtype}/{up.qtype}/{down.qtype} experts {gate.shape}")
  E, F, D = gate.shape
  nbD, nbF = D // quant.GGML_TYPES[gate.qtype][0], F // quant.GGML_TYPES[down.qtype][0]
  ov = overrides or {}
  return _grouped(x_TD, ids_TK, w_TK, tuple(gate.planes), tuple(up.planes), tuple(down.planes), gq=gate.qtype,
                  dq=down.qtype, D=D, F=F, E=E, interpret=interpret, cg=_cfg(gate.qtype, F, nbD, ov.get("gateup")),
                  cd=_cfg(down.qtype, D, nbF, ov.get("down")))
