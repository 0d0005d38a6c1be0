"""Could attention over the host tier run where the tier lives? Time it on the GPU machine's CPU (issue 26 item 5).

One layer of the seed-mtp shape's tier at 128K depth with a 32,768-slot ring: N = 98,304 positions of int8 K and V
([N, 2, 256], per-row float32 scales), 16 query heads (8 per K/V head), T = 1 (a step) and T = 4 (a k = 3 verify
pass). Attention over it with jax's CPU backend (jitted, XLA's thread pool) and with numpy, median of a few
runs; printed as ms per layer, ms per step (12 attention layers) and the K/V bytes' rate, to set beside the PCIe
rate at which the GPU reads the same bytes today (~48 GB/s: PERF "The host tier at 128K").

  python3 scripts/gpu/host_attention_probe.py [--n 98304] [--repeats 5]
"""
import argparse
import os
import time

import numpy as np


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--n", type=int, default=98304)
  ap.add_argument("--repeats", type=int, default=5)
  a = ap.parse_args()
  import jax
  import jax.numpy as jnp
  cpu = jax.devices("cpu")[0]
  N, Hkv, G, Dh, layers = a.n, 2, 8, 256, 12
  rng = np.random.default_rng(0)
  k8 = rng.integers(-127, 128, (N, Hkv, Dh), dtype=np.int8)
  v8 = rng.integers(-127, 128, (N, Hkv, Dh), dtype=np.int8)
  ks = rng.uniform(0.01, 0.02, (N, Hkv)).astype(np.float32)
  vs = rng.uniform(0.01, 0.02, (N, Hkv)).astype(np.float32)
  kv_bytes = k8.nbytes + v8.nbytes + ks.nbytes + vs.nbytes
  print(f"cpu: {os.cpu_count()} cores; one layer's tier {N} positions, {kv_bytes / 2**20:.0f} MiB of K/V")

  @jax.jit
  def attend(q_TKGD, k8, v8, ks, vs):        # -> (out [T, Hkv, G, Dh], lse [T, Hkv, G]), float32
    s = jnp.einsum("tkgd,nkd->tkgn", q_TKGD, k8.astype(jnp.float32)) * ks.T[None, :, None, :] / Dh ** 0.5
    m = s.max(-1, keepdims=True)
    p = jnp.exp(s - m)
    o = jnp.einsum("tkgn,nkd->tkgd", p * vs.T[None, :, None, :], v8.astype(jnp.float32))
    return o / p.sum(-1)[..., None], (m[..., 0] + jnp.log(p.sum(-1)))

  def numpy_attend(q, k8, v8, ks, vs):
    outs = []
    for h in range(Hkv):
      s = (k8[:, h].astype(np.float32) @ q[:, h].reshape(-1, Dh).T) * ks[:, h:h + 1] / Dh ** 0.5   # [N, T*G]
      p = np.exp(s - s.max(0))
      outs.append(((p * vs[:, h:h + 1]).T @ v8[:, h].astype(np.float32)) / p.sum(0)[:, None])
    return outs

  args = [jax.device_put(x, cpu) for x in (k8, v8, ks, vs)]
  for T in (1, 4):
    q = rng.standard_normal((T, Hkv, G, Dh)).astype(np.float32)
    qd = jax.device_put(q, cpu)
    jax.block_until_ready(attend(qd, *args))
    ts = []
    for _ in range(a.repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(attend(qd, *args))
      ts.append(time.perf_counter() - t0)
    tn = []
    for _ in range(max(2, a.repeats // 2)):
      t0 = time.perf_counter()
      numpy_attend(q, k8, v8, ks, vs)
      tn.append(time.perf_counter() - t0)
    for name, t in (("jax cpu", np.median(ts)), ("numpy", np.median(tn))):
      print(f"T={T} {name}: {t * 1e3:.1f} ms/layer, {t * 1e3 * layers:.0f} ms/step ({layers} layers), "
            f"{kv_bytes / t / 1e9:.1f} GB/s of K/V")


if __name__ == "__main__":
  main()
