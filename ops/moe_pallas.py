"""Routed-expert FFN as two Pallas kernels (Triton lowering) over packed experts: only the routed experts are read.

For T <= 16 tokens with top-X routing, P = T*X (token, expert) pairs, p = t*X + k:

  1. gate/up: grid (F / BN, P), row tiles fastest. Program (i, p) loads its expert id e = ids[p] (an int32
     input, no scalar prefetch), reads rows [i*BN, i*BN + BN) of gate[e] and up[e] (QTensor planes
     [E, F, nb, ...]) over the whole D, dequantizes in registers (the tiles of ops/qmatmul_pallas) and writes
     h[p, rows] = silu(gate . x_t) * (up . x_t), straight into the down type's x layout (natural order, or the
     permuted view through `x_view_index`: the down tile's natural_b), so no op runs between the two kernels.
     Optionally (Tuning.ks > 1) D is split over KS programs per row tile and pair; they write partial sums that
     XLA adds in a fixed order before SiLU(g) * u (more programs in flight at B = 1, where the grid is only
     F / BN x X programs).
     Optionally (gate/up's tile x8) the program reads x rounded to 8 bits per 32 values and sums with integer
     dots (ops/dot8's tiles): x comes rounded from the norm kernel before (`x8`) or XLA rounds it once per call.
     With down's tile x8 the program rounds its h rows (whole 32-value blocks: BN a multiple of 32) and writes
     them as dot8.X8 words, scales and sums instead of floats.
  2. down: grid (D / BN, P). Program (i, p) reads rows [i*BN, i*BN + BN) of down[e] over F and writes
     y[p, rows] = w[p] * (down[e] . h[p]). The X partial rows of a token are summed afterwards in a fixed order
     (a [T, X, D] -> [T, D] reduction XLA fuses), so the result is deterministic and every program is short:
     at B = 1 the down grid has D / BN * X programs instead of D / BN, which is what keeps the SMs busy.

Stacked layers: planes may carry a leading layer dim ([L, E, F, nb, ...]) with `layer` an int32 scalar; the
kernels index `[layer, e, rows, ...]` themselves. A model that scans over layers then holds one instance of
each kernel (XLA compiles every Triton custom call on its own) and XLA never copies a layer's slab out of the
stack to feed the custom call (it would: an operand sliced from a stacked array is materialised first).

Nothing dequantized is written to memory; h is P x F float32. Tile sizes: `Tuning` over the table `TUNING` (the
qmatmul tiles with each kernel's S). Reference: ops/moe.moe_ref.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ops import dot8, quant, repack, router_pallas
from ops import qmatmul_pallas as qp
from ops.tuning import fill

F32, I32 = jnp.float32, jnp.int32


class Tuning(NamedTuple):
  """The gate/up and down kernels' tiles (qmatmul_pallas.Tuning; fields left None take `TUNING[kernel, qtype]`)
  and ks, a split of gate/up's D blocks over KS programs (a power of two dividing them; None or 1: off): at B = 1
  it multiplies the programs in flight by KS, and XLA adds the KS partial sums. gateup.x8 runs gate/up on 8-bit x
  (ops/dot8); down.x8 runs down on h rounded to 8 bits, which gate/up's epilogue writes (its BN a multiple of 32:
  whole blocks of h per program; with KS > 1 XLA rounds h)."""
  gateup: qp.Tuning | None = None
  down: qp.Tuning | None = None
  ks: int | None = None


# (kernel, qtype) -> tile: the type's qmatmul tile with the S of each kernel; "gateup" tiles F rows of gate and up,
# "down" tiles D rows.
TUNING: dict[tuple[str, str], qp.Tuning] = {}
for _q in qp.KERNEL_TYPES:
  _super = qp.quant.GGML_TYPES[_q][0] == 256
  TUNING["gateup", _q] = qp.TUNING[_q]._replace(S=2 if _super else 16)
  TUNING["down", _q] = qp.TUNING[_q]._replace(S=1 if _super else 8)


def _lead(lid_ref, e):
  """Leading plane index: (layer, expert) for stacked planes, (expert,) otherwise."""
  return (e,) if lid_ref is None else (lid_ref[0], e)


class Route(NamedTuple):
  """Routing made by gate/up's programs themselves (static; Tunings.fuse "topk"): each program routes its pair's
  token from the router logits with ops.router_pallas.route_row, and the programs of row tile 0 write the pairs'
  ids and weights for down."""
  routing: str
  top_k: int
  norm_topk: bool
  routed_scale: float
  has_bias: bool


def _route_pair(l_ref, b_ref, route: Route, E: int, t, k):
  """(expert id, weight) of pair (t, k): token t's routing, entry k."""
  KP = 1 << (route.top_k - 1).bit_length()
  ids, w = router_pallas.route_row(l_ref[t, :], b_ref[...] if route.has_bias else None, E=E, K=route.top_k, KP=KP,
                                   softmax=route.routing == "softmax", norm_topk=route.norm_topk,
                                   scale=route.routed_scale)
  at = jax.lax.iota(I32, KP) == k
  return jnp.sum(jnp.where(at, ids, 0)), jnp.sum(jnp.where(at, w, 0.0))


