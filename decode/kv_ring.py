"""`KVRing`: the main (and drafter) K/V cache as an explicit pytree whose capacity is static.

Position p lives in slot p mod R. K is stored after RoPE, so slot order never matters to attention. With
`dtype="int8"` each (token, head) row is stored as int8 with an absmax scale (`k_scale`, `v_scale`).
The ring never moves data when it wraps: the oldest positions are simply overwritten; what is live is
[max(0, length - R), length).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

KV_DTYPES = ("f32", "bf16", "int8")
_STORE = {"f32": jnp.float32, "bf16": jnp.bfloat16, "int8": jnp.int8}


@struct.dataclass
class KVRing:
  k: jax.Array                  # [L, R, Hkv, Dh] (f32 | bf16 | int8)
  v: jax.Array                  # [L, R, Hkv, Dh]
  k_scale: jax.Array | None     # [L, R, Hkv] float32 (int8 only)
  v_scale: jax.Array | None
  length: jax.Array             # int32 scalar: positions written so far (next position to write)
  capacity: int = struct.field(pytree_node=False)
  dtype: str = struct.field(pytree_node=False)
  # Slots reserved for speculative overshoot: a verify pass writes up to `scratch` positions past the accepted
  # length, and a wrapped ring must not lose live entries to them. Attention sees the last capacity - scratch
  # positions (`window`), so a rejected write only ever lands on a slot that is no longer read.
  scratch: int = struct.field(pytree_node=False, default=0)

  @classmethod
  def create(cls, n_layers: int, capacity: int, n_kv_heads: int, head_dim: int, dtype: str = "bf16",
             block: int = 1, scratch: int = 0) -> "KVRing":
    if dtype not in KV_DTYPES:
      raise ValueError(f"KVRing: kv dtype {dtype!r} is not one of {KV_DTYPES}")
    if capacity <= 0 or capacity % block:
      raise ValueError(f"KVRing: capacity {capacity} must be a positive multiple of the attention block {block}")
    shape = (n_layers, capacity, n_kv_heads, head_dim)
    k = jnp.zeros(shape, _STORE[dtype])
    scales = (jnp.zeros(shape[:-1], jnp.float32), jnp.zeros(shape[:-1], jnp.float32)) if dtype == "int8" else (None, None)
    if not 0 <= scratch < capacity:
      raise ValueError(f"KVRing: scratch {scratch} must be in [0, capacity {capacity})")
    return cls(k, jnp.zeros(shape, _STORE[dtype]), *scales, jnp.zeros((), jnp.int32), capacity, dtype, scratch)

  @property
  def window(self) -> int:
    """Positions attention can see: the last `capacity - scratch` written."""
    return self.capacity - self.scratch

  @property
  def n_layers(self) -> int:
    return self.k.shape[0]

  @property
  def nbytes(self) -> int:
    n = self.k.size * self.k.dtype.itemsize * 2
    if self.k_scale is not None:
      n += self.k_scale.size * 4 * 2
    return int(n)

  def write(self, layer: int, pos_T: jax.Array, k_THD: jax.Array, v_THD: jax.Array) -> "KVRing":
    """Store T new rows of one layer at positions pos_T (slots pos mod R). Does not advance `length`."""
    slots = pos_T % self.capacity
    if self.dtype == "int8":
      kq, ks = quantize_int8(k_THD)
      vq, vs = quantize_int8(v_THD)
      return self.replace(k=self.k.at[layer, slots].set(kq), v=self.v.at[layer, slots].set(vq),
                          k_scale=self.k_scale.at[layer, slots].set(ks), v_scale=self.v_scale.at[layer, slots].set(vs))
    dt = _STORE[self.dtype]
    return self.replace(k=self.k.at[layer, slots].set(k_THD.astype(dt)), v=self.v.at[layer, slots].set(v_THD.astype(dt)))

  def grow(self, capacity: int) -> "KVRing":
    """The same live positions in a larger ring (the next bucket): slot p mod R moves to slot p mod R'."""
    if capacity < self.capacity:
      raise ValueError(f"KVRing.grow: {capacity} is smaller than the current capacity {self.capacity}")
    R, L = self.capacity, self.length
    s = jnp.arange(R, dtype=jnp.int32)
    pos = L - 1 - jnp.mod(L - 1 - s, R)                    # position held by each old slot
    dst = jnp.where(pos >= 0, pos % capacity, capacity)     # dead slots go out of bounds (dropped)

    def move(a):
      if a is None:
        return None
      new = jnp.zeros((a.shape[0], capacity) + a.shape[2:], a.dtype)
      return new.at[:, dst].set(a, mode="drop")

    return KVRing(move(self.k), move(self.v), move(self.k_scale), move(self.v_scale), L, capacity, self.dtype,
                  self.scratch)

  def advance(self, n) -> "KVRing":
    return self.replace(length=self.length + jnp.asarray(n, jnp.int32))

  def rewind(self, length) -> "KVRing":
    """Forget positions >= length (rejected drafts): they are masked out and overwritten later."""
    return self.replace(length=jnp.asarray(length, jnp.int32))


def quantize_int8(x_THD: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Absmax per (token, head): q = round(x / s), s = max|x| / 127."""
  x = x_THD.astype(jnp.float32)
  s = jnp.max(jnp.abs(x), axis=-1) / 127.0
  q = jnp.round(x / jnp.where(s > 0, s, 1.0)[..., None])
  return jnp.clip(q, -127, 127).astype(jnp.int8), s
