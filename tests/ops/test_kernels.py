"""Quantized kernels on CPU: repacked planes (bit-exact both ways), and the Pallas kernels in interpret mode against
the jnp reference for every kernel type at B in {1, 3, 8}, odd N, several experts; greedy tokens of a tiny model
identical between kernels "xla" and "interpret". Shapes are tiny: interpret mode copies every input per grid step.
"""
from __future__ import annotations

import zlib

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from ops import moe as moe_ops
from ops import dot8, moe_grouped_pallas, moe_pallas, qgemm_pallas, qmatmul, qmatmul_pallas, quant, repack
from ops.qtensor import QTensor, with_kernels
from ops.tuning import ByType, Tunings

TYPES = qmatmul_pallas.KERNEL_TYPES
QMM = qmatmul_pallas.Tuning
SMALL = QMM(BN=16, S=2)                      # a small projection tile: several programs and K steps


# Kernel and reference both sum in float32, in different orders. One matmul stays under 1e-5; the MoE chain
# (gate/up, SiLU product, down, weighted k-sum) compounds two of them with cancellation in the down sum: over
# 30 seeds of one (Q8_0, Q4_K, B=3) case its median was 3.4e-6 and its worst 9.5e-6, and another seed gave
# 1.25e-5. A wrong block, column or scale is off by 1e-2 or more.
TOL_MATMUL = 1e-5
TOL_MOE = 3e-5


def _relerr(y, r):
  return float(jnp.linalg.norm(y - r) / jnp.linalg.norm(r))


def _rng(*key):
  """A generator seeded by the test's parameters, the same in every process (str hashes are salted per run)."""
  return np.random.default_rng(zlib.crc32(repr(key).encode()))


@pytest.mark.parametrize("qtype", ["Q8_0", "IQ3_S"])
def test_qmatmul_programs_shrink_the_tile_and_keep_every_bit(qtype):
  """Tuning.programs halves BN until the grid has that many programs; a row's sums do not depend on BN, so the
  result is bitwise the 16-row tile's (batch invariance survives), and both match the jnp reference."""
  rng = _rng(qtype, "programs")
  K, N = 2 * max(256, quant.GGML_TYPES[qtype][0] * 8), 40
  w = QTensor.from_gguf(quant.random_blocks(qtype, (N, K), rng), qtype, K)
  x = jnp.asarray(rng.standard_normal((3, K)).astype(np.float32))
  nb = K // quant.GGML_TYPES[qtype][0]
  assert qmatmul_pallas.config(qtype, N, nb, QMM(BN=16, S=2, programs=12)).BN == 2       # 40 rows: 3 -> 20 programs
  assert qmatmul_pallas.config(qtype, N, nb, QMM(BN=16, S=2, programs=0)).BN == 16
  y16 = qmatmul_pallas.qmatmul_pallas(x, w, interpret=True, tuning=SMALL)
  y2 = qmatmul_pallas.qmatmul_pallas(x, w, interpret=True, tuning=SMALL._replace(programs=12))
  np.testing.assert_array_equal(np.asarray(y2), np.asarray(y16))
  assert _relerr(y2, qmatmul.qmatmul_ref(x, w)) < TOL_MATMUL


@pytest.mark.parametrize("qtype", list(quant.GGML_TYPES))
def test_repack_roundtrip_and_qtensor(qtype):
  rng = np.random.default_rng(1)
  n = 512 if quant.GGML_TYPES[qtype][0] > 1 else 64
  b = quant.random_blocks(qtype, (3, 5, n), rng)
  planes = repack.repack_np(b, qtype, n)
  assert sum(p.nbytes for p in planes) == b.nbytes                       # the same bytes, moved
  np.testing.assert_array_equal(repack.unpack_np(planes, qtype, n), b)
  for pj, pn in zip(repack.repack(jnp.asarray(b), qtype, n), planes):
    np.testing.assert_array_equal(np.asarray(pj), pn)
  t = QTensor.from_gguf(b, qtype, n)
  assert t.shape == (3, 5, n) and t.nbytes == b.nbytes
  np.testing.assert_array_equal(np.asarray(t.data), b)
  ref = np.asarray(quant.dequantize(jnp.asarray(b), qtype, n))
  np.testing.assert_array_equal(np.asarray(t.dense()).view(np.uint32), ref.view(np.uint32))   # bit-exact
  ids = jnp.asarray([2, 0, 2])
  np.testing.assert_array_equal(np.asarray(t[ids].data), b[[2, 0, 2]])
  assert t[1].shape == (5, n) and t[1, 3].shape == (n,)


@pytest.mark.parametrize("qtype", TYPES)
def test_x_view_index_matches_x_view(qtype):
  K = 2 * quant.GGML_TYPES[qtype][0]
  x = jnp.arange(K, dtype=jnp.float32)[None]
  flat = np.asarray(qmatmul_pallas.x_view(x, qtype)).reshape(-1)
  pos = np.asarray(qmatmul_pallas.x_view_index(qtype, jnp.arange(K)))
  np.testing.assert_array_equal(flat[pos], np.arange(K))


