"""`python -m bench.step`: decode step time against ring capacity and depth, on a full-size shape.

The ring is filled with random K/V up to `depth` (a step's cost depends on how many positions it reads, not
on their values), then a jitted loop of `--steps` plain decode steps is timed after a warm-up. Params are
random valid blocks built in memory (model.writer.random_params) of a preset's shape. Variants of one cell
(kernels, attention implementation) run in the same process so they compare as ratios.

  python -m bench.step --preset qwen3moe-30b-a3b --rings 4096,32768,131072 --depths 1024
  python -m bench.step --preset qwen3moe-30b-a3b --rings 131072 --depths 1024,8192,32768,131072
  python -m bench.step --cells 32768:131072:auto:pallas:139264     # a 32K ring + host tier at 128K depth
  python -m bench.step --preset seed-mtp --cells 4096:1024:auto:pallas::15800 --glue on,on/miss=4:1

A fifth cell field C (max_context) adds a host tier of C positions (model/host_tier.py, pinned host memory on
a GPU): the ring holds the newest R positions of `depth`, the tier the older ones, and every step evicts one
position into the tier and merges the two attentions (log-sum-exp). A sixth field N runs the routed experts
through an expert cache of N device slots (model/expert_cache.py) over a store in pinned host memory on a GPU;
its slots start empty, so the timed repeats run warm after the compiling run, and the record has their hit rate.
"""
from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags, logging

from bench.glue import glue_options
from decode import cli
from ops.attention_pallas import DOTS, is_spec

FLAGS = flags.FLAGS

flags.DEFINE_string("preset", "qwen3moe-30b-a3b", "model shape (configs.presets)")
flags.DEFINE_string("experts", "IQ3_S", "routed expert type")
flags.DEFINE_string("other", "Q8_0", "other matrices' type")
flags.DEFINE_list("rings", ["4096", "16384", "32768", "131072"], "ring capacities")
flags.DEFINE_list("depths", ["1024"], "live positions before timing")
flags.DEFINE_list("kernels", ["xla"], "quantized kernels: xla | pallas")
flags.DEFINE_list("attn", ["auto"], "attention on the GPU: auto (the dispatcher's default) | ref | pallas | a kernel "
                  "spec dots/bk/warps/stages (e.g. bf16x2/128/8/3: the kernel so tuned)")
flags.DEFINE_list("cells", None, "explicit cells ring:depth[:attn[:kernels[:max_context[:slots]]]] (instead of the "
                  "rings x depths grid); max_context > ring adds a host tier, slots an expert cache of that many "
                  "slots over a pinned-host store")
flags.DEFINE_string("kv", "int8", "KV dtype")
flags.DEFINE_integer("steps", 64, "timed decode steps per cell")
flags.DEFINE_integer("repeats", 3, "timed repeats (median)")
flags.DEFINE_string("out", "/tmp/moejax-bench/step.jsonl", "JSONL output")
flags.DEFINE_string("attn_kernel", None, "decode attention kernel tuning dots[:bk:warps:stages] for every cell "
                    "(ops.attention_pallas.parse_spec; e.g. bf16x2:128:8:3); unset: the kernel's table")
flags.register_validator("attn_kernel", lambda v: v is None or is_spec(v),
                         "expected dots[:bk:warps:stages] with dots tf32x3 or bf16x2")
flags.DEFINE_bool("fuse_qkv", True, "one q/k/v matmul per layer (model.api.fuse_qkv, as load_model does); "
                  "--nofuse_qkv runs three")
flags.DEFINE_list("glue", ["on"], "on: the per-token Pallas glue kernels (RMSNorm + residual, routing, q/k norm + "
                  "RoPE + ring write; Options.glue, with --kernels pallas); off: the XLA ops; on may carry tuning "
                  "overrides (see bench.glue.glue_options), e.g. on/rope=1/router=64:2048:8:1/xnat=0; a list runs every "
                  "variant cell by cell in one process (the A/B)")
flags.DEFINE_bool("interleave", False, "build and compile every cell first, then run the timed repeats in turns "
                  "(cell 1, 2, .., 1, 2, ..): an A/B free of the cells' order (the first cell of a call ran slower "
                  "before; PERF 'The host tier read in spans'). Every cell's state is held at once; no --profile")
flags.DEFINE_string("profile", None, "folder: trace one extra run of each cell with jax.profiler (a perfetto "
                    "trace.json.gz per cell, readable with plain Python: per-kernel GPU time of a step)")

