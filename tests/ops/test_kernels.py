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
from ops import moe_grouped_pallas, moe_pallas, qgemm_pallas, qmatmul, qmatmul_pallas, quant, repack
from ops.qtensor import QTensor, with_kernels

TYPES = qmatmul_pallas.KERNEL_TYPES


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
def test_x_layouts_give_bitwise_equal_results(qtype, monkeypatch, request):
  """The kernels read x in natural order or through the permuted view (qmatmul_pallas.NATURAL_X_MAX_B, a speed
  choice per type): the same values enter the same arithmetic, so the matmul and the expert FFN (gate/up writing
  h in the down type's layout, down reading it) are bitwise equal either way."""
  rng = np.random.default_rng(7)
  K = 2 * max(256, quant.GGML_TYPES[qtype][0] * 8)
  w = QTensor.from_gguf(quant.random_blocks(qtype, (37, K), rng), qtype, K)
  x = jnp.asarray(rng.standard_normal((3, K)).astype(np.float32))
  E, F = 4, 256
  gate, up = (QTensor.from_gguf(quant.random_blocks(qtype, (E, F, K), rng), qtype, K) for _ in range(2))
  down = QTensor.from_gguf(quant.random_blocks(qtype, (E, K, F), rng), qtype, F)
  ids = jnp.asarray([[0, 2], [3, 1], [2, 2]], jnp.int32)
  wk = jnp.asarray(rng.random((3, 2)), jnp.float32)
  request.addfinalizer(jax.clear_caches)              # no trace made under the patched choice outlives it
  outs = []
  for natural in (0, 16):
    monkeypatch.setattr(qmatmul_pallas, "NATURAL_X_MAX_B", {qtype: natural})
    assert qmatmul_pallas.x_natural(qtype, 3) == bool(natural)
    jax.clear_caches()                                          # read at trace time
    outs.append((qmatmul_pallas.qmatmul_pallas(x, w, interpret=True, overrides=dict(BN=16, S=2)),
                 moe_pallas.moe_pallas(x, ids, wk, gate, up, down, interpret=True)))
  for a, b in zip(*outs):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
  assert _relerr(outs[0][1], moe_ops.moe_ref(x, ids, wk, gate, up, down)) < TOL_MOE


@pytest.mark.parametrize("B", [1, 3, 8])
@pytest.mark.parametrize("qtype", TYPES)
def test_qmatmul_interpret_matches_reference(qtype, B):
  rng = _rng(qtype, B)
  K = 2 * max(256, quant.GGML_TYPES[qtype][0] * 8)
  N = 37                                                                  # odd: clamped rows
  w = QTensor.from_gguf(quant.random_blocks(qtype, (N, K), rng), qtype, K)
  x = jnp.asarray(rng.standard_normal((B, K)).astype(np.float32))
  y = qmatmul_pallas.qmatmul_pallas(x, w, interpret=True, overrides=dict(BN=16, S=2))
  r = qmatmul.qmatmul_ref(x, w)
  assert y.shape == (B, N)
  assert _relerr(y, r) < TOL_MATMUL


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K"])
def test_k_quant_tile_forms_match_reference(qtype, fold, retrace):
  """Both forms of the Q4_K / Q5_K tile (qmatmul_pallas.FOLD_K: word-shaped contributions summed once by the caller,
  or a reduction per sub-block) match the reference, in the projection kernel at B = 3 and in both MoE kernels;
  and the projection's rows do not depend on the batch in either form (DESIGN invariant 3)."""
  retrace(qmatmul_pallas, "FOLD_K", fold)
  rng = _rng(qtype, int(fold))
  K, N = 1024, 37
  w = QTensor.from_gguf(quant.random_blocks(qtype, (N, K), rng), qtype, K)
  x = jnp.asarray(rng.standard_normal((3, K)).astype(np.float32))
  y = qmatmul_pallas.qmatmul_pallas(x, w, interpret=True, overrides=dict(BN=16, S=2))
  assert _relerr(y, qmatmul.qmatmul_ref(x, w)) < TOL_MATMUL
  y1 = qmatmul_pallas.qmatmul_pallas(x[1:2], w, interpret=True, overrides=dict(BN=16, S=2))
  np.testing.assert_array_equal(np.asarray(y[1:2]), np.asarray(y1))
  E, F, D = 4, 256, 512
  g, u = (QTensor.from_gguf(quant.random_blocks(qtype, (E, F, D), rng), qtype, D) for _ in range(2))
  d = QTensor.from_gguf(quant.random_blocks(qtype, (E, D, F), rng), qtype, F)
  xm = jnp.asarray(rng.standard_normal((2, D)).astype(np.float32))
  ids = jnp.asarray([[0, 3], [2, 1]], jnp.int32)
  wk = jnp.asarray(rng.random((2, 2)).astype(np.float32))
  ym = moe_pallas.moe_pallas(xm, ids, wk, g, u, d, interpret=True)
  assert _relerr(ym, moe_ops.moe_ref(xm, ids, wk, g, u, d)) < TOL_MOE