@pytest.mark.parametrize("qtype", TYPES)
def test_x_layouts_give_bitwise_equal_results(qtype):
  """The kernels read x in natural order or through the permuted view (the tile's natural_b, a speed choice per
  type): the same values enter the same arithmetic, so the matmul and the expert FFN (gate/up writing h in the
  down type's layout, down reading it) are bitwise equal either way, called directly and through the
  dispatchers with a Tunings."""
  rng = np.random.default_rng(7)
  K = 2 * max(256, quant.GGML_TYPES[qtype][0] * 8)
  w = QTensor.from_gguf(quant.random_blocks(qtype, (37, K), rng), qtype, K)
  x = jnp.asarray(rng.standard_normal((3, K)).astype(np.float32))
  E, F = 4, 256
  gate, up = (QTensor.from_gguf(quant.random_blocks(qtype, (E, F, K), rng), qtype, K) for _ in range(2))
  down = QTensor.from_gguf(quant.random_blocks(qtype, (E, K, F), rng), qtype, F)
  ids = jnp.asarray([[0, 2], [3, 1], [2, 2]], jnp.int32)
  wk = jnp.asarray(rng.random((3, 2)), jnp.float32)
  outs = []
  for natural in (0, 16):
    tile = SMALL._replace(natural_b=natural)
    assert qmatmul_pallas.x_natural(qmatmul_pallas.config(qtype, 37, K // quant.GGML_TYPES[qtype][0], tile), 3) == bool(natural)
    nat = QMM(natural_b=natural)
    moe_t = moe_pallas.Tuning(gateup=nat, down=nat)
    tunings = Tunings(qmatmul=ByType(**{qtype: tile}), moe=ByType(**{qtype: moe_t}))
    ki = [t.replace(kernel="interpret") for t in (w, gate, up, down)]
    outs.append((qmatmul_pallas.qmatmul_pallas(x, w, interpret=True, tuning=tile),
                 moe_pallas.moe_pallas(x, ids, wk, gate, up, down, interpret=True, tuning=moe_t),
                 qmatmul.qmatmul(x, ki[0], tunings=tunings),
                 moe_ops.moe(x, ids, wk, *ki[1:], tunings=tunings)))
  for a, b in zip(*outs):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
  for o in outs:
    np.testing.assert_array_equal(np.asarray(o[0]), np.asarray(o[2]))     # the dispatchers pass the tuning on
    np.testing.assert_array_equal(np.asarray(o[1]), np.asarray(o[3]))
  assert _relerr(outs[0][0], qmatmul.qmatmul_ref(x, w)) < TOL_MATMUL
  assert _relerr(outs[0][1], moe_ops.moe_ref(x, ids, wk, gate, up, down)) < TOL_MOE


@pytest.mark.parametrize("B", [1, 3, 8])
@pytest.mark.parametrize("qtype", TYPES)
def test_qmatmul_interpret_matches_reference(qtype, B):
  rng = _rng(qtype, B)
  K = 2 * max(256, quant.GGML_TYPES[qtype][0] * 8)
  N = 37                                                                  # odd: clamped rows
  w = QTensor.from_gguf(quant.random_blocks(qtype, (N, K), rng), qtype, K)
  x = jnp.asarray(rng.standard_normal((B, K)).astype(np.float32))
  y = qmatmul_pallas.qmatmul_pallas(x, w, interpret=True, tuning=SMALL)
  r = qmatmul.qmatmul_ref(x, w)
  assert y.shape == (B, N)
  assert _relerr(y, r) < TOL_MATMUL


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K"])
def test_k_quant_tile_matches_reference(qtype):
  """The Q4_K / Q5_K tile (word-shaped contributions summed once by the caller) matches the reference, in the
  projection kernel at B = 3 and in both MoE kernels; and the projection's rows do not depend on the batch
  (DESIGN invariant 3)."""
  rng = _rng(qtype, 1)
  K, N = 1024, 37
  w = QTensor.from_gguf(quant.random_blocks(qtype, (N, K), rng), qtype, K)
  x = jnp.asarray(rng.standard_normal((3, K)).astype(np.float32))
  y = qmatmul_pallas.qmatmul_pallas(x, w, interpret=True, tuning=SMALL)
  assert _relerr(y, qmatmul.qmatmul_ref(x, w)) < TOL_MATMUL
  y1 = qmatmul_pallas.qmatmul_pallas(x[1:2], w, interpret=True, tuning=SMALL)
  np.testing.assert_array_equal(np.asarray(y[1:2]), np.asarray(y1))
  E, F, D = 4, 256, 512
  g, u = (QTensor.from_gguf(quant.random_blocks(qtype, (E, F, D), rng), qtype, D) for _ in range(2))
  d = QTensor.from_gguf(quant.random_blocks(qtype, (E, D, F), rng), qtype, F)
  xm = jnp.asarray(rng.standard_normal((2, D)).astype(np.float32))
  ids = jnp.asarray([[0, 3], [2, 1]], jnp.int32)
  wk = jnp.asarray(rng.random((2, 2)).astype(np.float32))
  ym = moe_pallas.moe_pallas(xm, ids, wk, g, u, d, interpret=True)
  assert _relerr(ym, moe_ops.moe_ref(xm, ids, wk, g, u, d)) < TOL_MOE


# every type appears once as gate/up and once as down
_PAIRS = [(TYPES[i], TYPES[(i + 1) % len(TYPES)]) for i in range(len(TYPES))]


@pytest.mark.parametrize("B", [1, 3, 8])
@pytest.mark.parametrize("gq,dq", _PAIRS)
def test_moe_interpret_matches_reference(gq, dq, B):
  rng = _rng(gq, dq, B)
  E, F, D, K = 5, 256, 256, 2
  g = QTensor.from_gguf(quant.random_blocks(gq, (E, F, D), rng), gq, D)
  u = QTensor.from_gguf(quant.random_blocks(gq, (E, F, D), rng), gq, D)
  d = QTensor.from_gguf(quant.random_blocks(dq, (E, D, F), rng), dq, F)
  x = jnp.asarray(rng.standard_normal((B, D)).astype(np.float32))
  ids = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(B)]).astype(np.int32))
  w = jnp.asarray(rng.random((B, K)).astype(np.float32))
  ov = moe_pallas.Tuning(gateup=QMM(BN=64, S=1, unroll=0), down=QMM(BN=64, S=1, unroll=0))
  y = moe_pallas.moe_pallas(x, ids, w, g, u, d, interpret=True, tuning=ov)
  r = moe_ops.moe_ref(x, ids, w, g, u, d)
  assert y.shape == (B, D)
  assert _relerr(y, r) < TOL_MOE


