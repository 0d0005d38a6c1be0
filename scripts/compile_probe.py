"""Compile probe (CPU, no device time): which jitted programs of the engine's request path are big and slow to compile.

Builds a model of the seed-mtp *structure* (qwen3next: Gated DeltaNet layers beside one gated attention layer in
four, routed experts plus a gated shared expert, one NextN block) at tiny widths, then lowers and compiles, each on
its own, the programs a bench.cells request compiles, under every combination of (a) an expert cache (fewer slots
than experts: misses happen) and (b) a host tier (max_context > ring):

  prefill8   api.prefill of an 8-token chunk (the GPU's chunk with expert slots, and every prompt's tail)
  prefillB   api.prefill of a --big_chunk chunk (the GPU's 1,024-token GEMM chunk without slots; T * top_k > E takes
             the direct MoE path even with a cache)
  step       api.decode_step (one token: the body of the plain loop)
  verify     api.forward of k + 1 tokens with keep_states (the body of a replay round's verify branch)
  decode     engine.decode_loop (the plain request's while loop)
  spec       speculative.spec_loop, drafter replay, k drafts (the replay arm's while loop)

Per program: seconds to trace + lower, seconds to compile (XLA), one run's seconds (the compiled executable,
8 new tokens for the loops; run2: a second call of a single pass on its returned state), the lowered StableHLO's
lines and its while / case counts, the optimized HLO's lines.
One JSON line per cell to --out (appended); --report prints the table of the lines in --out.

  .venv/bin/python scripts/compile_probe.py --layers 12 --out /tmp/probe.jsonl
  .venv/bin/python scripts/compile_probe.py --layers 48 --programs prefill8,decode,spec --out /tmp/probe.jsonl
  .venv/bin/python scripts/compile_probe.py --report --out /tmp/probe.jsonl
On a GPU, `--kernels pallas --layers 12` against `--layers 48` shows whether compile time grows with the layers
(each layer's Pallas calls compiled anew) or not (docs/PERF.md, 2026-12-04: +0.13 s a layer at tiny widths);
`--widths seed-mtp` runs the same programs at the real model's widths (its kernels' real shapes), e.g.
  python3 scripts/compile_probe.py --kernels pallas --widths seed-mtp --layers 48 --experts 64 \
      --programs prefill8,prefillB,step,verify,decode,spec --features cache+tier
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

PROGRAMS = ("prefill8", "prefillB", "step", "verify", "decode", "spec")
FEATURES = ("plain", "cache", "tier", "cache+tier")


def build(args):
  """The seed-mtp-structured config (tiny widths, or --widths seed-mtp: the real model's widths) and its random
  IQ3_S / Q8_0 params (fused as load_model fuses them)."""
  from configs.presets import TINY_QWEN3NEXT, preset
  from model.api import fuse_qkv
  from model.writer import quant_policy, random_params
  from ops.qtensor import with_kernels
  L = args.layers
  base = TINY_QWEN3NEXT if args.widths == "tiny" else preset(args.widths)
  cfg = dataclasses.replace(base, n_layers=L, recurrent=tuple((i + 1) % 4 != 0 for i in range(L)),
                            n_experts=args.experts, top_k=args.top_k, n_nextn=1)
  params = fuse_qkv(random_params(cfg, types=quant_policy(args.expert_type, "Q8_0")))
  if args.kernels != "xla":
    params = with_kernels(params, args.kernels)
  return cfg, params


def gen_config(args, feature: str):
  from decode.engine import GenConfig
  tier = "tier" in feature
  return GenConfig(max_new_tokens=args.new, kv="int8", kv_resident=args.ring,
                   max_context=args.max_context if tier else None, stop_at_eos=False,
                   expert_slots=args.slots if "cache" in feature else None,
                   expert_store=args.store if "cache" in feature else None)


def fresh_state(model, gen, k: int):
  """The request's state as engine.start_request lays it out (ring, scratch, tier, expert cache), committed as the
  engine commits it, and the params the request runs with (the store placed by request_params)."""
  from decode import engine
  params = engine.request_params(model, gen)
  cap = gen.kv_resident
  slack, host = (k + 1 if k else 0), None
  if gen.max_context:
    slack, host = engine.tier_layout(gen.max_context, cap, k)
  state = engine.init_state(model, cap, gen, mtp_window=None, scratch=slack, host=host, params=params)
  return params, engine.commit_for_store(state, params, model.cfg)


def program(name: str, model, gen, args):
  """(jitted function, its positional args, its static kwargs) of program `name` on a fresh state."""
  from decode import engine, speculative
  from model import api
  cfg, opts, k = model.cfg, gen.options, args.k
  if name in ("prefill8", "prefillB"):
    T = 8 if name == "prefill8" else args.big_chunk
    params, st = fresh_state(model, gen, 0)
    toks = jnp.arange(T, dtype=jnp.int32) % cfg.vocab_size
    return api.prefill, (params, toks, st), dict(cfg=cfg, options=opts, last_only=True)
  if name == "step":
    params, st = fresh_state(model, gen, 0)
    return api.decode_step, (params, jnp.int32(1), st), dict(cfg=cfg, options=opts)
  if name == "verify":
    params, st = fresh_state(model, gen, k)
    fn = jax.jit(functools.partial(api.forward, keep_states=True), static_argnames=("cfg", "options"),
                 donate_argnames=("state",))
    return fn, (params, jnp.arange(1, k + 2, dtype=jnp.int32), st), dict(cfg=cfg, options=opts)
  if name == "decode":
    params, st = fresh_state(model, gen, 0)
    n = engine.new_tokens_sized(gen)
    first = jnp.int32(1)
    ls = engine.LoopState(st, jnp.zeros(engine._buffer_size(n), jnp.int32).at[0].set(first), jnp.ones((), jnp.int32),
                          first, jax.random.PRNGKey(0), first == -1, jnp.int32(-1))
    ls = engine.commit_for_store(ls, params, cfg)
    return (engine.decode_loop, (params, ls, jnp.int32(args.new), jnp.int32(-1)),
            dict(cfg=cfg, temperature=0.0, top_p=1.0, options=opts))
  if name == "spec":
    params, st = fresh_state(model, gen, k)
    T = args.prompt
    H = speculative._hist_size(T + engine.new_tokens_sized(gen) + k + 2)
    toks = jnp.arange(H, dtype=jnp.int32) % cfg.vocab_size
    hist = jnp.where(jnp.arange(H) <= T, toks, 0)
    s = speculative.SpecState(st, hist, jnp.int32(T + 1), jnp.int32(T), jnp.zeros((k + 1, cfg.d_model), jnp.float32),
                              jnp.zeros((k + 1,), jnp.int32), jnp.int32(1), jax.random.PRNGKey(0), jnp.asarray(False),
                              jnp.zeros((k,), jnp.int32), jnp.zeros((k,), jnp.int32), jnp.int32(0), jnp.int32(-1))
    s, replay = engine.commit_for_store((s, toks), params, cfg)     # replay: drafts valid (the verify branch runs)
    return (speculative.spec_loop, (params, s, replay, jnp.int32(-1), jnp.int32(args.new)),
            dict(cfg=cfg, k=k, drafter="replay", temperature=0.0, top_p=1.0, options=opts))
  raise ValueError(f"program {name!r}, expected one of {PROGRAMS}")


def probe(name: str, feature: str, model, args) -> dict:
  gen = gen_config(args, feature)
  fn, pos, kw = program(name, model, gen, args)
  t0 = time.perf_counter()
  lowered = fn.lower(*pos, **kw)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  text = lowered.as_text()
  out = jax.block_until_ready(compiled(*pos))
  t3 = time.perf_counter()
  run2 = None
  if name in ("prefill8", "prefillB", "step", "verify"):      # a second call on the returned state: steady state
    t4 = time.perf_counter()
    jax.block_until_ready(compiled(*pos[:2], out[2]))
    run2 = round(time.perf_counter() - t4, 3)
  del out
  try:
    opt_lines = len(compiled.as_text().splitlines())
  except Exception:          # noqa: BLE001  (some backends keep no text)
    opt_lines = None
  return dict(program=name, feature=feature, layers=model.cfg.n_layers, lower_s=round(t1 - t0, 3),
              compile_s=round(t2 - t1, 3), run_s=round(t3 - t2, 3), run2_s=run2, hlo_lines=len(text.splitlines()),
              opt_hlo_lines=opt_lines, whiles=text.count("stablehlo.while"), cases=text.count("stablehlo.case"),
              experts=args.experts, top_k=args.top_k, slots=args.slots, ring=args.ring, max_context=args.max_context,
              k=args.k, kernels=args.kernels, big_chunk=args.big_chunk, widths=args.widths)


def report(path: str) -> None:
  rows = [json.loads(line) for line in open(path) if line.strip()]
  print("| program | feature | widths | layers | HLO lines | opt HLO lines | while / case | lower s | compile s "
        "| run s | run2 s |")
  print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
  for r in sorted(rows, key=lambda r: (PROGRAMS.index(r["program"]), r.get("widths", "tiny"), r["layers"],
                                       FEATURES.index(r["feature"]))):
    extra = "" if r.get("skip_idle_tier") is None else f" skip_idle={r['skip_idle_tier']}"
    print(f"| {r['program']} | {r['feature']}{extra} | {r.get('widths', 'tiny')} | {r['layers']} | {r['hlo_lines']} | "
          f"{r['opt_hlo_lines']} | "
          f"{r['whiles']} / {r['cases']} | {r['lower_s']:.1f} | {r['compile_s']:.1f} | {r['run_s']:.2f} | "
          f"{r.get('run2_s') if r.get('run2_s') is not None else '-'} |")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--layers", type=int, default=12, help="trunk layers (one attention layer in four)")
  p.add_argument("--widths", default="tiny", help="tiny, or a hybrid preset whose widths the model takes (seed-mtp: "
                 "the real kernels' shapes; on a GPU, with --experts small enough to fit)")
  p.add_argument("--programs", default=",".join(PROGRAMS), help=f"comma list of {','.join(PROGRAMS)}")
  p.add_argument("--features", default=",".join(FEATURES), help=f"comma list of {','.join(FEATURES)}")
  p.add_argument("--experts", type=int, default=64, help="routed experts (E: 8 * top_k <= E keeps 8-token chunks "
                 "on the cached path, as seed-mtp's 80 <= 512)")
  p.add_argument("--top_k", type=int, default=4)
  p.add_argument("--slots", type=int, default=128, help="expert-cache slots (fewer than layers x experts)")
  p.add_argument("--expert_type", default="IQ3_S")
  p.add_argument("--store", default="pinned_host", help="expert store memory kind with a cache (pinned_host as on "
                 "the GPU; jax's CPU client has it) or device")
  p.add_argument("--ring", type=int, default=256, help="ring capacity (kv_resident)")
  p.add_argument("--max_context", type=int, default=1024, help="max_context with a tier (> ring)")
  p.add_argument("--k", type=int, default=3, help="replay drafts per round")
  p.add_argument("--new", type=int, default=8, help="new tokens (buffers; the loops' run)")
  p.add_argument("--prompt", type=int, default=16, help="prompt tokens the speculative state's history holds")
  p.add_argument("--big_chunk", type=int, default=64, help="tokens of prefillB")
  p.add_argument("--kernels", default="xla", choices=("xla", "interpret", "pallas"),
                 help="the quantized kernels (pallas: compiled, on a GPU: compile time with its Triton kernels)")
  p.add_argument("--out", default="/tmp/compile_probe.jsonl")
  p.add_argument("--report", action="store_true", help="print the table of --out and run nothing")
  args = p.parse_args(argv)
  if args.report:
    report(args.out)
    return
  t0 = time.perf_counter()
  cfg, params = build(args)
  model = types.SimpleNamespace(cfg=cfg, params=params)
  print(f"model: {cfg.n_layers} layers ({len(cfg.recurrent_layers)} DeltaNet), E {cfg.n_experts} top-{cfg.top_k}, "
        f"built in {time.perf_counter() - t0:.1f} s", flush=True)
  for name in args.programs.split(","):
    for feature in args.features.split(","):
      r = probe(name, feature, model, args)
      print(json.dumps(r), flush=True)
      with open(args.out, "a") as f:
        f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
  main()
