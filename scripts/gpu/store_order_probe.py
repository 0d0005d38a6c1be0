"""GPU probe: does a chain of blocks that each move their experts from pinned host memory hold one block's copy at
a time? The compiled program's temp bytes, with and without `expert_cache.to_device(..., after=x)`, against one
block's bytes (a plain device_put of every block is scheduled at the program's start: all blocks live at once).

  python scripts/gpu/store_order_probe.py
"""
import jax
import jax.numpy as jnp
import numpy as np

from model import expert_cache as xc

L, E, F, D = 8, 512, 512, 512
host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
rng = np.random.default_rng(0)
ws = [jax.device_put(rng.integers(-8, 8, (E, F, D), dtype=np.int8), host) for _ in range(L)]


def chain(ws, x, order):
  for w in ws:
    wd = xc.to_device(w, after=x if order else None)
    x = jnp.tanh(jnp.einsum("efd,d->f", wd.astype(jnp.float32), x) * 1e-4 + x)
  return x


x = jnp.ones((D,), jnp.float32)
block = E * F * D / 2**20
outs = []
for order in (False, True):
  c = jax.jit(chain, static_argnums=2).lower(ws, x, order).compile()
  print(f"after={order}: temp {c.memory_analysis().temp_size_in_bytes / 2**20:.0f} MiB, one block {block:.0f} MiB, "
        f"{L} blocks {L * block:.0f} MiB")
  outs.append(np.asarray(c(ws, x)))
print("same values:", bool(np.array_equal(*outs)))
