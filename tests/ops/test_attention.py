"""Decode attention over the KV ring: the Pallas kernel (interpret mode on CPU) against the jnp reference.

- kernel == reference within float32 tolerance: f32 / bf16 / int8 rings, T in {1, 3}, GQA 1 and 4, wrapped rings;
- capacity invariance (DESIGN 1): bitwise-equal outputs for R in {1536, 2048, 4096} (block 256) at depth 1000,
  for the kernel, the reference and the chunked prefill reference;
- work follows live length (DESIGN 2): the split schedule and the tiles each program visits depend on the
  live length alone; tiles outside the live range are never read (NaN-poisoned, output stays finite);
- dispatch (ref on CPU, kernel for T <= MAX_T, prefill on the chunked reference, refusals);
- the kernel lowers for an abstract CUDA and ROCm device (Triton), which interpret mode does not check.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

from model.kv_ring import KVRing
from ops import attention, attention_pallas, prefill_attention_pallas
from ops.attention import ring_attention, ring_attention_ref, ring_attention_ref_chunked
from ops.attention_pallas import ring_attention_pallas, split_schedule, live_tiles
from ops.tuning import Tunings

AT = attention_pallas.Tuning

DH = 16
SCALE = DH ** -0.5


def _ring(R: int, depth: int, dtype: str, hkv: int, layers: int = 1, seed: int = 0, block: int = 16) -> KVRing:
  """A ring holding positions [0, depth) written in order (row p a function of p and the seed only)."""
  rng = np.random.default_rng(seed)
  k = rng.standard_normal((layers, depth, hkv, DH)).astype(np.float32)
  v = rng.standard_normal((layers, depth, hkv, DH)).astype(np.float32)
  ring = KVRing.create(layers, R, hkv, DH, dtype, block=block)
  for start in range(0, depth, R):                 # one scatter per lap: no slot written twice in one call
    pos = jnp.arange(start, min(start + R, depth), dtype=jnp.int32)
    for layer in range(layers):
      ring = ring.write(layer, pos, jnp.asarray(k[layer, start:start + R]), jnp.asarray(v[layer, start:start + R]))
  return ring.advance(depth)


def _layer(ring: KVRing, i: int = 0):
  sc = (None, None) if ring.k_scale is None else (ring.k_scale[i], ring.v_scale[i])
  return ring.k[i], ring.v[i], *sc


def _q(T: int, hq: int, seed: int = 1):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((T, hq, DH)), jnp.float32)


def _pos(T: int, length: int):
  return jnp.arange(length - T, length, dtype=jnp.int32)


# (T, G, R, depth): T in {1, 3}, GQA 1 and 4, rings within capacity and wrapped (depth > R).
CASES = [(1, 1, 128, 100), (3, 4, 128, 300), (1, 4, 64, 200), (3, 1, 256, 256)]


@pytest.mark.parametrize("dtype", ["f32", "bf16", "int8"])
@pytest.mark.parametrize("T,G,R,depth", CASES)
def test_kernel_matches_reference(dtype, T, G, R, depth):
  hkv = 2
  ring = _ring(R, depth, dtype, hkv)
  q, pos = _q(T, hkv * G), _pos(T, depth)
  ref = ring_attention_ref(q, *_layer(ring), pos, depth, block=32, scale=SCALE)
  out = ring_attention_pallas(q, *_layer(ring), pos, depth, block=32, scale=SCALE, interpret=True,
                              tuning=AT(bk=16, dots="tf32x3"))   # float32 in interpret mode; bf16x2 has its own test
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-6)


def test_layer_stack_equals_one_layer():
  """The whole stack with a traced layer index gives the one-layer result bitwise (no layer copy needed)."""
  ring = _ring(128, 150, "int8", 2, layers=3)
  q, pos = _q(2, 8), _pos(2, 150)
  for impl in ("ref", "interpret"):
    one = ring_attention(q, *_layer(ring, 1), pos, 150, block=32, scale=SCALE, impl=impl)
    f = jax.jit(functools.partial(ring_attention, block=32, scale=SCALE, impl=impl))
    stack = f(q, jnp.stack(ring.k), jnp.stack(ring.v), jnp.stack(ring.k_scale), jnp.stack(ring.v_scale), pos, 150,
              layer=jnp.int32(1))
    np.testing.assert_array_equal(np.asarray(stack), np.asarray(one))


CAPACITIES = (1536, 2048, 4096)
DEPTH = 1000
SPLITS = 4      # few splits, so that a schedule sized from R (24, 32, 64 tiles of 64) would split differently


@functools.lru_cache(maxsize=None)
def _capacity_rings(dtype: str):
  return {R: _ring(R, DEPTH, dtype, 1, block=256) for R in CAPACITIES}


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
@pytest.mark.parametrize("impl", ["kernel", "ref", "ref_chunked"])
def test_capacity_invariance_bitwise(dtype, impl):
  T = 3
  q, pos = _q(T, 4), _pos(T, DEPTH)
  fn = {
      "kernel": functools.partial(ring_attention_pallas, interpret=True, tuning=AT(n_splits=SPLITS)),
      "ref": ring_attention_ref,
      "ref_chunked": functools.partial(ring_attention_ref_chunked, q_chunk=2),
  }[impl]
  outs = {R: np.asarray(fn(q, *_layer(ring), pos, DEPTH, block=256, scale=SCALE))
          for R, ring in _capacity_rings(dtype).items()}
  for R in CAPACITIES[1:]:
    np.testing.assert_array_equal(outs[R], outs[CAPACITIES[0]], err_msg=f"{impl} {dtype}: R={R} vs {CAPACITIES[0]}")


def test_split_schedule_follows_live_length():
  S = attention_pallas.max_splits(4)
  for n in range(1, 3000, 7):
    busy, tps = (int(x) for x in split_schedule(n, S))
    assert busy == min(n, S) and tps == -(-n // S), (n, busy, tps)
    # the strided schedule: each tile exactly once, program s taking the tiles i with i mod S == s
    first = (n * 37) % 500
    seen = []
    for s in range(S):
      start, count = (int(x) for x in attention_pallas.strided_tiles(jnp.int32(s), first, first + n, S))
      tiles = [start + j * S for j in range(count)]
      assert all(i % S == s and first <= i < first + n for i in tiles) and count <= tps
      seen += tiles
    assert sorted(seen) == list(range(first, first + n))
  # The live range below capacity, and so the schedule, is the same for every R.
  for bk in (64, 256):
    got = {R: tuple(int(x) for x in live_tiles(DEPTH, DEPTH - 1, R, bk)) for R in CAPACITIES + (49152, 131072)}
    assert len(set(got.values())) == 1 and got[4096] == (0, (DEPTH - 1) // bk + 1), got
  # ... and the schedule grows with depth, not capacity: deeper means more tiles, never fewer.
  prev = 0
  for depth in (1000, 8000, 32000, 128000):
    _, n = live_tiles(depth, depth - 1, 1 << 20, 64)
    busy, tps = split_schedule(n, S)
    assert int(n) > prev and int(busy) * int(tps) >= int(n)
    prev = int(n)


def test_tiles_visited_independent_of_capacity():
  """The kernel's own count of tiles per program: same for every R, summing to the live tile count."""
  q, pos = _q(1, 4), _pos(1, DEPTH)
  counts = {}
  for R, ring in _capacity_rings("bf16").items():
    _, cnt = ring_attention_pallas(q, *_layer(ring), pos, DEPTH, block=256, scale=SCALE, interpret=True,
                                   tuning=AT(n_splits=SPLITS), count_visits=True)
    counts[R] = np.asarray(cnt)
  bk = attention_pallas.config(DH, 256, 2, jnp.bfloat16).bk
  for R in CAPACITIES:
    np.testing.assert_array_equal(counts[R], counts[CAPACITIES[0]])
    assert counts[R].sum() == (DEPTH - 1) // bk + 1 and counts[R].max() == -(-((DEPTH - 1) // bk + 1) // SPLITS)
  # A wrapped ring visits its live tiles only: about R / bk of them, from the oldest live tile.
  ring = _ring(128, 300, "f32", 1)
  _, cnt = ring_attention_pallas(q, *_layer(ring), _pos(1, 300), 300, block=32, scale=SCALE, interpret=True,
                                 tuning=AT(bk=16), count_visits=True)
  assert int(np.asarray(cnt).sum()) == 299 // 16 - (300 - 128) // 16 + 1


