"""GGUF block formats: jnp dequantizers equal bit for bit to gguf-py, and a fast writer of random valid blocks.

`dequantize(data_u8, qtype, n)` turns packed rows (uint8 [..., row_bytes(qtype, n)]) into float32 [..., n].
It is pure jnp (shifts, masks, `jnp.take` on small tables), jittable and vectorised over any leading dims
(rows, experts, ...); `qtype` and `n` are static Python values. The result equals
`gguf.quants.dequantize(bytes, GGMLQuantizationType[qtype])` in every bit (tests/ops/test_dequant.py).

Float32 rounding: a float16 scale has 11 significant bits and every integer factor it meets is below 2^12
(Q6_K: |scale * q| <= 128 * 32; IQ4_XS: 32 * 127; K-quants: 63 * 31), so all products are exact in
float32 and their order is free. The only rounding is the final `a * q - b` / `a * q + b` of
Q4_K/Q5_K/Q5_1, and since `a * q` is exact a fused multiply-add (which XLA may emit, on GPU certainly)
rounds the same as gguf-py's separate multiply and add. The code still follows gguf-py's order.

Format data: IQ4_NL's 16 non-linear levels (shared by IQ4_XS) are written out below; the IQ3_S grid
(512 entries of 4 odd magnitudes 1..15) is built at import time from gguf-py's table
(`gguf.quants.IQ3_S.init_grid()`), so it cannot drift from the oracle. Sign bits of IQ3_S are unpacked
with shifts, no table.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

QK_K = 256  # values per super-block of the K and IQ formats

# name -> (values per block, bytes per block); the same numbers as ggml's type traits.
GGML_TYPES: dict[str, tuple[int, int]] = {
    "F32": (1, 4),
    "F16": (1, 2),
    "BF16": (1, 2),
    "Q8_0": (32, 2 + 32),
    "Q5_0": (32, 2 + 4 + 16),
    "Q5_1": (32, 2 + 2 + 4 + 16),
    "Q4_K": (QK_K, 2 + 2 + 12 + QK_K // 2),
    "Q5_K": (QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),
    "Q6_K": (QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
    "IQ3_S": (QK_K, 2 + QK_K // 4 + QK_K // 32 + QK_K // 8 + QK_K // 64),
    "IQ4_NL": (32, 2 + 16),
    "IQ4_XS": (QK_K, 2 + 2 + QK_K // 64 + QK_K // 2),
}

# IQ4_NL / IQ4_XS: a 4-bit index picks one of these int8 levels.
IQ4_NL_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)


def _iq3s_grid() -> np.ndarray:
  """IQ3_S grid from gguf-py: float32 [512, 4], entries in {1, 3, ..., 15}."""
  from gguf.quants import IQ3_S
  IQ3_S.init_grid()
  grid = np.asarray(IQ3_S.grid, np.float32).reshape(512, 4)
  return grid


IQ3_S_GRID = _iq3s_grid()


def _check_type(qtype: str) -> tuple[int, int]:
  try:
    return GGML_TYPES[qtype]
  except (KeyError, TypeError):
    raise ValueError(f"unknown GGML type {qtype!r}; supported: {', '.join(GGML_TYPES)}") from None


def row_bytes(qtype: str, n: int) -> int:
  """Bytes of one row of `n` values of `qtype` (n must be a positive multiple of the block size)."""
  block, size = _check_type(qtype)
  if int(n) != n or n <= 0 or n % block:
    raise ValueError(f"{qtype}: a row of n={n} values is not a positive multiple of the block size {block}")
  return int(n) // block * size


# ---------------------------------------------------------------------------------------------- helpers


def _f16(b: jax.Array, off: int) -> jax.Array:
  """Little-endian float16 at byte `off` of each block -> float32 [..., nb, 1]."""
  lo = b[..., off:off + 1].astype(jnp.uint16)
  hi = b[..., off + 1:off + 2].astype(jnp.uint16)
  return jax.lax.bitcast_convert_type(lo | (hi << 8), jnp.float16).astype(jnp.float32)


def _bits(b: jax.Array) -> jax.Array:
  """uint8 [..., k] -> its bits [..., k * 8] (byte-major, least significant bit first), uint8 0/1."""
  shifts = jnp.arange(8, dtype=jnp.uint8)
  return ((b[..., :, None] >> shifts) & 1).reshape(*b.shape[:-1], b.shape[-1] * 8)


def _nibbles(b: jax.Array, group: int) -> jax.Array:
  """uint8 [..., k] -> 4-bit values [..., 2k]: per run of `group` bytes, the low nibbles then the high ones."""
  g = b.reshape(*b.shape[:-1], b.shape[-1] // group, 1, group)
  q = (g >> jnp.array([0, 4], jnp.uint8)[:, None]) & 0xF
  return q.reshape(*b.shape[:-1], b.shape[-1] * 2)


def _pairs(b: jax.Array) -> jax.Array:
  """uint8 [..., k] -> 4-bit values [..., 2k] in byte order: low nibble of byte 0, high of byte 0, ..."""
  q = (b[..., :, None] >> jnp.array([0, 4], jnp.uint8)) & 0xF
  return q.reshape(*b.shape[:-1], b.shape[-1] * 2)


def _k_scales(s: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Q4_K/Q5_K 12 scale bytes -> (scale, min), uint8 [..., 8] each, 6 bits each.

  Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; bytes 8-11 hold the low 4 bits of
  scale/min 4-7 (low/high nibble), whose top 2 bits are the top 2 bits of bytes 0-3 / 4-7.
  """
  a, m, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
  sc = jnp.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
  mn = jnp.concatenate([m & 0x3F, (c >> 4) | ((m >> 2) & 0x30)], axis=-1)
  return sc, mn


