"""ops/quant: the jnp dequantizers equal gguf-py's `gguf.quants.dequantize` bit for bit, for every type.

Oracle: gguf-py (the numpy twin of ggml-quants.c). Inputs: random valid blocks (ops.quant.random_blocks),
fully random bytes (NaN/Inf/subnormal scales included), and real floats quantized by gguf-py itself.
"""
from __future__ import annotations

import functools

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType

from ops import quant
from ops.quant import GGML_TYPES, dequantize, random_blocks, row_bytes

TYPES = list(GGML_TYPES)
SHAPES = [(3, 512), (2, 3, 256)]  # rows; experts x rows


def _oracle(blocks: np.ndarray, qtype: str, shape) -> np.ndarray:
  out = gguf.quants.dequantize(blocks, GGMLQuantizationType[qtype])
  return np.asarray(out, np.float32).reshape(shape)


@functools.cache
def _jitted(qtype: str, n: int):
  return jax.jit(lambda x: dequantize(x, qtype, n))


def _assert_bits_equal(got: np.ndarray, want: np.ndarray) -> None:
  """Equal as float32 bit patterns (so -0.0 != 0.0); NaNs only need to sit in the same places."""
  assert got.dtype == np.float32 and want.dtype == np.float32
  assert got.shape == want.shape
  np.testing.assert_array_equal(got, want)
  nan = np.isnan(want)
  np.testing.assert_array_equal(np.isnan(got), nan)
  np.testing.assert_array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])


def _ours(blocks: np.ndarray, qtype: str, n: int) -> tuple[np.ndarray, np.ndarray]:
  eager = np.asarray(dequantize(jnp.asarray(blocks), qtype, n))
  jitted = np.asarray(_jitted(qtype, n)(jnp.asarray(blocks)))
  return eager, jitted


def test_block_sizes_match_gguf():
  for name, sizes in GGML_TYPES.items():
    assert gguf.GGML_QUANT_SIZES[GGMLQuantizationType[name]] == sizes, name
  assert GGML_TYPES["Q4_K"] == (256, 144)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("qtype", TYPES)
def test_random_valid_blocks_match_gguf(qtype, shape):
  rng = np.random.default_rng(100 * TYPES.index(qtype) + SHAPES.index(shape))
  blocks = random_blocks(qtype, shape, rng)
  n = shape[-1]
  assert blocks.dtype == np.uint8
  assert blocks.shape == (*shape[:-1], row_bytes(qtype, n))

  want = _oracle(blocks, qtype, shape)
  eager, jitted = _ours(blocks, qtype, n)
  assert eager.shape == shape and eager.dtype == np.float32
  _assert_bits_equal(eager, want)
  _assert_bits_equal(jitted, want)

  # A broken dequantizer must not pass by accident: the outputs are finite, non-zero and varied.
  assert np.isfinite(want).all()
  assert np.count_nonzero(want) > want.size // 2
  assert np.unique(want).size > 32
  assert want.std() > 0
  # ... and the rows differ (leading dims are not broadcast copies of one row).
  flat = want.reshape(-1, n)
  assert not (flat == flat[:1]).all()


@pytest.mark.parametrize("qtype", TYPES)
def test_arbitrary_bytes_match_gguf(qtype):
  """Every byte random, scales included: NaN, Inf, negative and subnormal float16 fields."""
  rng = np.random.default_rng(1234 + TYPES.index(qtype))
  n = 512
  raw = rng.integers(0, 256, size=(4, row_bytes(qtype, n)), dtype=np.uint8)
  with np.errstate(invalid="ignore", over="ignore"):
    want = _oracle(raw, qtype, (4, n))
  eager, jitted = _ours(raw, qtype, n)
  _assert_bits_equal(eager, want)
  _assert_bits_equal(jitted, want)


def test_float16_special_values():
  vals = np.array([0.0, -0.0, 6.0e-8, -6.0e-8, 1.0e-5, 65504.0, -65504.0, np.inf, -np.inf, np.nan, 1.0, -2.5],
                  np.float16)
  raw = vals.view(np.uint8).reshape(1, -1)
  got = np.asarray(dequantize(jnp.asarray(raw), "F16", vals.size))
  _assert_bits_equal(got, _oracle(raw, "F16", (1, vals.size)))


def _f16_bytes(x: float) -> list[int]:
  return list(np.array([x], np.float16).view(np.uint8))


