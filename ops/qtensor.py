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
  # Which implementation multiplies with this tensor: "xla" (dequantize-then-dot reference), "pallas" (compiled
  # kernel) or "interpret" (the Pallas kernel in interpret mode, for CPU tests). A static field, so switching it
  # changes the treedef and every jitted function retraces: `with_kernels(params, "pallas")`.
  kernel: str = struct.field(pytree_node=False, default="xla")

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
    return self.replace(data=self.data[idx])

  @classmethod
  def from_gguf(cls, data_u8, qtype: str, n: int) -> "QTensor":
    """From a GGUF tensor's bytes (numpy uint8 [..., rows, row_bytes])."""
    import numpy as np
    return cls(jnp.asarray(np.ascontiguousarray(data_u8)), qtype, n)


KERNELS = ("xla", "pallas", "interpret")


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
