"""GPU probe: what one expert-cache miss costs by how its bytes are laid out in the store. A jitted while loop
over N misses (the shape of `expert_cache.ensure`'s loop), each copying one seed-mtp IQ3_S expert (gate, up, down
of F = 512 x D = 2048: 1.35 MB) from pinned host memory into a device pool slot:
  planes: 15 copies, one per plane (5 IQ3_S planes x 3 tensors), as the cache does today;
  slab:   the same bytes as one [E, bytes] uint8 row, one copy into a slab pool;
  unpack: one slab copy into a staging row, then its 15 slices written into the 15 plane pools (the lever).
Prints µs per miss and the bytes' GB/s; one device, seconds.

  python scripts/gpu/miss_copy_probe.py
"""
import time

import jax
import jax.numpy as jnp
import numpy as np

from ops.attention import on_device

E, S, N, F, NB = 512, 64, 400, 512, 8
PLANES = [2, 64, 8, 32, 4]                   # IQ3_S bytes per superblock: d, qs, qh, signs, scales
sizes = [F * NB * b for b in PLANES] * 3     # gate, up, down (down: D rows x F/256 blocks: the same bytes)
total = sum(sizes)
dev = jax.devices()[0]
host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
rng = np.random.default_rng(0)
store_planes = [jax.device_put(rng.integers(0, 255, (E, n), dtype=np.uint8), host) for n in sizes]
store_slab = jax.device_put(rng.integers(0, 255, (E, total), dtype=np.uint8), host)
ids = jnp.asarray(rng.integers(0, E, N), jnp.int32)


def fetch(plane, e):
  return on_device(jax.lax.dynamic_slice_in_dim(plane, e, 1, axis=0))


def run(kind):
  def body(c):
    i, pools = c
    e, v = ids[i], i % S
    if kind == "planes":
      pools = tuple(jax.lax.dynamic_update_slice_in_dim(p, fetch(s, e), v, 0) for p, s in zip(pools, store_planes))
    elif kind == "slab":
      pools = (jax.lax.dynamic_update_slice_in_dim(pools[0], fetch(store_slab, e), v, 0),)
    else:
      row, out, a = fetch(store_slab, e), [], 0
      for p, n in zip(pools, sizes):
        out.append(jax.lax.dynamic_update_slice_in_dim(p, row[:, a:a + n], v, 0))
        a += n
      pools = tuple(out)
    return i + 1, pools
  shapes = [(S, total)] if kind == "slab" else [(S, n) for n in sizes]
  f = jax.jit(lambda n, pools: jax.lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), pools))[1],
              donate_argnums=1)
  pools = tuple(jnp.zeros(s, jnp.uint8) for s in shapes)
  pools = jax.block_until_ready(f(jnp.int32(N), pools))        # compile + warm
  best = []
  for _ in range(5):
    t0 = time.perf_counter()
    pools = jax.block_until_ready(f(jnp.int32(N), pools))
    best.append(time.perf_counter() - t0)
  t = min(best) / N
  print(f"{kind:7s}: {t * 1e6:7.1f} us per miss, {total / t / 1e9:5.1f} GB/s ({total / 1e6:.2f} MB a miss)")
  return pools


for kind in ("planes", "slab", "unpack"):
  run(kind)
