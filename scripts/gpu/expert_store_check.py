"""GPU check of the expert store in pinned host memory (issue 6): greedy decode of a small random model with every
expert resident and with N slots over a store placed by `expert_cache.place_store`; tokens must be identical.
`python scripts/gpu/expert_store_check.py [--store pinned_host]` (auto: where store_memory_kind() puts it).
The prompt has n_experts / top_k tokens so the prefill also goes through the cache: the direct path
(T * top_k > n_experts) reads the whole store and needs model/transformer to move it first (xc.to_device).
"""
import argparse
import collections
import dataclasses
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from configs.presets import preset
from configs.vocab import load_vocab
from model import expert_cache as xc
from decode.engine import generate
from model import api
from model.loader import LoadedModel
from model.tokenizer import Tokenizer
from model.writer import pad_vocab, quant_policy, random_params
from ops.qtensor import with_kernels

ap = argparse.ArgumentParser()
ap.add_argument("--preset", default="tiny-qwen3moe")
ap.add_argument("--experts", default="IQ3_S", help="GGUF type of the routed experts")
ap.add_argument("--n_experts", type=int, default=64)
ap.add_argument("--top_k", type=int, default=4)
ap.add_argument("--slots", type=int, default=0, help="expert slots (default 2 * top_k)")
ap.add_argument("--tokens", type=int, default=32)
ap.add_argument("--kernels", default="xla", choices=("xla", "pallas"))
ap.add_argument("--store", default="auto", choices=("auto", "pinned_host", "device"))
a = ap.parse_args()

dev = jax.devices()[0]
print("jax", jax.__version__, dev, "memories:", [m.kind for m in dev.addressable_memories()], flush=True)
cfg = dataclasses.replace(preset(a.preset), n_experts=a.n_experts, top_k=a.top_k)
params = with_kernels(random_params(cfg, types=quant_policy(a.experts, "Q8_0"), seed=0), a.kernels)
tok = Tokenizer.from_metadata(pad_vocab(load_vocab(1024), cfg.vocab_size).metadata())
kind = xc.store_memory_kind() if a.store == "auto" else a.store
print(f"store_memory_kind() = {xc.store_memory_kind()!r}; placing the store in {kind!r}", flush=True)
resident = LoadedModel(cfg, params, tok, "in-memory", False, 0.0)
cached = dataclasses.replace(resident, params=xc.place_store(params, cfg, kind))
print("store arrays' memory kinds:", {k: sorted(set(v)) for k, v in xc.store_kinds(cached.params, cfg).items()})

prompt = [int(t) for t in np.random.default_rng(0).integers(0, 1000, max(1, cfg.n_experts // cfg.top_k))]
slots = a.slots or 2 * cfg.top_k
# Each arm twice: a committed (host-placed) store makes the loop's outputs committed, so the first request's second
# decode_loop call compiles again inside its timing; the second request times warm code.
res = {}
for name, model, kw in (("all resident", resident, {}), (f"{slots} slots", cached, {"expert_slots": slots})):
  t0 = time.time()
  res[name] = [generate(model, prompt, max_new_tokens=a.tokens, stop_at_eos=False, **kw) for _ in range(2)][1]
  print(f"{name}: {res[name].stats['decode_tok_s']:.1f} tok/s warm ({time.time() - t0:.0f} s for two requests)")
base, got = res["all resident"], res[f"{slots} slots"]
st = got.stats["expert_cache"]
hits, misses = sum(st["hits"]), sum(st["misses"])
print(f"cache: store_memory_kind={st['store_memory_kind']} slots={st['slots']} hits={hits} misses={misses} "
      f"hit_rate={hits / max(1, hits + misses):.3f} bytes_moved={sum(st['bytes_moved'])} steps={max(st['steps'])} "
      f"bytes_per_step={st['bytes_per_step']:.0f}")
same = got.ids == base.ids
print("tokens identical:", same)
if not same:
  i = next(i for i, (x, y) in enumerate(zip(got.ids, base.ids)) if x != y)
  print("  first difference at", i, base.ids[:i + 2], got.ids[:i + 2])
# Where the compiled decode step touches host memory (S(5)): expect dynamic slices of the store feeding copies of
# single expert rows, never a copy of a whole store tensor.
st0 = api.init_state(cfg, 1024, "bf16").replace(experts=xc.create(cached.params, cfg, slots))
hlo = api.decode_step.lower(cached.params, jnp.int32(0), st0, cfg=cfg).compile().as_text() or ""
host = [ln.strip() for ln in hlo.splitlines()[1:] if "S(5)" in ln and "parameter(" not in ln and " = " in ln]
ops = collections.Counter(m.group(1) for ln in host if (m := re.search(r" ([a-z-]+)\(", ln.split(" = ", 1)[1])))
whole = [ln for ln in host if re.search(r" = \S+\[%d," % cfg.n_experts, ln) and re.search(r" copy(-start)?\(", ln)]
print(f"compiled decode step: instructions touching host memory (S(5)) by opcode: {dict(ops)}")
for ln in host[:6]:
  print("  " + ln[:220])
print("WARNING: copies of whole store tensors:\n  " + "\n  ".join(ln[:220] for ln in whole) if whole else
      "no copy of a whole store tensor")
ok = same and st["store_memory_kind"] == kind and (dev.platform != "gpu" or a.store != "auto" or kind == "pinned_host")
print("PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