def test_hand_built_blocks():
  """Blocks built by hand from the format description, independent of gguf-py."""
  # Q8_0: d = 0.5, q = -16..15.
  q = np.arange(-16, 16, dtype=np.int8)
  blk = np.array(_f16_bytes(0.5) + list(q.view(np.uint8)), np.uint8)[None]
  np.testing.assert_array_equal(np.asarray(dequantize(jnp.asarray(blk), "Q8_0", 32))[0], 0.5 * q)

  # Q5_0: d = 2, value j = j (0..31) -> 2 * (j - 16); low nibbles hold j & 15 (j and j+16 share a byte),
  # bit j of the little-endian u32 qh is bit 4 of value j.
  v = np.arange(32)
  qs = (v[:16] & 15) | ((v[16:] & 15) << 4)
  qh = int(sum(((int(x) >> 4) & 1) << j for j, x in enumerate(v)))
  blk = np.array(_f16_bytes(2.0) + list(qh.to_bytes(4, "little")) + list(qs), np.uint8)[None]
  np.testing.assert_array_equal(np.asarray(dequantize(jnp.asarray(blk), "Q5_0", 32))[0], 2.0 * (v - 16))

  # IQ4_NL: d = 1, indices 0..15 then 15..0 -> the level table forwards then backwards.
  idx = np.concatenate([np.arange(16), np.arange(15, -1, -1)])
  qs = idx[:16] | (idx[16:] << 4)
  blk = np.array(_f16_bytes(1.0) + list(qs), np.uint8)[None]
  np.testing.assert_array_equal(np.asarray(dequantize(jnp.asarray(blk), "IQ4_NL", 32))[0],
                                quant.IQ4_NL_LEVELS[idx].astype(np.float32))

  # BF16 and F32 raw bytes.
  x = np.array([1.5, -3.25, 0.0, 1e30], np.float32)
  np.testing.assert_array_equal(np.asarray(dequantize(jnp.asarray(x.view(np.uint8)), "F32", 4)), x)
  bf = (x.view(np.uint32) >> 16).astype(np.uint16)                  # truncation: exact for all but 1e30
  want = (bf.astype(np.uint32) << 16).view(np.float32)
  np.testing.assert_array_equal(want[:3], x[:3])
  np.testing.assert_array_equal(np.asarray(dequantize(jnp.asarray(bf.view(np.uint8)), "BF16", 4)), want)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0", "Q5_1", "F16", "BF16"])
def test_real_floats_quantized_by_gguf(qtype):
  rng = np.random.default_rng(7)
  shape = (2, 4, 256)
  x = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 3.0, (2, 4, 1)).astype(np.float32)
  x[0, 0, :32] = 0.0                     # an all-zero block (d = 0)
  x[0, 1, :32] = -7.0                    # a constant block
  blocks = np.asarray(gguf.quants.quantize(x, GGMLQuantizationType[qtype]))
  blocks = blocks.view(np.uint8).reshape(*shape[:-1], -1)
  assert blocks.shape[-1] == row_bytes(qtype, shape[-1])
  want = _oracle(blocks, qtype, shape)
  eager, jitted = _ours(blocks, qtype, shape[-1])
  _assert_bits_equal(eager, want)
  _assert_bits_equal(jitted, want)
  # The round trip is close to the input (catches a consistent misreading shared with the oracle's use).
  assert np.abs(want - x).max() <= 0.1 * np.abs(x).max()


def test_row_bytes_and_errors():
  assert row_bytes("Q4_K", 512) == 288
  assert row_bytes("F32", 3) == 12
  assert row_bytes("IQ3_S", 256) == 110
  with pytest.raises(ValueError, match=r"Q4_K.*100"):
    row_bytes("Q4_K", 100)
  with pytest.raises(ValueError, match="Q8_0"):
    row_bytes("Q8_0", 0)
  for fn in (lambda: row_bytes("Q4_42", 256),
             lambda: dequantize(jnp.zeros((1, 144), jnp.uint8), "Q4_42", 256),
             lambda: random_blocks("Q4_42", (1, 256), np.random.default_rng(0))):
    with pytest.raises(ValueError, match="Q4_42"):
      fn()
  with pytest.raises(ValueError, match="Q4_K"):
    dequantize(jnp.zeros((1, 143), jnp.uint8), "Q4_K", 256)       # wrong row length
  with pytest.raises(ValueError, match="uint8"):
    dequantize(jnp.zeros((1, 144), jnp.int8), "Q4_K", 256)        # wrong dtype


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_1", "F32", "F16", "BF16"])
def test_random_blocks_contract(qtype):
  scale = 0.03
  a = random_blocks(qtype, (5, 512), np.random.default_rng(3), scale=scale)
  b = random_blocks(qtype, (5, 512), np.random.default_rng(3), scale=scale)
  np.testing.assert_array_equal(a, b)                                # deterministic in the rng
  assert a.shape == (5, row_bytes(qtype, 512)) and a.dtype == np.uint8
  block, size = GGML_TYPES[qtype]
  if block > 1:
    blocks = a.reshape(-1, size)
    for off in quant._SCALE_FIELDS[qtype]:
      d = blocks[:, off:off + 2].copy().view(np.float16).astype(np.float32)
      assert (d >= 0.49 * scale).all() and (d <= 1.51 * scale).all(), off
  out = np.asarray(dequantize(jnp.asarray(a), qtype, 512))
  assert np.isfinite(out).all() and out.std() > 0
  if block == 1:                                                     # floats: |x| in [scale/8, 4 scale)
    assert (np.abs(out) >= scale / 8).all() and (np.abs(out) < 4 * scale).all()
    assert 0.4 < (out > 0).mean() < 0.6
  with pytest.raises(ValueError, match="scale"):
    random_blocks(qtype, (1, 512), np.random.default_rng(0), scale=0.0)
