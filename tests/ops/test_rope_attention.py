"""ops/rope_attention_pallas: RoPE and the ring write folded into the decode attention kernel, in interpret mode on
CPU against the two kernels it replaces (rope_write_pallas, then ring_attention_pallas: the ring's rows bitwise,
q within an ulp, the attention bitwise where q is) and the jnp reference, a verify pass's rows against one-row
steps and two ring capacities against each other (bitwise), and lowered for an abstract CUDA and ROCm device."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops import attention_pallas as ap
from ops import rope_attention_pallas as ra
from ops import rope_write_pallas as rw
from tools.lowering import DEVICES, lower as _lower
from tests.ops.test_rope_write import _case

BLOCK = 16


def _kw(Hq, Hkv, Dh, rope_dim):
  return dict(n_heads=Hq, n_kv_heads=Hkv, head_dim=Dh, rope_dim=rope_dim, theta=10000.0, offset=1, eps=1e-6)


def _unfused(qkv, qn, kn, pos, ring, length, lo, kw, with_lse):
  q, ring = rw.rope_write_pallas(qkv, qn, kn, pos, ring, interpret=True, **kw)
  out = ap.ring_attention_pallas(q, *ring, pos, length, block=BLOCK, scale=kw["head_dim"] ** -0.5, interpret=True,
                                 with_lse=with_lse, lo_T=lo)
  return out, ring, q


def _leaves(x):
  return [np.asarray(a, np.float32) for a in jax.tree_util.tree_leaves(x)]


@pytest.mark.parametrize("T,Hq,Hkv,Dh,rope_dim,dtype,qk_norm,tier", [
    (1, 8, 2, 32, 32, "int8", True, False),      # qwen3moe's form: full rotary, qk norm
    (3, 4, 4, 64, 32, "int8", False, True),      # partial rotary, no qk norm (glm4moe), per-row windows + lse
    (8, 16, 2, 16, 16, "bf16", True, False),     # the largest verify pass, a bf16 ring
    (2, 8, 2, 32, 16, "f32", True, True),        # a float32 ring (3xTF32 dots)
    (4, 2, 1, 256, 64, "int8", True, True),      # the hybrid family's gated attention heads (256 wide, 64 rotated)
])
def test_fold_is_the_two_kernels(T, Hq, Hkv, Dh, rope_dim, dtype, qk_norm, tier):
  R = 64
  qkv, qn, kn, ring = _case(T, Hq, Hkv, Dh, R, dtype, qk_norm=qk_norm)
  pos = jnp.arange(T, dtype=jnp.int32) + 70                   # slots 6.. of a ring that has wrapped once
  length = 70 + T
  lo = jnp.maximum(pos + 1 - 40, length - R) if tier else None  # a 40-position window per row (beside a tier)
  kw = _kw(Hq, Hkv, Dh, rope_dim)
  out, new, q = ra.rope_attention_pallas(qkv, qn, kn, pos, ring, length, lo, interpret=True, block=BLOCK,
                                         scale=Dh ** -0.5, with_lse=tier, with_q=True, **kw)
  want_out, want_ring, want_q = _unfused(qkv, qn, kn, pos, ring, length, lo, kw, tier)
  for a, b in zip(_leaves(new), _leaves(want_ring)):            # the ring's rows: bitwise rope_write_pallas's
    np.testing.assert_array_equal(a, b)
  # q: normed from its own [P, 1, Dh] load and rotated as x cos + x_swapped (-sin), against rope_write's [H, Dh] norm
  # and x1 cos - x2 sin (each may round otherwise: an ulp); the attention on the same q is the split kernel's bitwise.
  # The model never mixes the two paths in one request (test_fusions), so no case needs q bitwise
  np.testing.assert_allclose(np.asarray(q), np.asarray(want_q), rtol=2e-6, atol=1e-6)
  same_q = np.array_equal(np.asarray(q), np.asarray(want_q))
  assert same_q or qk_norm                                      # unnormed q: the bitwise attention case is exercised
  for a, b in zip(_leaves(out), _leaves(want_out)):
    if same_q:
      np.testing.assert_array_equal(a, b)
    else:
      np.testing.assert_allclose(a, b, rtol=0, atol=5e-5 * max(1.0, np.abs(b).max()))
  ref_out, ref_ring, ref_q = ra.rope_attention_ref(qkv, qn, kn, pos, ring, length, lo_T=lo, block=BLOCK,
                                                   scale=Dh ** -0.5, with_lse=tier, with_q=True, **kw)
  for a, b in zip(_leaves(out), _leaves(ref_out)):             # the kernels' bf16x2 dots against float32
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * max(1.0, np.abs(b).max()))
  slots = np.asarray(pos) % R
  untouched = np.setdiff1d(np.arange(R), slots)
  for a, old in zip(_leaves(new), _leaves(ring)):
    np.testing.assert_array_equal(a[untouched], old[untouched])  # only the T rows are written
    assert not np.array_equal(a[slots], old[slots])


def test_a_verify_pass_is_its_steps_bitwise_on_any_ring():
  """Rows of a 4-token pass equal four one-token steps, each writing its row first (DESIGN invariant 3), and a
  64-slot ring gives what a 128-slot ring gives at a depth both hold (invariants 1 and 2); the pass's tiles span a
  tile boundary (positions 30..33, bk 16). Then a pass across the 64-slot ring's wrap (positions 62..65, slots 62,
  63, 0, 1: its first tile's slots 0 and 1 are rewritten while that tile is read, masked), with each row's window
  of 60 positions as beside a host tier (without one the ring holds the whole context and never wraps)."""
  T, Hq, Hkv, Dh = 4, 8, 2, 32
  kw = _kw(Hq, Hkv, Dh, Dh)
  outs = {}
  for R, start in ((64, 30), (128, 30), (64, 62)):
    qkv, qn, kn, ring = _case(T, Hq, Hkv, Dh, R, "int8", seed=2)
    old = jax.random.normal(jax.random.PRNGKey(9), (R, Hkv, Dh))
    ring = rw.write_rows(*ring, jnp.arange(R), old, old * 0.5, "int8")   # the same old positions on both rings
    pos = jnp.arange(start, start + T, dtype=jnp.int32)
    lo = (lambda p: p + 1 - 60) if start > R - T else (lambda p: None)      # noqa: E731
    call = lambda x, p, r: ra.rope_attention_pallas(x, qn, kn, p, r, p[-1] + 1, lo(p), interpret=True,  # noqa: E731
                                                    block=BLOCK, scale=0.2, **kw)
    full, full_ring = call(qkv, pos, ring)
    steps, r = [], ring
    for t in range(T):
      o, r = call(qkv[t:t + 1], pos[t:t + 1], r)
      steps.append(o)
    np.testing.assert_array_equal(np.asarray(full), np.concatenate([np.asarray(o) for o in steps]))
    for a, b in zip(_leaves(full_ring), _leaves(r)):
      np.testing.assert_array_equal(a, b)
    outs[R, start] = np.asarray(full)
  np.testing.assert_array_equal(outs[64, 30], outs[128, 30])


def test_dispatch_falls_back_and_refuses_bad_impls():
  qkv, qn, kn, ring = _case(2, 6, 2, 32, 64, "int8")            # Hq = 6: not a power of two
  kw = dict(_kw(6, 2, 32, 32), block=BLOCK, scale=0.2)
  pos = jnp.array([3, 4], jnp.int32)
  assert ra.supported(2, 6, 2, 32, 32, BLOCK, ring[0]) is not None
  got = ra.rope_attention(qkv, qn, kn, pos, ring, 5, impl="interpret", **kw)
  want = ra.rope_attention_ref(qkv, qn, kn, pos, ring, 5, **kw)
  for a, b in zip(_leaves(got), _leaves(want)):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match="not a power of two"):
    ra.rope_attention_pallas(qkv, qn, kn, pos, ring, 5, **kw)
  with pytest.raises(ValueError, match="impl"):
    ra.rope_attention(qkv, qn, kn, pos, ring, 5, impl="cuda", **kw)


@pytest.mark.parametrize("platform", list(DEVICES))
def test_lowers(platform):
  """The 30B shape (Hq 32, Hkv 4, Dh 128, full rotary, int8 ring) at T = 1 and 4, and qwen3next-80b-a3b's gated
  attention (Dh 256, 64 rotated) beside a tier (lse, per-row windows, q out) lower for both."""
  S = jax.ShapeDtypeStruct
  for Hq, Hkv, Dh, rd, T, tier in ((32, 4, 128, 128, 1, False), (32, 4, 128, 128, 4, False), (16, 2, 256, 64, 3, True)):
    R = 4096
    ring = (S((R, Hkv, Dh), jnp.int8), S((R, Hkv, Dh), jnp.int8), S((R, Hkv), jnp.float32), S((R, Hkv), jnp.float32))
    fn = lambda x, a, b, p, r, n, lo: ra.rope_attention_pallas(  # noqa: E731
        x, a, b, p, r, n, lo if tier else None, block=256, scale=0.1, with_lse=tier, with_q=tier,
        **dict(_kw(Hq, Hkv, Dh, rd), theta=1e6))
    txt = _lower(platform, fn, S((T, (Hq + 2 * Hkv) * Dh), jnp.float32), S((Dh,), jnp.float32),
                 S((Dh,), jnp.float32), S((T,), jnp.int32), ring, S((), jnp.int32), S((T,), jnp.int32))
    assert "__gpu$xla.gpu.triton" in txt and "rope_ring_attention" in txt
