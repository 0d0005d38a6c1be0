"""`QTensor`: a GGUF tensor kept packed on the device, repacked once into per-field planes.

Quantized weights are never expanded to a full-precision copy that lives in the params. At load, each GGUF
tensor's blocks are split into per-field planes (ops/repack: d, scales, qs, qh, signs, ...), each shaped
`[..., rows, nb, *field_shape]`, aligned and with power-of-two trailing dims, so the Pallas kernels
(ops/qmatmul_pallas, ops/moe_pallas) read them with wide loads and dequantize in registers. The planes hold
exactly the file's bytes (moved, not decoded): `data` gives the GGUF rows back and `dense()` dequantizes
them bit-exactly (the XLA reference path). Leading dims (experts, rows) index as usual: `w[ids]`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from ops import quant, repack

FLOAT_TYPES = ("F32", "F16", "BF16")


@struct.dataclass
class QTensor:
  """Packed GGUF tensor as planes (see ops/repack.LAYOUTS[qtype]); logical shape [..., rows, n]."""
  planes: tuple
  qtype: str = struct.field(pytree_node=False)
  n: int = struct.field(pytree_node=False)        # values per row (the input dimension of a weight)
  # Which implementation multiplies with this tensor: "xla" (dequantize-then-dot reference), "pallas" (compiled
  # kernel) or "interpret" (the Pallas kernel in interpret mode, for CPU tests). A static field, so switching it
  # changes the treedef and every jitted function retraces: `with_kernels(params, "pallas")`.
  kernel: str = struct.field(pytree_node=False, default="xla")

  @property
  def shape(self) -> tuple[int, ...]:
    return repack.lead_shape(self.planes, self.qtype) + (self.n,)

  @property
  def nbytes(self) -> int:
    return int(sum(p.size * p.dtype.itemsize for p in self.planes))

  @property
  def plane_names(self) -> tuple[str, ...]:
    return repack.plane_names(self.qtype)

  def plane(self, name: str) -> jax.Array:
    return self.planes[self.plane_names.index(name)]

  @property
  def data(self) -> jax.Array:
    """The GGUF rows, uint8 [..., rows, row_bytes] (reassembled from the planes)."""
    return repack.unpack(self.planes, self.qtype, self.n)

  def dense(self, dtype=jnp.float32) -> jax.Array:
    """Dequantize (bit-exactly as ggml) to `dtype` [..., rows, n]."""
    return quant.dequantize(self.data, self.qtype, self.n).astype(dtype)

  def __getitem__(self, idx) -> "QTensor":
    """Index leading dims (experts, rows): `w[ids]` keeps the rows packed."""
    return self.replace(planes=tuple(p[idx] for p in self.planes))

  @classmethod
  def from_gguf(cls, data_u8, qtype: str, n: int) -> "QTensor":
    """From a GGUF tensor's bytes (numpy uint8 [..., rows, row_bytes]): repacked once, on the host."""
    return cls(tuple(jnp.asarray(p) for p in repack.repack_np(data_u8, qtype, n)), qtype, n)

  @classmethod
  def from_planes(cls, planes, qtype: str, n: int, kernel: str = "xla") -> "QTensor":
    return cls(tuple(planes), qtype, n, kernel)


KERNELS = ("xla", "pallas", "interpret")


def concat_rows(ws):
  """Weights [rows_i, n] of one type stacked along their rows into one [sum rows_i, n] (a QTensor's planes
  concatenated along the rows axis: the same bytes, so every output row is computed as before), or None when
  they do not share a type, n and kernel (or are not 2-D)."""
  if all(isinstance(w, QTensor) for w in ws):
    w0 = ws[0]
    if any((w.qtype, w.n, w.kernel) != (w0.qtype, w0.n, w0.kernel) or len(w.shape) != 2 for w in ws):
      return None
    fields = repack.LAYOUTS[w0.qtype]
    planes = tuple(jnp.concatenate([w.planes[j] for w in ws], axis=w0.planes[j].ndim - 2 - len(f.shape))
                   for j, f in enumerate(fields))
    return w0.replace(planes=planes)
  if any(isinstance(w, QTensor) for w in ws) or len({(w.dtype, w.shape[1:]) for w in ws}) != 1 or ws[0].ndim != 2:
    return None
  return jnp.concatenate(ws, axis=0)


def with_kernels(params, kernel: str):
  """The same params with every QTensor set to use `kernel` ("xla" | "pallas" | "interpret")."""
  if kernel not in KERNELS:
    raise ValueError(f"kernels: {kernel!r}, expected one of {KERNELS}")
  return jax.tree_util.tree_map(lambda w: w.replace(kernel=kernel) if isinstance(w, QTensor) else w, params,
                                is_leaf=lambda w: isinstance(w, QTensor))


def as_dense(w, dtype=jnp.float32) -> jax.Array:
  """A weight as a dense array: QTensor dequantized, plain arrays cast."""
  if isinstance(w, QTensor):
    return w.dense(dtype)
  return jnp.asarray(w).astype(dtype)


def weight_shape(w) -> tuple[int, ...]:
  return w.shape if isinstance(w, QTensor) else tuple(jnp.shape(w))
