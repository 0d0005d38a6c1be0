"""Static facts of the Pallas GPU kernels without a GPU: registers, spills, shared memory and SASS instruction
mix for sm_90, from the Triton IR that Pallas emits on this CPU-only jaxlib.

Two steps, two Python environments (jaxlib does not ship Triton's Python compiler; the pip `triton` wheel does,
with ptxas and cuobjdump inside it):

  python scripts/kernel_sass.py dump DIR [--cases qgemm,grouped,decode,attention,dp4a,fuse,rope] [--precision P: f32 | bf16 (default,
      the GPU's)]   # project venv: DIR/<kernel>.ttir
  TRITON_ALWAYS_COMPILE=1 /path/to/venv-with-triton/bin/python scripts/kernel_sass.py compile DIR

`compile` runs Triton's TTIR passes first (XLA runs the same pipeline on a GPU: canonicalize, combine, ...), then
the sm_90 pipeline, and prints one line per kernel, with the seconds Triton took to compile it (ptxas included:
about what XLA's own Triton pays per distinct kernel of a program it compiles). What it cannot show: run time. A
spill, a second accumulator or a missing MMA fold shows here; whether a kernel is faster is a GPU measurement
(docs/PERF.md).
Used for the prefill GEMM's accumulator fold (docs/PERF.md "Prefill"); a dev tool, not run by the tests.
"""
from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter

# --------------------------------------------------------------------------------------- dump (project venv)


