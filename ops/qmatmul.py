"""Quantized matmul `x[..., K] @ W[N, K]^T -> [..., N]` with W a packed QTensor.

`qmatmul_ref` is the reference: dequantize (bit-exact, ops/quant) then a float32 dot. The Pallas kernel that
reads the packed planes in place is ops/qmatmul_pallas.py. `qmatmul` dispatches on `w.kernel`: "xla" is the
reference; "pallas" (compiled, Triton lowering) and "interpret" (the same kernels in interpret mode, for CPU
tests) run the FMA kernel for at most MAX_B rows of x (decode) and the tensor-core GEMM of ops/qgemm_pallas for
more (prefill) wherever they apply (a type in KERNEL_TYPES, a 2-D weight), and the reference elsewhere (Q5_0/Q5_1
fallback rows).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ops import qgemm_pallas, qmatmul_pallas
from ops.qtensor import QTensor
from ops.tuning import Tunings, fill, pick


def qmatmul_ref(x: jax.Array, w: QTensor) -> jax.Array:
  return jnp.einsum("...k,nk->...n", x.astype(jnp.float32), w.dense(jnp.float32))


def wants_x8(T: int, w, tunings: Tunings | None = None) -> bool:
  """Whether `qmatmul` on T rows of x reads x rounded to 8 bits (the decode kernel's tile x8 for w's type): then the
  norm that makes x rounds it in its own program and passes it as `qmatmul(..., x8=)`."""
  return (isinstance(w, QTensor) and w.kernel in ("pallas", "interpret") and qmatmul_pallas.supported(w, T)
          and fill(pick(tunings, "qmatmul", w.qtype), qmatmul_pallas.TUNING[w.qtype]).x8 is not None)


def qmatmul(x: jax.Array, w: QTensor, *, tunings: Tunings | None = None, precision: str = "auto",
            x8=None) -> jax.Array:
  """The dispatcher (module docstring); tunings (static): the kernels' pieces (`qmatmul`, `qgemm`, by w's type);
  precision: the prefill GEMM's ("auto" | "f32" | "bf16"; the decode kernel and the reference run float32); x8: x
  rounded to 8 bits by the norm before (wants_x8; an ops.dot8.X8), for the decode kernel; the other paths read x."""
  if w.kernel in ("pallas", "interpret"):
    rows = math.prod(x.shape[:-1])
    interpret = w.kernel == "interpret"
    if qmatmul_pallas.supported(w, rows):
      return qmatmul_pallas.qmatmul_pallas(x, w, interpret=interpret, tuning=pick(tunings, "qmatmul", w.qtype),
                                           x8=x8)
    if rows > qmatmul_pallas.MAX_B and len(w.shape) == 2 and qgemm_pallas.supported(w):
      return qgemm_pallas.qgemm_pallas(x, w, interpret=interpret, tuning=pick(tunings, "qgemm", w.qtype),
                                       precision=precision)
  return qmatmul_ref(x, w)