@pytest.mark.parametrize("impl", ["ref", "interpret"])
def test_reads_only_live_blocks(impl):
  """NaN in every slot past the last live tile must never reach the output: those tiles are not read.
  (In a wrapped ring every slot is live; there the visit counts above show the range.)"""
  R, depth, T = 256, 100, 2
  ring = _ring(R, depth, "f32", 2)
  nan = jnp.full_like(ring.v[0][128:], jnp.nan)
  k, v = ring.k[0].at[128:].set(nan), ring.v[0].at[128:].set(nan)          # slots 128.. are positions 128..
  q, pos = _q(T, 4), _pos(T, depth)
  out = ring_attention(q, k, v, None, None, pos, depth, block=32, scale=SCALE, impl=impl)
  assert np.isfinite(np.asarray(out)).all()


def test_dispatch():
  ring = _ring(128, 100, "bf16", 2)
  q, pos = _q(1, 8), _pos(1, 100)
  assert jax.default_backend() == "cpu" and attention.default_impl(1) == "ref"
  ref = ring_attention_ref(q, *_layer(ring), pos, 100, block=32, scale=SCALE)
  np.testing.assert_array_equal(np.asarray(ring_attention(q, *_layer(ring), pos, 100, block=32, scale=SCALE)),
                                np.asarray(ref))
  out = ring_attention(q, *_layer(ring), pos, 100, block=32, scale=SCALE, impl="interpret")
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-6)
  # prefill (T > MAX_T): the reference by default on CPU, the prefill kernel on request
  T = attention_pallas.MAX_T + 4
  qp, pp = _q(T, 8), _pos(T, 100)
  ref_p = np.asarray(ring_attention_ref(qp, *_layer(ring), pp, 100, block=32, scale=SCALE))
  np.testing.assert_array_equal(np.asarray(ring_attention(qp, *_layer(ring), pp, 100, block=32, scale=SCALE)), ref_p)
  a = ring_attention(qp, *_layer(ring), pp, 100, block=32, scale=SCALE, impl="interpret")
  np.testing.assert_allclose(np.asarray(a), ref_p, rtol=2e-5, atol=2e-6)
  # Tunings: the impl for decode and prefill calls, and the kernels' tuning passed on (bitwise the direct call)
  t = Tunings(attention_impl="interpret", attention=AT(bk=16, dots="tf32x3"))
  np.testing.assert_array_equal(
      np.asarray(ring_attention(q, *_layer(ring), pos, 100, block=32, scale=SCALE, tunings=t)),
      np.asarray(ring_attention_pallas(q, *_layer(ring), pos, 100, block=32, scale=SCALE, interpret=True,
                                       tuning=AT(bk=16, dots="tf32x3"))))
  assert attention.default_impl(T, t) == "ref" and attention.default_impl(1, t) == "interpret"
  tp = Tunings(prefill_attention_impl="interpret", prefill_attention=prefill_attention_pallas.Tuning(bk=16))
  np.testing.assert_array_equal(
      np.asarray(ring_attention(qp, *_layer(ring), pp, 100, block=32, scale=SCALE, tunings=tp)),
      np.asarray(prefill_attention_pallas.prefill_attention_pallas(
          qp, *_layer(ring), pp, 100, block=32, scale=SCALE, interpret=True,
          tuning=prefill_attention_pallas.Tuning(bk=16))))
  np.testing.assert_array_equal(np.asarray(ring_attention(q, *_layer(ring), pos, 100, block=32, scale=SCALE,
                                                          tunings=tp)), np.asarray(ref))     # decode: still ref
  with pytest.raises(ValueError, match="attention_impl"):
    Tunings(attention_impl="xla")
  with pytest.raises(ValueError, match="impl"):
    ring_attention(q, *_layer(ring), pos, 100, block=32, scale=SCALE, impl="xla")
  with pytest.raises(ValueError, match="block=48"):
    ring_attention(q, *_layer(ring), pos, 100, block=48, scale=SCALE, impl="pallas")
  # int8 stacks of 2**31..2**32 elements would overflow Triton's int32 offsets: refused (default falls back)
  big = jax.ShapeDtypeStruct((48, 131072, 4, 128), jnp.int8)
  assert "int32 offsets" in attention_pallas.supported(1, 32, 4, 128, 256, big)
  assert attention_pallas.supported(1, 32, 4, 128, 256, jax.ShapeDtypeStruct(big.shape, jnp.bfloat16)) is None


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
@pytest.mark.parametrize("T,G,R,depth", CASES[:2])
def test_kernel_bf16x2_dots_match_reference(dtype, T, G, R, depth):
  """The two-bf16-MMA scheme (ring values exact in bf16, q and p split hi + lo) against the float32 reference:
  ~16 significant bits of q and p, so a few 1e-5 relative, never the ~4e-3 of plain bf16 operands."""
  hkv = 2
  ring = _ring(R, depth, dtype, hkv)
  q, pos = _q(T, hkv * G), _pos(T, depth)
  ref = np.asarray(ring_attention_ref(q, *_layer(ring), pos, depth, block=32, scale=SCALE))
  out = np.asarray(ring_attention_pallas(q, *_layer(ring), pos, depth, block=32, scale=SCALE, interpret=True,
                                         tuning=AT(bk=16, dots="bf16x2")))
  err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
  assert err < 5e-5, err
  one_bf16 = np.linalg.norm(np.asarray(q.astype(jnp.bfloat16), np.float32) - np.asarray(q)) / np.linalg.norm(q)
  assert err < one_bf16 / 20, (err, one_bf16)       # the split pays: far below one bf16 rounding of q


