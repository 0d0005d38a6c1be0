"""GPU probe: what one expert-cache miss costs by how its bytes are laid out in the store. A jitted while loop
over N misses (the shape of `expert_cache.ensure`'s loop), each copying one seed-mtp IQ3_S expert (gate and up of
F = 512 rows x D = 2048, down of D rows x F: 1.35 MB) from pinned host memory into a device pool slot:
  planes: 15 copies, one per plane (ops.repack's 5 IQ3_S planes x 3 tensors), as the cache does today;
  slab:   the same bytes as one [E, bytes] uint8 row, one copy into a slab pool (the copy alone, a floor);
  rows:   the store as each expert's GGUF bytes (gate, up, down rows end to end), one copy into a staging row,
          split and repacked on the device (`ops.repack.repack`) into the 15 plane pools: the lever a row store
          would be. Its pools are checked bytewise equal to the planes variant's (same experts, same slots; the random
          bytes make NaN scales, so values would not compare).
Prints µs per miss and the bytes' GB/s; one device, seconds (on CPU the store is device memory: the check alone).

  python scripts/gpu/miss_copy_probe.py [--n 400] [--repeats 5]
"""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from model.expert_cache import store_memory_kind
from ops import quant, repack
from ops.attention import on_device

E, S, F, D, QT = 512, 64, 512, 2048, "IQ3_S"
TENSORS = ((F, D), (F, D), (D, F))                       # gate, up, down: (rows, n)
ROW_BYTES = [rows * quant.row_bytes(QT, n) for rows, n in TENSORS]


def split(x, repack_fn):
  """[k, sum(ROW_BYTES)] GGUF bytes (each expert's gate, up, down rows end to end) -> the 15 planes, [k, ...] each."""
  out, off = [], 0
  for (rows, n), b in zip(TENSORS, ROW_BYTES):
    out += repack_fn(x[:, off:off + b].reshape(x.shape[0], rows, -1), QT, n)
    off += b
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--n", type=int, default=400, help="misses per loop")
  ap.add_argument("--repeats", type=int, default=5)
  a = ap.parse_args()
  dev = jax.devices()[0]
  host = jax.sharding.SingleDeviceSharding(dev, memory_kind=store_memory_kind(dev))   # CPU: "device"
  rng = np.random.default_rng(0)
  total = sum(ROW_BYTES)
  gguf = rng.integers(0, 255, (E, total), dtype=np.uint8)             # each expert's rows end to end
  planes_np = split(gguf, repack.repack_np)
  store_planes = [jax.device_put(p, host) for p in planes_np]
  store_rows = jax.device_put(gguf, host)
  ids = jnp.asarray(rng.integers(0, E, a.n), jnp.int32)

  def fetch(plane, e):
    return on_device(jax.lax.dynamic_slice_in_dim(plane, e, 1, axis=0))

  def run(kind):
    def body(c):
      i, pools = c
      e, v = ids[i], i % S
      if kind == "planes":
        new = [fetch(s, e) for s in store_planes]
      elif kind == "slab":
        new = [fetch(store_rows, e)]
      else:
        new = split(fetch(store_rows, e), repack.repack)
      return i + 1, tuple(jax.lax.dynamic_update_slice_in_dim(p, r, v, 0) for p, r in zip(pools, new))
    shapes = [((S, total), np.uint8)] if kind == "slab" else [((S,) + p.shape[1:], p.dtype) for p in planes_np]
    f = jax.jit(lambda n, pools: jax.lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), pools))[1],
                donate_argnums=1)
    pools = tuple(jnp.zeros(s, dt) for s, dt in shapes)
    pools = jax.block_until_ready(f(jnp.int32(a.n), pools))           # compile + warm
    best = []
    for _ in range(a.repeats):
      t0 = time.perf_counter()
      pools = jax.block_until_ready(f(jnp.int32(a.n), pools))
      best.append(time.perf_counter() - t0)
    t = min(best) / a.n
    print(f"{kind:7s}: {t * 1e6:7.1f} us per miss, {total / t / 1e9:5.1f} GB/s ({total / 1e6:.2f} MB a miss)",
          flush=True)
    return pools

  ref = run("planes")
  run("slab")
  got = run("rows")
  same = all(np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8)) for x, y in zip(ref, got))
  print(f"rows' pools == planes' pools: {same}")
  if not same:
    raise SystemExit("miss_copy_probe: the rows variant's pools differ from the planes variant's")


if __name__ == "__main__":
  main()