@pytest.mark.parametrize("gq,dq", [("IQ3_S", "Q4_K"), ("Q8_0", "IQ4_NL")])
def test_moe_stacked_layer_index_matches_reference(gq, dq):
  """Stacked [L, E, ...] experts with a traced layer index (the scan-over-layers entry) equal the reference on
  that layer's experts."""
  rng = np.random.default_rng(11)
  L, E, F, D, K, B = 3, 4, 256, 256, 2, 2
  g = QTensor.from_gguf(quant.random_blocks(gq, (L, E, F, D), rng), gq, D)
  u = QTensor.from_gguf(quant.random_blocks(gq, (L, E, F, D), rng), gq, D)
  d = QTensor.from_gguf(quant.random_blocks(dq, (L, E, D, F), rng), dq, F)
  x = jnp.asarray(rng.standard_normal((B, D)).astype(np.float32))
  ids = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(B)]).astype(np.int32))
  w = jnp.asarray(rng.random((B, K)).astype(np.float32))
  ov = moe_pallas.Tuning(gateup=QMM(BN=64, S=1), down=QMM(BN=64, S=1))
  f = jax.jit(lambda l: moe_pallas.moe_pallas(x, ids, w, g, u, d, layer=l, interpret=True, tuning=ov))
  for l in (0, 2):
    r = moe_ops.moe_ref(x, ids, w, g[l], u[l], d[l])
    assert _relerr(f(jnp.int32(l)), r) < TOL_MOE
  with pytest.raises(ValueError, match="layer index"):
    moe_pallas.moe_pallas(x, ids, w, g[0], u[0], d[0], layer=0, interpret=True)


@pytest.mark.parametrize("ks", [2, 4])
def test_moe_split_k_matches_reference(ks):
  """gate/up with D split over KS programs (partial sums added by XLA): equal to the reference, stacked too."""
  rng = np.random.default_rng(13)
  L, E, F, D, K, B = 2, 4, 256, 1024, 2, 3
  g = QTensor.from_gguf(quant.random_blocks("IQ3_S", (L, E, F, D), rng), "IQ3_S", D)
  u = QTensor.from_gguf(quant.random_blocks("IQ3_S", (L, E, F, D), rng), "IQ3_S", D)
  d = QTensor.from_gguf(quant.random_blocks("Q4_K", (L, E, D, F), rng), "Q4_K", F)
  x = jnp.asarray(rng.standard_normal((B, D)).astype(np.float32))
  ids = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(B)]).astype(np.int32))
  w = jnp.asarray(rng.random((B, K)).astype(np.float32))
  ov = moe_pallas.Tuning(gateup=QMM(BN=64, S=1), down=QMM(BN=64, S=1), ks=ks)
  y = moe_pallas.moe_pallas(x, ids, w, g, u, d, layer=1, interpret=True, tuning=ov)
  assert _relerr(y, moe_ops.moe_ref(x, ids, w, g[1], u[1], d[1])) < TOL_MOE
  with pytest.raises(ValueError, match="ks=3"):
    moe_pallas.moe_pallas(x, ids, w, g, u, d, layer=1, interpret=True, tuning=moe_pallas.Tuning(ks=3))


def _random_experts(rng, gq, dq, E, F, D, lead=()):
  """Random valid gate, up [*lead, E, F, D] of type gq and down [*lead, E, D, F] of type dq, as QTensors."""
  g, u = (QTensor.from_gguf(quant.random_blocks(gq, (*lead, E, F, D), rng), gq, D) for _ in range(2))
  return g, u, QTensor.from_gguf(quant.random_blocks(dq, (*lead, E, D, F), rng), dq, F)


@pytest.mark.parametrize("ks", [1, 2])
@pytest.mark.parametrize("gq,dq", [("IQ3_S", "Q4_K"), ("Q8_0", "IQ4_NL")])
def test_moe_skip_pairs_with_a_negative_id(gq, dq, ks):
  """skip=True (expert parallel: pairs another device owns): a pair with id -1 reads no expert and adds 0; the
  result equals the kernel without skip on the same pairs at id 0 with weight 0 (bitwise) and the reference."""
  rng = np.random.default_rng(17)
  E, F, D, K, B = 4, 256, 512, 3, 3
  g, u, d = _random_experts(rng, gq, dq, E, F, D)
  x = jnp.asarray(rng.standard_normal((B, D)).astype(np.float32))
  ids = np.stack([rng.choice(E, K, replace=False) for _ in range(B)]).astype(np.int32)
  own = np.array([[True, False, True], [False, False, True], [False, False, False]])
  w = np.where(own, rng.random((B, K)), 0).astype(np.float32)
  ov = moe_pallas.Tuning(gateup=QMM(BN=64, S=1), down=QMM(BN=64, S=1), ks=ks)
  y = moe_pallas.moe_pallas(x, jnp.asarray(np.where(own, ids, -1)), jnp.asarray(w), g, u, d, interpret=True,
                            tuning=ov, skip=True)
  at0 = jnp.asarray(np.where(own, ids, 0))
  y0 = moe_pallas.moe_pallas(x, at0, jnp.asarray(w), g, u, d, interpret=True, tuning=ov)
  assert np.array_equal(np.asarray(y), np.asarray(y0)) and not np.asarray(y)[2].any()
  assert _relerr(y, moe_ops.moe_ref(x, at0, jnp.asarray(w), g, u, d)) < TOL_MOE