def test_iq3s_grid_forms_are_bitwise_the_same(retrace):
  """The 16-bit IQ3_S grid table (qmatmul_pallas.IQ3S_GRID16: 4 x 3-bit codes, magnitude 2c + 1) decodes to the
  GGUF grid; the projection and the prefill GEMM give bitwise the results of the 32-bit table (the same
  magnitudes reach the same arithmetic), the MoE kernels the same within float rounding; all match the reference."""
  rng = _rng("iq3s-grid16")
  K, N, E, F, D = 512, 37, 4, 256, 512
  w = QTensor.from_gguf(quant.random_blocks("IQ3_S", (N, K), rng), "IQ3_S", K)
  w48 = QTensor.from_gguf(quant.random_blocks("IQ3_S", (48, K), rng), "IQ3_S", K)
  x = jnp.asarray(rng.standard_normal((3, K)).astype(np.float32))
  xt = jnp.asarray(rng.standard_normal((17, K)).astype(np.float32))
  g, u = (QTensor.from_gguf(quant.random_blocks("IQ3_S", (E, F, D), rng), "IQ3_S", D) for _ in range(2))
  d = QTensor.from_gguf(quant.random_blocks("IQ3_S", (E, D, F), rng), "IQ3_S", F)
  xm = jnp.asarray(rng.standard_normal((2, D)).astype(np.float32))
  ids = jnp.asarray([[0, 3], [2, 1]], jnp.int32)
  wk = jnp.asarray(rng.random((2, 2)).astype(np.float32))
  out = {}
  for form in (False, True):
    retrace(qmatmul_pallas, "IQ3S_GRID16", form)
    tab = np.asarray(qmatmul_pallas.table("IQ3_S"))
    if form:
      assert tab.dtype == np.uint16 and tab.nbytes < 1200
      codes = tab[:512].astype(np.int64)
      grid = np.stack([2 * ((codes >> (3 * m)) & 7) + 1 for m in range(4)], axis=1)
      np.testing.assert_array_equal(grid, quant.IQ3_S_GRID)
    out[form] = [qmatmul_pallas.qmatmul_pallas(x, w, interpret=True, overrides=dict(BN=16, S=2)),
                 moe_pallas.moe_pallas(xm, ids, wk, g, u, d, interpret=True),
                 qgemm_pallas.qgemm_pallas(xt, w48, interpret=True, overrides=dict(BN=16))]
    assert _relerr(out[form][0], qmatmul.qmatmul_ref(x, w)) < TOL_MATMUL
    assert _relerr(out[form][1], moe_ops.moe_ref(xm, ids, wk, g, u, d)) < TOL_MOE
    assert _relerr(out[form][2], qmatmul.qmatmul_ref(xt, w48)) < TOL_MATMUL
  for i in (0, 2):
    np.testing.assert_array_equal(np.asarray(out[False][i]), np.asarray(out[True][i]))
  # the MoE chain in interpret mode: XLA CPU compiles the two graphs' sums in different orders (1.6e-7); a wrong
  # magnitude would be off by 1e-2 or more
  assert _relerr(out[True][1], out[False][1]) < 1e-6


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
  ov = {"gateup": dict(BN=64, S=1, unroll=0), "down": dict(BN=64, S=1, unroll=0)}
  y = moe_pallas.moe_pallas(x, ids, w, g, u, d, interpret=True, overrides=ov)
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
  ov = {"gateup": dict(BN=64, S=1), "down": dict(BN=64, S=1)}
  f = jax.jit(lambda l: moe_pallas.moe_pallas(x, ids, w, g, u, d, layer=l, interpret=True, overrides=ov))
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
  ov = {"gateup": dict(BN=64, S=1, KS=ks), "down": dict(BN=64, S=1)}
  y = moe_pallas.moe_pallas(x, ids, w, g, u, d, layer=1, interpret=True, overrides=ov)
  assert _relerr(y, moe_ops.moe_ref(x, ids, w, g[1], u[1], d[1])) < TOL_MOE
  with pytest.raises(ValueError, match="KS=3"):
    moe_pallas.moe_pallas(x, ids, w, g, u, d, layer=1, interpret=True, overrides={"gateup": dict(KS=3)})


