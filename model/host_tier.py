"""Host tier: K/V of positions older than the main ring's window, in (pinned) host memory.

With `max_context` C > R, every write of positions p into the ring also copies position p - W (W = the ring's
window, capacity - scratch) from its ring slot into the tier, so the tier holds exactly the positions the ring
no longer shows. Attention then runs over the ring and over the tier and merges the two exactly with their
log-sum-exps (ops/attention.merge_lse). A decode step or verify pass (T <= the decode kernel's MAX_T) splits per
row, as the step at that row's position would: row t sees the ring from pos_t + 1 - W and the tier below it,
which makes a verify pass's rows the steps' bitwise on the GPU (`ops/attention.tier_attention` runs the tier's
blocks through the decode kernel); a prefill chunk splits every row at written - W.

The tier is indexed by position (slot p), capacity C, same dtype and scales as the ring. On a GPU its arrays
are placed in pinned host memory (`place_on_host`); on CPU it is ordinary memory unless a test forces the
kind. Inside the jitted step a tier in host memory takes only dynamic slices and updates: attention slices the
visited pieces (spans of `tier_span` positions a row sees whole, then blocks of `tier_block` positions, live
positions only) and moves them to the device, and `evict` writes T rows back. On a GPU both parts of attention
run on the Pallas kernels: the ring's part as without a tier, the tier's piece by piece (the decode kernel for
steps and verify passes, the prefill kernel for prefill chunks). Each piece read crosses PCIe (4 MB per 4,096
positions and layer at int8 on seed-mtp), the tier's inherent cost: a seed-mtp step at 128K depth with a
32,768-slot ring reads ~1.2 GB of tier a step, ~26 ms at the ~48 GB/s the H200's copies reach (docs/PERF.md,
"The host tier at 128K reads its bytes at PCIe speed").
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from model.kv_ring import KVRing, layer_arrays
from ops.attention import in_host_memory

HOST_BLOCK = 4096          # positions per block of attention over the tier (tier_block)
HOST_SPAN = 16384          # positions per span, the pieces a row sees whole (tier_span)


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
    """Copy positions pos_T - W (those >= 0) of `layer` from the ring (before pos_T overwrite anything).

    pos_T are consecutive (a step, a verify pass, a prefill chunk). The T tier rows from s = clip(pos_T[0] - W)
    are written from the ring slots of positions s .. s + T - 1: one gather on the device, one transfer and one
    dynamic update per array, and nothing read back from the tier (the only operation a tier in host memory
    takes inside jit is that update). Rows written are either evicted now (their ring slot still holds them:
    a slot is overwritten R >= W positions later) or, while pos_T[0] < W, positions still inside the window:
    attention reads the tier below written - W only, and those rows are written again, equal, when they
    leave. Needs pos_T[-1] - W < capacity (the engine sizes the tier to max_context plus slack)."""
    W, R, C = ring.window, ring.capacity, self.capacity
    T = pos_T.shape[0]
    s = jnp.clip(pos_T[0] - W, 0, C - T)
    pos = s + jnp.arange(T, dtype=jnp.int32)

    def copy(tier, rng):
      if tier is None:
        return None
      a = tier[layer]
      new = rng[layer][pos % R]
      if in_host_memory(a):
        new = jax.device_put(new, jax.memory.Space.Host)
      return tier[:layer] + (jax.lax.dynamic_update_slice(a, new, (s,) + (0,) * (a.ndim - 1)),) + tier[layer + 1:]

    return self.replace(k=copy(self.k, ring.k), v=copy(self.v, ring.v), k_scale=copy(self.k_scale, ring.k_scale),
                        v_scale=copy(self.v_scale, ring.v_scale))


def evict_leaving(tier: HostTier, ring: KVRing, pos_T: jax.Array) -> tuple[HostTier, KVRing]:
  """`evict` for every layer before a forward pass of positions pos_T writes the ring (each layer's ring is
  unchanged until then, so this equals evicting layer by layer before each write). Returns (tier, ring): the
  forward pass must write the ring returned here. It leaves an optimization barrier over both, which orders
  every read of the evict before the layers' in-place ring writes; without it XLA could not prove that order
  and copied every layer's whole ring per step (and per branch of a round's cond), a cost proportional to the
  capacity at any depth (tests/model/test_ring.py::test_host_tier_steps_never_copy_the_ring)."""
  t = tier
  for layer in range(len(t.k)):
    t = t.evict(ring, layer, pos_T)
  return jax.lax.optimization_barrier((t, ring))


def tier_block(window: int, attn_block: int, want: int | None = None) -> int:
  """Positions per block when attention visits the tier: `want` (ops.tuning.Tunings.tier_block) or HOST_BLOCK,
  halved until it is at most the ring's window (a block then never runs past the tier's capacity: see HostTier),
  and at least attn_block.

  >>> tier_block(32760, 256), tier_block(32760, 256, 16384), tier_block(248, 32), tier_block(248, 32, 16)
  (4096, 16384, 128, 32)
  """
  b = want or HOST_BLOCK
  while b > window:
    b //= 2
  return max(b, attn_block)


def tier_span(block: int, want: int | None = None) -> int:
  """Positions per span, the large pieces attention takes of the tier where a row sees them whole (see
  ops.attention.tier_attention): `want` (ops.tuning.Tunings.tier_span) or HOST_SPAN, at least `block` (a power
  of two at least the block is a multiple of it). A span is read only when some row sees all of it, so it never
  runs past what was written.

  >>> tier_span(4096), tier_span(4096, 4096), tier_span(128), tier_span(32768, 16384)
  (16384, 4096, 16384, 32768)
  """
  return max(want or HOST_SPAN, block)


def host_memory_kind(dev=None) -> str | None:
  """The memory kind that host-side state (the host tier, the expert store) lives in on `dev` (default: the
  first device): "pinned_host" on a GPU that exposes it, else None (on CPU host memory is the device's)."""
  dev = dev or jax.devices()[0]
  if dev.platform != "gpu":
    return None
  return "pinned_host" if "pinned_host" in {m.kind for m in dev.addressable_memories()} else None


def place_on_host(tier: HostTier, memory_kind: str | None = None) -> HostTier:
  """Move the tier's arrays to `memory_kind`, by default host_memory_kind() (pinned host memory on a GPU;
  unchanged where there is none, e.g. on CPU, whose memory is the host's). Tests pass "pinned_host" to run the
  host-memory path on CPU (jax's CPU client has the kind)."""
  kind = memory_kind or host_memory_kind()
  if kind is None:
    return tier
  sh = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=kind)
  return jax.tree_util.tree_map(lambda a: jax.device_put(a, sh), tier)