def cell_options(glue: str, attn: str, attn_kernel: str | None = None):
  """The model Options of one cell: its --glue value and its attention ("auto": the dispatcher's default, "ref" |
  "pallas", or a kernel spec dots/bk/warps/stages: the decode kernel so tuned; --attn_kernel tunes the kernel of
  every cell that does not name one)."""
  from model.options import Options
  from ops.attention_pallas import parse_spec
  on, tunings = glue_options(glue)
  spec = attn.replace("/", ":") if attn.split("/")[0] in DOTS else None
  if spec is not None and not is_spec(spec):
    raise app.UsageError(f"--cells: attention {attn!r}, expected dots/bk/warps/stages")
  if spec is None and attn not in ("auto", "ref", "pallas"):
    raise app.UsageError(f"--cells: attention {attn!r}, expected auto, ref, pallas or dots/bk/warps/stages")
  kernel = spec or attn_kernel
  tunings = tunings.replace(attention_impl=None if attn == "auto" else "pallas" if spec else attn,
                            attention=parse_spec(kernel) if kernel else None)
  return Options(glue=on, tunings=tunings)


def _random_kv(store, n_live: int, seed: int):
  """`store` (a KVRing or a HostTier: per-layer k, v [C, Hkv, Dh] and int8 scales [C, Hkv]) with random K/V in its
  first n_live slots (RoPE'd values are unit-scale; int8 as round(40 x) with scale 1/40) and zeros elsewhere."""
  import jax
  import jax.numpy as jnp
  live = jnp.arange(store.k[0].shape[0]) < n_live
  keys = jax.random.split(jax.random.PRNGKey(seed), 2 * len(store.k))

  def rnd(key, like):
    x = jax.random.normal(key, like.shape, jnp.float32)
    if like.dtype == jnp.int8:
      return jnp.where(live[:, None, None], jnp.clip(jnp.round(x * 40), -127, 127), 0).astype(jnp.int8)
    return jnp.where(live[:, None, None], x, 0).astype(like.dtype)
  store = store.replace(k=tuple(rnd(keys[2 * i], a) for i, a in enumerate(store.k)),
                        v=tuple(rnd(keys[2 * i + 1], a) for i, a in enumerate(store.v)))
  if store.k_scale is not None:
    sc = jnp.where(live[:, None], 1.0 / 40, 0.0).astype(jnp.float32)
    store = store.replace(k_scale=tuple(jnp.broadcast_to(sc, a.shape) + 0 for a in store.k_scale),
                          v_scale=tuple(jnp.broadcast_to(sc, a.shape) + 0 for a in store.v_scale))
  return store


def fill_ring(ring, depth: int, seed: int = 0, wrap: bool = False):
  """Random K/V at positions [0, depth); length = depth. With `wrap` (a host tier holds the older positions)
  depth may exceed the window: every slot is then live."""
  import jax.numpy as jnp
  if depth > ring.window and not wrap:
    raise ValueError(f"depth {depth} exceeds the ring's window {ring.window}")
  return _random_kv(ring, depth, seed).replace(length=jnp.int32(depth))


def fill_host(ring, depth: int, capacity: int, seed: int = 1):
  """A host tier of `capacity` positions holding random K/V for the positions the ring no longer shows,
  [0, depth - window), placed in pinned host memory where the backend has it."""
  from model.host_tier import HostTier, place_on_host
  return place_on_host(_random_kv(HostTier.like(ring, capacity), max(0, depth - ring.window), seed))