@pytest.mark.parametrize("dq", ["Q4_K", "IQ3_S"])
def test_moe_down_with_the_topk_sum_matches_reference_and_is_batch_invariant(dq):
  """Down tile option KSUM (each program sums its token's K pairs in order): equal to the reference, stacked and
  not; a token's row bitwise the same whether it runs alone or with 3 others (a verify pass against its steps);
  and refused on the gate/up kernel."""
  rng = np.random.default_rng(14)
  L, E, F, D, K, B = 2, 5, 256, 512, 3, 4
  g = QTensor.from_gguf(quant.random_blocks("IQ3_S", (L, E, F, D), rng), "IQ3_S", D)
  u = QTensor.from_gguf(quant.random_blocks("IQ3_S", (L, E, F, D), rng), "IQ3_S", D)
  d = QTensor.from_gguf(quant.random_blocks(dq, (L, E, D, F), rng), dq, F)
  x = jnp.asarray(rng.standard_normal((B, D)).astype(np.float32))
  ids = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(B)]).astype(np.int32))
  w = jnp.asarray(rng.random((B, K)).astype(np.float32))
  ov = {"gateup": dict(BN=64, S=1), "down": dict(BN=64, S=1, KSUM=True)}
  y = moe_pallas.moe_pallas(x, ids, w, g, u, d, layer=1, interpret=True, overrides=ov)
  assert y.shape == (B, D)
  assert _relerr(y, moe_ops.moe_ref(x, ids, w, g[1], u[1], d[1])) < TOL_MOE
  g0, u0, d0 = g[0], u[0], d[0]
  y0 = moe_pallas.moe_pallas(x, ids, w, g0, u0, d0, interpret=True, overrides=ov)
  assert _relerr(y0, moe_ops.moe_ref(x, ids, w, g0, u0, d0)) < TOL_MOE
  for t in range(B):
    alone = moe_pallas.moe_pallas(x[t:t + 1], ids[t:t + 1], w[t:t + 1], g0, u0, d0, interpret=True, overrides=ov)
    np.testing.assert_array_equal(np.asarray(alone[0]), np.asarray(y0[t]))
  with pytest.raises(ValueError, match="KSUM"):
    moe_pallas.moe_pallas(x, ids, w, g0, u0, d0, interpret=True, overrides={"gateup": dict(KSUM=True)})

  def down_rows(overrides):                  # rows the down kernel writes: one per token with KSUM, else per pair
    jaxpr = jax.make_jaxpr(lambda x: moe_pallas.moe_pallas(x, ids, w, g0, u0, d0, interpret=True,
                                                           overrides=overrides))(x)
    calls = []

    def walk(jx):
      for e in jx.eqns:
        if e.primitive.name == "pallas_call":
          calls.append(e.outvars[0].aval.shape)
        for v in e.params.values():
          sub = getattr(v, "jaxpr", v)
          if hasattr(sub, "eqns"):
            walk(sub)
    walk(jaxpr.jaxpr)
    return calls[-1][0]
  assert (down_rows(ov), down_rows({"gateup": dict(BN=64, S=1), "down": dict(BN=64, S=1)})) == (B, B * K)


def test_qmatmul_stacked_layer_index_matches_reference():
  rng = np.random.default_rng(12)
  w = QTensor.from_gguf(quant.random_blocks("Q4_K", (3, 40, 512), rng), "Q4_K", 512)
  x = jnp.asarray(rng.standard_normal((2, 512)).astype(np.float32))
  f = jax.jit(lambda l: qmatmul_pallas.qmatmul_pallas(x, w, layer=l, interpret=True, overrides=dict(BN=16, S=1)))
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
    y = qgemm_pallas.qgemm_pallas(x, w, interpret=True, overrides=dict(BN=16))
    assert y.shape == (T, N)
    assert _relerr(y, qmatmul.qmatmul_ref(x, w)) < TOL_MATMUL