@pytest.mark.parametrize("routing,tuning", [
    ("softmax", None), ("sigmoid", moe_pallas.Tuning(ks=2)),
    ("softmax", moe_pallas.Tuning(gateup=QMM(BN=32, programs=0, x8="int"), down=QMM(x8="int")))])
def test_moe_routes_for_itself_as_the_route_kernel(routing, tuning):
  """Route (Tunings.fuse "topk"): gate/up's programs route from the logits with the route kernel's ops; the result
  is bitwise the route kernel's ids and weights fed to the same kernels (split K and 8-bit h too), and the route
  kernel's top-k matches lax.top_k on these logits; a mismatched bias is a one-line error."""
  from ops import router_pallas
  rng = np.random.default_rng(23)
  E, F, D, K, B = 8, 256, 512, 3, 3
  g, u, d = _random_experts(rng, "IQ3_S", "Q8_0", E, F, D)
  x = jnp.asarray(rng.standard_normal((B, D)).astype(np.float32))
  logits = jnp.asarray(rng.standard_normal((B, E)).astype(np.float32))
  bias = jnp.asarray(rng.standard_normal(E).astype(np.float32) * 0.1) if routing == "sigmoid" else None
  kw = dict(routing=routing, top_k=K, norm_topk=True, routed_scale=1.5)
  ids, w = router_pallas.topk_pallas(logits, bias, interpret=True, **kw)
  want_ids, _ = router_pallas.route_ref(logits, bias, **kw)
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
  want = moe_pallas.moe_pallas(x, ids, w, g, u, d, interpret=True, tuning=tuning)
  route = moe_pallas.Route(routing, K, True, 1.5, bias is not None)
  got = moe_pallas.moe_pallas(x, logits, bias, g, u, d, interpret=True, tuning=tuning, route=route)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  with pytest.raises(ValueError, match="expected top_k <= E, the bias"):
    moe_pallas.moe_pallas(x, logits, None if bias is not None else logits[0], g, u, d, interpret=True, route=route)


def _np_round32(x):
  """numpy's x8 rounding of x [T, K] float32: per 32 values dx = max|x| * (1 / 127) (1 for zeros), q = x / dx
  rounded half away from zero (C's roundf): (q int8 [T, K/32, 32], dx [T, K/32])."""
  xb = x.reshape(x.shape[0], -1, 32)
  dx = np.abs(xb).max(axis=2) * np.float32(1 / 127)
  dx[dx == 0] = 1
  v = xb / dx[..., None]
  return np.clip(np.trunc(v + np.copysign(np.float32(0.5), v)), -127, 127).astype(np.int8), dx


def test_x8_rounding_is_numpys_and_within_half_a_step():
  """dot8's rounding against numpy's (_np_round32), ties included (x / dx = k + 1/2 rounds away from zero): the
  words hold the rounded values in byte order, xsum is their sum times dx, each value is within dx / 2 of x; a block
  of zeros stays zero."""
  x = np.random.default_rng(23).standard_normal((2, 256)).astype(np.float32)
  x[1, 32:64] = 0.0
  x[0, :32] = np.arange(-16, 16) * 0.25 + 0.125         # ties: dx = 0.25 (max 31.75), x / dx = k + 1/2
  x[0, 31] = 31.75
  words, dx, xsum = (np.asarray(a) for a in dot8.quantize_x(jnp.asarray(x)))
  q, want_dx = _np_round32(x)
  np.testing.assert_array_equal(dx, want_dx)
  np.testing.assert_array_equal(words.view(np.int8).reshape(2, 8, 32), q)
  np.testing.assert_allclose(xsum, want_dx * q.astype(np.float32).sum(axis=2), rtol=1e-6)
  assert dx[0, 0] == 0.25 and q[0, 0, 0] == -16 and q[0, 0, 18] == 3    # -15.5 -> -16, 2.5 -> 3 (half-even: 2)
  r = np.asarray(dot8.rounded_x(jnp.asarray(x))).reshape(2, 8, 32)
  xb = x.reshape(2, 8, 32)
  assert np.all(np.abs(r - xb) <= dx[..., None] / 2 * (1 + 1e-6)) and not r[1, 1].any()


@pytest.mark.parametrize("gq", ["IQ3_S", "Q4_K", "Q8_0"])
def test_moe_x8_gateup_matches_reference_on_the_rounded_x(gq):
  """gate/up's tile x8 (ops/dot8: x rounded to 8 bits per 32 values, integer dots; interpret mode runs the int32
  form of "dp4a"): equal to the reference fed dot8.rounded_x, stacked and split over K too; a row's result does
  not depend on the other rows (bitwise: one token against three); x8 on down is a one-line error."""
  rng = np.random.default_rng(19)
  L, E, F, D, K, B = 2, 4, 256, 512, 2, 3
  g, u, d = _random_experts(rng, gq, "Q4_K", E, F, D, lead=(L,))
  x = jnp.asarray(rng.standard_normal((B, D)).astype(np.float32))
  ids = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(B)]).astype(np.int32))
  w = jnp.asarray(rng.random((B, K)).astype(np.float32))
  want = moe_ops.moe_ref(dot8.rounded_x(x), ids, w, g[1], u[1], d[1])
  assert _relerr(moe_ops.moe_ref(x, ids, w, g[1], u[1], d[1]), want) > 1e-4       # the rounding is visible
  for x8, ks in (("dp4a", 1), ("int", 2)):
    ov = moe_pallas.Tuning(gateup=QMM(BN=64, S=1, x8=x8), down=QMM(BN=64, S=1), ks=ks)
    y = moe_pallas.moe_pallas(x, ids, w, g, u, d, layer=1, interpret=True, tuning=ov)
    assert _relerr(y, want) < TOL_MOE, (x8, ks)
  y1 = moe_pallas.moe_pallas(x[1:2], ids[1:2], w[1:2], g, u, d, layer=1, interpret=True, tuning=ov)
  np.testing.assert_array_equal(np.asarray(y1[0]), np.asarray(y[1]))
  with pytest.raises(ValueError, match="moe_pallas down: x8='int' needs gate/up row tiles of whole 32-value"):
    moe_pallas.moe_pallas(x, ids, w, g, u, d, layer=1, interpret=True,
                          tuning=moe_pallas.Tuning(gateup=QMM(BN=16), down=QMM(x8="int")))


