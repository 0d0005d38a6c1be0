"""ops/rope_write_pallas: the fused q/k norm + RoPE + K/V ring write against its jnp reference (the model's own
ops), in interpret mode on CPU, and lowered for an abstract CUDA and ROCm device."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops import rope_write_pallas as rw
from ops.kv_write import STORE, write_rows
from tools.lowering import DEVICES, lower as _lower

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _case(T, Hq, Hkv, Dh, R, dtype, seed=0, qk_norm=True):
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  qkv = jax.random.normal(ks[0], (T, (Hq + 2 * Hkv) * Dh), jnp.float32) * 3.0
  qn = 1.0 + 0.1 * jax.random.normal(ks[1], (Dh,)) if qk_norm else None
  kn = 1.0 + 0.1 * jax.random.normal(ks[2], (Dh,)) if qk_norm else None
  z = jnp.zeros((R, Hkv, Dh), STORE[dtype])
  zs = jnp.zeros((R, Hkv), jnp.float32) if dtype == "int8" else None
  # a ring layer with old contents, so that rows the kernel must not touch are not all zero
  old = jax.random.normal(ks[3], (R, Hkv, Dh)) * 2.0
  ring = write_rows(z, z, zs, zs, jnp.arange(R, dtype=jnp.int32), old, -old, dtype)
  return qkv, qn, kn, ring


@pytest.mark.parametrize("T,Hq,Hkv,Dh,rope_dim,dtype,qk_norm", [
    (1, 8, 2, 32, 32, "int8", True),      # full rotary, int8 ring, qk norm (qwen3moe)
    (3, 4, 4, 64, 32, "int8", False),     # partial rotary (glm4moe), no qk norm
    (8, 16, 2, 16, 16, "bf16", True),     # a verify-sized pass, bf16 ring
    (2, 8, 2, 32, 16, "f32", True),
    (4, 4, 2, 64, 16, "int8", True),      # a tail of 48 columns = 32 + 16 (the tiny hybrid files)
    (1, 2, 1, 256, 64, "int8", True),     # the hybrid family's heads: 256 wide, 64 rotated, 128 + 64 passed through
])
def test_kernel_matches_reference(T, Hq, Hkv, Dh, rope_dim, dtype, qk_norm):
  R = 64
  qkv, qn, kn, ring = _case(T, Hq, Hkv, Dh, R, dtype, qk_norm=qk_norm)
  pos = jnp.array([70, 71, 5, 6, 7, 8, 9, 10][:T], jnp.int32)           # wraps: slots 6, 7, then 5..
  kw = dict(n_heads=Hq, n_kv_heads=Hkv, head_dim=Dh, rope_dim=rope_dim, theta=10000.0, offset=1, eps=1e-6)
  q_ref, ring_ref = rw.rope_write_ref(qkv, qn, kn, pos, ring, **kw)
  q, ring_k = rw.rope_write_pallas(qkv, qn, kn, pos, ring, interpret=True, **kw)
  # Not bitwise: XLA fuses the reference's elementwise chains differently (1-ulp differences in q); an int8 code
  # next to a rounding tie may then move by one.
  np.testing.assert_allclose(np.asarray(q), np.asarray(q_ref), rtol=2e-6, atol=1e-6)
  slots = np.asarray(pos) % R
  untouched = np.setdiff1d(np.arange(R), slots)
  for a, b, old in zip(ring_k, ring_ref, ring):
    if b is None:
      assert a is None
      continue
    a, b, old = np.asarray(a, np.float32), np.asarray(b, np.float32), np.asarray(old, np.float32)
    np.testing.assert_array_equal(a[untouched], old[untouched])        # only the T rows are written
    assert not np.array_equal(a[slots], old[slots])
    if dtype == "int8" and a.ndim == 3:                                  # codes
      assert np.abs(a - b).max() <= 1 and np.mean(a != b) < 0.01
    else:                                                                # scales, or a float ring
      np.testing.assert_allclose(a, b, rtol=2e-6 if dtype != "bf16" else 1e-2, atol=1e-6)


def test_round_half_even_matches_jnp_round():
  x = jnp.array([0.5, 1.5, 2.5, -0.5, -1.5, 126.5, -126.5, 3.4999998, 0.49999997, -127.0, 127.0], jnp.float32)
  x = jnp.concatenate([x, jax.random.uniform(jax.random.PRNGKey(0), (4096,), minval=-130, maxval=130),
                       jnp.arange(-260, 261, dtype=jnp.float32) * 0.5])
  np.testing.assert_array_equal(np.asarray(jax.jit(rw.round_half_even)(x)), np.asarray(jnp.round(x)))


def test_q_programs_split_the_q_heads_and_change_no_value():
  """Tuning.q_programs (programs per token for the q heads) only splits the work: every setting writes bitwise
  the same q and ring rows, and the dispatcher passes the tuning on."""
  qkv, qn, kn, ring = _case(2, 8, 2, 32, 64, "int8")
  kw = dict(n_heads=8, n_kv_heads=2, head_dim=32, rope_dim=32, theta=10000.0, offset=0, eps=1e-6)
  pos = jnp.array([3, 4], jnp.int32)
  outs = [rw.rope_write_pallas(qkv, qn, kn, pos, ring, interpret=True, tuning=rw.Tuning(q_programs=n), **kw)
          for n in (1, 2, 4)]
  outs.append(rw.rope_write(qkv, qn, kn, pos, ring, impl="interpret", tuning=rw.Tuning(q_programs=2), **kw))
  assert [rw.head_block(8, 2, n) for n in (1, 2, 4, 8)] == [8, 4, 2, 2]
  for o in outs[1:]:
    for a, b in zip(jax.tree_util.tree_leaves(o), jax.tree_util.tree_leaves(outs[0])):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  q_ref, _ = rw.rope_write_ref(qkv, qn, kn, pos, ring, **kw)
  np.testing.assert_allclose(np.asarray(outs[0][0]), np.asarray(q_ref), rtol=2e-6, atol=1e-6)


def test_dispatch_falls_back_on_unsupported_shapes():
  qkv, qn, kn, ring = _case(2, 6, 2, 32, 16, "int8")                  # Hq = 6: not a power of two
  kw = dict(n_heads=6, n_kv_heads=2, head_dim=32, rope_dim=32, theta=10000.0, offset=0, eps=1e-6)
  assert rw.supported(6, 2, 32, 32) is not None
  pos = jnp.array([3, 4], jnp.int32)
  q, _ = rw.rope_write(qkv, qn, kn, pos, ring, impl="interpret", **kw)
  q_ref, _ = rw.rope_write_ref(qkv, qn, kn, pos, ring, **kw)
  np.testing.assert_array_equal(np.asarray(q), np.asarray(q_ref))
  with pytest.raises(ValueError, match="not a power of two"):
    rw.rope_write_pallas(qkv, qn, kn, pos, ring, **kw)
  with pytest.raises(ValueError, match="impl"):
    rw.rope_write(qkv, qn, kn, pos, ring, impl="cuda", **kw)


@pytest.mark.parametrize("platform", list(DEVICES))
def test_lowers(platform):
  """The 30B shape (Hq 32, Hkv 4, Dh 128, full rotary, int8 ring), glm4moe's partial rotary and qwen3next-80b-a3b's
  gated attention (Dh 256, 64 rotated) lower for both."""
  for Hq, Hkv, Dh, rd, qk in ((32, 4, 128, 128, True), (16, 2, 128, 64, False), (16, 2, 256, 64, True)):
    T, R = 1, 4096
    args = [jax.ShapeDtypeStruct((T, (Hq + 2 * Hkv) * Dh), jnp.float32),
            jax.ShapeDtypeStruct((Dh,), jnp.float32) if qk else None,
            jax.ShapeDtypeStruct((Dh,), jnp.float32) if qk else None,
            jax.ShapeDtypeStruct((T,), jnp.int32),
            (jax.ShapeDtypeStruct((R, Hkv, Dh), jnp.int8), jax.ShapeDtypeStruct((R, Hkv, Dh), jnp.int8),
             jax.ShapeDtypeStruct((R, Hkv), jnp.float32), jax.ShapeDtypeStruct((R, Hkv), jnp.float32))]
    fn = lambda x, a, b, p, r: rw.rope_write_pallas(x, a, b, p, r, n_heads=Hq, n_kv_heads=Hkv, head_dim=Dh,  # noqa
                                                     rope_dim=rd, theta=1e6, offset=0, eps=1e-6)
    txt = _lower(platform, fn, *args)
    assert "__gpu$xla.gpu.triton" in txt


def test_tail_pieces_are_powers_of_two_covering_the_tail():
  assert rw.tail_pieces(256, 64) == [(64, 128), (192, 64)]
  assert rw.tail_pieces(64, 16) == [(16, 32), (48, 16)]
  assert rw.tail_pieces(128, 128) == [] and rw.tail_pieces(128, 2) == [(2, 64), (66, 32), (98, 16), (114, 8),
                                                                       (122, 4), (126, 2)]
  assert rw.supported(16, 2, 256, 64) is None


@pytest.mark.parametrize("which", ["default", "qwen3moe", "qwen3next"])
def test_model_with_the_kernel(which, monkeypatch):
  """In the model (interpret mode): the same greedy tokens with the kernel as with the separate jnp ops, and greedy
  speculative decoding with the kernel (NextN block: RoPE offset 1, its own ring) emits the plain greedy tokens.
  default: glm4moe, partial rotary, q/k/v bias, NextN; qwen3moe: per-head q/k norm, full rotary; qwen3next (greedy
  only: its verify passes are tests/decode/test_hybrid_speculative.py's): gated attention beside DeltaNet layers, q/k
  norm, 16 of 64 dims rotated (a 48-column tail)."""
  from decode.engine import generate
  from decode.speculative import speculative_generate
  from model.loader import load_model
  from model.options import Options
  from ops.qtensor import with_kernels
  from tests.models import model_path
  m = load_model(os.path.join(ROOT, "configs/data/default.gguf") if which == "default" else model_path(which, "Q8_0"))
  first = m.cfg.attention_layers[0] if m.cfg.recurrent else 0
  assert "wqkv" in m.params[f"blk_{first}"]["attn"]          # fused at load: the kernel's precondition
  m.params = with_kernels(m.params, "interpret")
  prompt = [int(t) for t in np.random.default_rng(5).integers(0, 500, 12)]
  kw = dict(max_new_tokens=10, stop_at_eos=False, kv="int8", kv_resident=256)
  ref = generate(m, prompt, options=Options(glue=False), **kw).ids
  calls = []
  orig = rw.rope_write_pallas
  monkeypatch.setattr(rw, "rope_write_pallas", lambda *a, **k: calls.append(1) or orig(*a, **k))
  assert generate(m, prompt, **kw).ids == ref
  assert calls                                                # the kernel ran (traced into the step)
  if which == "default":
    r = speculative_generate(m, prompt, drafter="mtp", k=2, mtp_window=256, **kw)
    assert r.ids == ref
