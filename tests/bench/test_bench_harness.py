"""bench.kernels's harness on tiny shapes (CPU, interpret mode): the Pallas path, the XLA path and a float64 numpy
pass over the same stacked experts agree, unrolled and scanned, so the GPU figures time the right computation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import kernels as bench
from ops import qmatmul_pallas
from tools.lowering import DEVICES, lower as _lower

SH = bench.Shape(D=256, F=256, E=4, TOPK=2, NPROJ=32)


def _numpy_step(x, ids, w, layers):
  g, u, d = (np.asarray(t.dense(), np.float64) for t in layers)     # ops.quant: bit-exact with gguf-py
  x = np.asarray(x, np.float64)
  for l in range(ids.shape[0]):
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
      for k in range(ids.shape[2]):
        e = int(ids[l, t, k])
        a, b = g[l, e] @ x[t], u[l, e] @ x[t]
        with np.errstate(over="ignore"):                            # silu(a) -> -0 for very negative a
          h = a / (1 + np.exp(-a)) * b
        y[t] += float(w[l, t, k]) * (d[l, e] @ h)
    x = y / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + 1e-6)
  return x


@pytest.mark.parametrize("qtype", ["IQ3_S", "Q4_K"])
def test_step_paths_agree_with_float64(qtype):
  L, T = 3, 2
  layers = bench._experts(jax.random.PRNGKey(0), qtype, L, sh=SH)
  assert layers[0].planes[0].shape[:2] == (L, SH.E)                # stacked [L, E, ...]
  separate = bench._experts(jax.random.PRNGKey(0), qtype, L, separate=True, sh=SH)
  for l in range(L):                                               # the same blocks, one layer's arrays each
    for stacked_t, own in zip(layers, separate[l]):
      assert all(np.array_equal(p[l], q) for p, q in zip(stacked_t.planes, own.planes))
  ids, w = bench._routing(jax.random.PRNGKey(1), L, T, sh=SH)
  x = jax.random.normal(jax.random.PRNGKey(2), (T, SH.D), jnp.float32)
  ref = _numpy_step(x, np.asarray(ids), np.asarray(w), layers)
  # the sweep's form of a tuning: other tiles, the same values within float32 rounding
  tuned, _ = bench.sweep_tunings({"gateup": {"BN": 16, "S": 1, "KS": 1}, "down": {"BN": 32}})
  for impl, tuning in (("pallas", None), ("pallas", tuned), ("xla", None)):
    for loop, ws, r in (("unroll", layers, (ids, w)), ("scan", layers, (ids, w)), ("unroll", separate, (list(ids), list(w)))):
      with jax.default_matmul_precision("highest"):
        y = np.asarray(bench._step_fn(impl, tuning, loop, interpret=True)(x, *r, ws), np.float64)
      assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-4, (impl, tuning, loop, type(ws))
  with pytest.raises(ValueError, match="layer_weights stacked"):
    bench._step_fn("xla", None, "scan")(x, ids, w, separate)
  with pytest.raises(ValueError, match="fold_k"):
    bench.sweep_tunings({"fold_k": False})


def test_projection_copies_separate_or_stacked_sum_the_same():
  from ops import repack
  from ops.qtensor import QTensor
  ws = QTensor(repack.random_planes(jax.random.PRNGKey(7), "Q8_0", (3, SH.NPROJ, SH.D)), "Q8_0", SH.D, "xla")
  own = [ws.replace(planes=tuple(p[i] for p in ws.planes)) for i in range(3)]
  x = jax.random.normal(jax.random.PRNGKey(2), (2, SH.D), jnp.float32)
  ref = sum(np.asarray(o.dense(), np.float64) @ np.asarray(x, np.float64).T for o in own).T
  for impl, w, tuning in (("xla", ws, None), ("xla", own, None), ("pallas", ws, None),
                          ("pallas", own, qmatmul_pallas.Tuning(BN=16, S=1))):
    with jax.default_matmul_precision("highest"):
      y = np.asarray(bench._proj_fn(impl, tuning, interpret=True, sh=SH)(x, w), np.float64)
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-5, (impl, type(w), tuning)


def test_floor_step_runs_the_step_chain_without_weights():
  """The floor cell computes what it says: per layer h[p] = x[t][:F], y[p] = w[p] h[p][j mod F], the top-k sum
  and the norm (a float64 emulation), with the type's grids (its BN) in interpret mode."""
  L, T = 3, 2
  ids, w = bench._routing(jax.random.PRNGKey(1), L, T, sh=SH)
  x = jax.random.normal(jax.random.PRNGKey(2), (T, SH.D), jnp.float32)
  y = np.asarray(bench._floor_fn("Q4_K", interpret=True, sh=SH)(x, ids, w), np.float64)
  ids_l, w_l = bench._routing(jax.random.PRNGKey(1), L, T, separate=True, sh=SH)   # per-layer arrays: the same step
  assert len(ids_l) == L and all(np.array_equal(a, b) for a, b in zip(ids_l, ids))
  np.testing.assert_array_equal(np.asarray(bench._floor_fn("Q4_K", interpret=True, sh=SH)(x, ids_l, w_l)), y)
  ref, wn = np.asarray(x, np.float64), np.asarray(w, np.float64)
  for l in range(L):
    h = ref[:, :SH.F]                                                # every routed pair copies its token's row
    out = np.stack([sum(wn[l, t, k] * h[t][np.arange(SH.D) % SH.F] for k in range(SH.TOPK)) for t in range(T)])
    ref = out / np.sqrt(np.mean(out * out, axis=-1, keepdims=True) + 1e-6)
  np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)


def test_launch_chain_adds_one_per_kernel_and_queued_timing_chains_calls():
  """The launch floor runs layers x n dependent kernels over every column (x + layers * n), and queued_seconds
  feeds each call's output to the next (two untimed + iters timed calls: x + 2 + iters)."""
  x = jax.random.normal(jax.random.PRNGKey(2), (1, SH.D), jnp.float32)
  fn = bench._chain_fn(2, 3, interpret=True)
  np.testing.assert_allclose(np.asarray(fn(x)), np.asarray(x) + 6, rtol=0, atol=1e-5)
  seen = []

  def count(v, inc):
    seen.append(float(v[0, 0]))
    return v + inc
  assert bench.queued_seconds(count, x, 1.0, iters=3) >= 0
  np.testing.assert_allclose(seen, float(x[0, 0]) + np.arange(5), atol=1e-5)


@pytest.mark.parametrize("platform", list(DEVICES))
def test_bench_floor_kernels_lower(platform):
  """The part (b) floor (the step's launches without weight bytes) lowers for both GPU platforms."""
  x = jax.ShapeDtypeStruct((1, bench.SHAPE.D), jnp.float32)
  ids = jax.ShapeDtypeStruct((2, 1, bench.SHAPE.TOPK), jnp.int32)
  w = jax.ShapeDtypeStruct((2, 1, bench.SHAPE.TOPK), jnp.float32)
  txt = _lower(platform, bench._floor_fn("Q4_K").__wrapped__, x, ids, w)
  assert txt.count("__gpu$xla.gpu.triton") == 4                   # two layers x (gate/up-like, down-like)


@pytest.mark.parametrize("platform", list(DEVICES))
def test_bench_launch_chain_lowers(platform):
  """The launch floor (layers x n trivial dependent kernels) lowers for both GPU platforms."""
  x = jax.ShapeDtypeStruct((1, bench.SHAPE.D), jnp.float32)
  txt = _lower(platform, bench._chain_fn(2, 3).__wrapped__, x)
  assert txt.count("__gpu$xla.gpu.triton") == 6
