"""Host tier: K/V of positions older than the main ring's window, in (pinned) host memory.

With `max_context` C > R, every write of positions p into the ring also copies position p - W (W = the ring's
window, capacity - scratch) from its ring slot into the tier, so the tier holds exactly the positions the ring
no longer shows. Attention then runs over the ring (positions >= written - W) and over the tier (positions
< written - W) and merges the two exactly with their log-sum-exps (ops/attention.merge_lse).

The tier is indexed by position (slot p), capacity C, same dtype and scales as the ring. On a GPU its arrays
are placed in pinned host memory (`place_on_host`); on CPU it is ordinary memory.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from decode.kv_ring import KVRing


@struct.dataclass
class HostTier:
  k: jax.Array                  # [L, C, Hkv, Dh]
  v: jax.Array
  k_scale: jax.Array | None     # [L, C, Hkv] (int8)
  v_scale: jax.Array | None
  capacity: int = struct.field(pytree_node=False)

  @classmethod
  def like(cls, ring: KVRing, capacity: int) -> "HostTier":
    shape = (ring.k.shape[0], capacity) + ring.k.shape[2:]
    sc = (jnp.zeros(shape[:-1], jnp.float32), jnp.zeros(shape[:-1], jnp.float32)) if ring.k_scale is not None else (None, None)
    return cls(jnp.zeros(shape, ring.k.dtype), jnp.zeros(shape, ring.v.dtype), *sc, capacity)

  @property
  def nbytes(self) -> int:
    n = self.k.size * self.k.dtype.itemsize * 2
    return int(n + (self.k_scale.size * 8 if self.k_scale is not None else 0))

  def evict(self, ring: KVRing, layer: int, pos_T: jax.Array) -> "HostTier":
    """Copy positions pos_T - W (those >= 0) of `layer` from the ring (before pos_T overwrite anything)."""
    W, R = ring.window, ring.capacity
    old = pos_T - W
    ok = old >= 0
    src = jnp.where(ok, old, 0) % R
    dst = jnp.where(ok, old, self.capacity)            # out of bounds: dropped

    def copy(tier_a, ring_a):
      if tier_a is None:
        return None
      return tier_a.at[layer, dst].set(ring_a[layer, src], mode="drop")

    return self.replace(k=copy(self.k, ring.k), v=copy(self.v, ring.v), k_scale=copy(self.k_scale, ring.k_scale),
                        v_scale=copy(self.v_scale, ring.v_scale))


def place_on_host(tier: HostTier) -> HostTier:
  """Move the tier's arrays to pinned host memory where the backend has it (GPU); unchanged on CPU."""
  dev = jax.devices()[0]
  if dev.platform == "cpu":
    return tier
  try:
    sh = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    return jax.tree_util.tree_map(lambda a: jax.device_put(a, sh), tier)
  except (ValueError, RuntimeError):
    return tier