def _moe_rounded_h_ref(x, ids, w, g, u, d):
  """The MoE with x and h both rounded to 8 bits (dot8.rounded_x), from the dequantized weights, float64."""
  rx = np.asarray(dot8.rounded_x(x), np.float64)
  G, U, Dn = (np.asarray(t.dense(jnp.float32), np.float64) for t in (g, u, d))
  y = np.zeros((x.shape[0], Dn.shape[1]))
  for t in range(x.shape[0]):
    for k, e in enumerate(np.asarray(ids[t])):
      a, b = G[e] @ rx[t], U[e] @ rx[t]
      h = (a / (1 + np.exp(-a)) * b).astype(np.float32)
      rh = np.asarray(dot8.rounded_x(jnp.asarray(h[None])), np.float64)[0]
      y[t] += float(w[t, k]) * (Dn[e] @ rh)
  return y


@pytest.mark.parametrize("gq,dq", [("IQ3_S", "IQ3_S"), ("Q8_0", "Q4_K")])
def test_moe_x8_down_reads_h_rounded_by_gateup(gq, dq):
  """down's tile x8: gate/up rounds its h rows in its epilogue (BN 32: one block a program), down sums on them;
  against a float64 MoE on the rounded x and the rounded h; split over K (XLA rounds h) too; one token bitwise
  alone and among three."""
  rng = np.random.default_rng(29)
  E, F, D, K, B = 4, 256, 512, 2, 3
  g, u, d = _random_experts(rng, gq, dq, E, F, D)
  x = jnp.asarray(rng.standard_normal((B, D)).astype(np.float32))
  ids = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(B)]).astype(np.int32))
  w = jnp.asarray(rng.random((B, K)).astype(np.float32))
  want = _moe_rounded_h_ref(x, ids, w, g, u, d)
  gate_only = np.asarray(moe_pallas.moe_pallas(x, ids, w, g, u, d, interpret=True,
                                               tuning=moe_pallas.Tuning(gateup=QMM(BN=32, x8="int"))))
  assert _relerr(gate_only, want) > 1e-4                                        # h's rounding is visible
  for ks in (1, 2):
    ov = moe_pallas.Tuning(gateup=QMM(BN=32, S=1, x8="int", programs=0), down=QMM(BN=32, S=1, x8="int"), ks=ks)
    y = moe_pallas.moe_pallas(x, ids, w, g, u, d, interpret=True, tuning=ov)
    assert _relerr(y, want) < TOL_MOE, ks
  ov = ov._replace(ks=1)
  y = moe_pallas.moe_pallas(x, ids, w, g, u, d, interpret=True, tuning=ov)
  y1 = moe_pallas.moe_pallas(x[1:2], ids[1:2], w[1:2], g, u, d, interpret=True, tuning=ov)
  np.testing.assert_array_equal(np.asarray(y1[0]), np.asarray(y[1]))


@pytest.mark.parametrize("qtype", ["Q8_0", "IQ3_S", "Q4_K"])
def test_qmatmul_x8_matches_reference_on_the_rounded_x(qtype):
  """The projection kernel with x8: B = 3 tokens against qmatmul_ref on dot8.rounded_x, and each row against the
  one-token call's (bitwise only on the GPU, scripts/gpu/batch_invariance.py: XLA on CPU fuses the interpreted
  body into its context); a type without 8-bit tiles is a one-line error."""
  rng = _rng(qtype, "x8")
  K, N = 512, 40
  w = QTensor.from_gguf(quant.random_blocks(qtype, (N, K), rng), qtype, K)
  x = jnp.asarray(rng.standard_normal((3, K)).astype(np.float32))
  t = SMALL._replace(x8="dp4a")
  y = qmatmul_pallas.qmatmul_pallas(x, w, interpret=True, tuning=t)
  assert _relerr(y, qmatmul.qmatmul_ref(dot8.rounded_x(x), w)) < TOL_MATMUL
  assert _relerr(qmatmul.qmatmul_ref(x, w), qmatmul.qmatmul_ref(dot8.rounded_x(x), w)) > 1e-4
  for b in range(3):
    np.testing.assert_allclose(np.asarray(qmatmul_pallas.qmatmul_pallas(x[b:b + 1], w, interpret=True, tuning=t)[0]),
                               np.asarray(y[b]), rtol=1e-6, atol=1e-6 * float(jnp.max(jnp.abs(y))))
  q6 = QTensor.from_gguf(quant.random_blocks("Q6_K", (N, K), rng), "Q6_K", K)
  with pytest.raises(ValueError, match="qmatmul_pallas: x8='dp4a' with Q6_K weights"):
    qmatmul_pallas.qmatmul_pallas(x, q6, interpret=True, tuning=t)