def _f32(x: jax.Array) -> jax.Array:
  return x.astype(jnp.float32)


# ---------------------------------------------------------------------------------------- one per type
# Each takes blocks uint8 [..., nb, type_size] and returns float32 [..., nb, block_size].


def _deq_f32(b):
  """4 bytes little-endian IEEE float32."""
  u = b.astype(jnp.uint32)
  u = u[..., 0:1] | (u[..., 1:2] << 8) | (u[..., 2:3] << 16) | (u[..., 3:4] << 24)
  return jax.lax.bitcast_convert_type(u, jnp.float32)


def _deq_f16(b):
  """2 bytes little-endian IEEE float16."""
  return _f16(b, 0)


def _deq_bf16(b):
  """2 bytes little-endian bfloat16 (the top half of a float32)."""
  u = b[..., 0:1].astype(jnp.uint32) | (b[..., 1:2].astype(jnp.uint32) << 8)
  return jax.lax.bitcast_convert_type(u << 16, jnp.float32)


def _deq_q8_0(b):
  """Q8_0, 34 bytes: d f16 | 32 x int8 q.   x = d * q."""
  d = _f16(b, 0)
  q = jax.lax.bitcast_convert_type(b[..., 2:34], jnp.int8)
  return d * _f32(q)


def _q5_low_high(b, qh_off):
  """Q5_0/Q5_1 5-bit values [..., 32]: 4 high-bit bytes at qh_off (bit j -> value j), 16 nibble bytes after."""
  qh = _bits(b[..., qh_off:qh_off + 4])
  ql = _nibbles(b[..., qh_off + 4:qh_off + 20], 16)
  return ql | (qh << 4)


def _deq_q5_0(b):
  """Q5_0, 22 bytes: d f16 | qh 4 bytes (bit j = bit 4 of value j) | 16 bytes nibbles (values j, j+16).
  x = d * (q - 16)."""
  d = _f16(b, 0)
  q = _q5_low_high(b, 2).astype(jnp.int32) - 16
  return d * _f32(q)