@pytest.mark.parametrize("qtype", TYPES)
def test_matmul_tiles_do_not_depend_on_the_batch_up_to_a_verify_pass(qtype, monkeypatch):
  """DESIGN invariant 3 needs a k + 1-token verify pass to compute each row as a one-token step does, and a row's
  partial sums are grouped by the tile: every batch up to INVARIANT_B must reach the kernel with the same tiles
  (the GPU probe scripts/gpu/batch_invariance.py checks the values; CPU interpret mode cannot, XLA fuses the
  kernel body into its context). Larger batches may shrink them (registers)."""
  seen = {}

  def record(x2, layer, planes, **kw):                        # the kernel's entry: keep its tiles, skip the work
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


@pytest.mark.parametrize("form", ["presplit", "v1"])
def test_qgemm_forms_agree(form, retrace):
  """Both kernel forms of ops.qgemm_pallas (kept for in-process A/B runs on the GPU) against the reference, dense
  and grouped: the split x operands and the accumulation order are all that differ."""
  retrace(qgemm_pallas, "GEMM_FORM", form)
  rng = _rng("forms", form)
  w = QTensor.from_gguf(quant.random_blocks("Q4_K", (32, 512), rng), "Q4_K", 512)
  x = jnp.asarray(rng.standard_normal((20, 512)).astype(np.float32))
  y = qgemm_pallas.qgemm_pallas(x, w, interpret=True, overrides=dict(BN=16))
  assert _relerr(y, qmatmul.qmatmul_ref(x, w)) < TOL_MATMUL
  E, F, D, K, T = 3, 256, 256, 2, 20
  g, u = (QTensor.from_gguf(quant.random_blocks("IQ3_S", (E, F, D), rng), "IQ3_S", D) for _ in range(2))
  d = QTensor.from_gguf(quant.random_blocks("Q8_0", (E, D, F), rng), "Q8_0", F)
  ids = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32))
  wk = jnp.asarray(rng.random((T, K)).astype(np.float32))
  xm = jnp.asarray(rng.standard_normal((T, D)).astype(np.float32))
  ym = moe_grouped_pallas.moe_grouped_pallas(xm, ids, wk, g, u, d, interpret=True, rows=16,
                                             overrides={"gateup": dict(BN=64), "down": dict(BN=64)})
  assert _relerr(ym, moe_ops.moe_ref(xm, ids, wk, g, u, d)) < TOL_MOE


@pytest.mark.parametrize("form,qtype", [("x1", "Q4_K"), ("x1", "IQ3_S"), ("x2", "Q8_0"), ("x2", "Q6_K")])
def test_qgemm_bf16_forms_are_their_rounded_products(form, qtype, retrace):
  """The faster prefill forms compute exactly the product of rounded operands: "x1" is bf16(x) . bf16(w) and
  "x2" is bf16(x) . w, each accumulated in float32, so against a float32 reference on those rounded operands only
  the summation order differs (1e-5); against the unrounded product they sit at bf16's ~2e-3, and the routed-
  expert chain (two GEMMs, h rounded between them) within 1e-2 of the float32 reference."""
  retrace(qgemm_pallas, "GEMM_FORM", form)
  rng = _rng("bf16 forms", form, qtype)
  w = QTensor.from_gguf(quant.random_blocks(qtype, (32, 512), rng), qtype, 512)
  x = jnp.asarray(rng.standard_normal((20, 512)).astype(np.float32))
  y = qgemm_pallas.qgemm_pallas(x, w, interpret=True, overrides=dict(BN=16))
  rnd = lambda a: a.astype(jnp.bfloat16).astype(jnp.float32)                               # noqa: E731
  wd = w.dense(jnp.float32)
  ref = jnp.einsum("tk,nk->tn", rnd(x), rnd(wd) if form == "x1" else wd, precision="highest")
  assert _relerr(y, ref) < TOL_MATMUL
  full = _relerr(y, qmatmul.qmatmul_ref(x, w))
  assert 1e-4 < full < 5e-3, full                        # rounded, and by no more than bf16's half ulp allows
  E, F, D, K, T = 3, 256, 256, 2, 20
  g, u, d = (QTensor.from_gguf(quant.random_blocks(qtype, shp, rng), qtype, shp[-1]) for shp in ((E, F, D),) * 2 + ((E, D, F),))
  ids = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32))
  wk = jnp.asarray(rng.random((T, K)).astype(np.float32))
  xm = jnp.asarray(rng.standard_normal((T, D)).astype(np.float32))
  ym = moe_grouped_pallas.moe_grouped_pallas(xm, ids, wk, g, u, d, interpret=True, rows=16,
                                             overrides={"gateup": dict(BN=64), "down": dict(BN=64)})
  assert _relerr(ym, moe_ops.moe_ref(xm, ids, wk, g, u, d)) < 1e-2


