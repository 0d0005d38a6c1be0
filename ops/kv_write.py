"""The K/V slot write shared by the model's ring (model/kv_ring.py) and the fused rope + write kernel's reference
(ops/rope_write_pallas.py): int8 absmax quantization per (token, head), or a cast, scattered to ring slots."""
from __future__ import annotations

import jax
import jax.numpy as jnp

STORE = {"f32": jnp.float32, "bf16": jnp.bfloat16, "int8": jnp.int8}


def quantize_int8(x_THkvDh: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Absmax per (token, head): (q int8 [T, Hkv, Dh], s float32 [T, Hkv]), q = round(x / s) clipped to +-127,
  s = max|x| / 127 (a zero row gets s = 0 and q = 0)."""
  x = x_THkvDh.astype(jnp.float32)
  s = jnp.max(jnp.abs(x), axis=-1) / 127.0
  q = jnp.round(x / jnp.where(s > 0, s, 1.0)[..., None])
  return jnp.clip(q, -127, 127).astype(jnp.int8), s


def write_rows(k_RHkvDh, v_RHkvDh, ks_RHkv, vs_RHkv, slots_T, k_THkvDh, v_THkvDh, dtype: str):
  """(k, v, ks, vs) with the T new rows stored at `slots_T`: quantized (`quantize_int8`, scales into ks / vs)
  when dtype is "int8", else cast to the ring's dtype ("f32" | "bf16"; ks / vs stay None)."""
  if dtype == "int8":
    kq, ks = quantize_int8(k_THkvDh)
    vq, vs = quantize_int8(v_THkvDh)
    return (k_RHkvDh.at[slots_T].set(kq), v_RHkvDh.at[slots_T].set(vq), ks_RHkv.at[slots_T].set(ks),
            vs_RHkv.at[slots_T].set(vs))
  dt = STORE[dtype]
  return k_RHkvDh.at[slots_T].set(k_THkvDh.astype(dt)), v_RHkvDh.at[slots_T].set(v_THkvDh.astype(dt)), ks_RHkv, vs_RHkv
