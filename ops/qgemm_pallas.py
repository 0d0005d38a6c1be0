"""Quantized GEMM on the tensor cores for many rows: prefill projections and the grouped routed-expert FFN.

Decode (B <= 16 rows) is weight-bandwidth-bound and runs the FMA kernels of ops/qmatmul_pallas. With hundreds of
rows the same weights are compute-bound, and the work belongs on the tensor cores. Here a program owns a row tile
of M rows of x and BN rows of W. A row tile holds consecutive tokens of a projection, or the tokens routed to one
expert (tile_e[j] is its expert; `ops.moe.tile_layout`). The program walks K in steps of S blocks. Each step
dequantizes the [BN, S blocks] weight tile once, in registers, and feeds it to bf16 MMAs that all M rows share.
Nothing dequantized is written to memory.

Pieces. A packed uint32 word holds values at several bit positions (bytes, nibbles, 2-bit fields: the *lanes*),
and the word's place in its block is the *word* index. With the lane fixed, the words of S blocks make a
[BN, S * words] tile whose values need no movement between registers. `VALUES[qtype]` yields one such piece
per lane. x is laid out to match (`x_pieces`: [R, lanes, nb * words]), so lane l of blocks [b0, b0 + S) is one
2-D load, and each piece is one [M, S * words] x [S * words, BN] product. `PIECES` gives each type's split of
a block's value index into lane and word axes; `tests/ops/test_kernels.py` checks the pieces against x_pieces of
the dequantized weights.

Precision (`form`: "presplit", float32-accurate, or "x1", one bf16 MMA, the GPU default): in "presplit" w
(float32, from the integer codes and scales, as in the decode tiles) is split into hi = bf16(w) and
lo = bf16(w - hi) in the kernel; x likewise, once, by XLA (`split_bf16_xla`, rounding on the bits: XLA on a GPU
drops a float32 -> bf16 -> float32 round trip as "excess precision", which zeroed lo once: 1.7e-3 error on the
H200). Then acc += xh.wh, += xl.wh, += xh.wl: three bf16 MMAs, each accumulating into acc itself (the form
Triton folds into the MMA: no second accumulator, no spills; `scripts/kernel_sass.py`), float32 accumulation,
~16 significant bits per operand (relative error ~1e-5 per dot). The decode kernels use float32 FMAs instead.
Prefill feeds the ring that every later step reads, plain and speculative alike, so this changes no
greedy-exactness invariant.

Reference: ops/qmatmul.qmatmul_ref (dense) and ops/moe.moe_ref (grouped, via ops/moe_grouped_pallas). Tile sizes:
`Tuning` over the table `TUNING` (BN, S, warps; clipped to divisors of the rows and blocks) and M (rows per tile)
from the caller. Tests: interpret mode on CPU against the references for every type, and lowering for an
abstract CUDA and ROCm device (tests/ops/test_lowering.py).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ops import quant, repack
from ops.tuning import fill
from ops.qmatmul_pallas import (ONE, Q8_FLIP, KERNEL_TYPES, _f16hi, _f16lo, _f32, _iota, _shl,
                                compiler_params, iq3s_grid, table)

U32, I32, F32, BF16 = jnp.uint32, jnp.int32, jnp.float32, jnp.bfloat16

# qtype -> (split of a block's value index, row-major; lane axes; word axes, in the order of the qs plane's dims)
PIECES = {
    "Q8_0": ((8, 4), (1,), (0,)),                          # 4w + c: lane byte c, word w
    "Q4_K": ((4, 2, 8, 4), (1, 3), (0, 2)),                # 64i + 32h + 4j + c: lanes (nibble h, byte c)
    "Q5_K": ((4, 2, 8, 4), (1, 3), (0, 2)),
    "Q6_K": ((2, 2, 2, 2, 4, 4), (1, 5), (0, 2, 3, 4)),    # 128hh + 64sh + 32sl + 16jh + 4jl + cb: lanes (sh, cb)
    "IQ3_S": ((2, 4, 2, 4, 4), (3, 4), (0, 1, 2)),         # 128a + 32pp + 16w2 + 4cb + m: lanes (cb, m)
    "IQ4_NL": ((2, 4, 4), (0, 2), (1,)),                   # 16h + 4jw + cb: lanes (h, cb), word jw
    "IQ4_XS": ((8, 2, 4, 4), (1, 3), (0, 2)),              # 32ib + 16h + 4jw + cb: lanes (h, cb)
}
assert set(PIECES) == set(KERNEL_TYPES)

class Tuning(NamedTuple):
  """A GEMM tile; a field left None takes the type's entry in `TUNING`. BN weight rows per program and S blocks per
  K step (S * words ~ 64 values per piece; both clipped to powers of two dividing the rows and the blocks), Triton
  warps and stages, and rows: the most rows per row tile M of a dense projection (`rows_per_tile`; the grouped
  kernel's M is its own, ops/moe_grouped_pallas)."""
  BN: int | None = None
  S: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None
  rows: int | None = None


# H200 (PERF "Prefill"): BN 64 beat 32 and 128 for Q8_0, IQ3_S and Q4_K at M = 64; larger S was slower; 128 rows
# per dense row tile against 64: 321.7 against 356.0 ms on the 30B prefill.
TUNING: dict[str, Tuning] = {
    "Q8_0": Tuning(BN=64, S=8, num_warps=4, num_stages=1, rows=128),
    "Q4_K": Tuning(BN=64, S=2, num_warps=4, num_stages=1, rows=128),
    "Q5_K": Tuning(BN=64, S=2, num_warps=4, num_stages=1, rows=128),
    "Q6_K": Tuning(BN=64, S=2, num_warps=4, num_stages=1, rows=128),
    "IQ3_S": Tuning(BN=64, S=4, num_warps=4, num_stages=1, rows=128),
    "IQ4_NL": Tuning(BN=64, S=16, num_warps=4, num_stages=1, rows=128),
    "IQ4_XS": Tuning(BN=64, S=2, num_warps=4, num_stages=1, rows=128),
}
MIN_DOT = 16          # smallest MMA extent (M, BN and S * words) the Triton dot takes


def lanes(qtype: str) -> int:
  dims, ln, _ = PIECES[qtype]
  return math.prod(dims[a] for a in ln)


def words(qtype: str) -> int:
  dims, _, wd = PIECES[qtype]
  return math.prod(dims[a] for a in wd)


def x_pieces(x2, qtype: str):
  """x [R, K] -> [R, lanes, nb * words]: lane l of blocks [b0, b0 + S) is the slice [:, l, b0*words:(b0+S)*words]."""
  R, K = x2.shape
  dims, ln, wd = PIECES[qtype]
  nb = K // quant.GGML_TYPES[qtype][0]
  v = x2.reshape(R, nb, *dims).transpose(0, *(2 + a for a in ln), 1, *(2 + a for a in wd))
  return v.reshape(R, lanes(qtype), nb * words(qtype))


def split_bf16(x):
  """float32 x -> (hi, lo) bf16 with hi + lo = x to ~16 significant bits (inside a kernel)."""
  hi = x.astype(BF16)
  return hi, (x - hi.astype(F32)).astype(BF16)


def split_bf16_xla(x):
  """`split_bf16` for XLA, outside a kernel, bitwise the same: hi rounds x to bf16 to nearest-even on its bits
  (an integer add and a mask), so no float32 -> bf16 -> float32 round trip exists for XLA on a GPU to drop as
  "excess precision" (that zeroed lo once: 1.7e-3 error on the H200). hi is then exact in bf16."""
  u = jax.lax.bitcast_convert_type(x, U32)
  hi = jax.lax.bitcast_convert_type((u + jnp.uint32(0x7FFF) + ((u >> 16) & 1)) & jnp.uint32(0xFFFF0000), F32)
  return hi.astype(BF16), (x - hi).astype(BF16)


# The kernel's form, from the precision asked for (`form`):
#   "presplit" (precision "f32"; "auto" on CPU): x split into bf16 hi/lo once by XLA, w split in the kernel,
#         three MMAs each accumulating into acc (~1e-5 relative error of a dot: float32-accurate);
#   "x1" (precision "bf16"; "auto" on a GPU): x and w each rounded to bf16, one MMA (~2e-3 relative error of a
#         dot). Finer than llama.cpp's own prefill GEMMs (MMQ), which quantize x to 8-bit integers per 32 values
#         (5e-3 on the same product: scripts/gpu/gemm_paths.py); 1.7x the speed of "presplit" on the 30B prefill
#         (PERF "Prefill").
# Prefill only: decode and verify passes (<= MAX_B rows) run the FMA kernels of ops/qmatmul_pallas in float32, so
# no form touches the greedy-exactness invariants (a prompt's K/V are the same for every arm that prefills it).
GEMM_FORMS = ("presplit", "x1")
PRECISIONS = {"f32": "presplit", "bf16": "x1"}     # precision -> form; "auto": the backend's


def form(precision: str = "auto") -> str:
  """The GEMM form of a precision: "f32" -> "presplit", "bf16" -> "x1", "auto" -> "x1" on a GPU, "presplit"
  elsewhere."""
  if precision == "auto":
    from ops import on_gpu
    return "x1" if on_gpu() else "presplit"
  if precision not in PRECISIONS:
    raise ValueError(f"prefill precision: {precision!r}, expected auto, {', '.join(PRECISIONS)}")
  return PRECISIONS[precision]


def prefill_gemm(kernels: str, precision: str = "auto") -> str:
  """What a request's prefill GEMMs run, for its records: "xla" (the dequantize-then-dot reference) when the
  params' kernels are "xla", else the form of `precision`.

  >>> prefill_gemm("xla"), prefill_gemm("pallas", "bf16")
  ('xla', 'x1')
  """
  return "xla" if kernels == "xla" else form(precision)


def x_operands(x2, qtype: str, form: str):
  """The kernels' x operands for rows x2 [R, K]: `x_pieces` as bf16 (hi, lo), split once by XLA rather than in
  each of the N / BN programs that read a row tile; under "x1" (hi, hi)."""
  xh, xl = split_bf16_xla(x_pieces(x2, qtype))
  return (xh, xh) if form == "x1" else (xh, xl)


# ------------------------------------------------------------------------------------- values per type
# values(ld, tab) yields (lane, w [BN, S, *word dims] float32), lanes in row-major order of PIECES' lane axes.
# ld(name, *idx): plane `name` at the tile's rows and blocks, then idx -> [BN, S, ...]. Codes enter the mantissa
# under the exponent of 1.0 (f = 1 + q / 2^k, no int -> float conversion), as in the decode tiles.


def _values_q8_0(ld, tab):
  d = ld("d").astype(F32)[:, :, None]                                  # [BN, S, 1]
  q = ld("qs", slice(None))                                            # [BN, S, 8]
  flip = tab[Q8_FLIP]
  for c in range(4):
    f = _f32((_shl(q, 15 - 8 * c) & 0x7F8000) ^ flip)                  # 1 + (q + 128) / 256
    yield c, d * (256.0 * f - 384.0)


def _k_scale_min(h1, h2, h3, k):
  """6-bit scale and min of sub-block k (a uint32 tensor) from the 12 scale bytes, as float32."""
  sh = 8 * (k & 3)
  lo = k < 4
  sc = jnp.where(lo, (h1 >> sh) & 63, ((h3 >> sh) & 15) | (((h1 >> (sh + 6)) & 3) << 4))
  mn = jnp.where(lo, (h2 >> sh) & 63, ((h3 >> (sh + 4)) & 15) | (((h2 >> (sh + 6)) & 3) << 4))
  return sc.astype(I32).astype(F32), mn.astype(I32).astype(F32)


def _values_q45_k(ld, tab, five: bool):
  h = [ld("hdr", k)[:, :, None, None] for k in range(4)]              # [BN, S, 1, 1]
  d, dmin = _f16lo(h[0]), _f16hi(h[0])
  q = ld("qs", slice(None), slice(None))                               # [BN, S, 4 i, 8 j]
  qh = ld("qh", slice(None))[:, :, None, :] if five else None          # [BN, S, 1, 8 j]
  i_ = _iota((1, 1, 4, 1), 2)
  bits = 5 if five else 4
  one = tab[ONE]
  for hh in range(2):
    k = 2 * i_ + hh                                                    # sub-block of word row i
    sc, mn = _k_scale_min(h[1], h[2], h[3], k)
    ds, dm = d * sc, dmin * mn                                         # [BN, S, 4, 1]
    for c in range(4):
      s = 8 * c + 4 * hh
      if five:   # 1 + q / 32, q = nibble | qh bit (8c + k) << 4
        b = (_shl(q, 18 - s) & 0x3C0000) | (((qh >> (8 * c + k)) & 1) << 22)
      else:      # 1 + q / 16
        b = _shl(q, 19 - s) & 0x780000
      f = _f32(b | one)
      yield 4 * hh + c, ds * (float(1 << bits) * (f - 1.0)) - dm


def _values_q4_k(ld, tab):
  return _values_q45_k(ld, tab, five=False)


def _values_q5_k(ld, tab):
  return _values_q45_k(ld, tab, five=True)


def _values_q6_k(ld, tab):
  d = ld("d").astype(F32)[:, :, None, None, None, None]                # [BN, S, 1, 1, 1, 1]
  ql = ld("ql", slice(None), slice(None), slice(None), slice(None))    # [BN, S, 2 hh, 2 sl, 2 jh, 4 jl]
  qh = ld("qh", slice(None), slice(None), slice(None))[:, :, :, None]  # [BN, S, 2 hh, 1, 2 jh, 4 jl]
  sl = _iota((1, 1, 1, 2, 1, 1), 3)
  one = tab[ONE]
  for sh in range(2):
    sc = ld("sc", slice(None), pl.ds(2 * sh, 2), slice(None)).astype(F32)[..., None]   # [BN, S, 2, 2 sl, 2, 1]
    ds = d * sc
    for cb in range(4):   # 1 + q / 64, q = ql nibble sh of byte cb | qh bits 8cb + 2s << 4, s = 2sh + sl
      lq = _shl(ql, 17 - (8 * cb + 4 * sh)) & 0x1E0000
      hq = ((qh >> (8 * cb + 4 * sh + 2 * sl)) & 3) << 21
      f = _f32(lq | hq | one)
      yield 4 * sh + cb, ds * (64.0 * (f - 1.0) - 32.0)


def _values_iq3_s(ld, tab):
  d = ld("d").astype(F32)[:, :, None, None, None]                      # [BN, S, 1, 1, 1]
  qs = ld("qs", slice(None), slice(None), slice(None))                 # [BN, S, 2 a, 4 pp, 2 w2]
  qh = ld("qh", slice(None))[:, :, :, None, None]                      # [BN, S, 2, 1, 1]
  sg = ld("signs", slice(None), slice(None))[:, :, :, :, None]         # [BN, S, 2, 4, 1]
  sc = ld("scales")[:, :, None, None, None]
  a_, pp, w2 = _iota((1, 1, 2, 4, 1), 2), _iota((1, 1, 2, 4, 1), 3), _iota((1, 1, 1, 1, 2), 4)
  db = d * (1 + 2 * ((sc >> (4 * (4 * a_ + pp))) & 15)).astype(I32).astype(F32)   # [BN, S, 2, 4, 1]
  gather, magnitude = iq3s_grid(tab)
  for cb in range(4):
    idx = ((qs >> (8 * cb)) & 255) | (((qh >> (8 * pp + 4 * w2 + cb)) & 1) << 8)
    gw = gather(idx)                                                   # [BN, S, 2, 4, 2]: the grid words
    for m in range(4):
      mag = magnitude(gw, m)
      sbit = (sg << (31 - (16 * w2 + 4 * cb + m))) & jnp.uint32(0x80000000)
      yield 4 * cb + m, db * _f32(jax.lax.bitcast_convert_type(mag, U32) ^ sbit)


def _values_iq4_nl(ld, tab):
  d = ld("d").astype(F32)[:, :, None]                                  # [BN, S, 1]
  q = ld("qs", slice(None))                                            # [BN, S, 4 jw]
  for h in range(2):
    for cb in range(4):
      yield 4 * h + cb, d * tab[((q >> (8 * cb + 4 * h)) & 15).astype(I32)]


def _values_iq4_xs(ld, tab):
  h0, h1 = ld("hdr", 0)[:, :, None, None], ld("hdr", 1)[:, :, None, None]   # [BN, S, 1, 1]
  ib = _iota((1, 1, 8, 1), 2)
  ls = ((h1 >> (4 * ib)) & 15) | (((h0 >> (16 + 2 * ib)) & 3) << 4)
  ds = _f16lo(h0) * (ls.astype(I32) - 32).astype(F32)                  # [BN, S, 8, 1]
  q = ld("qs", slice(None), slice(None))                               # [BN, S, 8 ib, 4 jw]
  for h in range(2):
    for cb in range(4):
      yield 4 * h + cb, ds * tab[((q >> (8 * cb + 4 * h)) & 15).astype(I32)]


VALUES = {
    "Q8_0": _values_q8_0, "Q4_K": _values_q4_k, "Q5_K": _values_q5_k, "Q6_K": _values_q6_k,
    "IQ3_S": _values_iq3_s, "IQ4_NL": _values_iq4_nl, "IQ4_XS": _values_iq4_xs,
}
assert set(VALUES) == set(PIECES)


# ------------------------------------------------------------------------------------------------ kernel


def _dot3(acc, xh, xl, w, form):
  """acc + x [M, k] (as bf16 hi/lo) . w [BN, k]^T -> [M, BN] float32: three bf16 MMAs into acc ("presplit"), or one
  of x's hi and w rounded to bf16 ("x1"). Each product is added to acc on its own (`acc + dot`), the form Triton
  folds into the MMA's accumulator operand; a sum of the products first would hold a second [M, BN] accumulator
  in registers and add it with FADDs."""
  dims = (((1,), (1,)), ((), ()))
  dot = functools.partial(jax.lax.dot_general, dimension_numbers=dims, preferred_element_type=F32)
  if form == "x1":
    return acc + dot(xh, w.astype(BF16))
  wh, wl = split_bf16(w)
  acc = acc + dot(xh, wh)
  acc = acc + dot(xl, wh)
  return acc + dot(xh, wl)


def _kernel(te_ref, nt_ref, *refs, qtype, names, N, M, BN, S, nb, pair, form, gather):
  if gather:
    tok_ref, *refs = refs
  xh_ref, xl_ref, tab_ref, *w_refs, o_ref = refs
  n = len(names)
  Ws = [dict(zip(names, w_refs[i * n:(i + 1) * n])) for i in range(2 if pair else 1)]
  nw = words(qtype)
  j = pl.program_id(1)
  rows = pl.ds(pl.multiple_of(pl.program_id(0) * BN, BN), BN)     # BN divides N; program ids outside pl.when

  @pl.when(j < nt_ref[0])
  def _():
    e = te_ref[j]
    r0 = pl.multiple_of(j * M, M)
    # the tile's x rows: gathered from the token rows by index (gather) or the tile's own rows
    xrows = tok_ref[pl.ds(r0, M)] if gather else pl.ds(r0, M)

    def step(b, accs):
      b0 = b * S
      cols = pl.ds(pl.multiple_of(b0 * nw, nw), S * nw)
      gens = [VALUES[qtype](functools.partial(lambda W, name, *idx: W[name][(e, rows, pl.ds(b0, S), *idx)], W),
                            tab_ref) for W in Ws]
      accs = list(accs)
      for pieces in zip(*gens):                      # the same lane of every weight (gate and up share x)
        at = (xrows, pieces[0][0], cols)
        xh = xh_ref[at]
        xl = xl_ref[at] if form == "presplit" else None
        for i, (_, v) in enumerate(pieces):
          accs[i] = _dot3(accs[i], xh, xl, v.reshape(BN, S * nw), form)
      return tuple(accs)

    accs = jax.lax.fori_loop(0, nb // S, step, tuple(jnp.zeros((M, BN), F32) for _ in Ws))
    if pair:
      g, u = accs
      o_ref[pl.ds(r0, M), rows] = g / (1.0 + jnp.exp(-g)) * u
    else:
      o_ref[pl.ds(r0, M), rows] = accs[0]


def _pow2_divisor(n: int, cap: int) -> int:
  """The largest power of two <= cap dividing n."""
  s = 1
  while s * 2 <= cap and n % (s * 2) == 0:
    s *= 2
  return s


def config(qtype: str, n_rows: int, nb: int, tuning: Tuning | None = None) -> Tuning:
  """The tile: TUNING[qtype] with the fields `tuning` sets, BN and S the largest powers of two up to theirs
  dividing the rows and the blocks (tiles never straddle an edge: no masks, no clamped rows)."""
  c = fill(tuning, TUNING[qtype])
  return c._replace(BN=_pow2_divisor(n_rows, c.BN), S=_pow2_divisor(nb, c.S))


def supported(w) -> bool:
  """Whether a QTensor ([N, K] or experts [E, N, K]) can take this kernel: a type with pieces, 16 | N, and
  S * words reaching the MMA's minimum extent."""
  if w.qtype not in PIECES or len(w.shape) not in (2, 3):
    return False
  nb = w.shape[-1] // quant.GGML_TYPES[w.qtype][0]
  c = config(w.qtype, w.shape[-2], nb)
  return c.BN >= MIN_DOT and c.S * words(w.qtype) >= MIN_DOT


@functools.partial(jax.jit, static_argnames=("qtype", "N", "K", "M", "pair", "interpret", "cfg", "form"))
def gemm(x, tile_e, n_tiles, planes, *, qtype, N, K, M, pair, interpret, cfg, form, row_tok=None):
  """Row tiles of x (`x_operands` of the rows under `form`: (hi, lo), each [R, lanes, nb * words] bf16) times their
  expert's W: y[j*M + m, n] = x[r] . W[tile_e[j], n] with r = j*M + m, or r = row_tok[j*M + m] when row_tok
  [NT * M] int32 is given (the kernel gathers the tile's rows itself: no gathered copy of x is written); pair:
  silu(x . G[e, n]) * (x . U[e, n]), `planes` holding G's planes then U's. planes: [E, N, nb, ...]. Tiles
  j >= n_tiles ([1] int32) are skipped (left unwritten). cfg: the tile (`config`). Returns [NT * M, N] float32."""
  cfg = cfg._replace(num_warps=max(cfg.num_warps, M * cfg.BN // 1024))   # accumulators: <= 32 float32 per thread
  xh, xl = x
  R = xh.shape[0] if row_tok is None else row_tok.shape[0]
  NT = R // M
  nb = K // quant.GGML_TYPES[qtype][0]
  kernel = functools.partial(_kernel, qtype=qtype, names=repack.plane_names(qtype), N=N, M=M, BN=cfg.BN,
                             S=cfg.S, nb=nb, pair=pair, form=form, gather=row_tok is not None)
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((R, N), F32), grid=(pl.cdiv(N, cfg.BN), NT),
      compiler_params=compiler_params(cfg), interpret=interpret,
      name=f"qgemm_{'pair_' if pair else ''}{qtype.lower()}",
  )(tile_e, n_tiles, *(() if row_tok is None else (row_tok,)), xh, xl, table(qtype), *planes)


def rows_per_tile(T: int, most: int) -> int:
  """M for a dense projection of T rows: `most` (the tile's rows), or fewer for short inputs (less padding)."""
  return max(MIN_DOT, min(most, 1 << (max(T, 1) - 1).bit_length()))


def qgemm_pallas(x, w, *, interpret: bool = False, tuning: Tuning | None = None, precision: str = "auto"):
  """x [..., K] @ W[N, K]^T -> [..., N] float32 on the tensor cores, W a 2-D QTensor of a type in PIECES; any
  number of rows (padded to a multiple of the row tile M). tuning (static): the tile's fields to set over
  TUNING[w.qtype]; precision: "auto" | "f32" | "bf16" (`form`)."""
  if not supported(w) or len(w.shape) != 2:
    raise ValueError(f"qgemm_pallas: {w.qtype} {w.shape} is not supported")
  N, K = w.shape
  lead = x.shape[:-1]
  x2 = x.reshape(-1, K).astype(F32)
  T = x2.shape[0]
  nb = K // quant.GGML_TYPES[w.qtype][0]
  cfg = config(w.qtype, N, nb, tuning)
  M = rows_per_tile(T, cfg.rows)
  NT = -(-T // M)
  x2 = jnp.pad(x2, ((0, NT * M - T), (0, 0)))
  f = form(precision)
  y = gemm(x_operands(x2, w.qtype, f), jnp.zeros((NT,), I32), jnp.full((1,), NT, I32),
           tuple(p[None] for p in w.planes), qtype=w.qtype, N=N, K=K, M=M, pair=False, interpret=interpret, cfg=cfg,
           form=f)
  return y[:T].reshape(*lead, N)
