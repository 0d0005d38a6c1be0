"""How long a host tier's pinned memory takes to allocate and to free (the seed-1 TTFT lead in next_session.sh):
48 layers of int8 K and V [positions, 4, 128] with float32 scales [positions, 4] (seed-mtp's tier at 139K,
~7 GB), zeros made on the device and placed in "pinned_host" as model.host_tier.place_on_host does; then freed.

  python scripts/gpu/tier_alloc_probe.py [--positions 139264] [--repeats 3]
"""
import argparse
import gc
import time

import jax
import jax.numpy as jnp

ap = argparse.ArgumentParser()
ap.add_argument("--positions", type=int, default=139264)
ap.add_argument("--repeats", type=int, default=3)
a = ap.parse_args()
dev = jax.devices()[0]
kinds = {m.kind for m in dev.addressable_memories()}
kind = "pinned_host" if "pinned_host" in kinds else None
sh = jax.sharding.SingleDeviceSharding(dev, memory_kind=kind)
print(f"device {dev.device_kind}, memory kinds {sorted(kinds)}, tier in {kind}", flush=True)
for r in range(a.repeats):
  t0 = time.perf_counter()
  tier = []
  for _ in range(48):
    for shape, dt in (((a.positions, 4, 128), jnp.int8),) * 2 + (((a.positions, 4), jnp.float32),) * 2:
      tier.append(jax.device_put(jnp.zeros(shape, dt), sh))
  jax.block_until_ready(tier)
  t1 = time.perf_counter()
  nbytes = sum(x.nbytes for x in tier)
  del tier
  gc.collect()
  t2 = time.perf_counter()
  print(f"repeat {r}: {nbytes / 1e9:.2f} GB allocated + placed in {t1 - t0:.2f} s, freed in {t2 - t1:.2f} s", flush=True)
