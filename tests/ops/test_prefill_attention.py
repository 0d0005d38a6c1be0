"""The prefill attention kernel (ops/prefill_attention_pallas.py): interpret mode on CPU against the jnp reference
(ops/attention.ring_attention_ref) for every ring dtype, group size, wrapped rings and stacked layers; the
dispatcher's use of it; a model prefill through it; and its lowering for abstract CUDA and ROCm devices."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.options import Options
from ops import attention, prefill_attention_pallas as pa
from ops.attention import ring_attention_ref
from ops.kv_write import quantize_int8
from ops.tuning import Tunings
from tools.lowering import DEVICES, lower as _lower


def _ring(R, Hkv, Dh, dtype, rng, layers=None):
  shape = ((layers,) if layers else ()) + (R, Hkv, Dh)
  k = jnp.asarray(rng.standard_normal(shape), jnp.float32)
  v = jnp.asarray(rng.standard_normal(shape), jnp.float32)
  if dtype == "int8":
    (k, ks), (v, vs) = quantize_int8(k), quantize_int8(v)
    return k, v, ks, vs
  if dtype == "bf16":
    return k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), None, None
  return k, v, None, None


def _rel(a, b):
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


# T, Hq, Hkv, Dh, R, first position, ring dtype: unwrapped and wrapped rings (first + T > R), G = 1, 2, 4, 8, T
# not a multiple of the query block, a chunk starting at 0.
CASES = [
    (40, 4, 2, 64, 256, 60, "f32"),
    (100, 8, 1, 64, 512, 700, "int8"),
    (33, 16, 2, 128, 256, 10, "bf16"),
    (9, 2, 2, 64, 128, 0, "int8"),
    (70, 8, 2, 64, 128, 300, "int8"),
]


@pytest.mark.parametrize("T,Hq,Hkv,Dh,R,start,dtype", CASES)
def test_prefill_kernel_matches_reference(T, Hq, Hkv, Dh, R, start, dtype):
  """Outputs within 1e-5 (relative L2) of the float32 reference; the dots run bf16x2 (int8 / bf16 rings, ~3e-6) or
  float32 (f32 rings in interpret mode)."""
  rng = np.random.default_rng(T + R)
  q = jnp.asarray(rng.standard_normal((T, Hq, Dh)), jnp.float32)
  k, v, ks, vs = _ring(R, Hkv, Dh, dtype, rng)
  pos = jnp.arange(start, start + T, dtype=jnp.int32)
  kw = dict(block=64, scale=Dh ** -0.5)
  got = pa.prefill_attention_pallas(q, k, v, ks, vs, pos, start + T, interpret=True, **kw)
  ref = ring_attention_ref(q, k, v, ks, vs, pos, start + T, **kw)
  err = _rel(got, ref)
  assert err < (1e-6 if dtype == "f32" else 1e-5), err


@pytest.mark.parametrize("T,Hq,Hkv,Dh,R,start,dtype", CASES[:3] + CASES[4:])
def test_prefill_kernel_log_sum_exp_matches_reference(T, Hq, Hkv, Dh, R, start, dtype):
  """with_lse (prefill beside a host tier): out and the rows' log-sum-exp as attention.attention_with_lse, the
  reference the tier's merge was written against."""
  rng = np.random.default_rng(T + R + 1)
  q = jnp.asarray(rng.standard_normal((T, Hq, Dh)), jnp.float32)
  k, v, ks, vs = _ring(R, Hkv, Dh, dtype, rng)
  pos = jnp.arange(start, start + T, dtype=jnp.int32)
  kw = dict(block=64, scale=Dh ** -0.5)
  got, lse = pa.prefill_attention_pallas(q, k, v, ks, vs, pos, start + T, interpret=True, with_lse=True, **kw)
  ref, ref_lse = attention.attention_with_lse(q, k, v, ks, vs, pos, start + T, **kw)
  assert lse.shape == (T, Hq) and _rel(got, ref) < (1e-6 if dtype == "f32" else 1e-5)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=0, atol=2e-5)


def test_prefill_kernel_on_a_stacked_ring_takes_the_layer_index():
  """A [L, R, ...] ring with `layer` as an int32 input equals the kernel on that layer alone."""
  rng = np.random.default_rng(1)
  k, v, ks, vs = _ring(256, 2, 64, "int8", rng, layers=3)
  q = jnp.asarray(rng.standard_normal((24, 8, 64)), jnp.float32)
  pos = jnp.arange(100, 124, dtype=jnp.int32)
  kw = dict(block=64, scale=0.125, interpret=True)
  got = pa.prefill_attention_pallas(q, k, v, ks, vs, pos, 124, jnp.int32(2), **kw)
  one = pa.prefill_attention_pallas(q, k[2], v[2], ks[2], vs[2], pos, 124, **kw)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(one))
  assert _rel(got, ring_attention_ref(q, k[2], v[2], ks[2], vs[2], pos, 124, block=64, scale=0.125)) < 1e-5


