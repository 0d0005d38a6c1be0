"""Small dense ops with their exact semantics (llama.cpp's): RMSNorm, NEOX RoPE (partial), linear, SwiGLU."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ops import qmatmul
from ops.qtensor import QTensor, as_dense
from ops.tuning import Tunings


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
  """x / sqrt(mean(x^2) + eps) * w over the last axis, in float32."""
  x = x.astype(jnp.float32)
  ms = jnp.mean(x * x, axis=-1, keepdims=True)
  return x * jax.lax.rsqrt(ms + eps) * w.astype(jnp.float32)


def rope_neox(x_THDh: jax.Array, pos_T: jax.Array, rope_dim: int, theta: float,
              pairs: tuple[bool, ...] | None = None) -> jax.Array:
  """NEOX rotary embedding on the first `rope_dim` dims of each head.

  Pairs (i, i + rope_dim/2) rotate by pos * theta^(-2i/rope_dim); dims past rope_dim pass through
  (partial rotary, as glm4moe). x: [T, H, Dh], pos: [T] int32 absolute positions. `pairs` (static, rope_dim / 2
  flags): only the pairs it marks rotate, the others pass through (llama.cpp's IMROPE on text positions).
  """
  half = rope_dim // 2
  inv_freq = theta ** (-2.0 * jnp.arange(half, dtype=jnp.float32) / rope_dim)
  if pairs is not None:
    if len(pairs) != half:
      raise ValueError(f"rope_neox: {len(pairs)} pair flags for rope_dim {rope_dim}, expected {half}")
    inv_freq = inv_freq * jnp.asarray(pairs, jnp.float32)
  ang = pos_T.astype(jnp.float32)[:, None] * inv_freq[None, :]          # [T, half]
  cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]         # [T, 1, half]
  x = x_THDh.astype(jnp.float32)
  x1, x2, rest = x[..., :half], x[..., half:rope_dim], x[..., rope_dim:]
  out = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
  if rest.shape[-1]:
    out.append(rest)
  return jnp.concatenate(out, axis=-1)


def linear(x: jax.Array, w, b: jax.Array | None = None, *, tunings: Tunings | None = None,
           precision: str = "auto", x8=None) -> jax.Array:
  """y = x @ w.T (+ b); w is [out, in] as GGUF stores it (dense or packed QTensor). A QTensor goes through
  ops.qmatmul.qmatmul (the Pallas kernels on a GPU, dequantize-then-dot elsewhere) with `tunings` (static),
  `precision` (the prefill GEMM's: "auto" | "f32" | "bf16") and `x8` (x rounded to 8 bits by the norm before)."""
  if isinstance(w, QTensor):
    y = qmatmul.qmatmul(x, w, tunings=tunings, precision=precision, x8=x8)
  else:
    y = jnp.einsum("...k,nk->...n", x.astype(jnp.float32), as_dense(w))
  if b is not None:
    y = y + b.astype(jnp.float32)
  return y


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
  return jax.nn.silu(gate) * up
