"""GPU micro-benchmark: decode attention (T=1) over the ring, Pallas kernel vs the jnp reference.

For each depth d and ring capacity R >= d, one layer of a `--layers` stack (passed whole, with the layer index,
as the model should) is attended `--iters` times inside one jitted fori_loop (each output feeds the next query,
so nothing is hoisted and launch overhead is amortised); the median of `--reps` runs is reported per call.
Time must be flat in R at fixed depth (DESIGN invariant 2); the last table gives max/min - 1 over R per depth.
`--sliced` also times the kernel on `ring.k[L]` sliced outside (what XLA copies when the stack is not passed).

  python -m bench.attention --kv bf16 --depths 1024,8192,32768,131072 --capacities 4096,16384,32768,131072
"""
from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp
from absl import app, flags, logging

from decode import cli
from ops import attention, attention_pallas

FLAGS = flags.FLAGS
flags.DEFINE_list("depths", ["1024", "4096", "16384", "32768", "131072"], "live lengths (tokens)")
flags.DEFINE_list("capacities", ["4096", "8192", "32768", "65536", "131072"], "ring capacities R")
flags.DEFINE_enum("kv", "bf16", ["bf16", "int8", "f32"], "ring dtype")
flags.DEFINE_integer("n_heads", 32, "query heads (Qwen3-30B-A3B: 32)")
flags.DEFINE_integer("n_kv_heads", 4, "kv heads (Qwen3-30B-A3B: 4)")
flags.DEFINE_integer("head_dim", 128, "head dim")
flags.DEFINE_integer("layers", 2, "layers in the ring stack (attention reads the last one)")
flags.DEFINE_integer("block", 256, "ring block (positions); R must be a multiple")
flags.DEFINE_integer("T", 1, "queries per call")
flags.DEFINE_integer("iters", 100, "calls per timed jit (fori_loop)")
flags.DEFINE_integer("reps", 5, "timed runs (median)")
flags.DEFINE_list("impls", ["ref", "pallas"], "implementations to time")
flags.DEFINE_bool("sliced", False, "also time the kernel on ring.k[L] sliced outside the call")
flags.DEFINE_list("variants", [], "kernel variants dots:bk:warps:stages[:splits] (e.g. tf32x3:64:4:2,bf16x2:128:8:3), "
                  "timed at the largest capacity for every depth, with KV GB/s; a table of their own")

_DT = {"bf16": jnp.bfloat16, "int8": jnp.int8, "f32": jnp.float32}


def make_ring(key, L, R, Hkv, Dh, kv):
  kk, kv_, ks = jax.random.split(key, 3)
  shape = (L, R, Hkv, Dh)
  if kv == "int8":
    k = jax.random.randint(kk, shape, -127, 128, jnp.int8)
    v = jax.random.randint(kv_, shape, -127, 128, jnp.int8)
    s = jax.random.uniform(ks, shape[:-1], jnp.float32, 0.001, 0.02)
    return k, v, s, s * 0.5
  return (jax.random.normal(kk, shape, _DT[kv]), jax.random.normal(kv_, shape, _DT[kv]), None, None)


@functools.partial(jax.jit, static_argnames=("impl", "iters", "block", "sliced", "variant"))
def _loop(q, k, v, ks, vs, pos, length, layer, *, impl, iters, block, sliced, variant=None):
  scale = q.shape[-1] ** -0.5

  def body(_, q):
    if variant is not None:
      o = attention_pallas.ring_attention_pallas(q, k, v, ks, vs, pos, length, layer, block=block, scale=scale,
                                                 tuning=variant, interpret=jax.default_backend() == "cpu")
    elif sliced:
      sc = (None, None) if ks is None else (ks[layer], vs[layer])
      o = attention.ring_attention(q, k[layer], v[layer], *sc, pos, length, block=block, scale=scale, impl=impl)
    else:
      o = attention.ring_attention(q, k, v, ks, vs, pos, length, block=block, scale=scale, impl=impl, layer=layer)
    return o.astype(q.dtype)

  return jax.lax.fori_loop(0, iters, body, q)


def parse_variant(text: str) -> attention_pallas.Tuning:
  """'dots:bk:warps:stages[:splits]' -> the kernel's Tuning (splits None: the kernel's own).

  >>> parse_variant("bf16x2:128:8:3:16")
  Tuning(bk=128, num_warps=8, num_stages=3, dots='bf16x2', n_splits=16)
  """
  parts = text.split(":")
  if (len(parts) not in (4, 5) or parts[0] not in attention_pallas.DOTS
      or not all(x.isdigit() and int(x) > 0 for x in parts[1:])):
    raise ValueError(f"--variants: {text!r}, expected dots:bk:warps:stages[:splits] with dots in "
                     f"{attention_pallas.DOTS}")
  bk, warps, stages = map(int, parts[1:4])
  return attention_pallas.Tuning(bk=bk, num_warps=warps, num_stages=stages, dots=parts[0],
                                 n_splits=int(parts[4]) if len(parts) == 5 else None)


def kv_bytes(depth: int, Hkv: int, Dh: int, kv: str) -> int:
  """Bytes of K and V (and int8 scales) one layer's call reads at `depth`."""
  item = {"bf16": 2, "int8": 1, "f32": 4}[kv]
  return depth * Hkv * (2 * Dh * item + (8 if kv == "int8" else 0))


