"""`KVRing`: the main (and drafter) K/V cache as an explicit pytree whose capacity is static, and `KVLayer`,
one attention layer's part of it as that layer's block receives and returns it.

Position p lives in slot p mod R. K is stored after RoPE, so slot order never matters to attention. With
`dtype="int8"` each (token, head) row is stored as int8 with an absmax scale (`k_scale`, `v_scale`).
The ring never moves data when it wraps: the oldest positions are simply overwritten; what is live is
[max(0, length - R), length).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from ops.kv_write import STORE as _STORE, write_rows

KV_DTYPES = ("f32", "bf16", "int8")


def _set(t: tuple, i: int, a) -> tuple:
  return t[:i] + (a,) + t[i + 1:]


def layer_arrays(cache, i: int):
  """(k, v, k_scale, v_scale) of layer i of a per-layer cache (KVRing or HostTier); scales None unless int8."""
  return (cache.k[i], cache.v[i], None if cache.k_scale is None else cache.k_scale[i],
          None if cache.v_scale is None else cache.v_scale[i])


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _zero_ring(n_layers: int, shape: tuple, dtype: str):
  """A ring's zeroed arrays (k, v, scales, length), all in one compiled call: 4 L arrays allocated one eager
  `jnp.zeros` at a time cost the 30B shape ~60 ms of host round trips per request on the H200 (PERF "Prefill")."""
  zeros = lambda shp, dt: tuple(jnp.zeros(shp, dt) for _ in range(n_layers))  # noqa: E731
  scales = (zeros(shape[:-1], jnp.float32), zeros(shape[:-1], jnp.float32)) if dtype == "int8" else (None, None)
  return zeros(shape, _STORE[dtype]), zeros(shape, _STORE[dtype]), *scales, jnp.zeros((), jnp.int32)


@struct.dataclass
class KVRing:
  # One array per layer (a tuple), not one [L, R, ...] stack: a layer is its own buffer, so attention reads it
  # without a slice copy, and a kernel's element offsets stay within one layer (R x Hkv x Dh), far from the
  # 2**31 where 32-bit offsets overflow at large capacities.
  k: tuple                      # L x [R, Hkv, Dh] (f32 | bf16 | int8)
  v: tuple                      # L x [R, Hkv, Dh]
  k_scale: tuple | None         # L x [R, Hkv] float32 (int8 only)
  v_scale: tuple | None
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
    if not 0 <= scratch < capacity:
      raise ValueError(f"KVRing: scratch {scratch} must be in [0, capacity {capacity})")
    k, v, ks, vs, length = _zero_ring(n_layers, (capacity, n_kv_heads, head_dim), dtype)
    return cls(k, v, ks, vs, length, capacity, dtype, scratch)

  @property
  def window(self) -> int:
    """Positions attention can see: the last `capacity - scratch` written."""
    return self.capacity - self.scratch

  @property
  def n_layers(self) -> int:
    return len(self.k)

  def layer(self, i: int):
    """(k, v, k_scale, v_scale) of layer i."""
    return layer_arrays(self, i)

  def cache(self, i: int, tier=None) -> "KVLayer":
    """Layer i's part, as its block takes it: its slots, the ring's written length and, with a host tier
    (model.host_tier.HostTier), the tier's rows of the same layer (read only)."""
    return KVLayer(*self.layer(i), self.length, None if tier is None else tier.layer(i), self.capacity, self.dtype,
                   self.scratch)

  def with_cache(self, i: int, cache: "KVLayer") -> "KVRing":
    """The ring with layer i's slots taken from the block's returned `cache`."""
    return self.with_layer(i, cache.arrays)

  def with_layer(self, i: int, arrays) -> "KVRing":
    """The ring with layer i's (k, v, k_scale, v_scale) replaced (a kernel that wrote them in place)."""
    k, v, ks, vs = arrays
    return self.replace(k=_set(self.k, i, k), v=_set(self.v, i, v),
                        k_scale=None if ks is None else _set(self.k_scale, i, ks),
                        v_scale=None if vs is None else _set(self.v_scale, i, vs))

  def write(self, layer: int, pos_T: jax.Array, k_THkvDh: jax.Array, v_THkvDh: jax.Array) -> "KVRing":
    """Store T new rows of one layer at positions pos_T (slots pos mod R). Does not advance `length`."""
    return self.with_layer(layer, write_rows(*self.layer(layer), pos_T % self.capacity, k_THkvDh, v_THkvDh,
                                             self.dtype))

  def grow(self, capacity: int) -> "KVRing":
    """The same live positions in a larger ring (the next bucket): slot p mod R moves to slot p mod R'."""
    if capacity < self.capacity:
      raise ValueError(f"KVRing.grow: {capacity} is smaller than the current capacity {self.capacity}")
    R, L = self.capacity, self.length
    s = jnp.arange(R, dtype=jnp.int32)
    pos = L - 1 - jnp.mod(L - 1 - s, R)                    # position held by each old slot
    dst = jnp.where(pos >= 0, pos % capacity, capacity)     # dead slots go out of bounds (dropped)

    def move(t):
      if t is None:
        return None
      return tuple(jnp.zeros((capacity,) + a.shape[1:], a.dtype).at[dst].set(a, mode="drop") for a in t)

    return KVRing(move(self.k), move(self.v), move(self.k_scale), move(self.v_scale), L, capacity, self.dtype,
                  self.scratch)

  def advance(self, n) -> "KVRing":
    return self.replace(length=self.length + jnp.asarray(n, jnp.int32))

  def rewind(self, length) -> "KVRing":
    """Forget positions >= length (rejected drafts): they are masked out and overwritten later."""
    return self.replace(length=jnp.asarray(length, jnp.int32))


@struct.dataclass
class KVLayer:
  """One attention layer's K/V state as its block receives and returns it (`KVRing.cache` / `with_cache`)."""
  k: jax.Array                  # [R, Hkv, Dh]
  v: jax.Array
  k_scale: jax.Array | None     # [R, Hkv] float32 (int8 only)
  v_scale: jax.Array | None
  length: jax.Array             # positions the ring held before this pass
  tier: tuple | None            # the host tier's (k, v, k_scale, v_scale) of this layer, or None (read only)
  capacity: int = struct.field(pytree_node=False)
  dtype: str = struct.field(pytree_node=False)
  scratch: int = struct.field(pytree_node=False, default=0)

  @property
  def window(self) -> int:
    return self.capacity - self.scratch

  @property
  def arrays(self) -> tuple:
    """(k, v, k_scale, v_scale)."""
    return self.k, self.v, self.k_scale, self.v_scale

  def with_arrays(self, arrays) -> "KVLayer":
    k, v, ks, vs = arrays
    return self.replace(k=k, v=v, k_scale=ks, v_scale=vs)

  def write(self, pos_T: jax.Array, k_THkvDh: jax.Array, v_THkvDh: jax.Array) -> "KVLayer":
    """Store T new rows at positions pos_T (slots pos mod R)."""
    return self.with_arrays(write_rows(*self.arrays, pos_T % self.capacity, k_THkvDh, v_THkvDh, self.dtype))