@pytest.mark.parametrize("dtype", ["f32", "int8"])
@pytest.mark.parametrize("T,G,R,depth", CASES)
def test_kernel_lse_matches_reference(dtype, T, G, R, depth):
  """with_lse: the kernel's (out, log-sum-exp) against the reference's attention_with_lse, through the
  dispatcher as the model calls it beside a host tier."""
  hkv = 2
  ring = _ring(R, depth, dtype, hkv)
  q, pos = _q(T, hkv * G), _pos(T, depth)
  o_ref, lse_ref = attention.attention_with_lse(q, *_layer(ring), pos, depth, block=32, scale=SCALE)
  o, lse = ring_attention(q, *_layer(ring), pos, depth, block=32, scale=SCALE, impl="interpret", with_lse=True)
  assert lse.shape == (T, hkv * G)
  np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), rtol=5e-5, atol=5e-6)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref), rtol=1e-5, atol=1e-5)
  o2, lse2 = ring_attention(q, *_layer(ring), pos, depth, block=32, scale=SCALE, impl="ref", with_lse=True)
  np.testing.assert_array_equal(np.asarray(lse2), np.asarray(lse_ref))


def test_kernel_dots_refused_and_f32_ring_stays_tf32():
  ring = _ring(64, 50, "f32", 1)
  q, pos = _q(1, 2), _pos(1, 50)
  with pytest.raises(ValueError, match="dots 'fp8'"):
    ring_attention_pallas(q, *_layer(ring), pos, 50, block=32, scale=SCALE, interpret=True,
                          tuning=AT(bk=16, dots="fp8"))
  assert attention_pallas.dots_for("bf16x2", jnp.float32) == "tf32x3"
  assert attention_pallas.dots_for("bf16x2", jnp.int8) == "bf16x2"