def _eqn_shapes(fn, *args):
  """(primitive, output shape) of every equation in fn's jaxpr, nested jaxprs (jit, pallas_call bodies aside)
  included: what a layout switch must change."""
  out = []

  def walk(jaxpr):
    for eq in jaxpr.eqns:
      out.extend((eq.primitive.name, tuple(v.aval.shape)) for v in eq.outvars)
      if eq.primitive.name != "pallas_call":
        for sub in jax.extend.core.jaxprs_in_params(eq.params):
          walk(sub)
  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return out


@pytest.mark.parametrize("switch,modes", [("COMBINE", ("scatter", "gather")), ("GATHER_X", ("xla", "kernel"))])
def test_grouped_layout_switches_are_bitwise_the_same(retrace, switch, modes):
  """The grouped GEMM's two layout switches (ops.moe_grouped_pallas, kept for the GPU A/Bs), each its old way
  against the default: the same values, bit for bit, with experts of many, one and no tokens. COMBINE: the rows
  back in pair order, scattered to [P, D] first or gathered by the k-sum (no [P, D] scatter in the program);
  GATHER_X: x's rows gathered into tile order by XLA or loaded by the gate/up kernel by token index (no
  rank-3 gather in the program)."""
  rng = _rng("switch", switch)
  E, F, D, K, T = 5, 256, 256, 3, 23
  g, u = (QTensor.from_gguf(quant.random_blocks("Q8_0", (E, F, D), rng), "Q8_0", D) for _ in range(2))
  d = QTensor.from_gguf(quant.random_blocks("Q4_K", (E, D, F), rng), "Q4_K", F)
  ids = np.stack([rng.choice(E - 1, K, replace=False) for _ in range(T)]).astype(np.int32)   # expert E-1: none
  ids[0] = [0, 1, 2]                                                                          # and skewed counts
  wk = jnp.asarray(rng.random((T, K)).astype(np.float32))
  x = jnp.asarray(rng.standard_normal((T, D)).astype(np.float32))
  ys, ops = {}, {}
  for mode in modes:
    retrace(moe_grouped_pallas, switch, mode)
    f = lambda x, i, w: moe_grouped_pallas.moe_grouped_pallas(x, i, w, g, u, d, interpret=True, rows=16)
    ys[mode] = np.asarray(f(x, jnp.asarray(ids), wk))
    ops[mode] = _eqn_shapes(f, x, jnp.asarray(ids), wk)
  np.testing.assert_array_equal(ys[modes[1]], ys[modes[0]])
  assert _relerr(ys[modes[1]], moe_ops.moe_ref(x, jnp.asarray(ids), wk, g, u, d)) < TOL_MOE
  old_op = (lambda p, s: p == "scatter" and s == (T * K, D)) if switch == "COMBINE" else \
           (lambda p, s: p == "gather" and len(s) == 3)
  assert any(old_op(*o) for o in ops[modes[0]]) and not any(old_op(*o) for o in ops[modes[1]])


def test_prefill_precision_picks_the_form(monkeypatch):
  """--prefill_precision: auto is float32-accurate off the GPU (the CPU tests' interpret runs) and one bf16 MMA
  on it; f32 and bf16 force a form; anything else is a one-line error naming the flag."""
  monkeypatch.setattr(qgemm_pallas, "GEMM_FORM", None)
  assert qgemm_pallas.gemm_form() == "presplit"                # this CPU
  for p, f in (("bf16", "x1"), ("f32", "presplit"), ("auto", None)):
    qgemm_pallas.set_precision(p)
    assert qgemm_pallas.GEMM_FORM == f
  qgemm_pallas.set_precision("bf16")
  assert [qgemm_pallas.prefill_gemm(k) for k in ("xla", "pallas", "interpret")] == ["xla", "x1", "x1"]   # records
  with pytest.raises(ValueError, match="prefill_precision: 'fp8'"):
    qgemm_pallas.set_precision("fp8")


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
  ov = {"gateup": dict(BN=64), "down": dict(BN=128)}
  y = moe_grouped_pallas.moe_grouped_pallas(x, jnp.asarray(ids), w, g, u, d, interpret=True, overrides=ov, rows=16)
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
