"""Routed experts for many tokens (prefill, long verify passes): the grouped tensor-core GEMM of ops/qgemm_pallas.

The routed (token, expert) pairs are sorted by expert and cut into row tiles of M rows, each belonging to one
expert (`ops.moe.tile_layout`, the layout of the XLA reference `_moe_grouped`). M is twice the power of two nearest
the mean rows per expert, in [16, 128] (`tile_rows`). The token rows are laid out as the gate type's pieces once
per token; the gate/up kernel loads each tile's rows from them by token index (`GATHER_X`). Then come two kernel
calls:

  1. gate/up: grid (F / BN, NT). Program (i, j) dequantizes rows [i*BN, i*BN + BN) of gate[e] and up[e] (e =
     tile_e[j]) piece by piece over D, runs bf16 MMAs against the tile's M rows, and writes
     h = silu(x . gate) * (x . up) [M, BN].
  2. down: the same over h (laid out as the down type's pieces) and down[e]: y [NT * M, D].

Tiles past the last real one (n_used; NT is a static bound for any routing) return at once. The rows then go
back to pair order t*K + k: each pair's row is gathered by the weighted k-sum itself (`COMBINE`), padding rows are
never read. They are weighted by the router and summed over k in a fixed order (`ops.moe._combine`). Each weight value is dequantized once per row
tile of its expert (NT / E ~ P / (M E) + 1 times); the MMAs do P * 3 * F * D * 2 * 3 flops.

Reference: ops/moe.moe_ref. Interpret mode and abstract CUDA/ROCm lowering are tested on CPU
(tests/ops/test_kernels.py, tests/ops/test_lowering.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ops import qgemm_pallas as qg

F32, I32 = jnp.float32, jnp.int32


def supported(gate, up, down) -> bool:
  return (gate.qtype == up.qtype and len(gate.shape) == 3 and qg.supported(gate) and qg.supported(down))


ROWS_FACTOR = 2      # M = ROWS_FACTOR x the power of two nearest the mean rows per expert (read at trace time);
                     # 2 against 1 on the H200: 4.52 against 5.48 ms per 30B layer at T = 1,024 (PERF "Prefill")


COMBINE = "gather"   # how the rows return to pair order (read at trace time): "gather" (each pair's row read by
                     # the k-sum itself) or "scatter" (every row written to a [P, D] array first, as until the
                     # eleventh session: 3.2 ms of the 30B prefill's 87 at 7d1397b); bitwise the same result


GATHER_X = "kernel"  # how x's rows reach the gate/up tiles (read at trace time): "kernel" (the kernel loads each
                     # tile's rows by token index) or "xla" (a gather into tile order first, until the twelfth
                     # session); bitwise the same result


def tile_rows(n_pairs: int, n_experts: int) -> int:
  """Rows per tile M: ROWS_FACTOR x the power of two nearest the mean rows per expert, in [16, 128] (a larger M
  dequantizes each expert's weights fewer times, for more padding rows in the MMAs)."""
  from ops.moe import grouped_tile_rows
  return min(128, max(qg.MIN_DOT, ROWS_FACTOR * grouped_tile_rows(n_pairs, n_experts)))


def _cfg(w, overrides):
  nb = w.shape[-1] // qg.quant.GGML_TYPES[w.qtype][0]
  return tuple(sorted(qg.config(w.qtype, w.shape[-2], nb, overrides).items()))


@functools.partial(jax.jit, static_argnames=("gq", "dq", "D", "F", "E", "M", "interpret", "cg", "cd"))
def _grouped(x_TD, ids_TK, w_TK, gplanes, uplanes, dplanes, *, gq, dq, D, F, E, M, interpret, cg, cd):
  from ops.moe import _combine, tile_layout
  T, K = ids_TK.shape
  P = T * K
  NT, tile_e, row_tok, row_pair, n_used = tile_layout(ids_TK.astype(I32), E, M)
  n_real = n_used.reshape(1)
  # x's pieces once per token (the piece layout permutes each row, so it commutes with the row gather: K times
  # less transposing than per routed pair), then each tile's rows gathered from them
  xo = qg.x_operands(x_TD.astype(F32), gq)                                   # 2 x [T, lanes, nb*words]
  if GATHER_X == "kernel":       # by the gate/up kernel itself, by index: no [NT*M, ...] copy of x is written
    xv, rows = xo, row_tok
  else:                          # by XLA into tile order first (10.1 of the 30B prefill's 91 ms at a9443ff)
    xv, rows = ((xo[0][row_tok],) * 2 if xo[0] is xo[1] else tuple(a[row_tok] for a in xo)), None
  h = qg.gemm(xv, tile_e, n_real, (*gplanes, *uplanes), qtype=gq, N=F, K=D, M=M, pair=True,
              interpret=interpret, cfg=cg, row_tok=rows)                          # [NT*M, F]
  y = qg.gemm(qg.x_operands(h, dq), tile_e, n_real, dplanes, qtype=dq, N=D, K=F, M=M, pair=False, interpret=interpret,
              cfg=cd)                                                             # [NT*M, D]
  if COMBINE == "scatter":
    # rows of tiles past n_used were never written: the scatter drops them (their pair index is P)
    y_PD = jnp.zeros((P, D), F32).at[row_pair].set(y, unique_indices=True, mode="drop")
  else:
    # each pair's tile row (a scatter of P int32 indices; padding rows, pair index P, dropped), then the rows
    # gathered in pair order: XLA fuses the gather into the weighted k-sum, so y_PD is never written
    pair_row = jnp.zeros((P,), I32).at[row_pair].set(jnp.arange(row_pair.shape[0], dtype=I32), unique_indices=True,
                                                      mode="drop")
    y_PD = y[pair_row]
  return _combine(y_PD, w_TK)


def moe_grouped_pallas(x_TD, ids_TK, w_TK, gate, up, down, *, interpret: bool = False,
                       overrides: dict | None = None, rows: int | None = None):
  """sum_k w[t, k] * down[e](silu(gate[e] x_t) * up[e] x_t), e = ids[t, k], for any number of tokens T, with
  packed QTensor experts gate/up [E, F, D], down [E, D, F] (types in ops/qgemm_pallas.PIECES).
  overrides: {"gateup": {...}, "down": {...}} tile sizes; rows: M, the rows per tile (default `tile_rows`)."""
  if not supported(gate, up, down):
    raise ValueError(f"moe_grouped_pallas: {gate.qtype}/{up.qtype}/{down.qtype} experts {gate.shape}")
  E, F, D = gate.shape
  T, K = ids_TK.shape
  ov = overrides or {}
  return _grouped(x_TD, ids_TK, w_TK, tuple(gate.planes), tuple(up.planes), tuple(down.planes), gq=gate.qtype,
                  dq=down.qtype, D=D, F=F, E=E, M=int(rows or tile_rows(T * K, E)), interpret=interpret,
                  cg=_cfg(gate, ov.get("gateup")), cd=_cfg(down, ov.get("down")))
