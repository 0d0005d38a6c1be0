"""Where the `memcpy32_post` entries in part (b) traces come from: trace small jitted chains of Pallas calls that
differ in one operand each, and count the device events per call by name.

  python scripts/gpu/memcpy_probe.py --out DIR

Variants (8 chained calls each): `plain` (x only), `const_table` (plus a table baked into the jit as a constant,
as ops/qmatmul_pallas.table() is), `arg_table` (the same table passed as a jit argument), `ids` (plus an int32
operand reshaped from an argument, as moe_pallas passes ids), and `moe` (4 Q4_K layers of ops/moe_pallas with
their own weights). Prints, per variant, each event name with its count per call and, for the first memcpy-like
event, its trace args.
"""
import argparse
import collections
import functools
import glob
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

import trace_summary                       # beside this script (scripts/gpu/)

ap = argparse.ArgumentParser()
ap.add_argument("--out", default="/tmp/memcpy_probe")
ap.add_argument("--calls", type=int, default=10)
a = ap.parse_args()
D = 2048


def kern(*refs, bw, extra):
  x_ref, o_ref = refs[0], refs[-1]
  cols = pl.ds(pl.program_id(0) * bw, bw)
  add = 1.0
  for r in refs[1:1 + extra]:
    add = add + r[0].astype(jnp.float32)
  o_ref[:, cols] = x_ref[:, cols] + add


def call(x, *extra):
  return pl.pallas_call(functools.partial(kern, bw=D // 128, extra=len(extra)), grid=(128,),
                        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), name="probe")(x, *extra)


TAB = np.arange(528, dtype=np.uint32)


def plain(x, t, i):
  for _ in range(8):
    x = call(x)
  return x


def const_table(x, t, i):
  for _ in range(8):
    x = call(x, jnp.asarray(TAB))
  return x


def arg_table(x, t, i):
  for _ in range(8):
    x = call(x, t)
  return x


def ids(x, t, i):
  for _ in range(8):
    x = call(x, i.reshape(-1).astype(jnp.int32))
  return x


def moe_variant():
  from bench import kernels as bench
  from ops import moe_pallas
  layers = bench._experts(jax.random.PRNGKey(0), "Q4_K", 4, separate=True)
  r, w = bench._routing(jax.random.PRNGKey(1), 4, 1)

  def f(x, t, i):
    for l in range(4):
      x = moe_pallas.moe_pallas(x, r[l], w[l], *layers[l])
    return x
  return f


x0 = jnp.ones((1, D), jnp.float32)
t0 = jnp.asarray(TAB)
i0 = jnp.arange(8, dtype=jnp.int32).reshape(1, 8)
for name, fn in [("plain", plain), ("const_table", const_table), ("arg_table", arg_table), ("ids", ids),
                 ("moe", moe_variant())]:
  f = jax.jit(fn)
  jax.block_until_ready(f(x0, t0, i0))
  d = os.path.join(a.out, name)
  with jax.profiler.trace(d, create_perfetto_trace=True):
    y = x0
    for _ in range(a.calls):
      y = f(y, t0, i0)
    jax.block_until_ready(y)
  path = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)[0]
  ks = trace_summary.load(path)[2]
  cnt, dur = collections.Counter(e["name"] for e in ks), collections.Counter()
  for e in ks:
    dur[e["name"]] += e["dur"]
  print(f"== {name}: " + ", ".join(f"{k[:40]} x{v / a.calls:g} ({dur[k] / v:.1f} us)" for k, v in cnt.most_common()),
        flush=True)
  for e in ks:
    if "memcpy" in e["name"].lower() or "memset" in e["name"].lower():
      print(f"   first {e['name']}: {json.dumps(e.get('args', {}))[:600]}", flush=True)
      break