def test_qmatmul_stacked_layer_index_matches_reference():
  rng = np.random.default_rng(12)
  w = QTensor.from_gguf(quant.random_blocks("Q4_K", (3, 40, 512), rng), "Q4_K", 512)
  x = jnp.asarray(rng.standard_normal((2, 512)).astype(np.float32))
  f = jax.jit(lambda l: qmatmul_pallas.qmatmul_pallas(x, w, layer=l, interpret=True, tuning=QMM(BN=16, S=1)))
  for l in (0, 2):
    assert _relerr(f(jnp.int32(l)), qmatmul.qmatmul_ref(x, w[l])) < TOL_MATMUL


@pytest.mark.parametrize("qtype", TYPES)
def test_qgemm_interpret_matches_reference(qtype):
  """The tensor-core GEMM (dequantized pieces into bf16x3 dots) for 17 and 40 rows (padded row tiles) against
  the float32 reference (N must be a multiple of 16: 37 rows take the reference): a piece whose values and x columns disagree in order would be far off."""
  rng = _rng(qtype)
  K, N = 512, 48                                                          # BN = 16: three row tiles
  assert not qgemm_pallas.supported(QTensor.from_gguf(quant.random_blocks(qtype, (37, K), rng), qtype, K))
  w = QTensor.from_gguf(quant.random_blocks(qtype, (N, K), rng), qtype, K)
  for T in (17, 40):
    x = jnp.asarray(rng.standard_normal((T, K)).astype(np.float32))
    y = qgemm_pallas.qgemm_pallas(x, w, interpret=True, tuning=qgemm_pallas.Tuning(BN=16))
    assert y.shape == (T, N)
    assert _relerr(y, qmatmul.qmatmul_ref(x, w)) < TOL_MATMUL


@pytest.mark.parametrize("qtype", TYPES)
def test_matmul_tiles_do_not_depend_on_the_batch_up_to_a_verify_pass(qtype, monkeypatch):
  """DESIGN invariant 3 needs a k + 1-token verify pass to compute each row as a one-token step does, and a row's
  partial sums are grouped by the tile: every batch up to INVARIANT_B must reach the kernel with the same tiles
  (the GPU probe scripts/gpu/batch_invariance.py checks the values; CPU interpret mode cannot, XLA fuses the
  kernel body into its context). Larger batches may shrink them (registers)."""
  seen = {}

  def record(x2, layer, planes, x8, **kw):                    # the kernel's entry: keep its tiles, skip the work
    seen[x2.shape[0]] = kw["cfg"]
    return jnp.zeros((x2.shape[0], 64), jnp.float32)

  monkeypatch.setattr(qmatmul_pallas, "_qmatmul", record)
  rng = _rng("tiles", qtype)
  w = QTensor.from_gguf(quant.random_blocks(qtype, (64, 2048), rng), qtype, 2048)
  for B in range(1, qmatmul_pallas.MAX_B + 1):
    qmatmul_pallas.qmatmul_pallas(jnp.zeros((B, 2048), jnp.float32), w, interpret=True)
  assert all(seen[B] == seen[1] for B in range(1, qmatmul_pallas.INVARIANT_B + 1)), seen
  assert qmatmul_pallas.INVARIANT_B >= 4                      # k = 3, the default and the seed's
  assert seen[qmatmul_pallas.MAX_B] != seen[1] or qtype not in ("Q8_0", "Q4_K")   # the budget still shrinks them


def test_split_bf16_xla_is_bitwise_the_kernel_split():
  """x's bf16 hi/lo split, done once by XLA (rounding on the bits), equals the kernels' own split bit for bit:
  magnitudes over 60 decades, exact ties (low half 0x8000, odd and even hi), subnormals, zeros and signs."""
  rng = np.random.default_rng(5)
  x = rng.standard_normal(1 << 16).astype(np.float32) * np.float32(10.0) ** rng.integers(-30, 30, 1 << 16).astype(np.float32)
  u = rng.integers(0, 1 << 31, 4096, dtype=np.uint32)
  ties = ((u & 0x7F7F0000) | 0x8000).view(np.float32)                     # exactly halfway between two bf16
  special = np.array([0.0, -0.0, 1e-40, -3e-39, 1.0, -1.0, 3.3895314e38], np.float32)
  x = jnp.asarray(np.concatenate([x, ties, -ties, special]))
  for a, b in zip(qgemm_pallas.split_bf16(x), jax.jit(qgemm_pallas.split_bf16_xla)(x)):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_qgemm_precisions_match_reference(precision):
  """Both prefill precisions against the reference, dense and grouped, called directly and through the
  dispatchers: "f32" (three bf16 MMAs) within float32 rounding, "bf16" (one MMA) within bf16's."""
  tol = TOL_MOE if precision == "f32" else 1e-2
  rng = _rng("forms", precision)
  w = QTensor.from_gguf(quant.random_blocks("Q4_K", (32, 512), rng), "Q4_K", 512)
  x = jnp.asarray(rng.standard_normal((20, 512)).astype(np.float32))
  tile = qgemm_pallas.Tuning(BN=16)
  y = qgemm_pallas.qgemm_pallas(x, w, interpret=True, tuning=tile, precision=precision)
  assert _relerr(y, qmatmul.qmatmul_ref(x, w)) < (TOL_MATMUL if precision == "f32" else 5e-3)
  yd = qmatmul.qmatmul(x, w.replace(kernel="interpret"), tunings=Tunings(qgemm=tile), precision=precision)
  np.testing.assert_array_equal(np.asarray(yd), np.asarray(y))
  E, F, D, K, T = 3, 256, 256, 2, 20
  g, u = (QTensor.from_gguf(quant.random_blocks("IQ3_S", (E, F, D), rng), "IQ3_S", D) for _ in range(2))
  d = QTensor.from_gguf(quant.random_blocks("Q8_0", (E, D, F), rng), "Q8_0", F)
  ids = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32))
  wk = jnp.asarray(rng.random((T, K)).astype(np.float32))
  xm = jnp.asarray(rng.standard_normal((T, D)).astype(np.float32))
  gt = moe_grouped_pallas.Tuning(gateup=qgemm_pallas.Tuning(BN=64), down=qgemm_pallas.Tuning(BN=64), rows=16)
  ym = moe_grouped_pallas.moe_grouped_pallas(xm, ids, wk, g, u, d, interpret=True, tuning=gt, precision=precision)
  assert _relerr(ym, moe_ops.moe_ref(xm, ids, wk, g, u, d)) < tol
  ki = [t.replace(kernel="interpret") for t in (g, u, d)]
  ymd = moe_ops.moe(xm, ids, wk, *ki, tunings=Tunings(grouped=ByType(IQ3_S=gt)), precision=precision)
  np.testing.assert_array_equal(np.asarray(ymd), np.asarray(ym))


