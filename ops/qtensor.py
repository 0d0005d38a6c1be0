"""`QTensor`: a GGUF tensor kept in its packed block form on the device.

Quantized weights are never expanded to a full-precision copy that lives in the params: `data` holds the
file's bytes, one row of `n` values per last-axis slice, and `dense()` dequantizes on the fly inside a
jitted function (the XLA reference path). Kernels (ops/qmatmul, ops/moe) read the same bytes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from ops import quant

FLOAT_TYPES = ("F32", "F16", "BF16")


@struct.dataclass
class QTensor:
  """Packed GGUF tensor: `data` uint8 [..., rows, row_bytes]; logical shape [..., rows, n]."""
  data: jax.Array
  qtype: str = struct.field(pytree_node=False)
  n: int = struct.field(pytree_node=False)        # values per row (the input dimension of a weight)

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.data.shape[:-1]) + (self.n,)

  @property
  def nbytes(self) -> int:
    return int(self.data.size)

  def dense(self, dtype=jnp.float32) -> jax.Array:
    """Dequantize (bit-exactly as ggml) to `dtype` [..., rows, n]."""
    return quant.dequantize(self.data, self.qtype, self.n).astype(dtype)

  def __getitem__(self, idx) -> "QTensor":
    """Index leading dims (e.g. experts): `w[ids]` keeps the rows packed."""
    return QTensor(self.data[idx], self.qtype, self.n)


def as_dense(w, dtype=jnp.float32) -> jax.Array:
  """A weight as a dense array: QTensor dequantized, plain arrays cast."""
  if isinstance(w, QTensor):
    return w.dense(dtype)
  return jnp.asarray(w).astype(dtype)


def weight_shape(w) -> tuple[int, ...]:
  return w.shape if isinstance(w, QTensor) else tuple(jnp.shape(w))
