"""Routed experts for many tokens (prefill, long verify passes): the grouped tensor-core GEMM of ops/qgemm_pallas.

The routed (token, expert) pairs are sorted by expert and cut into row tiles of M rows, each belonging to one
expert (`ops.moe_layout.tile_layout`, the layout of the XLA reference `ops.moe._moe_grouped`). M is rows_factor
(2) times the power of two nearest the mean rows per expert, in [16, 128] (`tile_rows`). The token rows are laid
out as the gate type's pieces once per token; the gate/up kernel loads each tile's rows from them by token index.
Then come two kernel calls:

  1. gate/up: grid (F / BN, NT). Program (i, j) dequantizes rows [i*BN, i*BN + BN) of gate[e] and up[e] (e =
     tile_e[j]) piece by piece over D, runs bf16 MMAs against the tile's M rows, and writes
     h = silu(x . gate) * (x . up) [M, BN].
  2. down: the same over h (laid out as the down type's pieces) and down[e]: y [NT * M, D].

Tiles past the last real one (n_used; NT is a static bound for any routing) return at once. The rows then go
back to pair order t*X + k: each pair's row is gathered by the weighted k-sum itself (padding rows are never
read), weighted by the router and summed over k in a fixed order (`ops.moe_layout.combine`). Each weight value
is dequantized once per row tile of its expert (NT / E ~ P / (M E) + 1 times); the MMAs do P * 3 * F * D * 2 * 3
flops.

Reference: ops/moe.moe_ref. Interpret mode and abstract CUDA/ROCm lowering are tested on CPU
(tests/ops/test_kernels.py, tests/ops/test_lowering.py).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ops import qgemm_pallas as qg
from ops.moe_layout import combine, grouped_tile_rows, tile_layout
from ops.tuning import fill

F32, I32 = jnp.float32, jnp.int32


class Tuning(NamedTuple):
  """The two GEMMs' tiles (qgemm_pallas.Tuning over its table; their `rows` does not apply here), rows_factor and
  rows: M is `rows`, or rows_factor x the power of two nearest the mean rows per expert (`tile_rows`)."""
  gateup: qg.Tuning | None = None
  down: qg.Tuning | None = None
  rows_factor: int | None = None
  rows: int | None = None


# rows_factor 2 against 1 on the H200: 4.52 against 5.48 ms per 30B layer at T = 1,024 (PERF "Prefill").
TUNING = Tuning(rows_factor=2)


def supported(gate, up, down) -> bool:
  return (gate.qtype == up.qtype and len(gate.shape) == 3 and qg.supported(gate) and qg.supported(down))


def tile_rows(n_pairs: int, n_experts: int, tuning: Tuning | None = None) -> int:
  """Rows per tile M: the tuning's rows, or rows_factor x the power of two nearest the mean rows per expert, in
  [16, 128] (a larger M dequantizes each expert's weights fewer times, for more padding rows in the MMAs)."""
  t = fill(tuning, TUNING)
  if t.rows:
    return int(t.rows)
  return min(128, max(qg.MIN_DOT, t.rows_factor * grouped_tile_rows(n_pairs, n_experts)))


def _cfg(w, tile):
  nb = w.shape[-1] // qg.quant.GGML_TYPES[w.qtype][0]
  return qg.config(w.qtype, w.shape[-2], nb, tile)


@functools.partial(jax.jit, static_argnames=("gq", "dq", "D", "F", "E", "M", "interpret", "cg", "cd", "form"))
def _grouped(x_TD, ids_TX, w_TX, gplanes, uplanes, dplanes, *, gq, dq, D, F, E, M, interpret, cg, cd, form):
  T, X = ids_TX.shape
  P = T * X
  NT, tile_e, row_tok, row_pair, n_used = tile_layout(ids_TX.astype(I32), E, M)
  n_real = n_used.reshape(1)
  # x's pieces once per token (the piece layout permutes each row, so it commutes with the row gather: X times
  # less transposing than per routed pair); the gate/up kernel loads each tile's rows from them by index, so no
  # [NT*M, ...] copy of x is written
  xo = qg.x_operands(x_TD.astype(F32), gq, form)                              # 2 x [T, lanes, nb*words]
  h = qg.gemm(xo, tile_e, n_real, (*gplanes, *uplanes), qtype=gq, N=F, K=D, M=M, pair=True,
              interpret=interpret, cfg=cg, form=form, row_tok=row_tok)                 # [NT*M, F]
  y = qg.gemm(qg.x_operands(h, dq, form), tile_e, n_real, dplanes, qtype=dq, N=D, K=F, M=M, pair=False,
              interpret=interpret, cfg=cd, form=form)                                  # [NT*M, D]
  # each pair's tile row (a scatter of P int32 indices; padding rows, pair index P, dropped), then the rows
  # gathered in pair order: XLA fuses the gather into the weighted k-sum, so y_PD is never written
  pair_row = jnp.zeros((P,), I32).at[row_pair].set(jnp.arange(row_pair.shape[0], dtype=I32), unique_indices=True,
                                                    mode="drop")
  return combine(y[pair_row], w_TX)


def moe_grouped_pallas(x_TD, ids_TX, w_TX, gate, up, down, *, interpret: bool = False,
                       tuning: Tuning | None = None, precision: str = "auto"):
  """sum_k w[t, k] * down[e](silu(gate[e] x_t) * up[e] x_t), e = ids[t, k], for any number of tokens T, with
  packed QTensor experts gate/up [E, F, D], down [E, D, F] (types in ops/qgemm_pallas.PIECES).
  tuning (static): the tiles and rows per tile (`Tuning`); precision: "auto" | "f32" | "bf16" (qgemm_pallas.form)."""
  if not supported(gate, up, down):
    raise ValueError(f"moe_grouped_pallas: {gate.qtype}/{up.qtype}/{down.qtype} experts {gate.shape}")
  E, F, D = gate.shape
  T, X = ids_TX.shape
  t = tuning or Tuning()
  return _grouped(x_TD, ids_TX, w_TX, tuple(gate.planes), tuple(up.planes), tuple(down.planes), gq=gate.qtype,
                  dq=down.qtype, D=D, F=F, E=E, M=tile_rows(T * X, E, t), interpret=interpret,
                  cg=_cfg(gate, t.gateup), cd=_cfg(down, t.down), form=qg.form(precision))