def test_prefill_kernel_refuses_a_group_size_it_cannot_tile():
  q = jnp.zeros((20, 12, 64), jnp.float32)
  k = jnp.zeros((128, 1, 64), jnp.float32)
  with pytest.raises(ValueError, match="Hq/Hkv = 12/1 is not a power of two"):
    pa.prefill_attention_pallas(q, k, k, None, None, jnp.arange(20), 20, block=64, scale=0.125, interpret=True)


def test_dispatcher_runs_the_prefill_kernel_for_long_calls(monkeypatch):
  """ring_attention with impl="interpret": T <= MAX_T runs the decode kernel, T > MAX_T the prefill kernel, also
  for a host tier's call (with_lse); for a G the kernel cannot tile only an explicit impl raises."""
  calls = []
  real = pa.prefill_attention_pallas
  monkeypatch.setattr(pa, "prefill_attention_pallas", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
  rng = np.random.default_rng(2)
  k, v, ks, vs = _ring(256, 2, 64, "int8", rng)
  for T in (4, 30):
    q = jnp.asarray(rng.standard_normal((T, 4, 64)), jnp.float32)
    pos = jnp.arange(50, 50 + T, dtype=jnp.int32)
    got = attention.ring_attention(q, k, v, ks, vs, pos, 50 + T, block=64, scale=0.125, impl="interpret")
    assert _rel(got, ring_attention_ref(q, k, v, ks, vs, pos, 50 + T, block=64, scale=0.125)) < 1e-5
  assert calls == [30]
  out, lse = attention.ring_attention(q, k, v, ks, vs, pos, 80, block=64, scale=0.125, impl="interpret",
                                      with_lse=True)
  assert calls == [30, 30] and lse.shape == (30, 4)
  with pytest.raises(ValueError, match="cannot take this prefill call"):
    attention.ring_attention(jnp.zeros((30, 6, 64)), k, v, ks, vs, pos, 80, block=64, scale=0.125,
                             impl="interpret")


def test_model_prefill_through_the_kernel_equals_the_reference(monkeypatch):
  """A tiny model's 300-token prefill (one call) with the prefill kernel (interpret mode) in every layer: the same
  greedy token at every position as with the reference, logits within 1e-3 relative L2 (measured 1.6e-4: the
  kernel's bf16x2 dots keep ~16 bits of q and p, 3e-6 per attention call, amplified by the random layers)."""
  from bench.cells import _in_memory_model
  from model import api
  m = _in_memory_model("tiny-qwen3moe", "Q8_0")
  toks = jnp.asarray(np.random.default_rng(3).integers(0, 1024, 300), jnp.int32)

  def run(impl):
    opts = Options(tunings=Tunings(attention_impl="ref", prefill_attention_impl=impl))
    lg, _, _ = api.prefill(m.params, toks, api.init_state(m.cfg, 1024, "int8"), cfg=m.cfg, options=opts)
    return np.asarray(lg)

  calls = []
  real = pa.prefill_attention_pallas
  monkeypatch.setattr(pa, "prefill_attention_pallas", lambda *a, **kw: calls.append(1) or real(*a, **kw))
  got, ref = run("interpret"), run("ref")
  assert len(calls) == m.cfg.n_layers
  assert (got.argmax(-1) == ref.argmax(-1)).all()
  assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-3


@pytest.mark.parametrize("platform", list(DEVICES))
@pytest.mark.parametrize("dtype,with_lse", [("int8", False), ("f32", False), ("int8", True)])
def test_prefill_kernel_lowers(platform, dtype, with_lse):
  """The 30B shape's layer (Hq 32, Hkv 4, Dh 128) on a 4K ring, a 1,024-token chunk, one Triton call (also with
  the log-sum-exp output of a host tier's prefill)."""
  kd = jnp.int8 if dtype == "int8" else jnp.float32
  q = jax.ShapeDtypeStruct((1024, 32, 128), jnp.float32)
  k = jax.ShapeDtypeStruct((4096, 4, 128), kd)
  s = jax.ShapeDtypeStruct((4096, 4), jnp.float32) if dtype == "int8" else None
  pos = jax.ShapeDtypeStruct((1024,), jnp.int32)
  n = jax.ShapeDtypeStruct((), jnp.int32)
  fn = (lambda q, k, v, ks, vs, p, n: pa.prefill_attention_pallas(q, k, v, ks, vs, p, n, block=256, scale=0.088,
                                                                  with_lse=with_lse))
  txt = _lower(platform, fn, q, k, k, s, s, pos, n)
  assert txt.count("__gpu$xla.gpu.triton") == 1