def _cases(names, precision="bf16"):
  import jax
  import jax.numpy as jnp
  from ops import moe_grouped_pallas, qgemm_pallas
  from tools.lowering import abstract_qtensor as _abstract_qtensor
  x = jax.ShapeDtypeStruct((1024, 2048), jnp.float32)
  if "qgemm" in names:
    for q in ("Q8_0", "IQ3_S", "Q4_K"):
      yield (f"qgemm_{q}", (lambda x, w: qgemm_pallas.qgemm_pallas(x, w, precision=precision)),
             (x, _abstract_qtensor(q, (5120, 2048))))
  if "decode" in names:                         # the decode kernels at B = 1 and a verify pass's B = 4
    from ops import moe_pallas, qmatmul_pallas
    for q in ("IQ3_S", "Q4_K", "Q8_0"):
      for B in (1, 4, 8):                       # a step, a verify pass at k = 3 and at k = 7
        xb = jax.ShapeDtypeStruct((B, 2048), jnp.float32)
        yield f"qmatmul_{q}_B{B}", (lambda x, w: qmatmul_pallas.qmatmul_pallas(x, w)), (xb, _abstract_qtensor(q, (5120, 2048)))
    for q in ("IQ3_S", "Q4_K"):
      g, d = _abstract_qtensor(q, (128, 768, 2048)), _abstract_qtensor(q, (128, 2048, 768))
      for B in (1, 4):
        xb = jax.ShapeDtypeStruct((B, 2048), jnp.float32)
        ib, wb = jax.ShapeDtypeStruct((B, 8), jnp.int32), jax.ShapeDtypeStruct((B, 8), jnp.float32)
        yield f"moe_{q}_B{B}", (lambda x, i, w, g, u, d: moe_pallas.moe_pallas(x, i, w, g, u, d)), (xb, ib, wb, g, g, d)
  if "attention" in names:                      # the 30B layer (Hq 32, Hkv 4, Dh 128), int8 K/V
    from ops import attention_pallas, prefill_attention_pallas
    S = jax.ShapeDtypeStruct
    kv, sc = S((4, 32768, 4, 128), jnp.int8), S((4, 32768, 4), jnp.float32)
    for T in (1, 4):
      yield (f"decode_attention_T{T}", functools.partial(attention_pallas.ring_attention_pallas, block=256, scale=0.088),
             (S((T, 32, 128), jnp.float32), kv, kv, sc, sc, S((T,), jnp.int32), S((), jnp.int32), S((), jnp.int32)))
    k1, s1 = S((4096, 4, 128), jnp.int8), S((4096, 4), jnp.float32)
    yield ("prefill_attention", functools.partial(prefill_attention_pallas.prefill_attention_pallas, block=256, scale=0.088),
           (S((1024, 32, 128), jnp.float32), k1, k1, s1, s1, S((1024,), jnp.int32), S((), jnp.int32)))
  if "rope" in names:                 # issue 27 item 3: the ring write and RoPE folded into the decode attention
    from ops import attention_pallas, rope_attention_pallas, rope_write_pallas
    S = jax.ShapeDtypeStruct
    for T in (1, 4):
      ring = (S((32768, 4, 128), jnp.int8), S((32768, 4, 128), jnp.int8), S((32768, 4), jnp.float32),
              S((32768, 4), jnp.float32))
      kw = dict(n_heads=32, n_kv_heads=4, head_dim=128, rope_dim=128, theta=1e6, offset=0, eps=1e-6)
      qkv, w, pos = S((T, 40 * 128), jnp.float32), S((128,), jnp.float32), S((T,), jnp.int32)
      yield (f"rope_attention_T{T}", functools.partial(rope_attention_pallas.rope_attention_pallas, block=256,
                                                       scale=0.088, **kw), (qkv, w, w, pos, ring, S((), jnp.int32)))
      yield (f"rope_write_T{T}", functools.partial(rope_write_pallas.rope_write_pallas, **kw), (qkv, w, w, pos, ring))
      yield (f"decode_attention_1layer_T{T}", functools.partial(attention_pallas.ring_attention_pallas, block=256,
                                                                scale=0.088),
             (S((T, 32, 128), jnp.float32), *ring, pos, S((), jnp.int32)))
  if "dp4a" in names:                 # issue 27: the x8 tiles (ops/dot8) against the float ones, B = 1
    from ops import moe_pallas, qmatmul_pallas
    x1 = jax.ShapeDtypeStruct((1, 2048), jnp.float32)
    ib, wb = jax.ShapeDtypeStruct((1, 8), jnp.int32), jax.ShapeDtypeStruct((1, 8), jnp.float32)
    for q in ("Q8_0", "IQ3_S", "Q4_K"):
      w = _abstract_qtensor(q, (5120, 2048))
      g, d = _abstract_qtensor(q, (128, 768, 2048)), _abstract_qtensor("Q4_K", (128, 2048, 768))
      for x8 in (None, "dp4a"):
        t = qmatmul_pallas.Tuning(x8=x8)
        for B in (1, 4):                        # a step and a verify pass at k = 3 (the same tiles)
          yield (f"qmatmul_{q}_B{B}_x8{x8}", functools.partial(
              lambda x, w, t: qmatmul_pallas.qmatmul_pallas(x, w, tuning=t), t=t),
              (jax.ShapeDtypeStruct((B, 2048), jnp.float32), w))
        yield (f"moe_{q}_x8{x8}", functools.partial(lambda x, i, w, g, u, d, t: moe_pallas.moe_pallas(
            x, i, w, g, u, d, tuning=moe_pallas.Tuning(gateup=t)), t=t), (x1, ib, wb, g, g, d))
      if q != "Q8_0":                 # down on 8-bit h too (gate/up BN 32 rounds h in its epilogue), same-type down
        dq = _abstract_qtensor(q, (128, 2048, 768))
        both = moe_pallas.Tuning(gateup=qmatmul_pallas.Tuning(x8="dp4a", BN=32), down=qmatmul_pallas.Tuning(x8="dp4a"))
        yield (f"moe_{q}_x8dx8", lambda x, i, w, g, u, d: moe_pallas.moe_pallas(x, i, w, g, u, d, tuning=both),
               (x1, ib, wb, g, g, dq))
        yield (f"moe_{q}_same_down", lambda x, i, w, g, u, d: moe_pallas.moe_pallas(x, i, w, g, u, d),
               (x1, ib, wb, g, g, dq))
    from ops import rmsnorm_pallas
    for x8 in (False, True):
      yield (f"rmsnorm_x8{x8}", functools.partial(lambda x, w, r, x8: rmsnorm_pallas.rms_norm_pallas(
          x, w, 1e-6, r, x8=x8), x8=x8), (x1, jax.ShapeDtypeStruct((2048,), jnp.float32), x1))
  if "fuse" in names:                 # issue 27 item 3: the kernels with a neighbour's work (Tunings.fuse), B = 1
    from ops import moe_pallas, norm_router_pallas, qmatmul_pallas, rmsnorm_pallas
    x1, wD = jax.ShapeDtypeStruct((1, 2048), jnp.float32), jax.ShapeDtypeStruct((2048,), jnp.float32)
    parts = jax.ShapeDtypeStruct((1, 8, 2048), jnp.float32)
    yield ("rmsnorm_pieces", lambda x, w, p, r: rmsnorm_pallas.rms_norm_pallas(x, w, 1e-6, (p, r)),
           (x1, wD, parts, x1))
    wr = jax.ShapeDtypeStruct((128, 2048), jnp.float32)
    for x8 in (False, True):
      yield (f"norm_router_x8{x8}", functools.partial(lambda x, r, w, wr, x8: norm_router_pallas.norm_logits_pallas(
          x, r, w, wr, 1e-6, x8=x8), x8=x8), (x1, x1, wD, wr))
    lg, ib, wb = (jax.ShapeDtypeStruct((1, 128), jnp.float32), jax.ShapeDtypeStruct((1, 8), jnp.int32),
                  jax.ShapeDtypeStruct((1, 8), jnp.float32))
    route = moe_pallas.Route("softmax", 8, True, 1.0, False)
    for q in ("IQ3_S", "Q4_K"):
      g, d = _abstract_qtensor(q, (128, 768, 2048)), _abstract_qtensor(q, (128, 2048, 768))
      for x8 in (None, "dp4a"):
        t = moe_pallas.Tuning(gateup=qmatmul_pallas.Tuning(x8=x8))
        yield (f"moe_{q}_x8{x8}_ids", functools.partial(lambda x, i, w, g, u, d, t: moe_pallas.moe_pallas(
            x, i, w, g, u, d, tuning=t), t=t), (x1, ib, wb, g, g, d))
        yield (f"moe_{q}_x8{x8}_route", functools.partial(lambda x, lg, g, u, d, t: moe_pallas.moe_pallas(
            x, lg, None, g, u, d, tuning=t, route=route), t=t), (x1, lg, g, g, d))
  if "grouped" in names:
    ids = jax.ShapeDtypeStruct((1024, 8), jnp.int32)
    wk = jax.ShapeDtypeStruct((1024, 8), jnp.float32)
    for q in ("IQ3_S", "Q4_K"):
      g, d = _abstract_qtensor(q, (128, 768, 2048)), _abstract_qtensor(q, (128, 2048, 768))
      yield (f"grouped_{q}", lambda x, i, w, g, u, d: moe_grouped_pallas.moe_grouped_pallas(x, i, w, g, u, d,
                                                                                           precision=precision),
             (x, ids, wk, g, g, d))