def _deq_q5_1(b):
  """Q5_1, 24 bytes: d f16 | m f16 | qh 4 bytes | 16 bytes nibbles.   x = d * q + m."""
  d, m = _f16(b, 0), _f16(b, 2)
  return d * _f32(_q5_low_high(b, 4)) + m


def _deq_q4_k(b):
  """Q4_K, 144 bytes: d f16 | dmin f16 | 12 bytes of 8 x (6-bit scale, 6-bit min) | 128 bytes nibbles
  (4 runs of 32 bytes: low nibbles = sub-block 2i, high = 2i+1).   x = (d*sc) * q - dmin*mn, per 32 values."""
  lead = b.shape[:-1]
  d, dmin = _f16(b, 0), _f16(b, 2)
  sc, mn = _k_scales(b[..., 4:16])
  ds = (d * _f32(sc))[..., None]
  dm = (dmin * _f32(mn))[..., None]
  q = _f32(_nibbles(b[..., 16:144], 32)).reshape(*lead, 8, 32)
  return (ds * q - dm).reshape(*lead, QK_K)


def _deq_q5_k(b):
  """Q5_K, 176 bytes: d | dmin | 12 scale bytes (as Q4_K) | qh 32 bytes (bit s of byte l = bit 4 of value
  l of sub-block s) | 128 bytes nibbles (as Q4_K).   x = (d*sc) * q - dmin*mn."""
  lead = b.shape[:-1]
  d, dmin = _f16(b, 0), _f16(b, 2)
  sc, mn = _k_scales(b[..., 4:16])
  ds = (d * _f32(sc))[..., None]
  dm = (dmin * _f32(mn))[..., None]
  qh = (b[..., 16:48, None] >> jnp.arange(8, dtype=jnp.uint8)) & 1      # [..., 32 (l), 8 (s)]
  qh = jnp.swapaxes(qh, -1, -2)                                        # [..., 8, 32]
  ql = _nibbles(b[..., 48:176], 32).reshape(*lead, 8, 32)
  q = _f32(ql | (qh << 4))
  return (ds * q - dm).reshape(*lead, QK_K)


def _deq_q6_k(b):
  """Q6_K, 210 bytes: ql 128 bytes | qh 64 bytes | 16 x int8 scales | d f16 (at the end).
  Per half h of 128 values: value 64k+p (k<2, p<64) has low 4 bits from nibble k of ql[64h+p]; value 32s+c
  (s<4, c<32) has high 2 bits from bits 2s..2s+1 of qh[32h+c].   x = (d * scale) * (q - 32), per 16 values."""
  lead = b.shape[:-1]
  d = _f16(b, 208)
  sc = _f32(jax.lax.bitcast_convert_type(b[..., 192:208], jnp.int8))
  ds = (d * sc)[..., None]                                             # [..., 16, 1]
  ql = _nibbles(b[..., 0:128], 64)                                     # [..., 256]
  qh = b[..., 128:192].reshape(*lead, 2, 1, 32) >> jnp.array([0, 2, 4, 6], jnp.uint8)[:, None]
  qh = (qh & 3).reshape(*lead, QK_K)
  q = (ql | (qh << 4)).astype(jnp.int32) - 32
  return (ds * _f32(q).reshape(*lead, 16, 16)).reshape(*lead, QK_K)


def _deq_iq3_s(b):
  """IQ3_S, 110 bytes: d f16 | qs 64 bytes | qh 8 bytes | signs 32 bytes | scales 4 bytes.
  Grid index g = qs[k] | bit k of qh << 8 picks 4 magnitudes; bit j of the signs negates value j; 4-bit
  scale s per 32 values (byte order, low nibble first).   x = (d * (1 + 2s)) * grid * sign."""
  lead = b.shape[:-1]
  d = _f16(b, 0)
  s = _pairs(b[..., 106:110])                                          # [..., 8]
  db = (d * _f32(1 + 2 * s.astype(jnp.int32)))[..., None]              # [..., 8, 1]
  idx = b[..., 2:66].astype(jnp.int32) | (_bits(b[..., 66:74]).astype(jnp.int32) << 8)   # [..., 64]
  mag = jnp.take(jnp.asarray(IQ3_S_GRID), idx, axis=0).reshape(*lead, 8, 32)
  sign = jnp.where(_bits(b[..., 74:106]) == 0, 1.0, -1.0).astype(jnp.float32).reshape(*lead, 8, 32)
  return (db * mag * sign).reshape(*lead, QK_K)