@pytest.mark.parametrize("qtype", ["Q4_K", "IQ3_S"])
def test_qgemm_bf16_is_the_rounded_product(qtype):
  """Precision "bf16" (the form "x1") computes exactly the product of rounded operands, bf16(x) . bf16(w)
  accumulated in float32, so against a float32 reference on those rounded operands only the summation order
  differs (1e-5); against the unrounded product it sits at bf16's ~2e-3, and the routed-expert chain (two GEMMs,
  h rounded between them) within 1e-2 of the float32 reference."""
  rng = _rng("bf16 forms", "x1", qtype)
  w = QTensor.from_gguf(quant.random_blocks(qtype, (32, 512), rng), qtype, 512)
  x = jnp.asarray(rng.standard_normal((20, 512)).astype(np.float32))
  y = qgemm_pallas.qgemm_pallas(x, w, interpret=True, tuning=qgemm_pallas.Tuning(BN=16), precision="bf16")
  rnd = lambda a: a.astype(jnp.bfloat16).astype(jnp.float32)                               # noqa: E731
  ref = jnp.einsum("tk,nk->tn", rnd(x), rnd(w.dense(jnp.float32)), precision="highest")
  assert _relerr(y, ref) < TOL_MATMUL
  full = _relerr(y, qmatmul.qmatmul_ref(x, w))
  assert 1e-4 < full < 5e-3, full                        # rounded, and by no more than bf16's half ulp allows
  E, F, D, K, T = 3, 256, 256, 2, 20
  g, u, d = (QTensor.from_gguf(quant.random_blocks(qtype, shp, rng), qtype, shp[-1]) for shp in ((E, F, D),) * 2 + ((E, D, F),))
  ids = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32))
  wk = jnp.asarray(rng.random((T, K)).astype(np.float32))
  xm = jnp.asarray(rng.standard_normal((T, D)).astype(np.float32))
  gt = moe_grouped_pallas.Tuning(gateup=qgemm_pallas.Tuning(BN=64), down=qgemm_pallas.Tuning(BN=64), rows=16)
  ym = moe_grouped_pallas.moe_grouped_pallas(xm, ids, wk, g, u, d, interpret=True, tuning=gt, precision="bf16")
  assert _relerr(ym, moe_ops.moe_ref(xm, ids, wk, g, u, d)) < 1e-2


def _eqn_shapes(fn, *args):
  """(primitive, output shape) of every equation in fn's jaxpr, nested jaxprs (jit, pallas_call bodies aside)
  included."""
  out = []

  def walk(jaxpr):
    for eq in jaxpr.eqns:
      out.extend((eq.primitive.name, tuple(v.aval.shape)) for v in eq.outvars)
      if eq.primitive.name != "pallas_call":
        for sub in jax.extend.core.jaxprs_in_params(eq.params):
          walk(sub)
  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return out


def test_grouped_layout_writes_no_row_copies():
  """The grouped GEMM with experts of many, one and no tokens matches the reference, and its program holds no
  [P, D] scatter (each pair's row is gathered by the k-sum) and no rank-3 gather of x (the gate/up kernel loads
  its rows by token index)."""
  rng = _rng("switch", "layout")
  E, F, D, K, T = 5, 256, 256, 3, 23
  g, u = (QTensor.from_gguf(quant.random_blocks("Q8_0", (E, F, D), rng), "Q8_0", D) for _ in range(2))
  d = QTensor.from_gguf(quant.random_blocks("Q4_K", (E, D, F), rng), "Q4_K", F)
  ids = np.stack([rng.choice(E - 1, K, replace=False) for _ in range(T)]).astype(np.int32)   # expert E-1: none
  ids[0] = [0, 1, 2]                                                                          # and skewed counts
  wk = jnp.asarray(rng.random((T, K)).astype(np.float32))
  x = jnp.asarray(rng.standard_normal((T, D)).astype(np.float32))
  t = moe_grouped_pallas.Tuning(rows=16)
  f = lambda x, i, w: moe_grouped_pallas.moe_grouped_pallas(x, i, w, g, u, d, interpret=True, tuning=t)  # noqa: E731
  y = np.asarray(f(x, jnp.asarray(ids), wk))
  assert _relerr(y, moe_ops.moe_ref(x, jnp.asarray(ids), wk, g, u, d)) < TOL_MOE
  ops = _eqn_shapes(f, x, jnp.asarray(ids), wk)
  assert not any(p == "scatter" and s == (T * K, D) for p, s in ops)
  assert not any(p == "gather" and len(s) == 3 for p, s in ops)


