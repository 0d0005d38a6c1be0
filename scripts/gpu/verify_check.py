"""GPU correctness probe: the decode-attention kernel against the jnp reference for T = 1 and 4 queries, and
replay speculative decoding against plain greedy on a small random model, attention kernel vs reference."""
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from model.kv_ring import KVRing
from ops import attention

rng = np.random.default_rng(0)
for kv in ("bf16", "int8"):
  for T in (1, 4):
    R, depth, Hq, Hkv, D = 4096, 1000, 32, 4, 128
    ring = KVRing.create(1, R, Hkv, D, kv, block=256)
    pos = jnp.arange(depth, dtype=jnp.int32)
    ring = ring.write(0, pos, jnp.asarray(rng.standard_normal((depth, Hkv, D)), jnp.float32),
                      jnp.asarray(rng.standard_normal((depth, Hkv, D)), jnp.float32)).advance(depth)
    q = jnp.asarray(rng.standard_normal((T, Hq, D)), jnp.float32)
    qp = jnp.arange(depth - T, depth, dtype=jnp.int32)
    with jax.default_matmul_precision("highest"):         # XLA's default float32 dot is TF32 on the GPU
      ref = attention.ring_attention(q, *ring.layer(0), qp, depth, block=256, scale=D ** -0.5, impl="ref")
    kimpl = "interpret" if jax.default_backend() == "cpu" else "pallas"
    got = attention.ring_attention(q, *ring.layer(0), qp, depth, block=256, scale=D ** -0.5, impl=kimpl)
    err = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
    print(f"attention kv={kv} T={T}: pallas vs ref rel L2 {err:.2e}", flush=True)

from bench.cells import _in_memory_model  # noqa: E402  (flags are defined on import; not parsed here)
from decode.engine import generate  # noqa: E402
from decode.speculative import speculative_generate  # noqa: E402
from model.options import Options  # noqa: E402
from ops.tuning import Tunings  # noqa: E402

if "--attention_only" in sys.argv:
  sys.exit(0)
name = sys.argv[1] if len(sys.argv) > 1 else "tiny-glm4moe"
m = _in_memory_model(name, "IQ3_S")
prompt = [int(t) for t in rng.integers(0, 1000, 64)]
for impl in ("ref", "pallas"):
  opts = Options(tunings=Tunings(attention_impl=impl))         # decode and verify attention: reference or kernel
  t0 = time.time()
  base = generate(m, prompt, max_new_tokens=24, stop_at_eos=False, kv="bf16", options=opts)
  r = speculative_generate(m, prompt, drafter="replay", k=3, max_new_tokens=24, stop_at_eos=False, kv="bf16",
                           replay_ids=base.ids, options=opts)
  print(f"{name} attention={impl}: replay equal={r.ids == base.ids} accepted {r.stats['drafts_accepted']} of "
        f"{r.stats['drafts_proposed']} ({time.time() - t0:.0f} s)", flush=True)
  if r.ids != base.ids:
    first = next(i for i, (a, b) in enumerate(zip(r.ids, base.ids)) if a != b)
    print("  first difference at", first, base.ids[:first + 2], r.ids[:first + 2])
