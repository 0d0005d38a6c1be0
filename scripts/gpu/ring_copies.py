"""GPU probe: does a compiled decode loop or speculative round copy the K/V ring? A whole-ring copy costs time in
proportion to the ring's capacity at any depth (the seed report's shape: a larger ring slower at 1K). Compiles
`engine.decode_loop` and `speculative.spec_loop` (lookup and mtp drafters) on a small model with the Pallas
kernels (XLA's on CPU), a fixed ring and optionally a host tier in pinned host memory, and prints, per program, the copies in
the optimized HLO by shape (ring-shaped ones flagged).

  python scripts/gpu/ring_copies.py [--preset tiny-glm4moe] [--ring 1024] [--host 8192] [--dump DIR]

tests/model/test_ring.py::test_host_tier_steps_never_copy_the_ring is the CPU check of the same property.
"""
import argparse
import collections
import dataclasses
import os
import re

import jax
import jax.numpy as jnp

from bench import cells as bench
from decode import speculative as sp
from decode.engine import GenConfig, LoopState, decode_loop, start_request
from ops.qtensor import with_kernels

ap = argparse.ArgumentParser()
ap.add_argument("--preset", default="tiny-glm4moe")
ap.add_argument("--ring", type=int, default=1024)
ap.add_argument("--host", type=int, default=8192, help="max_context (> ring: a host tier); 0: none")
ap.add_argument("--dump", default=None, help="folder for the optimized HLO text of each program")
a = ap.parse_args()

m = bench._in_memory_model(a.preset, "IQ3_S")
m = dataclasses.replace(m, params=with_kernels(m.params, "xla" if jax.default_backend() == "cpu" else "pallas"))
k, prompt, H = 3, list(range(1, 40)), 128
gen = GenConfig(kv="int8", kv_resident=a.ring, max_new_tokens=16, max_context=a.host or None)


def programs():
  st = start_request(m, prompt, gen)
  ls = LoopState(st.state, jnp.zeros((17,), jnp.int32), jnp.ones((), jnp.int32), jnp.int32(1), jax.random.PRNGKey(0),
                 jnp.zeros((), bool))
  yield "decode_loop", st.state.ring, decode_loop.lower(m.params, ls, jnp.int32(17), jnp.int32(-1), cfg=m.cfg,
                                                         temperature=0.0, top_p=1.0)
  for drafter in ("lookup", "mtp"):
    st = start_request(m, prompt, gen, k=k, mtp_window=256 if drafter == "mtp" else None)
    z = jnp.zeros((k,), jnp.int32)
    s = sp.SpecState(st.state, jnp.zeros((H,), jnp.int32), jnp.int32(40), jnp.int32(39),
                     jnp.zeros((k + 1, m.cfg.d_model)), jnp.zeros((k + 1,), jnp.int32), jnp.int32(1),
                     jax.random.PRNGKey(0), jnp.asarray(False), z, z, jnp.int32(0))
    yield f"spec_loop/{drafter}", st.state.ring, sp.spec_loop.lower(
        m.params, s, jnp.full((H,), -1, jnp.int32), jnp.int32(-1), jnp.int32(16), cfg=m.cfg, k=k, drafter=drafter,
        temperature=0.0, top_p=1.0)


for name, ring, lowered in programs():
  txt = lowered.compile().as_text()
  if a.dump:
    os.makedirs(a.dump, exist_ok=True)
    open(os.path.join(a.dump, name.replace("/", "-") + ".hlo.txt"), "w").write(txt)
  R, Hkv, Dh = ring.k[0].shape
  ring_pat = re.compile(rf"^(s8\[{R},{Hkv},{Dh}\]|bf16\[{R},{Hkv},{Dh}\]|f32\[{R},{Hkv}\])")
  shapes = collections.Counter(mm.group(1) for mm in re.finditer(r"= (\S+?)(?:\{[^}]*\})? copy\(", txt))
  n_ring = sum(c for s, c in shapes.items() if ring_pat.match(s))
  big = ", ".join(f"{s} x{c}" for s, c in shapes.most_common(6))
  print(f"{name}: ring R={R} host={a.host}: {n_ring} ring-shaped copies; copies by shape: {big or 'none'}")