def _deq_iq4_nl(b):
  """IQ4_NL, 18 bytes: d f16 | 16 bytes nibbles (values j, j+16) indexing the 16 int8 levels.   x = d * level."""
  d = _f16(b, 0)
  lv = jnp.take(jnp.asarray(IQ4_NL_LEVELS, jnp.float32), _nibbles(b[..., 2:18], 16).astype(jnp.int32), axis=0)
  return d * lv


def _deq_iq4_xs(b):
  """IQ4_XS, 136 bytes: d f16 | scales_h u16 (2 bits per sub-block) | scales_l 4 bytes (nibbles, byte order)
  | 128 bytes: 8 sub-blocks of 16 bytes (low nibbles = values 0-15, high = 16-31) indexing the IQ4_NL levels.
  x = (d * (6-bit scale - 32)) * level, per 32 values."""
  lead = b.shape[:-1]
  d = _f16(b, 0)
  sh = b[..., 2:3].astype(jnp.int32) | (b[..., 3:4].astype(jnp.int32) << 8)
  sh = (sh >> (2 * jnp.arange(8, dtype=jnp.int32))) & 3                # [..., 8]
  sl = _pairs(b[..., 4:8]).astype(jnp.int32)                           # [..., 8]
  ds = (d * _f32((sl | (sh << 4)) - 32))[..., None]                    # [..., 8, 1]
  idx = _nibbles(b[..., 8:136], 16).astype(jnp.int32)
  lv = jnp.take(jnp.asarray(IQ4_NL_LEVELS, jnp.float32), idx, axis=0).reshape(*lead, 8, 32)
  return (ds * lv).reshape(*lead, QK_K)


_DEQUANT = {
    "F32": _deq_f32,
    "F16": _deq_f16,
    "BF16": _deq_bf16,
    "Q8_0": _deq_q8_0,
    "Q5_0": _deq_q5_0,
    "Q5_1": _deq_q5_1,
    "Q4_K": _deq_q4_k,
    "Q5_K": _deq_q5_k,
    "Q6_K": _deq_q6_k,
    "IQ3_S": _deq_iq3_s,
    "IQ4_NL": _deq_iq4_nl,
    "IQ4_XS": _deq_iq4_xs,
}
assert _DEQUANT.keys() == GGML_TYPES.keys()


