"""Where a deep request with a host tier spends its time, stage by stage, one process: the state with its tier
(`engine.init_state`), the store commit, the prompt chunk by chunk, then plain decode steps.

  python scripts/gpu/tier_probe.py --preset seed-mtp --depth 32768 --ring 32768 --max_context 139264
Prints one `stage ...: S s` line per stage as it ends (a call that runs out of time still shows how far it got)
and the prefill's chunk times (the first chunk compiles)."""
import argparse
import sys
import time

import jax

sys.argv, argv = sys.argv[:1], sys.argv[1:]      # decode.bench defines absl flags; keep ours out of them
ap = argparse.ArgumentParser()
ap.add_argument("--preset", default="seed-mtp")
ap.add_argument("--experts", default="IQ3_S")
ap.add_argument("--depth", type=int, default=32768)
ap.add_argument("--ring", type=int, default=32768)
ap.add_argument("--max_context", type=int, default=139264)
ap.add_argument("--steps", type=int, default=16)
args = ap.parse_args(argv)

from decode import bench, engine  # noqa: E402
from model import api  # noqa: E402
from ops.qtensor import with_kernels  # noqa: E402

T0 = time.perf_counter()


def stage(name, t):
  print(f"stage {name}: {time.perf_counter() - t:.2f} s (at {time.perf_counter() - T0:.1f} s)", flush=True)


t = time.perf_counter()
model = bench._in_memory_model(args.preset, args.experts)
model.params = with_kernels(model.params, "pallas" if jax.default_backend() != "cpu" else "interpret")
jax.block_until_ready(model.params)
stage("random params", t)
prompt = [(7 * (i + 1)) % model.cfg.vocab_size for i in range(args.depth)]
gen = engine.GenConfig(max_new_tokens=args.steps, kv="int8", kv_resident=args.ring, max_context=args.max_context)
host = args.max_context if args.max_context > args.ring else None
for rep in range(2):
  t = time.perf_counter()
  state = engine.init_state(model, args.ring, gen, host=host)
  jax.block_until_ready(state)
  stage(f"init_state (ring {args.ring}, tier {host}), run {rep}", t)
t = time.perf_counter()
state = engine.commit_for_store(state, model.params, model.cfg)
jax.block_until_ready(state)
stage("commit_for_store", t)
chunk = min(engine.prefill_chunk(gen), state.ring.window) if host else engine.prefill_chunk(gen)
ts, a = [], 0
t = time.perf_counter()
while a < len(prompt):
  c = chunk if len(prompt) - a >= chunk else engine.prefill_tail(chunk)
  t1 = time.perf_counter()
  logits, _, state = api.prefill(model.params, jax.numpy.asarray(prompt[a:a + c], jax.numpy.int32), state,
                                 cfg=model.cfg, last_only=True)
  jax.block_until_ready(logits)
  ts.append(time.perf_counter() - t1)
  a += c
  if len(ts) in (1, 2) or len(ts) % 8 == 0:
    print(f"  chunk {len(ts)} ({c} tokens, to position {a}): {ts[-1]:.3f} s", flush=True)
stage(f"prefill of {args.depth} tokens in {len(ts)} calls of {chunk} (first {ts[0]:.1f} s, then median "
      f"{sorted(ts[1:])[len(ts[1:]) // 2] if len(ts) > 1 else 0:.3f} s)", t)
