"""Repack GGUF blocks once into per-field planes, and back (bit-exact, in both directions).

A GGUF row is an array of blocks, each an interleaved record (array of structs): IQ3_S is
`d f16 | qs 64 | qh 8 | signs 32 | scales 4` = 110 bytes, so its fields sit at odd, unaligned offsets and a
kernel cannot read them with wide loads. `repack` splits every block into its fields and stores each field as
its own array, a *plane* (struct of arrays), shaped `[..., rows, nb, *field_shape]` with `nb = n / block`:

  - the bytes are the same bytes, only moved: no plane is larger than its field, nothing is decoded;
  - every plane is aligned and its trailing dims are powers of two, so a Triton tile `[BN rows, S blocks,
    *field_shape]` is one strided load with 16-byte vectors;
  - multi-byte fields are viewed as little-endian uint32 words (8 nibbles or 4 bytes per register), f16
    scales as float16, Q6_K's int8 scales as int8; `field_shape` splits the words so that the value index of
    each nibble/byte is an affine function of the tile's coordinates (see each kernel's tile docstring in
    ops/qmatmul_pallas.py).

`unpack(planes)` concatenates the fields back into GGUF rows, so `QTensor.dense()` is still the bit-exact
ops/quant dequantizer. The leading dims (experts, rows) are untouched: `plane[ids]` selects experts or rows.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ops import quant


@dataclasses.dataclass(frozen=True)
class Field:
  name: str
  nbytes: int             # bytes of this field in one GGUF block
  dtype: str              # numpy dtype of the plane
  shape: tuple[int, ...]  # per-block shape of the plane (product * itemsize == nbytes)


def _f(name, nbytes, dtype, shape=()):
  f = Field(name, nbytes, dtype, tuple(shape))
  assert int(np.prod(f.shape, dtype=np.int64)) * np.dtype(f.dtype).itemsize == nbytes, f
  return f


# Fields in GGUF byte order; offsets are the running sum of nbytes. Shapes are documented with each kernel.
LAYOUTS: dict[str, tuple[Field, ...]] = {
    "F32": (_f("v", 4, "float32"),),
    "F16": (_f("v", 2, "float16"),),
    "BF16": (_f("v", 2, "uint16"),),
    # x = d * q; word w byte c = value 4w + c
    "Q8_0": (_f("d", 2, "float16"), _f("qs", 32, "uint32", (8,))),
    "Q5_0": (_f("d", 2, "float16"), _f("qh", 4, "uint32"), _f("qs", 16, "uint32", (4,))),
    "Q5_1": (_f("d", 2, "float16"), _f("m", 2, "float16"), _f("qh", 4, "uint32"), _f("qs", 16, "uint32", (4,))),
    # hdr = d|dmin<<16, 12 scale bytes; qs word (i, j) byte c nibble h = value 64i + 32h + 4j + c
    "Q4_K": (_f("hdr", 16, "uint32", (4,)), _f("qs", 128, "uint32", (4, 8))),
    # as Q4_K, plus qh word j bit 8c+k = bit 4 of value 32k + 4j + c
    "Q5_K": (_f("hdr", 16, "uint32", (4,)), _f("qh", 32, "uint32", (8,)), _f("qs", 128, "uint32", (4, 8))),
    # value 128hh + 32s + 4(4jh + jl) + cb: ql (hh, s%2, jh, jl) nibble s//2 of byte cb; qh (hh, jh, jl) bits
    # 8cb + 2s; scale (hh, s, jh)
    "Q6_K": (_f("ql", 128, "uint32", (2, 2, 2, 4)), _f("qh", 64, "uint32", (2, 2, 4)), _f("sc", 16, "int8", (2, 4, 2)),
             _f("d", 2, "float16")),
    # group k = 8p + 4w2 + cb (p = 4a + pp) of 4 values: qs (a, pp, w2) byte cb, qh (a) bit 8pp + 4w2 + cb,
    # signs (a, pp) bit 16w2 + 4cb + m, scales nibble p
    "IQ3_S": (_f("d", 2, "float16"), _f("qs", 64, "uint32", (2, 4, 2)), _f("qh", 8, "uint32", (2,)),
              _f("signs", 32, "uint32", (2, 4)), _f("scales", 4, "uint32")),
    # word jw byte cb nibble h = value 16h + 4jw + cb
    "IQ4_NL": (_f("d", 2, "float16"), _f("qs", 16, "uint32", (4,))),
    # hdr = d|scales_h<<16, scales_l; qs (ib, jw) byte cb nibble h = value 32ib + 16h + 4jw + cb
    "IQ4_XS": (_f("hdr", 8, "uint32", (2,)), _f("qs", 128, "uint32", (8, 4))),
}
assert LAYOUTS.keys() == quant.GGML_TYPES.keys()
for _q, _fs in LAYOUTS.items():
  assert sum(f.nbytes for f in _fs) == quant.GGML_TYPES[_q][1], _q


def block_values(qtype: str) -> int:
  return quant.GGML_TYPES[qtype][0]


def plane_names(qtype: str) -> tuple[str, ...]:
  return tuple(f.name for f in LAYOUTS[qtype])


def lead_shape(planes, qtype: str) -> tuple[int, ...]:
  """[..., rows] of a repacked tensor (the plane shape without `nb` and the field dims)."""
  f0 = LAYOUTS[qtype][0]
  return tuple(planes[0].shape[:planes[0].ndim - 1 - len(f0.shape)])


def _split_bytes(blocks, qtype: str, xp):
  """blocks u8 [..., nb, size] -> one u8 array [..., nb, nbytes] per field."""
  out, off = [], 0
  for f in LAYOUTS[qtype]:
    out.append(blocks[..., off:off + f.nbytes])
    off += f.nbytes
  return out


def repack_np(data_u8: np.ndarray, qtype: str, n: int) -> tuple[np.ndarray, ...]:
  """GGUF rows (numpy uint8 [..., row_bytes]) -> planes (numpy, [..., nb, *field_shape]). Host side, at load."""
  data_u8 = np.asarray(data_u8)
  rb = quant.row_bytes(qtype, n)
  if data_u8.dtype != np.uint8 or data_u8.shape[-1] != rb:
    raise ValueError(f"{qtype}: expected uint8 [..., {rb}] for n={n}, got {data_u8.dtype} {data_u8.shape}")
  block, size = quant.GGML_TYPES[qtype]
  lead = data_u8.shape[:-1]
  blocks = data_u8.reshape(*lead, n // block, size)
  planes = []
  for f, b in zip(LAYOUTS[qtype], _split_bytes(blocks, qtype, np)):
    planes.append(np.ascontiguousarray(b).view(f.dtype).reshape(*lead, n // block, *f.shape))
  return tuple(planes)


def repack(data_u8: jax.Array, qtype: str, n: int) -> tuple[jax.Array, ...]:
  """The same as `repack_np` in jnp (device side; used by the benchmark's on-device random weights)."""
  block, size = quant.GGML_TYPES[qtype]
  lead = data_u8.shape[:-1]
  blocks = data_u8.reshape(*lead, n // block, size)
  planes = []
  for f, b in zip(LAYOUTS[qtype], _split_bytes(blocks, qtype, jnp)):
    dt = jnp.dtype(f.dtype)
    if dt.itemsize > 1:
      b = jax.lax.bitcast_convert_type(b.reshape(*b.shape[:-1], f.nbytes // dt.itemsize, dt.itemsize), dt)
    else:
      b = jax.lax.bitcast_convert_type(b, dt)
    planes.append(b.reshape(*lead, n // block, *f.shape))
  return tuple(planes)


def unpack(planes, qtype: str, n: int) -> jax.Array:
  """Planes -> GGUF rows uint8 [..., row_bytes] (jnp, jittable; inverse of `repack`)."""
  lead = lead_shape(planes, qtype)
  nb = n // block_values(qtype)
  parts = []
  for f, p in zip(LAYOUTS[qtype], planes):
    p = jnp.asarray(p).reshape(*lead, nb, -1)
    b = jax.lax.bitcast_convert_type(p, jnp.uint8)
    parts.append(b.reshape(*lead, nb, f.nbytes))
  return jnp.concatenate(parts, axis=-1).reshape(*lead, quant.row_bytes(qtype, n))


def unpack_np(planes, qtype: str, n: int) -> np.ndarray:
  lead = lead_shape(planes, qtype)
  nb = n // block_values(qtype)
  parts = [np.ascontiguousarray(np.asarray(p)).reshape(*lead, nb, -1).view(np.uint8).reshape(*lead, nb, f.nbytes)
           for f, p in zip(LAYOUTS[qtype], planes)]
  return np.concatenate(parts, axis=-1).reshape(*lead, quant.row_bytes(qtype, n))


def random_planes(key: jax.Array, qtype: str, shape: tuple[int, ...], scale: float = 1e-2) -> tuple[jax.Array, ...]:
  """Random valid blocks of `qtype` for logical `shape`, made on the device, already repacked (for the benchmark).

  Random bytes, with every float16 scale field set to uniform[0.5, 1.5] * scale (as `quant.random_blocks`).
  """
  block, size = quant.GGML_TYPES[qtype]
  *lead, n = shape
  nb = n // block
  k1, k2 = jax.random.split(key)
  bits = jax.random.bits(k1, (*lead, nb, size), jnp.uint8)
  offs = quant._SCALE_FIELDS.get(qtype, ())
  if offs:
    v = jax.random.uniform(k2, (*lead, nb, len(offs)), jnp.float32, 0.5, 1.5) * scale
    vb = jax.lax.bitcast_convert_type(v.astype(jnp.float16), jnp.uint8)      # [..., nb, len, 2]
    for i, off in enumerate(offs):
      bits = bits.at[..., off:off + 2].set(vb[..., i, :])
  return repack(bits.reshape(*lead, nb * size), qtype, n)
