"""The per-token Pallas glue kernels against their jnp references (interpret mode on CPU), their batch invariance
(a T-token call's row t is bitwise the same row computed alone), and their lowering for an abstract CUDA and ROCm
device: ops/rmsnorm_pallas (RMSNorm + residual), ops/router_pallas (router logits, top-k routing) and the decode
attention's split merge (ops/attention_pallas.merge_splits)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops import attention, attention_pallas, rmsnorm_pallas, router_pallas
from ops.layers import rms_norm
from tools.lowering import DEVICES, lower as _lower

RNG = np.random.default_rng(0)


def _rows_alone(f, *xs):
  T = xs[0].shape[0]
  return [jax.tree_util.tree_map(np.asarray, f(*(x[i:i + 1] for x in xs))) for i in range(T)]


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_kernel(residual):
  T, D = 5, 256
  x = jnp.asarray(RNG.standard_normal((T, D)) * 3, jnp.float32)
  r = jnp.asarray(RNG.standard_normal((T, D)), jnp.float32) if residual else None
  w = jnp.asarray(1 + 0.1 * RNG.standard_normal(D), jnp.float32)
  got = rmsnorm_pallas.add_rms_norm(x, w, 1e-6, r, impl="interpret", tuning=rmsnorm_pallas.Tuning(num_warps=2))
  if residual:
    s, y = got
    np.testing.assert_array_equal(np.asarray(s), np.asarray(x + r))
    np.testing.assert_allclose(np.asarray(y), np.asarray(rms_norm(x + r, w, 1e-6)), rtol=2e-6, atol=1e-6)
  else:
    np.testing.assert_allclose(np.asarray(got), np.asarray(rms_norm(x, w, 1e-6)), rtol=2e-6, atol=1e-6)
  f = jax.jit(lambda x, *r: rmsnorm_pallas.rms_norm_pallas(x, w, 1e-6, *r, interpret=True))
  full = np.asarray(jax.tree_util.tree_leaves(f(x, *([r] if residual else [])))[-1])
  alone = _rows_alone(lambda *a: jax.tree_util.tree_leaves(f(*a))[-1], x, *([r] if residual else []))
  np.testing.assert_array_equal(full, np.concatenate(alone))
  # the dispatcher keeps the reference where the kernel does not apply (prefill-sized T, D not a power of two)
  assert not rmsnorm_pallas.supported(17, 256) and not rmsnorm_pallas.supported(4, 384)


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_kernel_rounds_its_output_to_8_bits(residual):
  """x8: the kernel also returns its norm rounded to 8 bits per 32 values (ops.dot8.X8), bitwise numpy's rounding
  of that norm (round half away from zero) and XLA's dot8.quantize_x; the norm itself is bitwise the kernel's
  without x8; each row as computed alone."""
  from ops import dot8
  from tests.ops.test_kernels import _np_round32
  T, D = 3, 128
  x = jnp.asarray(RNG.standard_normal((T, D)) * 3, jnp.float32)
  r = [jnp.asarray(RNG.standard_normal((T, D)), jnp.float32)] if residual else []
  w = jnp.asarray(1 + 0.1 * RNG.standard_normal(D), jnp.float32)
  f = jax.jit(lambda x, *r: rmsnorm_pallas.rms_norm_pallas(x, w, 1e-6, *r, interpret=True, x8=True))
  *ys, x8 = f(x, *r)
  plain = rmsnorm_pallas.rms_norm_pallas(x, w, 1e-6, *r, interpret=True)
  for a, b in zip(ys, plain if residual else [plain]):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  q, dx = _np_round32(np.asarray(ys[-1]))
  np.testing.assert_array_equal(np.asarray(x8.words).view(np.int8).reshape(q.shape), q)
  np.testing.assert_array_equal(np.asarray(x8.dx), dx)
  for a, b in zip(x8, dot8.quantize_x(ys[-1])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  alone = _rows_alone(lambda *a: f(*a)[-1], x, *r)
  for i, row in enumerate(alone):
    for a, b in zip(row, x8):
      np.testing.assert_array_equal(a[0], np.asarray(b)[i])
  with_ref = rmsnorm_pallas.add_rms_norm(x, w, 1e-6, *r, impl="ref", x8=True)   # the reference path rounds in XLA
  np.testing.assert_array_equal(np.asarray(with_ref[-1].words), np.asarray(dot8.quantize_x(with_ref[-2]).words))


def test_rms_norm_kernel_adds_the_residual_from_pieces():
  """res as pieces (a routed-experts block [T, X, D] and a shared expert's [T, D]): the stream's sum is bitwise
  numpy's float32 left fold x + (((r_0 + r_1) + ...) + r_n), the norm that of the sum against float64, the
  reference path the same bits, and each row as computed alone."""
  T, X, D = 3, 4, 256
  x = RNG.standard_normal((T, D)).astype(np.float32) * 3
  routed = RNG.standard_normal((T, X, D)).astype(np.float32)
  shared = RNG.standard_normal((T, D)).astype(np.float32)
  w = (1 + 0.1 * RNG.standard_normal(D)).astype(np.float32)
  r = routed[:, 0]
  for j in range(1, X):
    r = r + routed[:, j]
  want_s = x + (r + shared)
  s64 = want_s.astype(np.float64)
  want_y = s64 / np.sqrt(np.mean(s64 * s64, axis=1, keepdims=True) + 1e-6) * w
  f = jax.jit(lambda x, a, b: rmsnorm_pallas.rms_norm_pallas(x, jnp.asarray(w), 1e-6, (a, b), interpret=True))
  s, y = (np.asarray(v) for v in f(x, routed, shared))
  np.testing.assert_array_equal(s, want_s)
  np.testing.assert_allclose(y, want_y, rtol=2e-6, atol=1e-6)
  ref_s, _ = rmsnorm_pallas.add_rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-6, (routed, shared), impl="ref")
  np.testing.assert_array_equal(np.asarray(ref_s), want_s)
  alone = _rows_alone(lambda *a: f(*a)[1], x, routed, shared)
  np.testing.assert_array_equal(y, np.concatenate(alone))
  # the shared expert as a Gated piece: scaled by sigmoid(logit) per token in the kernel, against float64
  gl = RNG.standard_normal(T).astype(np.float32)
  g = jax.jit(lambda x, a, b, l: rmsnorm_pallas.rms_norm_pallas(x, jnp.asarray(w), 1e-6, (a, rmsnorm_pallas.Gated(
      b, l)), interpret=True))
  want = x + (r.astype(np.float64) + shared / (1 + np.exp(-gl.astype(np.float64)))[:, None])
  for impl_s in (g(x, routed, shared, gl)[0], rmsnorm_pallas.add_rms_norm(
      jnp.asarray(x), jnp.asarray(w), 1e-6, (routed, rmsnorm_pallas.Gated(shared, gl)), impl="ref")[0]):
    np.testing.assert_allclose(np.asarray(impl_s), want, rtol=1e-6, atol=1e-5)


def test_rms_norm_kernel_with_a_silu_gate():
  """gate_TD (a DeltaNet layer's output norm): norm(x) * silu(z) in the kernel, against float64, each row alone."""
  T, D = 6, 128
  x, z = (RNG.standard_normal((T, D)).astype(np.float32) * 2 for _ in range(2))
  w = (1 + 0.1 * RNG.standard_normal(D)).astype(np.float32)
  f = jax.jit(lambda x, z: rmsnorm_pallas.rms_norm_pallas(x, jnp.asarray(w), 1e-6, interpret=True, gate_TD=z))
  x64, z64 = x.astype(np.float64), z.astype(np.float64)
  want = x64 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + 1e-6) * w * (z64 / (1 + np.exp(-z64)))
  got = np.asarray(f(x, z))
  np.testing.assert_allclose(got, want, rtol=3e-6, atol=1e-6)
  np.testing.assert_array_equal(got, np.concatenate(_rows_alone(f, x, z)))


@pytest.mark.parametrize("tuning", [None, router_pallas.Tuning(programs=8, dc=64, warps=2)])
def test_norm_router_kernel(tuning):
  """ops.norm_router_pallas: the stream's sum bitwise x + res; the norm, the logits and an extra row's against
  float64; the 8-bit rounding bitwise XLA's of the kernel's own norm, and each row as computed alone (logits
  included)."""
  from ops import dot8, norm_router_pallas
  T, D, E = 3, 256, 64
  x = RNG.standard_normal((T, D)).astype(np.float32) * 3
  r = RNG.standard_normal((T, D)).astype(np.float32)
  w = (1 + 0.1 * RNG.standard_normal(D)).astype(np.float32)
  wr = (RNG.standard_normal((E, D)) * 0.05).astype(np.float32)
  wg = (RNG.standard_normal((1, D)) * 0.05).astype(np.float32)         # a shared expert's gate row, program 0's
  f = jax.jit(lambda x, r: norm_router_pallas.norm_logits_pallas(x, r, w, wr, 1e-6, x8=True, interpret=True,
                                                                  tuning=tuning, extra_ND=wg))
  s, y, logits, x8, gate = f(x, r)
  np.testing.assert_array_equal(np.asarray(s), x + r)
  s64 = (x + r).astype(np.float64)
  y64 = s64 / np.sqrt(np.mean(s64 * s64, axis=1, keepdims=True) + 1e-6) * w
  np.testing.assert_allclose(np.asarray(y), y64, rtol=2e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(logits), y64 @ wr.astype(np.float64).T, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(gate), y64 @ wg.astype(np.float64).T, rtol=1e-5, atol=1e-5)
  for a, b in zip(x8, dot8.quantize_x(y)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  alone = _rows_alone(lambda *a: f(*a)[1:3], x, r)
  np.testing.assert_array_equal(np.asarray(y), np.concatenate([a[0] for a in alone]))
  np.testing.assert_array_equal(np.asarray(logits), np.concatenate([a[1] for a in alone]))
  with pytest.raises(ValueError, match="logits given for 'ref' routing"):   # logits only where the top-k kernel runs
    router_pallas.route(y, wr, None, routing="softmax", top_k=2, norm_topk=True, routed_scale=1.0, logits=logits)


@pytest.mark.parametrize("routing,E,K,norm,scale", [("softmax", 128, 8, True, 1.0), ("sigmoid", 64, 10, True, 2.5),
                                                    ("softmax", 8, 2, False, 1.0)])
def test_route_kernel(routing, E, K, norm, scale):
  T, D = 3, 512
  x = jnp.asarray(RNG.standard_normal((T, D)), jnp.float32)
  wr = jnp.asarray(RNG.standard_normal((E, D)) * 0.05, jnp.float32)
  bias = jnp.asarray(RNG.standard_normal(E) * 0.05, jnp.float32) if routing == "sigmoid" else None
  kw = dict(routing=routing, top_k=K, norm_topk=norm, routed_scale=scale)
  ids, w = router_pallas.route(x, wr, bias, impl="interpret", **kw)
  with jax.default_matmul_precision("highest"):
    rid, rw = router_pallas.route(x, wr, bias, impl="ref", **kw)
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(rid))      # the same experts in the same order
  np.testing.assert_allclose(np.asarray(w), np.asarray(rw), rtol=1e-5, atol=1e-7)
  f = jax.jit(lambda x: router_pallas.route_pallas(x, wr, bias, interpret=True, **kw))
  full = jax.tree_util.tree_map(np.asarray, f(x))
  alone = _rows_alone(f, x)
  for j in range(2):
    np.testing.assert_array_equal(full[j], np.concatenate([a[j] for a in alone]))
  # another logits tiling (more rows per program, D in chunks; passed by the dispatcher): the same experts, and
  # weights within float32 rounding (each token's dot still one sequential sum per row, in other chunks)
  t = router_pallas.Tuning(programs=E // 8 or 1, dc=128, warps=4)
  assert router_pallas.logits_tiling(E, D, t) == (min(16, E // t.programs), 128)
  tid, tw = router_pallas.route(x, wr, bias, impl="interpret", tuning=t, **kw)
  np.testing.assert_array_equal(np.asarray(tid), np.asarray(rid))
  np.testing.assert_allclose(np.asarray(tw), np.asarray(rw), rtol=1e-5, atol=1e-7)


def test_route_ties_pick_the_lower_index_as_top_k():
  x = jnp.ones((1, 256), jnp.float32)
  wr = jnp.zeros((16, 256), jnp.float32).at[5].set(1.0).at[9].set(1.0).at[2].set(1.0)   # three equal best logits
  ids, _ = router_pallas.route(x, wr, None, routing="softmax", top_k=4, norm_topk=True, routed_scale=1.0,
                               impl="interpret")
  rid, _ = router_pallas.route(x, wr, None, routing="softmax", top_k=4, norm_topk=True, routed_scale=1.0, impl="ref")
  assert list(np.asarray(ids)[0]) == list(np.asarray(rid)[0])


@pytest.mark.parametrize("with_lse", [False, True])
def test_attention_merge_kernel_and_its_batch_invariance(with_lse):
  """The split merge inside the decode kernel: against the reference attention, and a 4-query call's rows bitwise
  the rows of each query alone at its own causal length."""
  from ops.kv_write import write_rows
  Hq, Hkv, Dh, T, depth = 8, 2, 32, 4, 300
  z, zs = jnp.zeros((512, Hkv, Dh), jnp.int8), jnp.zeros((512, Hkv), jnp.float32)
  ring = write_rows(z, z, zs, zs, jnp.arange(depth + T),
                    jnp.asarray(RNG.standard_normal((depth + T, Hkv, Dh)), jnp.float32),
                    jnp.asarray(RNG.standard_normal((depth + T, Hkv, Dh)), jnp.float32), "int8")
  q = jnp.asarray(RNG.standard_normal((T, Hq, Dh)), jnp.float32)

  def att(q, p, n, impl):
    return attention.ring_attention(q, *ring, p, n, block=64, scale=Dh ** -0.5, impl=impl, with_lse=with_lse)

  pos = depth + jnp.arange(T)
  got = att(q, pos, depth + T, "interpret")
  with jax.default_matmul_precision("highest"):
    ref = att(q, pos, depth + T, "ref")
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)
  k = jax.jit(lambda q, p, n: att(q, p, n, "interpret"))
  full = jax.tree_util.tree_leaves(k(q, pos, depth + T))
  alone = [jax.tree_util.tree_leaves(k(q[i:i + 1], pos[i:i + 1], depth + i + 1)) for i in range(T)]
  for j, f in enumerate(full):
    np.testing.assert_array_equal(np.asarray(f), np.concatenate([np.asarray(a[j]) for a in alone]))


@pytest.mark.parametrize("N", [1, 16])
def test_logits_kernel_rows_against_float64(N):
  """router_pallas.logits_pallas, also the hybrid shared-expert gate (N = 1): x @ w.T against a float64 dot, and each
  token's row bitwise the row computed alone (batch invariance)."""
  T, D = 4, 256
  x = jnp.asarray(RNG.standard_normal((T, D)), jnp.float32)
  w = jnp.asarray(RNG.standard_normal((N, D)), jnp.float32)
  got = np.asarray(router_pallas.logits_pallas(x, w, interpret=True))
  want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
  alone = _rows_alone(lambda x: router_pallas.logits_pallas(x, w, interpret=True), x)
  np.testing.assert_array_equal(got, np.concatenate(alone))


@pytest.mark.parametrize("platform", list(DEVICES))
def test_glue_kernels_lower(platform):
  T, D, E = 4, 2048, 512
  x = jax.ShapeDtypeStruct((T, D), jnp.float32)
  w = jax.ShapeDtypeStruct((D,), jnp.float32)
  assert "__gpu$xla.gpu.triton" in _lower(platform, lambda x, w, r: rmsnorm_pallas.rms_norm_pallas(x, w, 1e-6, r),
                                          x, w, x)
  assert "__gpu$xla.gpu.triton" in _lower(platform, lambda x, w, r: rmsnorm_pallas.rms_norm_pallas(x, w, 1e-6, r,
                                                                                                    x8=True), x, w, x)
  from ops import norm_router_pallas
  wr = jax.ShapeDtypeStruct((E, D), jnp.float32)
  assert "__gpu$xla.gpu.triton" in _lower(platform, lambda x, r, w, wr: norm_router_pallas.norm_logits_pallas(
      x, r, w, wr, 1e-6, x8=True), x, x, w, wr)
  assert "__gpu$xla.gpu.triton" in _lower(platform, lambda x, w, z: rmsnorm_pallas.rms_norm_pallas(
      x, w, 1e-6, gate_TD=z), x, w, x)
  parts = jax.ShapeDtypeStruct((T, 8, D), jnp.float32)
  assert "__gpu$xla.gpu.triton" in _lower(platform, lambda x, w, p, r: rmsnorm_pallas.rms_norm_pallas(
      x, w, 1e-6, (p, r), x8=True), x, w, parts, x)
  wr = jax.ShapeDtypeStruct((E, D), jnp.float32)
  b = jax.ShapeDtypeStruct((E,), jnp.float32)
  txt = _lower(platform, lambda x, wr, b: router_pallas.route_pallas(x, wr, b, routing="sigmoid", top_k=10,
                                                                     norm_topk=True, routed_scale=2.5), x, wr, b)
  assert txt.count("__gpu$xla.gpu.triton") == 2
  g = jax.ShapeDtypeStruct((1, D), jnp.float32)
  assert "__gpu$xla.gpu.triton" in _lower(platform, lambda x, g: router_pallas.logits_pallas(x, g), x, g)
  S, P, Dh, G = 64, 32, 128, 8
  o = jax.ShapeDtypeStruct((4, S, P, Dh), jnp.float32)
  m = jax.ShapeDtypeStruct((4, S, P), jnp.float32)
  txt = _lower(platform, lambda o, m, l: attention_pallas.merge_splits(o, m, l, T=4, G=G, with_lse=True), o, m, m)
  assert "__gpu$xla.gpu.triton" in txt