class StepTimer:
  """One cell's jitted plain loop (with a host tier when given), run one timed repeat at a time, so that the cells
  of an A/B can take turns (--interleave). The state is donated to the loop, so each run starts from the previous
  one's state rewound. options: the model's (model.options.Options; None: the defaults)."""

  def __init__(self, params, cfg, ring, steps: int, host=None, options=None, experts=None):
    from model.options import DEFAULT
    self.params, self.cfg, self.ring, self.host, self.steps = params, cfg, ring, host, steps
    self.experts = experts                                        # an expert cache (None: every expert resident)
    self.kw = dict(cfg=cfg, temperature=0.0, top_p=1.0, options=options or DEFAULT)
    self.base_len, self.ls = int(ring.length), None

  def run(self, trace_dir: str | None = None) -> float:
    """Seconds of one run of `steps` steps (the first compiles); with `trace_dir` traced with jax.profiler (a
    perfetto trace)."""
    import contextlib

    import jax
    import jax.numpy as jnp

    from decode.engine import LoopState, decode_loop
    from model import api
    from model.recurrent import RecurrentState
    rec = RecurrentState.create(self.cfg) if self.cfg.recurrent_layers else None     # a hybrid model's DeltaNet state
    st = (api.ModelState(self.ring, host=self.host, recurrent=rec, experts=self.experts) if self.ls is None
          else self.ls.model.replace(ring=self.ls.model.ring.rewind(self.base_len)))
    self.ring = self.host = self.experts = None                   # the loop donates them
    st, held = api.split_idle_tier(st, self.base_len + self.steps)   # inside the window: ring-only, as a request's
    ls = LoopState(st, jnp.zeros((self.steps + 1,), jnp.int32), jnp.ones((), jnp.int32), jnp.int32(1),
                   jax.random.PRNGKey(0), jnp.zeros((), bool), jnp.int32(-1))
    # every input committed to the device, as the loop's outputs are (a host tier is committed to pinned host
    # memory): otherwise the first timed repeat, fed the compile run's outputs, compiles again (seen on the H200)
    ls = jax.tree.map(lambda x: x if x.committed else jax.device_put(x, jax.devices()[0]), ls)
    jax.block_until_ready(ls)
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True) if trace_dir else contextlib.nullcontext():
      t0 = time.perf_counter()
      ls = decode_loop(self.params, ls, jnp.int32(self.steps + 1), jnp.int32(-1), **self.kw)
      jax.block_until_ready(ls)
      dt = time.perf_counter() - t0
    self.ls = ls.replace(model=api.join_tier(ls.model, held))
    return dt

  def expert_counts(self) -> tuple[int, int]:
    """(hits, misses) of the expert cache so far, over every block; (0, 0) without one."""
    ec = self.ls.model.experts if self.ls is not None else None
    return (int(ec.hits.sum()), int(ec.misses.sum())) if ec is not None else (0, 0)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from tqdm import tqdm

  from configs.presets import preset
  from model.kv_ring import KVRing
  from model.writer import quant_policy, random_params
  from ops import attention_pallas
  from ops.qtensor import with_kernels
  for g in FLAGS.glue:                        # every variant checked before the first cell runs
    glue_options(g)
  if FLAGS.interleave and FLAGS.profile:
    raise app.UsageError("--interleave with --profile: expected one of them (a traced run is not a timed turn)")
  cfg = preset(FLAGS.preset)
  table_dots = attention_pallas.TUNING.get(cfg.head_dim, attention_pallas.DEFAULT_TUNING).dots
  t0 = time.time()
  params = random_params(cfg, types=quant_policy(FLAGS.experts, FLAGS.other), progress=True)
  if FLAGS.fuse_qkv:
    from model.api import fuse_qkv
    params = fuse_qkv(params)                   # as model.loader.load_model
  print(f"params built in {time.time() - t0:.0f} s", file=sys.stderr)
  from bench.provenance import commit as _commit, device as _device
  commit, device = _commit(), _device()
  os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
  rows = []
  cells = [(int(r), int(d), kn, at, None, None) for r in FLAGS.rings for d in FLAGS.depths for kn in FLAGS.kernels
           for at in FLAGS.attn if int(d) <= int(r)]
  if FLAGS.cells:
    cells = []
    for c in FLAGS.cells:
      parts = c.split(":")
      if not 2 <= len(parts) <= 6:
        raise app.UsageError(f"--cells {c!r}: expected ring:depth[:attn[:kernels[:max_context[:slots]]]]")
      parts += ["auto", FLAGS.kernels[0], "", ""][len(parts) - 2:]
      cells.append((int(parts[0]), int(parts[1]), parts[3], parts[2], int(parts[4]) if parts[4] else None,
                    int(parts[5]) if parts[5] else None))
  cells = [c + (rw,) for c in cells for rw in FLAGS.glue]
  for _, _, _, at, _, _, rw in cells:
    cell_options(rw, at, FLAGS.attn_kernel)
  stores = {}                                   # kernels -> the params with the store in pinned host memory

  def cell_params(kn, slots):
    """The cell's params, and its expert cache (None: every expert resident)."""
    from model import expert_cache as xc
    if slots is None:
      return with_kernels(params, kn), None
    if kn not in stores:
      stores[kn] = xc.place_store(with_kernels(params, kn), cfg)
    return stores[kn], xc.create(stores[kn], cfg, slots)

  def build(R, depth, kn, at, C, slots, rw):
    """The cell's StepTimer and its host tier's capacity (None: no tier)."""
    if C is not None and C < depth + FLAGS.steps + 1:
      raise ValueError(f"max_context {C} < depth {depth} + {FLAGS.steps + 1} steps")
    host_cap = C if C is not None and C > R else None
    ring = KVRing.create(len(cfg.attention_layers), R, cfg.n_kv_heads, cfg.head_dim, FLAGS.kv, block=min(256, R))
    ring = fill_ring(ring, depth, wrap=host_cap is not None)
    host = fill_host(ring, depth, host_cap) if host_cap else None
    opts = cell_options(rw, at, FLAGS.attn_kernel)
    p, experts = cell_params(kn, slots)
    return StepTimer(p, cfg, ring, FLAGS.steps, host, opts, experts), host_cap

  failures = []

  def failed(cell, e):
    """Report a cell that raised on its own line (tqdm.write: not glued to a progress bar, which log filters
    drop) and count it: the table prints the cells that ran, then the process exits 1."""
    R, depth, kn, at, _, _, rw = cell
    failures.append(cell)
    tqdm.write(f"cell R={R} depth={depth} {kn}/{at} glue {rw}: {type(e).__name__}: {str(e).splitlines()[0][:300]}",
               file=sys.stderr)

  def runs():
    """(cell, seconds per step of each timed repeat, seconds of the first run, host tier capacity, the expert
    cache's hit rate over the timed repeats or None) of every cell that ran: cell by cell, or (--interleave) all
    compiled first and then their repeats in turns."""

    def hit_rate(timer, before):
      h, m = (a - b for a, b in zip(timer.expert_counts(), before))
      return h / (h + m) if h + m else None
    if not FLAGS.interleave:
      for cell in tqdm(cells, desc="cells", file=sys.stderr):
        timer = None                          # the last cell's state goes before this one's is built
        try:
          timer, host_cap = build(*cell)
          first = timer.run()
          before = timer.expert_counts()
          ts = [timer.run() / FLAGS.steps for _ in range(FLAGS.repeats)]
          hits = hit_rate(timer, before)
          if FLAGS.profile:
            R, depth, kn, at, _, _, rw = cell
            name = f"R{R}-d{depth}-{kn}-{at}-glue{rw}".replace("/", "_").replace(":", "-")
            timer.run(os.path.join(FLAGS.profile, name))
        except Exception as e:  # noqa: BLE001 - a failing variant is reported, the sweep goes on
          failed(cell, e)
          continue
        yield cell, ts, first, host_cap, hits
      return
    timers = {}
    for cell in tqdm(cells, desc="compile", file=sys.stderr):
      try:
        timer, host_cap = build(*cell)
        first = timer.run()
        timers[cell] = (timer, first, host_cap, [], timer.expert_counts())
      except Exception as e:  # noqa: BLE001
        failed(cell, e)
    for _ in tqdm(range(FLAGS.repeats), desc="rounds", file=sys.stderr):
      for timer, _, _, ts, _ in timers.values():
        ts.append(timer.run() / FLAGS.steps)
    for cell, (timer, first, host_cap, ts, before) in timers.items():
      yield cell, ts, first, host_cap, hit_rate(timer, before)

  with open(FLAGS.out, "a") as f:
    for (R, depth, kn, at, C, slots, rw), ts, first_s, host_cap, hits in runs():
      spec = at.replace("/", ":") if at.split("/")[0] in DOTS else None
      ms = sorted(ts)[len(ts) // 2] * 1e3
      rec = {"preset": FLAGS.preset, "experts": FLAGS.experts, "kv": FLAGS.kv, "ring": R, "depth": depth, "kernels": kn,
             "host_tier": host_cap, "expert_slots": slots, "expert_hit_rate": hits,
             "attn": at, "fuse_qkv": FLAGS.fuse_qkv, "glue": rw, "interleaved": FLAGS.interleave,
             "attn_kernel": spec or FLAGS.attn_kernel or table_dots,
             "ms_per_step": ms,
             "all_ms": [t * 1e3 for t in ts], "first_run_s": first_s,
             "xla_flags": os.environ.get("XLA_FLAGS", ""), "commit": commit, "device": device,
             "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
      f.write(json.dumps(rec) + "\n")
      f.flush()
      rows.append(rec)
      cache = f" slots {slots} ({hits:.1%} hits)" if slots is not None and hits is not None else ""
      print(f"R={R} depth={depth} {kn}/{at} glue {rw}{f' host {host_cap}' if host_cap else ''}{cache}: "
            f"{ms:.3f} ms/step (first run {first_s:.1f} s)", file=sys.stderr)
  print(f"\n{FLAGS.preset} ({FLAGS.experts} experts, {FLAGS.other} other, {FLAGS.kv} KV), {device}, commit {commit}, "
        f"{FLAGS.steps} steps x {FLAGS.repeats}\n")
  print("| ring | host tier | depth | expert slots (hits) | kernels | attn | glue | ms/step | tok/s |\n"
        "| ---: | ---: | ---: | ---: | --- | --- | --- | ---: | ---: |")
  for r in rows:
    slots = "-" if r["expert_slots"] is None else f"{r['expert_slots']} ({(r['expert_hit_rate'] or 0):.1%})"
    print(f"| {r['ring']} | {r['host_tier'] or '-'} | {r['depth']} | {slots} | {r['kernels']} | {r['attn']} | "
          f"{r['glue']} | {r['ms_per_step']:.3f} | {1e3 / r['ms_per_step']:.1f} |")
  if failures:
    sys.exit(f"bench.step: {len(failures)} of {len(cells)} cells failed (their lines above), the table has the rest")


if __name__ == "__main__":
  cli.run(main)                    # expected failures: one line, exit 1 (decode.cli)