def test_prefill_chunked_matches_reference():
  ring = _ring(128, 90, "int8", 2)
  T = 40
  q, pos = _q(T, 8), _pos(T, 90)
  ref = ring_attention_ref(q, *_layer(ring), pos, 90, block=32, scale=SCALE)
  out = ring_attention_ref_chunked(q, *_layer(ring), pos, 90, block=32, scale=SCALE, q_chunk=16)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("platform,kind", [("cuda", "NVIDIA H200"), ("rocm", "gfx942")])
@pytest.mark.parametrize("dtype", ["bf16", "int8"])
@pytest.mark.parametrize("dots", attention_pallas.DOTS)
def test_kernel_lowers_for_gpu(platform, kind, dtype, dots):
  """Trace and lower the Triton kernel for an abstract GPU (the Qwen3-30B-A3B attention shape, T = 1 and 8)."""
  L, R, hkv, G, dh = 4, 4096, 4, 8, 128
  st = {"bf16": jnp.bfloat16, "int8": jnp.int8}[dtype]
  S = jax.ShapeDtypeStruct
  sc = S((L, R, hkv), jnp.float32) if dtype == "int8" else None
  mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,),
                      abstract_device=AbstractDevice(device_kind=kind, num_cores=None, platform=platform))
  for T in (1, 8):
    f = jax.jit(functools.partial(ring_attention_pallas, block=256, scale=dh ** -0.5, tuning=AT(dots=dots)))
    args = (S((T, hkv * G, dh), jnp.float32), S((L, R, hkv, dh), st), S((L, R, hkv, dh), st), sc, sc,
            S((T,), jnp.int32), S((), jnp.int32), S((), jnp.int32))
    with use_abstract_mesh(mesh):
      text = f.trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert "__gpu$xla.gpu.triton" in text and "ring_decode_attention" in text