def dequantize(data_u8: jax.Array, qtype: str, n: int) -> jax.Array:
  """uint8 [..., row_bytes(qtype, n)] -> float32 [..., n], bit-identical to gguf-py's dequantize."""
  nbytes = row_bytes(qtype, n)
  block, size = GGML_TYPES[qtype]
  data_u8 = jnp.asarray(data_u8)
  if data_u8.dtype != jnp.uint8:
    raise ValueError(f"{qtype}: dequantize wants uint8 bytes, got {data_u8.dtype}")
  if data_u8.ndim < 1 or data_u8.shape[-1] != nbytes:
    raise ValueError(f"{qtype}: a row of n={n} values is {nbytes} bytes, got shape {data_u8.shape}")
  lead = data_u8.shape[:-1]
  blocks = data_u8.reshape(*lead, n // block, size)
  return _DEQUANT[qtype](blocks).reshape(*lead, n)


# ------------------------------------------------------------------------------------ random valid blocks

# Byte offsets of the float16 scale fields of each block format (everything else is free bits).
_SCALE_FIELDS: dict[str, tuple[int, ...]] = {
    "Q8_0": (0,), "Q5_0": (0,), "Q5_1": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ3_S": (0,), "IQ4_NL": (0,), "IQ4_XS": (0,),
}
# Float16 fields that are an added offset, not a multiplier: set to -16 * (a scale) so values centre near 0.
_OFFSET_FIELDS: dict[str, tuple[int, ...]] = {"Q5_1": (2,)}


# Float formats: (unsigned view, mantissa bits, exponent bits).
_FLOAT_BITS = {"F32": (np.uint32, 23, 8), "F16": (np.uint16, 10, 5), "BF16": (np.uint16, 7, 8)}


def _random_floats(qtype: str, count: int, rng: np.random.Generator, scale: float) -> np.ndarray:
  """`count` finite values built from random bits: random sign and mantissa, exponent uniform over the 4
  octaves [2^(E-2), 2^(E+2)) with E = floor(log2(scale)) (clamped to the format's normal range)."""
  utype, mbits, ebits = _FLOAT_BITS[qtype]
  width = np.dtype(utype).itemsize
  w = rng.bit_generator.random_raw(-(-count * width // 8)).view(utype)[:count]
  bias = (1 << (ebits - 1)) - 1
  e0 = int(np.clip(np.floor(np.log2(scale)) + bias - 2, 1, (1 << ebits) - 5))
  octave = (w >> utype(mbits)) & utype(3)                       # two random bits of the exponent field
  w &= utype((1 << (mbits + ebits)) | ((1 << mbits) - 1))       # keep sign and mantissa
  octave += utype(e0)
  octave <<= utype(mbits)
  w |= octave
  return w


def random_blocks(qtype: str, shape: tuple[int, ...], rng: np.random.Generator,
                  scale: float = 1e-2) -> np.ndarray:
  """Random valid rows of `qtype` for logical `shape`: uint8 [*shape[:-1], row_bytes(qtype, shape[-1])].

  Block formats: random bytes, except each float16 scale field (d, dmin, ...) = uniform[0.5, 1.5] * scale,
  and Q5_1's offset m = -16 * uniform[0.5, 1.5] * scale (so its values centre near 0). Float formats
  (F32/F16/BF16): random sign, magnitude in [2^(E-2), 2^(E+2)) with E = floor(log2(scale)) (about
  [scale/4, 4*scale)), from random bits. Every dequantized value is finite. Vectorised numpy, no per-block
  Python: roughly 0.1-0.4 s per 100 MB on one core.
  """
  shape = tuple(int(s) for s in shape)
  if not shape:
    raise ValueError("random_blocks needs a shape with at least one dim")
  n = shape[-1]
  rb = row_bytes(qtype, n)
  lead = shape[:-1]
  if not (np.isfinite(scale) and scale > 0):
    raise ValueError(f"random_blocks: scale must be finite and > 0, got {scale}")
  if qtype in _FLOAT_BITS:
    return _random_floats(qtype, int(np.prod(shape, dtype=np.int64)), rng, scale).view(np.uint8).reshape(*lead, rb)

  block, size = GGML_TYPES[qtype]
  nb = int(np.prod(lead, dtype=np.int64)) * (n // block)
  # 64 random bits at a time straight from the bit generator: several GB/s, no per-byte work.
  words = rng.bit_generator.random_raw(-(-nb * size // 8))
  out = words.view(np.uint8)[:nb * size].reshape(nb, size)

  def f16_field(sign: float, mult: float) -> np.ndarray:
    v = rng.uniform(0.5, 1.5, nb).astype(np.float32) * np.float32(sign * mult * scale)
    return v.astype(np.float16).view(np.uint8).reshape(nb, 2)

  for off in _SCALE_FIELDS[qtype]:
    out[:, off:off + 2] = f16_field(1.0, 1.0)
  for off in _OFFSET_FIELDS.get(qtype, ()):
    out[:, off:off + 2] = f16_field(-1.0, 16.0)
  return out.reshape(*lead, rb)
