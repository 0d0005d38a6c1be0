"""Quantized matmul `x[..., K] @ W[N, K]^T -> [..., N]` with W a packed QTensor.

`qmatmul_ref` is the reference: dequantize (bit-exact, ops/quant) then a float32 dot. The Pallas kernel that
reads the packed blocks in place comes in ops/qmatmul_pallas.py; `qmatmul` dispatches.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ops.qtensor import QTensor


def qmatmul_ref(x: jax.Array, w: QTensor) -> jax.Array:
  return jnp.einsum("...k,nk->...n", x.astype(jnp.float32), w.dense(jnp.float32))


def qmatmul(x: jax.Array, w: QTensor) -> jax.Array:
  return qmatmul_ref(x, w)