def dump(out_dir, names):
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
  from jax._src.pallas.triton import pallas_call_registration as reg
  from tools.lowering import lower as _lower
  os.makedirs(out_dir, exist_ok=True)
  captured = []
  orig = reg.lowering.lower_jaxpr_to_triton_module

  def capture(*a, **k):
    r = orig(*a, **k)
    captured.append(r.module.operation.get_asm())
    return r

  reg.lowering.lower_jaxpr_to_triton_module = capture
  # the precision a GPU takes by default (this CPU's default is the other)
  precision = sys.argv[sys.argv.index("--precision") + 1] if "--precision" in sys.argv else "bf16"
  if precision not in ("f32", "bf16"):
    sys.exit(f"--precision {precision}: expected f32 or bf16")
  for case, fn, args in _cases(names, precision):
    captured.clear()
    txt = _lower("cuda", fn, *args)
    cfgs = re.findall(r"name = \"(\w+)\", num_stages = (\d+) : i32, num_warps = (\d+) : i32", txt)
    assert len(cfgs) == len(captured), (case, len(cfgs), len(captured))
    for (kname, stages, warps), ttir in zip(cfgs, captured):
      base = os.path.join(out_dir, f"{case}.{kname}")
      with open(base + ".ttir", "w") as f:
        f.write(ttir)
      with open(base + ".json", "w") as f:
        json.dump(dict(num_warps=int(warps), num_stages=int(stages)), f)
      print(f"dumped {base}.ttir (warps {warps}, stages {stages})")


# ------------------------------------------------------------------------------------ compile (triton venv)


def compile_dir(in_dir):
  import triton
  from triton.backends.compiler import GPUTarget
  from triton.backends.nvidia.compiler import CUDABackend
  orig = CUDABackend.add_stages

  def add_stages(self, stages, options, language):     # an IR source skips its own stage: keep the TTIR passes
    orig(self, stages, options, language)
    items = list(stages.items())
    stages.clear()
    stages["ttir"] = lambda src, md: src
    for k, v in items:
      stages["ttir_passes" if k == "ttir" else k] = v

  CUDABackend.add_stages = add_stages
  bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
  for name in sorted(f for f in os.listdir(in_dir) if f.endswith(".ttir")):
    path = os.path.join(in_dir, name)
    with open(path[:-5] + ".json") as f:
      opts = json.load(f)
    t0 = time.perf_counter()
    k = triton.compile(path, target=GPUTarget("cuda", 90, 32), options=opts)
    seconds = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
      cubin, ptx = os.path.join(tmp, "k.cubin"), os.path.join(tmp, "k.ptx")
      open(cubin, "wb").write(k.asm["cubin"])
      open(ptx, "w").write(k.asm["ptx"])
      sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", cubin], capture_output=True,
                            text=True).stdout
      info = subprocess.run([os.path.join(bin_dir, "ptxas"), "-v", "-arch=sm_90a", ptx, "-o", os.devnull],
                            capture_output=True, text=True).stderr
    with open(path[:-5] + ".sass", "w") as f:
      f.write(sass)
    regs = re.search(r"Used (\d+) registers", info)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    ops = Counter(o.split(".")[0] for o in re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)", sass))
    top = ", ".join(f"{o} {n}" for o, n in ops.most_common(8))
    print(f"{name[:-5]}: compiled in {seconds:.2f} s, warps {opts['num_warps']}, regs {regs and regs.group(1)}, spill st/ld "
          f"{spill and spill.group(1)}/{spill and spill.group(2)} B, smem {k.metadata.shared} B, SASS "
          f"{sum(ops.values())} (MMA {sum(ops[o] for o in ('HGMMA', 'HMMA', 'IGMMA', 'IMMA', 'QGMMA'))}; {top})")


if __name__ == "__main__":
  if len(sys.argv) < 3 or sys.argv[1] not in ("dump", "compile"):
    sys.exit(__doc__)
  if sys.argv[1] == "dump":
    cases = sys.argv[sys.argv.index("--cases") + 1] if "--cases" in sys.argv else "qgemm,grouped"
    dump(sys.argv[2], cases.split(","))
  else:
    compile_dir(sys.argv[2])