def _np_attention(q, k, v, lo, hi, scale):
  """float64 softmax attention of q [T, Hq, Dh] over positions lo[t] .. hi[t] of k, v [N, Hkv, Dh] (slot = position);
  (out, lse), lse -inf and out 0 where a row sees nothing."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  T, Hq, _ = q.shape
  G = Hq // k.shape[1]
  out, lse = np.zeros(q.shape), np.full((T, Hq), -np.inf)
  for t in range(T):
    if hi[t] < lo[t]:
      continue
    for h in range(Hq):
      s = k[lo[t]:hi[t] + 1, h // G] @ q[t, h] * scale
      w = np.exp(s - s.max())
      out[t, h], lse[t, h] = w @ v[lo[t]:hi[t] + 1, h // G] / w.sum(), s.max() + np.log(w.sum())
  return out, lse


@pytest.mark.parametrize("impl", ["ref", "interpret"])
def test_per_row_windows_match_float64(impl):
  """lo_T: row t sees positions lo_t .. q_pos_t of a wrapped ring (the ring beside a host tier: the window of the
  step at its position), in the kernel and the reference, against float64."""
  R, depth, T, hkv, G = 128, 300, 4, 2, 4
  rng = np.random.default_rng(3)
  k = rng.standard_normal((depth, hkv, DH)).astype(np.float32)
  v = rng.standard_normal((depth, hkv, DH)).astype(np.float32)
  ring = KVRing.create(1, R, hkv, DH, "f32", block=32)
  ring = ring.write(0, jnp.arange(depth - R, depth), jnp.asarray(k[-R:]), jnp.asarray(v[-R:])).advance(depth)
  q, pos = _q(T, hkv * G), _pos(T, depth)
  lo = np.asarray(pos) + 1 - (R - T)                       # window W = R - scratch, scratch = T
  want, want_lse = _np_attention(q, k, v, lo, np.asarray(pos), SCALE)
  out, lse = ring_attention(q, *_layer(ring), pos, depth, block=32, scale=SCALE, impl=impl, with_lse=True,
                            lo_T=jnp.asarray(lo, jnp.int32))
  np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-6)
  np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl,T", [("ref", 4), ("interpret", 4), ("ref", 12), ("interpret", 12)])
def test_tier_attention_per_row_bounds_match_float64(impl, T, monkeypatch):
  """attention.tier_attention over a tier of 3 blocks: row t sees positions 0 .. q_hi[t] (-1: none, lse -inf), on
  the reference and block by block through a kernel (folded with merge_lse_pair), against float64: the decode
  kernel for T = 4, the prefill kernel for T = 12 (> MAX_T: a prefill chunk beside the tier)."""
  C, hkv, G, tb = 192, 2, 2, 64
  rng = np.random.default_rng(4)
  k = rng.standard_normal((C, hkv, DH)).astype(np.float32)
  v = rng.standard_normal((C, hkv, DH)).astype(np.float32)
  q = _q(T, hkv * G, seed=5)
  assert attention_pallas.supported(4, hkv * G, hkv, DH, 32, k) is None       # the kernels take these calls
  assert prefill_attention_pallas.supported(hkv * G, hkv, DH, 32) is None
  calls = []                                 # which kernel the blocks ran through (none on the reference)
  for mod, name in ((attention_pallas, "ring_attention_pallas"), (prefill_attention_pallas, "prefill_attention_pallas")):
    real = getattr(mod, name)
    monkeypatch.setattr(mod, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
  for q_hi, span in (([130, 131, 132, 133], None), ([-1, 0, 63, 64], None), ([-1, -1, -1, -1], None),
                     ([126, 127, 128, 191], 128), ([-1, 127, 5, 150], 128)):   # rows with and without a whole span
    q_hi = (q_hi * 3)[:T]
    hi = np.asarray(q_hi)
    want, want_lse = _np_attention(q, k, v, np.zeros(T, int), hi, SCALE)
    out, lse = attention.tier_attention(q, jnp.asarray(k), jnp.asarray(v), None, None, jnp.asarray(hi, jnp.int32),
                                        tier_block=tb, block=32, scale=SCALE, impl=impl, tier_span=span)
    np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-6, err_msg=f"{q_hi} span {span}")
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5, atol=1e-5, err_msg=f"{q_hi} span {span}")
  want_kernel = {"ref": set(), "interpret": {"ring_attention_pallas" if T <= 8 else "prefill_attention_pallas"}}[impl]
  assert set(calls) == want_kernel, calls


def test_verify_rows_equal_the_steps_bitwise_on_a_wrapped_ring():
  """Row t of a T-query call with per-row windows equals the one-query call at its position bitwise (interpret
  mode; the GPU check is scripts/gpu/batch_invariance.py), where the window's start crosses a key tile inside the
  pass. The strided split schedule makes this hold: with splits of consecutive tiles from the first live one, the
  boundaries moved with the pass's first tile and the rows summed in other groups. The same for the host tier's
  blocks and spans through the kernel (attention.tier_attention), rows on both sides of a boundary."""
  R, T, hkv, G, bk, S = 256, 4, 2, 2, 16, 4
  W = R - T
  L = 2 * R + (bk - 3 - T) % bk                           # row windows start at bk - 2, bk - 1, 0, 1 (mod bk)
  rng = np.random.default_rng(6)
  ring = KVRing.create(1, R, hkv, DH, "int8", block=32)
  ring = ring.write(0, jnp.arange(L + T - R, L + T), jnp.asarray(rng.standard_normal((R, hkv, DH)), jnp.float32),
                    jnp.asarray(rng.standard_normal((R, hkv, DH)), jnp.float32))
  q = _q(T, hkv * G, seed=7)
  f = jax.jit(lambda q, p, n, lo: ring_attention_pallas(q, *_layer(ring), p, n, block=32, scale=SCALE, interpret=True,
                                                        tuning=AT(bk=bk, n_splits=S), with_lse=True, lo_T=lo))
  pos = L + jnp.arange(T, dtype=jnp.int32)
  full = f(q, pos, L + T, pos + 1 - W)
  for i in range(T):
    one = f(q[i:i + 1], pos[i:i + 1], L + i + 1, pos[i:i + 1] + 1 - W)
    for a, b in zip(full, one):
      np.testing.assert_array_equal(np.asarray(a[i:i + 1]), np.asarray(b), err_msg=f"row {i}")
  C, tb = 192, 64
  tk = jnp.asarray(rng.standard_normal((C, hkv, DH)), jnp.float32)
  tv = jnp.asarray(rng.standard_normal((C, hkv, DH)), jnp.float32)
  for span, edge in ((None, tb), (2 * tb, 2 * tb)):      # rows on both sides of a tier block / span boundary
    tier = jax.jit(lambda q, hi, span=span: attention.tier_attention(q, tk, tv, None, None, hi, tier_block=tb,
                                                                     block=32, scale=SCALE, impl="interpret",
                                                                     tier_span=span))
    hi = edge - 2 + jnp.arange(T, dtype=jnp.int32)
    full = tier(q, hi)
    for i in range(T):
      one = tier(q[i:i + 1], hi[i:i + 1])
      for a, b in zip(full, one):
        np.testing.assert_array_equal(np.asarray(a[i:i + 1]), np.asarray(b), err_msg=f"tier row {i}, span {span}")
