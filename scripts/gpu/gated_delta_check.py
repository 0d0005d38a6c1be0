"""The Gated DeltaNet kernels compiled on the GPU against their jnp references, at the qwen3next-80b-a3b layer
shape (Hk 16, Hv 32, Dk = Dv 128, conv kernel 4), and their time per call (a layer's share of a decode step or of a
prefill chunk). Prints one line per case: relative error of o and of the state, and microseconds per call.

  python scripts/gpu/gated_delta_check.py [--T 1024] [--reps 50]
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from ops import gated_delta as gd

ap = argparse.ArgumentParser()
ap.add_argument("--T", type=int, default=1024, help="prefill chunk tokens")
ap.add_argument("--reps", type=int, default=50)
args = ap.parse_args()
Hk, Hv, Dk, Dv, Kc = 16, 32, 128, 128, 4
Cc = 2 * Hk * Dk + Hv * Dv
rng = np.random.default_rng(0)


def arr(*shape, scale=1.0):
  return jnp.asarray(rng.standard_normal(shape).astype(np.float32) * scale)


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def timed(f):
  out = jax.block_until_ready(f())
  t0 = time.perf_counter()
  for _ in range(args.reps):
    out = f()
  jax.block_until_ready(out)
  return out, (time.perf_counter() - t0) / args.reps * 1e6


state = arr(Hv, Dk, Dv, scale=0.1)
win, w = arr(Cc, Kc - 1), arr(Cc, Kc, scale=0.5)
for T in (1, 4):
  qkv, g, beta = arr(T, Cc), -jnp.abs(arr(T, Hv, scale=0.1)), jax.nn.sigmoid(arr(T, Hv))
  for keep in (False, True):
    kw = dict(eps=1e-6, head_map="interleave", keep_states=keep)
    ref, _ = timed(lambda: gd.gated_delta_step(qkv, win, w, g, beta, state, impl="ref", **kw))
    got, us = timed(lambda: gd.gated_delta_step(qkv, win, w, g, beta, state, impl="pallas", **kw))
    print(f"step T={T} keep={keep}: o {rel(got[0], ref[0]):.2e} window {rel(got[1], ref[1]):.2e} "
          f"state {rel(got[2], ref[2]):.2e}  {us:.1f} us/call")
T = args.T
q = gd.l2_normalize(arr(T, Hk, Dk), 1e-6)
k = gd.l2_normalize(arr(T, Hk, Dk), 1e-6)
v, g, beta = arr(T, Hv, Dv), -jnp.abs(arr(T, Hv, scale=0.1)), jax.nn.sigmoid(arr(T, Hv))
for head_map in ("interleave", "tile"):
  kw = dict(chunk=64, head_map=head_map)
  ref, us_ref = timed(lambda: gd.gated_delta_chunked(q, k, v, g, beta, state, impl="ref", **kw))
  got, us = timed(lambda: gd.gated_delta_chunked(q, k, v, g, beta, state, impl="pallas", **kw))
  seq = gd.gated_delta_recurrent(q, k, v, g, beta, state, head_map=head_map)
  print(f"chunk T={T} {head_map}: o {rel(got[0], ref[0]):.2e} (vs recurrent {rel(got[0], seq[0]):.2e}) state "
        f"{rel(got[1], ref[1]):.2e}  pallas {us:.0f} us/call, jnp chunked {us_ref:.0f} us/call")
