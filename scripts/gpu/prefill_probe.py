"""Prefill timing on a preset's shape, several chunk sizes in one process (ratios within it), optionally one
traced run per chunk for scripts/gpu/trace_summary.py.

  python scripts/gpu/prefill_probe.py --preset qwen3moe-30b-a3b --chunks 8,1024 --tokens 1024 [--profile DIR]
Prints `prefill chunk C: X ms (Y tok/s), first run Z s` per chunk size: `engine.start_request` whole (state
allocation and the prompt), then `call` ms: the prompt's jitted calls alone, on a state allocated beforehand."""
import argparse
import contextlib
import os
import sys
import time

import jax

sys.argv, argv = sys.argv[:1], sys.argv[1:]      # bench.cells defines absl flags; keep ours out of them
ap = argparse.ArgumentParser()
ap.add_argument("--preset", default="qwen3moe-30b-a3b")
ap.add_argument("--experts", default="IQ3_S")
ap.add_argument("--chunks", default="8,1024")
ap.add_argument("--tokens", type=int, default=1024)
ap.add_argument("--repeats", type=int, default=3)
ap.add_argument("--profile", default=None)
ap.add_argument("--variants", default="default", help="';'-separated settings, each 'default' or "
                "'dense=M,factor=F,attn=A,gemm=G,combine=C,gatherx=X' (ops.qgemm_pallas.DENSE_ROWS, "
                "ops.moe_grouped_pallas.ROWS_FACTOR, ops.attention.PREFILL_GPU_IMPL: ref | pallas, "
                "ops.qgemm_pallas.GEMM_FORM: one of GEMM_FORMS, ops.moe_grouped_pallas.COMBINE: gather | scatter, "
                "ops.moe_grouped_pallas.GATHER_X: kernel | xla)")
args = ap.parse_args(argv)

from bench import cells as bench
from decode import engine  # noqa: E402
from ops import attention, moe_grouped_pallas, qgemm_pallas  # noqa: E402
from ops.qtensor import with_kernels  # noqa: E402

model = bench._in_memory_model(args.preset, args.experts)
model.params = with_kernels(model.params, "pallas" if jax.default_backend() != "cpu" else "interpret")
prompt = [(7 * (i + 1)) % model.cfg.vocab_size for i in range(args.tokens)]
DEFAULTS = (qgemm_pallas.DENSE_ROWS, moe_grouped_pallas.ROWS_FACTOR, attention.PREFILL_GPU_IMPL, qgemm_pallas.GEMM_FORM,
            moe_grouped_pallas.COMBINE, moe_grouped_pallas.GATHER_X)
for variant in args.variants.split(";"):
  kv = dict(p.split("=") for p in variant.split(",") if "=" in p)
  qgemm_pallas.DENSE_ROWS = int(kv.get("dense", DEFAULTS[0]))
  moe_grouped_pallas.ROWS_FACTOR = int(kv.get("factor", DEFAULTS[1]))
  attention.PREFILL_GPU_IMPL = kv.get("attn", DEFAULTS[2])
  qgemm_pallas.GEMM_FORM = kv.get("gemm", DEFAULTS[3])
  moe_grouped_pallas.COMBINE = kv.get("combine", DEFAULTS[4])
  moe_grouped_pallas.GATHER_X = kv.get("gatherx", DEFAULTS[5])
  if moe_grouped_pallas.GATHER_X not in ("kernel", "xla"):
    ap.error(f"--variants {variant!r}: gatherx={moe_grouped_pallas.GATHER_X}, expected kernel or xla")
  if moe_grouped_pallas.COMBINE not in ("gather", "scatter"):
    ap.error(f"--variants {variant!r}: combine={moe_grouped_pallas.COMBINE}, expected gather or scatter")
  if qgemm_pallas.GEMM_FORM not in (None, *qgemm_pallas.GEMM_FORMS):
    ap.error(f"--variants {variant!r}: gemm={qgemm_pallas.GEMM_FORM}, expected one of {', '.join(qgemm_pallas.GEMM_FORMS)}")
  jax.clear_caches()                     # the settings are read at trace time
  for c in (int(v) for v in args.chunks.split(",")):
    gen = engine.GenConfig(max_new_tokens=1, kv="int8", kv_resident=4096, prefill_chunk=c)
    t = time.perf_counter()
    jax.block_until_ready(engine.start_request(model, prompt, gen).logits)
    first = time.perf_counter() - t
    ts = []
    for r in range(args.repeats + bool(args.profile)):
      traced = args.profile and r == args.repeats
      ctx = jax.profiler.trace(os.path.join(args.profile, f"{variant.replace('=', '').replace(',', '_')}-chunk{c}"), create_perfetto_trace=True) if traced \
          else contextlib.nullcontext()
      with ctx:
        t = time.perf_counter()
        jax.block_until_ready(engine.start_request(model, prompt, gen).logits)
        if not traced:
          ts.append(time.perf_counter() - t)
    ms = 1e3 * sorted(ts)[len(ts) // 2]
    calls = []
    for r in range(args.repeats):
      state = engine.init_state(model, engine.ring_capacity(args.tokens + 1, gen.kv_resident), gen)
      jax.block_until_ready(state)
      t = time.perf_counter()
      jax.block_until_ready(engine.prefill_chunked(model.params, prompt, state, model.cfg, c, engine.prefill_tail(c))[0])
      calls.append(time.perf_counter() - t)
    call = 1e3 * sorted(calls)[len(calls) // 2]
    print(f"prefill {variant} chunk {c}: {ms:.1f} ms ({args.tokens / ms * 1e3:.0f} tok/s), first run {first:.1f} s; "
          f"call {call:.1f} ms ({args.tokens / call * 1e3:.0f} tok/s)", flush=True)