def test_prefill_precision_picks_the_form():
  """The prefill precision: auto is float32-accurate off the GPU (the CPU tests' interpret runs) and one bf16 MMA
  on it; f32 and bf16 force a form; anything else is a one-line error."""
  assert qgemm_pallas.form() == qgemm_pallas.form("auto") == "presplit"          # this CPU
  assert (qgemm_pallas.form("bf16"), qgemm_pallas.form("f32")) == ("x1", "presplit")
  assert [qgemm_pallas.prefill_gemm(k, "bf16") for k in ("xla", "pallas", "interpret")] == ["xla", "x1", "x1"]
  with pytest.raises(ValueError, match="precision: 'fp8'"):
    qgemm_pallas.form("fp8")


@pytest.mark.parametrize("gq,dq,T,E,K", [("IQ3_S", "Q4_K", 40, 8, 2), ("Q8_0", "Q6_K", 23, 5, 3),
                                         ("Q4_K", "IQ4_XS", 33, 6, 1)])
def test_moe_grouped_interpret_matches_reference(gq, dq, T, E, K):
  """The grouped prefill GEMM (row tiles of one expert, 16 rows each; an expert with no token, experts spanning
  several tiles) against the reference."""
  rng = np.random.default_rng(T * E + K)
  F, D = 256, 512
  g = QTensor.from_gguf(quant.random_blocks(gq, (E, F, D), rng), gq, D)
  u = QTensor.from_gguf(quant.random_blocks(gq, (E, F, D), rng), gq, D)
  d = QTensor.from_gguf(quant.random_blocks(dq, (E, D, F), rng), dq, F)
  x = jnp.asarray(rng.standard_normal((T, D)).astype(np.float32))
  ids = np.stack([rng.choice(E - 1, K, replace=False) for _ in range(T)]).astype(np.int32)   # expert E-1: none
  w = jnp.asarray(rng.random((T, K)).astype(np.float32))
  ov = moe_grouped_pallas.Tuning(gateup=qgemm_pallas.Tuning(BN=64), down=qgemm_pallas.Tuning(BN=128), rows=16)
  y = moe_grouped_pallas.moe_grouped_pallas(x, jnp.asarray(ids), w, g, u, d, interpret=True, tuning=ov)
  assert _relerr(y, moe_ops.moe_ref(x, jnp.asarray(ids), w, g, u, d)) < TOL_MOE
  # dispatch: more than 16 tokens with kernel "interpret" takes the grouped kernels
  y2 = moe_ops.moe(x, jnp.asarray(ids), w, *(t.replace(kernel="interpret") for t in (g, u, d)))
  assert _relerr(y2, y) < TOL_MATMUL


def test_dispatch_uses_kernel_field_and_falls_back():
  rng = np.random.default_rng(3)
  w = QTensor.from_gguf(quant.random_blocks("Q8_0", (16, 64), rng), "Q8_0", 64)
  x = jnp.asarray(rng.standard_normal((2, 64)).astype(np.float32))
  r = qmatmul.qmatmul_ref(x, w)
  y = qmatmul.qmatmul(x, w.replace(kernel="interpret"))
  assert _relerr(y, r) < TOL_MATMUL
  big = jnp.asarray(rng.standard_normal((qmatmul_pallas.MAX_B + 1, 64)).astype(np.float32))
  assert not qmatmul_pallas.supported(w, big.shape[0]) and qgemm_pallas.supported(w)   # many rows: the GEMM
  y = qmatmul.qmatmul(big, w.replace(kernel="interpret"))
  assert _relerr(y, qmatmul.qmatmul_ref(big, w)) < TOL_MATMUL
  assert not np.array_equal(np.asarray(y), np.asarray(qmatmul.qmatmul_ref(big, w)))   # not the reference
  w32 = QTensor.from_gguf(quant.random_blocks("Q8_0", (16, 32), rng), "Q8_0", 32)      # 1 block: 8 < 16 values
  assert not qgemm_pallas.supported(w32)
  np.testing.assert_array_equal(np.asarray(qmatmul.qmatmul(big[:, :32], w32.replace(kernel="interpret"))),
                                np.asarray(qmatmul.qmatmul_ref(big[:, :32], w32)))
  q5 = QTensor.from_gguf(quant.random_blocks("Q5_0", (4, 64), rng), "Q5_0", 64)     # no kernel: reference
  assert not qmatmul_pallas.supported(q5, 1)


def test_greedy_tokens_identical_xla_and_interpret():
  from decode.engine import generate
  from model.loader import load_model
  from tests.models import model_path
  m = load_model(model_path("qwen3moe", "Q4_K_M"))
  kinds = {w.qtype for w in jax.tree_util.tree_leaves(m.params, is_leaf=lambda v: isinstance(v, QTensor))
           if isinstance(w, QTensor)}
  assert kinds & set(TYPES)
  prompt = m.tokenizer.encode("def fib(n):")
  ref = generate(m, prompt, max_new_tokens=8, stop_at_eos=False)
  m.params = with_kernels(m.params, "interpret")
  out = generate(m, prompt, max_new_tokens=8, stop_at_eos=False)
  assert len(out.ids) == 8 and out.ids == ref.ids
  # a prompt of more than 16 tokens: the prefill's experts run the grouped kernels
  long_prompt = m.tokenizer.encode("def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n")
  assert len(long_prompt) > moe_pallas.qp.MAX_B
  m.params = with_kernels(m.params, "xla")
  ref = generate(m, long_prompt, max_new_tokens=4, stop_at_eos=False)
  m.params = with_kernels(m.params, "interpret")
  assert generate(m, long_prompt, max_new_tokens=4, stop_at_eos=False).ids == ref.ids