def time_call(impl, q, ring, depth, sliced=False, variant=None) -> float:
  """Median µs per attention call."""
  k, v, ks, vs = ring
  T = q.shape[0]
  pos = jnp.arange(depth - T, depth, dtype=jnp.int32)
  args = (q, k, v, ks, vs, pos, jnp.int32(depth), jnp.int32(k.shape[0] - 1))
  f = functools.partial(_loop, impl=impl, iters=FLAGS.iters, block=FLAGS.block, sliced=sliced, variant=variant)
  for _ in range(2):             # the first run of a Pallas call can extend the tracing context: warm up twice
    f(*args).block_until_ready()
  ts = []
  for _ in range(FLAGS.reps):
    t = time.perf_counter()
    f(*args).block_until_ready()
    ts.append(time.perf_counter() - t)
  return statistics.median(ts) / FLAGS.iters * 1e6


def main(argv):
  del argv
  dev = jax.devices()[0]
  logging.info("device: %s (%s)", dev.device_kind, jax.default_backend())
  Hq, Hkv, Dh, T = FLAGS.n_heads, FLAGS.n_kv_heads, FLAGS.head_dim, FLAGS.T
  depths = sorted(int(d) for d in FLAGS.depths)
  caps = sorted(int(c) for c in FLAGS.capacities)
  impls = list(FLAGS.impls) + (["pallas_sliced"] if FLAGS.sliced else [])
  try:
    variants = [parse_variant(x) for x in FLAGS.variants]
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  q = jax.random.normal(jax.random.key(1), (T, Hq, Dh), jnp.float32)
  kt = attention_pallas.config(Dh, FLAGS.block, Hkv, _DT[FLAGS.kv])
  bk, warps, stages = kt.bk, kt.num_warps, kt.num_stages
  res = {}
  for R in caps:
    ring = make_ring(jax.random.key(R), FLAGS.layers, R, Hkv, Dh, FLAGS.kv)
    for d in depths:
      if d > R:
        continue
      for impl in impls:
        sliced = impl == "pallas_sliced"
        kernel = "interpret" if jax.default_backend() == "cpu" else "pallas"    # CPU: a smoke run only
        us = time_call(kernel if sliced else impl, q, ring, d, sliced=sliced)
        res[(d, R, impl)] = us
        logging.info("depth %6d  R %6d  %-13s %9.1f us", d, R, impl, us)
    if R == caps[-1] and FLAGS.variants:
      for d in depths:
        for name, var in zip(FLAGS.variants, variants):
          try:
            res[(d, "variant", name)] = us = time_call(None, q, ring, d, variant=var)
          except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported, the sweep goes on
            logging.warning("variant %s at depth %d: %s: %s", name, d, type(e).__name__, str(e).splitlines()[0][:200])
            res[(d, "variant", name)] = float("nan")
            continue
          logging.info("depth %6d  R %6d  %-24s %9.1f us  %7.1f GB/s", d, R, name, us,
                       kv_bytes(d, Hkv, Dh, FLAGS.kv) / us / 1e3)
    del ring

  if FLAGS.variants:
    print(f"kernel variants at R={caps[-1]} (dots:bk:warps:stages[:splits]), µs per call / KV GB/s, kv={FLAGS.kv}, "
          f"T={T}, {dev.device_kind}\n")
    print("| variant | " + " | ".join(f"depth {d}" for d in depths) + " |")
    print("|---|" + "---:|" * len(depths))
    for name in FLAGS.variants:
      cells = [f"{res[(d, 'variant', name)]:.1f} / {kv_bytes(d, Hkv, Dh, FLAGS.kv) / res[(d, 'variant', name)] / 1e3:.0f}"
               for d in depths]
      print(f"| {name} | " + " | ".join(cells) + " |")
    print()
  if not impls:
    return
  lines = [f"decode attention, T={T}, Hq={Hq}, Hkv={Hkv}, Dh={Dh}, kv={FLAGS.kv}, block={FLAGS.block}, "
           f"kernel bk={bk} warps={warps} stages={stages} splits<={attention_pallas.max_splits(Hkv)}, "
           f"{dev.device_kind}", "",
           "| depth | R | splits x tiles | " + " | ".join(f"{i} µs" for i in impls) + " | ref / pallas |",
           "|" + "---|" * (4 + len(impls))]
  for d in depths:
    _, n = attention_pallas.live_tiles(d, d - 1, caps[-1], bk)
    busy, tps = attention_pallas.split_schedule(n, attention_pallas.max_splits(Hkv))
    for R in caps:
      if (d, R, impls[0]) not in res:
        continue
      cells = [f"{res[(d, R, i)]:.1f}" for i in impls]
      sp = (f"{res[(d, R, 'ref')] / res[(d, R, 'pallas')]:.2f}x"
            if "ref" in impls and "pallas" in impls else "-")
      lines.append(f"| {d} | {R} | {int(busy)} x {int(tps)} | " + " | ".join(cells) + f" | {sp} |")
  lines += ["", "flatness in R at fixed depth (max/min - 1 over the capacities that hold the depth):", "",
            "| depth | #R | " + " | ".join(impls) + " |", "|" + "---|" * (2 + len(impls))]
  for d in depths:
    rs = [R for R in caps if (d, R, impls[0]) in res]
    if len(rs) < 2:
      continue
    cells = []
    for i in impls:
      xs = [res[(d, R, i)] for R in rs]
      cells.append(f"{(max(xs) / min(xs) - 1) * 100:+.1f} %")
    lines.append(f"| {d} | {len(rs)} | " + " | ".join(cells) + " |")
  print("\n".join(lines))


if __name__ == "__main__":
  cli.run(main)                    # expected failures: one line, exit 1 (decode.cli)