def _gateup_kernel(ids_ref, *refs, qtype, names, X, F, BN, S, nb, unroll, down_qtype, stacked, KS, natural,
                   natural_h, skip, tile8, h8, route, E):
  if route is not None:                # ids_ref holds the router logits; the pairs' ids and weights are outputs
    b_ref, refs = (refs[0], refs[1:]) if route.has_bias else (None, refs)
    *refs, rid_ref, rw_ref = refs
  if tile8:
    xw_ref, dx_ref, xs_ref, tab_ref, *refs = refs
  else:
    x_ref, tab_ref, *refs = refs
  lid_ref, refs = (refs[0], refs[1:]) if stacked else (None, refs)
  if KS > 1:
    *w_refs, g_ref, u_ref = refs
  elif h8:
    *w_refs, hw_ref, hdx_ref, hxs_ref = refs
  else:
    *w_refs, h_ref = refs
  n = len(names)
  G, U = dict(zip(names, w_refs[:n])), dict(zip(names, w_refs[n:]))
  p = pl.program_id(1)
  t = p // X
  if route is None:
    e = ids_ref[p]
  else:
    e, wp = _route_pair(ids_ref, b_ref, route, E, t, p % X)
    first = (pl.program_id(0) == 0) & (pl.program_id(2) == 0)     # (read here: not inside a branch)

    @pl.when(first)
    def _():
      rid_ref[p] = e
      rw_ref[p] = wp
  pre = _lead(lid_ref, jnp.maximum(e, 0) if skip else e)
  rows = jnp.minimum(pl.program_id(0) * BN + jax.lax.iota(I32, BN), F - 1)

  kid = pl.program_id(2) if KS > 1 else 0                         # (read here: not inside a branch)
  off = kid * (nb // KS)                                          # split K: this program's share of the blocks

  def tile_sums(b0, s):
    b0 = b0 + off
    if tile8:
      at = lambda ref: (lambda *idx: ref[(t, pl.ds(b0, s), *idx)])
      xs = [(at(xw_ref), at(dx_ref), at(xs_ref))]
      return tuple(tile8(lambda name, *idx: W[name][(*pre, rows, pl.ds(b0, s), *idx)], xs, tab_ref)[0]
                   for W in (G, U))
    xs = [lambda *idx: x_ref[(t, pl.ds(b0, s), *qp.x_index(qtype, natural, idx))]]
    g = qp.TILES[qtype](lambda name, *idx: G[name][(*pre, rows, pl.ds(b0, s), *idx)], xs, tab_ref)[0]
    u = qp.TILES[qtype](lambda name, *idx: U[name][(*pre, rows, pl.ds(b0, s), *idx)], xs, tab_ref)[0]
    return qp.row_sums(g), qp.row_sums(u)

  zero = jnp.zeros((BN,), F32)

  def write(g, u):
    if KS > 1:                        # partial sums; XLA adds the KS parts in a fixed order, then SiLU(g) * u
      # (without skip the kernel is op for op what it was; in a branch program_id cannot be read)
      g_ref[kid if skip else pl.program_id(2), p, rows] = g
      u_ref[kid if skip else pl.program_id(2), p, rows] = u
      return
    h = g / (1.0 + jnp.exp(-g)) * u
    if h8:                            # h rounded to 8 bits for down's x8 tile: BN / 32 whole blocks of 32
      q, dx = dot8.round32(h.reshape(BN // 32, 32))
      i = pl.program_id(0)
      hw_ref[p, pl.ds(i * (BN // 4), BN // 4)] = dot8.pack(q).reshape(BN // 4)
      hdx_ref[p, pl.ds(i * (BN // 32), BN // 32)] = dx
      hxs_ref[p, pl.ds(i * (BN // 32), BN // 32)] = dx * jnp.sum(q, axis=1).astype(F32)
      return
    h_ref[p, rows if natural_h else qp.x_view_index(down_qtype, rows)] = h

  if not skip:
    write(*qp.k_loop(nb // KS, S, unroll, tile_sums, (zero, zero)))
    return

  @pl.when(e >= 0)
  def _():
    write(*qp.k_loop(nb // KS, S, unroll, tile_sums, (zero, zero)))

  @pl.when(e < 0)                     # a skipped pair: no expert rows read, h = 0
  def _():
    write(zero, zero)


def _down_kernel(ids_ref, w_ref, *refs, qtype, names, D, BN, S, nb, unroll, stacked, natural, skip, tile8):
  """Program (i, p): w[p] * (down[ids[p]] . h[p]) over rows [i*BN, i*BN + BN); 0 for a skipped pair (ids[p] < 0,
  with `skip`). With tile8, h comes rounded to 8 bits (words, dx, xsum) and the tile is dot8's."""
  if tile8:
    hw_ref, hdx_ref, hxs_ref, tab_ref, *refs = refs
  else:
    h_ref, tab_ref, *refs = refs
  lid_ref, refs = (refs[0], refs[1:]) if stacked else (None, refs)
  *w_refs, o_ref = refs
  W = dict(zip(names, w_refs))
  rows = jnp.minimum(pl.program_id(0) * BN + jax.lax.iota(I32, BN), D - 1)
  p = pl.program_id(1)
  e = ids_ref[p]
  pre = _lead(lid_ref, jnp.maximum(e, 0) if skip else e)

  def tile_sums(b0, s):
    if tile8:
      at = lambda ref: (lambda *idx: ref[(p, pl.ds(b0, s), *idx)])
      return (tile8(lambda name, *idx: W[name][(*pre, rows, pl.ds(b0, s), *idx)],
                    [(at(hw_ref), at(hdx_ref), at(hxs_ref))], tab_ref)[0],)
    xs = [lambda *idx: h_ref[(p, pl.ds(b0, s), *qp.x_index(qtype, natural, idx))]]
    y = qp.TILES[qtype](lambda name, *idx: W[name][(*pre, rows, pl.ds(b0, s), *idx)], xs, tab_ref)[0]
    return (qp.row_sums(y),)

  def run():
    (y,) = qp.k_loop(nb, S, unroll, tile_sums, (jnp.zeros((BN,), F32),))
    o_ref[p, rows] = w_ref[p] * y

  if not skip:
    run()
    return
  pl.when(e >= 0)(run)

  @pl.when(e < 0)
  def _():
    o_ref[p, rows] = jnp.zeros((BN,), F32)


def supported(x_TD, ids_TX, gate, up, down) -> bool:
  T = ids_TX.shape[0]
  return (gate.qtype == up.qtype and gate.qtype in qp.TILES and down.qtype in qp.TILES and 1 <= T <= qp.MAX_B
          and len(gate.shape) == 3)


def gateup_x8(qtype: str, tuning: Tuning | None = None):
  """The gate/up tile's x8 (None: the float tiles) for `qtype` experts under `tuning`: whether the kernel reads x
  rounded to 8 bits, so that the norm before it can make that (ops.moe.wants_x8)."""
  if ("gateup", qtype) not in TUNING:
    return None
  return fill((tuning or Tuning()).gateup, TUNING["gateup", qtype]).x8


def _cfg(kernel, qtype, rows, nb, tile):
  """One kernel's tile: TUNING[kernel, qtype] with the fields `tile` sets, clipped (qmatmul_pallas.config)."""
  return qp.config(qtype, rows, nb, fill(tile, TUNING[kernel, qtype]))


@functools.partial(jax.jit, static_argnames=("gq", "dq", "D", "F", "interpret", "cg", "cd", "KS", "skip", "parts",
                                             "route"))
def _moe(x_TD, ids_TX, w_TX, layer, gplanes, uplanes, dplanes, x8, *, gq, dq, D, F, interpret, cg, cd, KS, skip,
         parts, route):
  """With `route`, ids_TX is the router logits [T, E] and w_TX the selection bias [E] (or None)."""
  if route is None:
    (T, X), E = ids_TX.shape, 0
    P = T * X
    first = (ids_TX.reshape(P).astype(I32),)
  else:
    (T, E), X = ids_TX.shape, route.top_k
    P = T * X
    first = (ids_TX.astype(F32),) + ((w_TX.astype(F32),) if route.has_bias else ())
  stacked = layer is not None
  lid = () if layer is None else (jnp.asarray(layer, I32).reshape(1),)
  nbD, nbF = D // quant.GGML_TYPES[gq][0], F // quant.GGML_TYPES[dq][0]
  names_g, names_d = repack.plane_names(gq), repack.plane_names(dq)
  nat_g, nat_d = qp.x_natural(cg, 1), qp.x_natural(cd, 1)     # one token (or pair) per program in both kernels
  gateup = functools.partial(_gateup_kernel, qtype=gq, names=names_g, X=X, F=F, BN=cg.BN, S=cg.S,
                             nb=nbD, unroll=cg.unroll, down_qtype=dq, stacked=stacked, KS=KS, natural=nat_g,
                             natural_h=nat_d, skip=skip, h8=bool(cd.x8) and KS == 1, route=route, E=E,
                             tile8=cg.x8 and functools.partial(dot8.TILES[gq], dot=dot8.dot_fn(cg.x8, interpret)))
  xin = dot8.x8_input(x_TD, gq, x8) if cg.x8 else (qp.x_input(x_TD.astype(F32), gq, nat_g),)
  if KS > 1:
    out_shape = (jax.ShapeDtypeStruct((KS, P, F), F32),) * 2
  elif cd.x8:                                    # h rounded in gate/up's epilogue (dot8.X8, flat)
    out_shape = (jax.ShapeDtypeStruct((P, F // 4), I32),) + (jax.ShapeDtypeStruct((P, F // 32), F32),) * 2
  else:
    out_shape = (jax.ShapeDtypeStruct((P, F), F32),)
  if route is not None:                          # the pairs' ids and weights, for down
    out_shape += (jax.ShapeDtypeStruct((P,), I32), jax.ShapeDtypeStruct((P,), F32))
  gu = pl.pallas_call(
      gateup, grid=(pl.cdiv(F, cg.BN), P, KS), out_shape=out_shape,
      compiler_params=qp.compiler_params(cg), interpret=interpret, name=f"moe_gateup_{gq.lower()}",
  )(*first, *xin, qp.table(gq), *lid, *gplanes, *uplanes)
  if route is None:
    ids, wts = first[0], w_TX.reshape(P).astype(F32)
  else:
    *gu, ids, wts = gu
  gu = gu[0] if len(gu) == 1 else gu
  if KS > 1:                                     # XLA adds the partial sums, then makes h
    g, u = (functools.reduce(lambda a, b: a + b, [v[i] for i in range(KS)]) for v in gu)      # fixed order
    h = g / (1.0 + jnp.exp(-g)) * u
    hin = dot8.x8_input(h, dq) if cd.x8 else (qp.x_input(h, dq, nat_d),)   # rounded there for down's x8
  elif cd.x8:
    hin = dot8.x8_view(dot8.X8(*gu), dq)
  else:
    view = qp.XVIEW[dq] if nat_d else tuple(qp.XVIEW[dq][i] for i in qp.XPERM[dq])
    hin = (gu.reshape(P, nbF, *view),)                                  # the x layout of dq
  down = functools.partial(_down_kernel, qtype=dq, names=names_d, D=D, BN=cd.BN, S=cd.S, nb=nbF,
                           unroll=cd.unroll, stacked=stacked, natural=nat_d, skip=skip,
                           tile8=cd.x8 and functools.partial(dot8.TILES[dq], dot=dot8.dot_fn(cd.x8, interpret)))
  y = pl.pallas_call(
      down, out_shape=jax.ShapeDtypeStruct((P, D), F32), grid=(pl.cdiv(D, cd.BN), P),
      compiler_params=qp.compiler_params(cd), interpret=interpret, name=f"moe_down_{dq.lower()}",
  )(ids, wts, *hin, qp.table(dq), *lid, *dplanes)
  y = y.reshape(T, X, D)
  if parts:
    return y
  out = y[:, 0]
  for k in range(1, X):                      # fixed order: out = ((y0 + y1) + y2) + ...
    out = out + y[:, k]
  return out


def moe_pallas(x_TD, ids_TX, w_TX, gate, up, down, *, layer=None, interpret: bool = False,
               tuning: Tuning | None = None, skip: bool = False, x8: dot8.X8 | None = None, parts: bool = False,
               route: Route | None = None):
  """sum_k w[t, k] * down[e](silu(gate[e] x_t) * up[e] x_t), e = ids[t, k]; packed QTensor experts
  gate/up [E, F, D], down [E, D, F]; T <= 16. With `layer` (an int32 scalar, may be traced) the experts are
  stacked over layers, [L, E, F, D] / [L, E, D, F], and layer `layer` is used without slicing it out.
  tuning (static): the tiles' fields to set over TUNING, and the split ks. skip (static): a pair whose id is
  negative (an expert another device owns, under expert parallelism) is skipped: its programs read no expert rows
  and its terms are 0. Off: the kernels are those without the branch. x8: x already rounded to 8 bits (by the norm
  kernel that made it, ops.rmsnorm_pallas), read by a gate/up tile with x8 instead of rounding x here; the float
  tiles ignore it. parts (static): the X weighted rows of each token unsummed, [T, X, D], for a consumer that adds
  them itself in the same order (the next norm kernel, ops.rmsnorm_pallas's pieces). route (static, a `Route`):
  the kernels route for themselves, ids_TX being then the router logits [T, E] and w_TX the selection bias [E] (or
  None): gate/up's programs pick their pairs' experts (the route kernel's ops) and hand ids and weights to down,
  one launch fewer than ops.router_pallas's top-k kernel before this one."""
  if route is not None and (skip or route.top_k > ids_TX.shape[1] or (w_TX is not None) != route.has_bias):
    raise ValueError(f"moe_pallas: route {route} for logits {ids_TX.shape}, bias {w_TX is not None} and skip "
                     f"{skip}, expected top_k <= E, the bias as route.has_bias says and no skip")
  g3, u3, d3 = (w if layer is None else w[0] for w in (gate, up, down))   # per-layer view, for the checks only
  if not supported(x_TD, ids_TX, g3, u3, d3) or len(gate.shape) != 3 + (layer is not None):
    raise ValueError(f"moe_pallas: {gate.qtype}/{up.qtype}/{down.qtype} {gate.shape} with {ids_TX.shape[0]} "
                     f"tokens{'' if layer is None else ' and a layer index'}")
  E, F, D = g3.shape
  nbD, nbF = D // quant.GGML_TYPES[gate.qtype][0], F // quant.GGML_TYPES[down.qtype][0]
  t = tuning or Tuning()
  ks = int(t.ks or 1)
  if ks < 1 or nbD % ks or ks & (ks - 1):
    raise ValueError(f"moe_pallas gateup: ks={ks} must be a power of two dividing {nbD} blocks")
  dot8.check(t.gateup and t.gateup.x8, gate.qtype, "moe_pallas gateup")
  dot8.check(t.down and t.down.x8, down.qtype, "moe_pallas down")
  cg = _cfg("gateup", gate.qtype, F, nbD // ks, t.gateup)
  cd = _cfg("down", down.qtype, D, nbF, t.down)
  if cd.x8 and ks == 1 and (cg.BN % 32 or F % cg.BN):
    raise ValueError(f"moe_pallas down: x8={cd.x8!r} needs gate/up row tiles of whole 32-value blocks of h, "
                     f"expected gateup BN a multiple of 32 dividing F {F}, got BN {cg.BN}")
  return _moe(x_TD, ids_TX, w_TX, layer, tuple(gate.planes), tuple(up.planes), tuple(down.planes), cg.x8 and x8,
              gq=gate.qtype, dq=down.qtype, D=D, F=F, interpret=interpret, KS=ks, skip=bool(skip),
              cg=cg, cd=cd, parts=bool(parts), route=route)
