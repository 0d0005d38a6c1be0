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
                "'dense=M,factor=F,attn=A,precision=P' (model Options: ops.qgemm_pallas.Tuning(rows=M), the most "
                "rows per dense row tile; ops.moe_grouped_pallas.Tuning(rows_factor=F); Tunings.prefill_attention_impl "
                "A: ref | pallas; prefill_precision P: auto | f32 | bf16)")
args = ap.parse_args(argv)

from bench import cells as bench
from decode import engine  # noqa: E402
from model.options import Options  # noqa: E402
from ops import moe_grouped_pallas, qgemm_pallas  # noqa: E402
from ops.qtensor import with_kernels  # noqa: E402
from ops.tuning import Tunings  # noqa: E402


def variant_options(variant: str) -> Options:
  """The model Options of one --variants entry (argparse error on an unknown key or value)."""
  kv = dict(p.split("=", 1) for p in variant.split(",") if "=" in p)
  if set(kv) - {"dense", "factor", "attn", "precision"} or kv.get("attn", "pallas") not in ("ref", "pallas") \
      or kv.get("precision", "auto") not in ("auto", "f32", "bf16"):
    ap.error(f"--variants {variant!r}: expected dense=M,factor=F,attn=ref|pallas,precision=auto|f32|bf16")
  t = Tunings(qgemm=qgemm_pallas.Tuning(rows=int(kv["dense"])) if "dense" in kv else None,
              grouped=moe_grouped_pallas.Tuning(rows_factor=int(kv["factor"])) if "factor" in kv else None,
              prefill_attention_impl=kv.get("attn"))
  return Options(prefill_precision=kv.get("precision", "auto"), tunings=t)


model = bench._in_memory_model(args.preset, args.experts)
model.params = with_kernels(model.params, "pallas" if jax.default_backend() != "cpu" else "interpret")
prompt = [(7 * (i + 1)) % model.cfg.vocab_size for i in range(args.tokens)]
variants = [(v, variant_options(v)) for v in args.variants.split(";")]
for variant, opts in variants:
  for c in (int(v) for v in args.chunks.split(",")):
    gen = engine.GenConfig(max_new_tokens=1, kv="int8", kv_resident=4096, prefill_chunk=c, options=opts)
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
      jax.block_until_ready(engine.prefill_chunked(model.params, prompt, state, model.cfg, c, engine.prefill_tail(c),
                                                   opts)[0])
      calls.append(time.perf_counter() - t)
    call = 1e3 * sorted(calls)[len(calls) // 2]
    print(f"prefill {variant} chunk {c}: {ms:.1f} ms ({args.tokens / ms * 1e3:.0f} tok/s), first run {first:.1f} s; "
          f"call {call:.1f} ms ({args.tokens / call * 1e3:.0f} tok/s)", flush=True)
