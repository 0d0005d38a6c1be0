"""GPU probe: is a hybrid model's verify pass bitwise the decode steps it replaces (DESIGN invariant 3)? A trunk of
the first --layers layers of --preset (3 Gated DeltaNet layers to 1 attention layer), random valid blocks in
memory, Pallas kernels: after a prompt, T decode steps against one T-token forward that keeps the per-token
recurrent states, from the same state; logits, and the recurrent state after the last token.

  python scripts/gpu/hybrid_invariance.py [--preset seed-mtp] [--layers 4] [--T 4] [--glue on,off]

Prints one line per setting: bitwise equal, or the largest difference. Runs on CPU too (interpret kernels).
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np

from configs.presets import preset
from model import api
from model.options import Options
from model.writer import quant_policy, random_params
from ops.qtensor import with_kernels

ap = argparse.ArgumentParser()
ap.add_argument("--preset", default="seed-mtp")
ap.add_argument("--layers", type=int, default=4)
ap.add_argument("--T", type=int, default=4)
ap.add_argument("--glue", default="on,off")
a = ap.parse_args()
kern = "interpret" if jax.default_backend() == "cpu" else "pallas"
full = preset(a.preset)
cfg = full.replace(n_layers=a.layers, recurrent=full.recurrent[:a.layers], n_nextn=0)
params = with_kernels(api.fuse_qkv(random_params(cfg, types=quant_policy("IQ3_S", "Q8_0"), seed=0)), kern)
prompt = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, 16), jnp.int32)
toks = np.random.default_rng(2).integers(0, cfg.vocab_size, a.T)
for glue in a.glue.split(","):
  opts = Options(glue=glue == "on")
  _, _, st = api.prefill(params, prompt, api.init_state(cfg, 1024, "int8", scratch=a.T), cfg=cfg, options=opts)
  st_copy = jax.tree.map(jnp.copy, st)
  steps = []
  for t in toks:
    lg, _, st = api.decode_step(params, jnp.int32(t), st, cfg=cfg, options=opts)
    steps.append(np.asarray(lg))
  steps = np.stack(steps)
  fwd = jax.jit(lambda p, x, s: api.forward(p, x, s, cfg=cfg, options=opts, keep_states=True))
  lg_pass, _, st_pass, kept = fwd(params, jnp.asarray(toks, jnp.int32), st_copy)
  lg_pass = np.asarray(lg_pass)
  d = np.abs(lg_pass - steps)
  rec = [float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in
         zip(st.recurrent.delta + st.recurrent.conv, st_pass.recurrent.delta + st_pass.recurrent.conv)]
  per_row = [float(d[i].max()) for i in range(a.T)]
  same = "bitwise equal" if d.max() == 0 and max(rec) == 0 else f"max |diff| logits per row {per_row}, state {max(rec):.2e}"
  print(f"{a.preset} {a.layers} layers, T={a.T}, glue {glue}: {same}; argmax equal "
        f"{np.mean(lg_pass.argmax(-1) == steps.argmax(-1)):.0%}")
