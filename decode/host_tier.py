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

from decode.kv_ring import KVRing, layer_arrays


@struct.dataclass
class HostTier:
  k: tuple                      # L x [C, Hkv, Dh] (like the ring: one array per layer)
  v: tuple
  k_scale: tuple | None         # L x [C, Hkv] (int8)
  v_scale: tuple | None
  capacity: int = struct.field(pytree_node=False)

  @classmethod
  def like(cls, ring: KVRing, capacity: int) -> "HostTier":
    z = lambda t: None if t is None else tuple(jnp.zeros((capacity,) + a.shape[1:], a.dtype) for a in t)  # noqa: E731
    return cls(z(ring.k), z(ring.v), z(ring.k_scale), z(ring.v_scale), capacity)

  def layer(self, i: int):
    return layer_arrays(self, i)

  def evict(self, ring: KVRing, layer: int, pos_T: jax.Array) -> "HostTier":
    """Copy positions pos_T - W (those >= 0) of `layer` from the ring (before pos_T overwrite anything)."""
    W, R = ring.window, ring.capacity
    old = pos_T - W
    ok = old >= 0
    src = jnp.where(ok, old, 0) % R
    dst = jnp.where(ok, old, self.capacity)            # out of bounds: dropped

    def copy(tier, rng):
      if tier is None:
        return None
      return tier[:layer] + (tier[layer].at[dst].set(rng[layer][src], mode="drop"),) + tier[layer + 1:]

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
