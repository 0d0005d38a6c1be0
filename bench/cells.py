"""`python -m bench.cells`: benchmark cells (arms x seeds), JSONL records, a markdown table and verdicts.

Each cell is one request (greedy): a prompt of `prompt_tokens` (the depth), `max_new_tokens` generated, with
the arm's ring capacity, drafter, KV dtype, expert cache (all | auto | N slots, sized by the memory plan under
--device_budget) and kernels; --max_context applies to every request (a fixed ring below it puts older positions
in the host tier). Every cell first runs once untimed (compiles), then once per seed; each timed run writes one
JSONL record (config, commit, device, prefill tok/s, TTFT, decode tok/s, drafts proposed/accepted per position,
expert-cache stats, the memory plan, and for drafted arms the bytes-per-round model of decode/round_model.py) and
its log, `<cells>.logs/<arm>-s<seed>.log` (an arm's `@` written `-k`; the request, the plan's table, what the
stack logged meanwhile, the result; the first seed's log also holds the compiling run), named by the record's "log".
The table shows the median decode tok/s over seeds, the drafts of every seed, the expert-cache hit rate, and
for drafted arms the speed-up over the matching plain arm beside what the byte ratio predicts; pre-declared bars
are evaluated and printed; a PNG plots tok/s against depth. A refused request or plan fails its arm (one line, the
other arms run); any other expected failure exits 1 with one line (decode.cli).

  python -m bench.cells --arms seed4 --preset seed-mtp --cells /tmp/seed4.jsonl        # the seed's experiment
  python -m bench.cells --gguf m.gguf --rings 4096,32768 --drafts none,lookup --depths 1024,8192
  python -m bench.cells --preset qwen3moe-30b-a3b --in_memory --kernels pallas --expert_cache all,4096,8192 \
      --device_budget 24GiB --drafts none,replay@3                        # issue 6: tok/s and hit rate vs slots
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import json
import logging as pylogging
import os
import statistics
import sys
import time

from absl import app, flags, logging

from decode import cli
from decode.cli import CLIError
from ops.attention_pallas import is_spec

FLAGS = flags.FLAGS

flags.DEFINE_string("gguf", None, "model file (default: --preset's synthetic file, else the default model)")
flags.DEFINE_string("preset", None, "write/reuse a synthetic file of this preset (configs.synth) under --synth_dir")
flags.DEFINE_string("synth_dir", "/tmp/moejax-synth", "where synthetic files are written")
flags.DEFINE_string("experts", "IQ3_S", "expert type of the synthetic file")
flags.DEFINE_bool("in_memory", False, "with --preset: random valid blocks built in memory instead of a GGUF file "
                  "(same params as writing and loading the synthetic file, without the multi-GB round trip)")
flags.DEFINE_string("arms", None, "named arm set: seed4 | rings | depths | drafts (overrides the list flags)")
flags.DEFINE_list("only", None, "run only these arms of the set (by name, e.g. AR,BR of seed4): a set split over "
                  "several processes; the bars compare the arms that ran")
flags.DEFINE_list("rings", ["auto"], "main ring capacities (kv_resident)")
flags.DEFINE_list("drafts", ["none"], "drafters: none | mtp | lookup | replay, each optionally @k (drafts per round)")
flags.DEFINE_list("kv", ["int8"], "KV dtypes")
flags.DEFINE_list("depths", ["1024"], "prompt tokens (depth)")
flags.DEFINE_integer("max_new_tokens", 256, "generated tokens per cell")
flags.DEFINE_integer("mtp_draft", 3, "drafts per round")
flags.DEFINE_integer("mtp_window", 4096, "drafter window")
flags.DEFINE_integer("seeds", 3, "timed runs per cell")
flags.DEFINE_integer("first_seed", 0, "the first seed of the timed runs (seeds first_seed .. first_seed + seeds - 1): "
                     "a cell's seeds split over calls, the JSONLs joined by --report")
flags.register_validator("first_seed", lambda v: v >= 0, "expected at least 0")
flags.DEFINE_integer("max_context", None, "max_context of every request (above a fixed ring: the host tier)")
flags.DEFINE_list("expert_cache", ["all"], "expert caches: all | auto | N slots (arms; seed4 takes the first)")
flags.DEFINE_string("device_budget", None, "device memory budget of the plan (e.g. 24GiB; default: the device's)")
flags.DEFINE_enum("expert_policy", "lru", ["lru", "lfu"], "expert-cache eviction policy")
flags.DEFINE_enum("kernels", "xla", ["xla", "pallas"], "quantized kernels")
flags.DEFINE_string("glue", "on", "the glue kernels and tuning overrides of every cell, as bench.step's --glue (one "
                    "value: bench.glue.glue_options), e.g. on/x8=dp4a")
flags.DEFINE_string("attn_kernel", None, "decode attention kernel tuning dots[:bk:warps:stages] "
                    "(ops.attention_pallas.parse_spec; e.g. bf16x2:128:8:3); unset: the kernel's table")
flags.register_validator("attn_kernel", lambda v: v is None or is_spec(v),
                         "expected dots[:bk:warps:stages] with dots tf32x3 or bf16x2")
flags.DEFINE_integer("prefill_chunk", None, "prompt tokens per prefill call (default: engine.prefill_chunk's: 1,024 on "
                     "a GPU, the remainder 8 a call, 2,048 on CPU)")
flags.DEFINE_enum("prefill_precision", "auto", ["auto", "f32", "bf16"],
                  "the prefill GEMMs' operands (Options.prefill_precision): f32 (three bf16 MMAs, float32-accurate), "
                  "bf16 (one MMA, ~2e-3 per dot, finer than llama.cpp's 8-bit x), auto: bf16 on a GPU, f32 elsewhere")
flags.DEFINE_enum("prompt_source", "synthetic", ["synthetic", "text"],
                  "synthetic: a fixed arithmetic token pattern; text: the standard library's documentation topics "
                  "(pydoc_data), tokenized, from a seed-dependent offset (real text, for models that learned it)")
flags.DEFINE_bool("reuse_prefill", False, "arms that share a prompt, ring, tier and k share one prefill "
                  "(bench.prefill_cache.PrefillCache; TTFT reports the original prefill's time, records say "
                  "prefill_reused): seeds run outermost and each arm's compiling run takes the first seed's prompt. "
                  "For deep cells, whose prefill dwarfs the decode")
flags.DEFINE_integer("compile_jobs", 1, "arms whose compiling runs go at once, in threads, before any timed run (XLA "
                     "compiles without the GIL: the seed4 arms' programs compile side by side on a many-core GPU host; "
                     "each run meanwhile holds its own state, expert slots included, on the device), after one arm's "
                     "alone whose prefill of the first seed's prompt the others take (compile_all); 1: each arm's "
                     "compiling run just before its first timed run")
flags.register_validator("compile_jobs", lambda v: v >= 1, "expected at least 1")
flags.DEFINE_string("trace", None, "folder: after an arm's timed runs, trace one more request of its seed 0 "
                    "(PROFILE_TOKENS tokens) with jax.profiler, its prompt's prefill reused from an untraced run just "
                    "before, so the trace holds the decode: <folder>/<arm>/ gets a perfetto trace.json.gz "
                    "(scripts/gpu/trace_summary.py: kernel time per step, launch gaps)")
flags.DEFINE_string("mesh", None, "split the model over this host's devices: ep=N[,tp=M] (routed experts by expert "
                    "id; K/V rings and attention by head where the heads divide; the rest replicated; model/mesh.py); "
                    "default: one device")
flags.DEFINE_string("cells", "/tmp/moejax-bench/cells.jsonl", "JSONL output (one record per timed run)")
flags.DEFINE_string("plot", None, "PNG of decode tok/s against depth per arm (default: beside --cells)")
flags.DEFINE_list("report", None, "JSONL files of earlier runs: print their table, verdicts and plot for the arms the "
                  "other flags name, and run nothing (arms measured in separate processes or device calls, e.g. "
                  "one seed4 ring per call)")


@dataclasses.dataclass(frozen=True)
class Arm:
  name: str
  ring: str = "auto"
  draft: str = "none"
  kv: str = "int8"
  depth: int = 1024
  k: int | None = None      # drafts per round (None: --mtp_draft)
  cache: str = "all"        # expert cache: all | auto | N slots


# The seed report (#3166): ring 32,768 vs 49,152, MTP on vs off, 1,024-token prompt, 256 tokens, int8 KV.
# On random weights MTP drafts are never accepted, so "on" arms are run with the NextN drafter (its real cost)
# and with replay (100 % acceptance); "off" arms use lookup, as the seed engine did.
SEED4 = [Arm("AS", "32768", "mtp"), Arm("BS", "49152", "mtp"), Arm("AR", "32768", "replay"), Arm("BR", "49152", "replay"),
         Arm("AN", "32768", "lookup"), Arm("BN", "49152", "lookup")]
# seed4 plus plain arms (the round-vs-step ratio) and a k sweep with replay (issue 5's benchmark), one process.
SEED4K = [Arm("AP", "32768", "none"), Arm("BP", "49152", "none")] + SEED4 + [
    Arm(f"AR{k}", "32768", "replay", k=k) for k in (1, 2, 4)]
SEED4_BARS = [("AS", "BS", 0.03, "decode tok/s"), ("AR", "BR", 0.03, "decode tok/s"), ("AN", "BN", 0.03, "decode tok/s"),
              ("AS", "BS", 0.0, "drafts accepted"), ("AR", "BR", 0.0, "drafts accepted"),
              ("AN", "BN", 0.0, "drafts accepted")]
# Depths up to which the speed bars hold: at 32K and 128K a 32,768-slot ring sends positions to the host tier and
# a 49,152-slot one fewer or none, so the rings are expected to differ there (reported without a bar).
SEED4_SPEED_BAR_DEPTH = 1024


def _arms() -> tuple[list[Arm], list]:
  if FLAGS.arms in ("seed4", "seed4k"):
    arms = SEED4 if FLAGS.arms == "seed4" else SEED4K
    if FLAGS.only:
      unknown = set(FLAGS.only) - {a.name for a in arms}
      if unknown:
        raise app.UsageError(f"--only {','.join(sorted(unknown))}: not arms of {FLAGS.arms} "
                             f"({','.join(a.name for a in arms)})")
      arms = [a for a in arms if a.name in FLAGS.only]
    depth = int(FLAGS.depths[0])
    bars = SEED4_BARS + [("AP", "BP", 0.03, "decode tok/s")]
    if depth > SEED4_SPEED_BAR_DEPTH:      # the speed bars are the seed's 1K claim; deeper cells report the ratio
      bars = [(a, b, None if what == "decode tok/s" else tol, what) for a, b, tol, what in bars]
    return [dataclasses.replace(a, depth=depth, cache=FLAGS.expert_cache[0]) for a in arms], bars
  if FLAGS.arms not in (None, "", "grid"):
    raise app.UsageError(f"--arms {FLAGS.arms!r}: known sets are seed4, seed4k (or give --rings/--drafts/--kv/--depths)")
  arms = []
  for r, d, kv, dep, c in itertools.product(FLAGS.rings, FLAGS.drafts, FLAGS.kv, FLAGS.depths, FLAGS.expert_cache):
    name, _, k = d.partition("@")
    arms.append(Arm(f"R{r}-{d}-{kv}-D{dep}" + ("" if c == "all" else f"-X{c}"), r, name, kv, int(dep),
                    int(k) if k else None, c))
  return arms, []


def _in_memory_model(name: str, experts: str, mesh=None):
  """A LoadedModel of random valid blocks in a preset's shape, with the shipped vocab padded to its size; with a mesh
  each tensor is placed on it as it is built (model.mesh.placer), so no device holds the whole model."""
  from configs.presets import preset
  from configs.vocab import load_vocab
  from model.loader import LoadedModel
  from model.tokenizer import Tokenizer
  from model.api import fuse_qkv
  from model.writer import pad_vocab, quant_policy, random_params
  cfg = preset(name)
  t0 = time.time()
  place = None
  if mesh is not None:
    from model.mesh import placer
    place = placer(mesh)
  params = fuse_qkv(random_params(cfg, types=quant_policy(experts, "Q8_0"), progress=True, place=place))  # load_model
  tok = Tokenizer.from_metadata(pad_vocab(load_vocab(1024), cfg.vocab_size).metadata())
  return LoadedModel(cfg, params, tok, f"in-memory:{name}", False, time.time() - t0)


_TEXT: dict = {}


def _text_tokens(model, n: int, seed: int) -> list[int]:
  """n tokens of documentation text starting at an offset chosen by the seed: from the last 40 topics in sorted
  order (which the default model's training held out in part) when they hold n tokens, else from all topics
  (deep cells: 168K tokens with the shipped vocab). A depth beyond all of them is refused, never cut short."""
  from pydoc_data.topics import topics

  def stream(last: int | None) -> list[int]:            # tokenized once per tokenizer and text
    key = (id(model.tokenizer), last)
    if key not in _TEXT:
      _TEXT[key] = model.tokenizer.encode("".join(topics[k] + "<|endoftext|>" for k in sorted(topics)[-(last or 0):]))
    return _TEXT[key]

  ids = stream(40)
  if len(ids) < n:
    ids = stream(None)
  if len(ids) < n:
    raise CLIError(f"--prompt_source text: depth {n} exceeds the {len(ids)} tokens of the documentation topics; "
                   f"use --prompt_source synthetic for deeper cells")
  start = (abs(seed) * 7919 * 13) % max(1, len(ids) - n)
  return ids[start:start + n]


def mesh():
  """The --mesh of every cell (model.mesh.make_mesh; None: one device); a CLIError naming the flag when bad. Meshes
  of one spec compare equal, so every cell's Options hash alike."""
  import jax

  from model.mesh import MeshError, make_mesh, parse_mesh
  try:
    return make_mesh(parse_mesh(FLAGS.mesh, len(jax.devices())))
  except MeshError as e:
    raise CLIError(f"--mesh: {e}") from None


def model_options():
  """The model Options of every cell: the flags' glue kernels and tunings, prefill precision, attention kernel
  tuning and mesh."""
  from bench.glue import glue_options
  from model.options import Options
  from ops.attention_pallas import parse_spec
  from ops.tuning import Tunings
  on, tunings = glue_options(FLAGS.glue)
  if FLAGS.attn_kernel:
    tunings = tunings.replace(attention=parse_spec(FLAGS.attn_kernel))
  return Options(glue=on, prefill_precision=FLAGS.prefill_precision,
                 tunings=None if tunings == Tunings() else tunings, mesh=mesh())


def run_cell(model, arm: Arm, seed: int, max_new: int, prefill_cache=None, buffer: int | None = None) -> dict:
  """One request of `arm` (plain, or the drafted one after the plain request it replays): its stats. `buffer`:
  size the request's buffers and ring for that many new tokens (engine.GenConfig.buffer_tokens)."""
  from decode.engine import GenConfig, generate
  from decode.speculative import speculative_generate
  from model.loader import LoadedModel  # noqa: F401
  if FLAGS.prompt_source == "text":
    prompt = _text_tokens(model, arm.depth, seed)
  else:
    base = [7, 11, 13, 17, 19, 23, 29, 31]
    prompt = [(base[i % len(base)] * (i + 1 + seed)) % model.cfg.vocab_size for i in range(arm.depth)]
  gen = GenConfig(max_new_tokens=max_new, kv=arm.kv, kv_resident=None if arm.ring == "auto" else int(arm.ring),
                  max_context=FLAGS.max_context, stop_at_eos=False, seed=seed, prefill_chunk=FLAGS.prefill_chunk,
                  buffer_tokens=buffer, options=model_options())
  k = (arm.k or FLAGS.mtp_draft) if arm.draft != "none" else 0
  plan, slots = _plan(model, arm, gen, k)
  gen = dataclasses.replace(gen, expert_slots=slots, expert_policy=FLAGS.expert_policy)
  CELL_LOG.info("cell %s seed %d: %s, %d prompt tokens, %d new, expert slots %s\nmemory plan:\n%s", arm.name, seed,
               dataclasses.asdict(arm), len(prompt), max_new, "all" if slots is None else slots, plan.table())
  plain = None
  if arm.draft == "none":
    res = generate(model, prompt, gen, prefill_cache=prefill_cache)
  else:
    plain = generate(model, prompt, gen, prefill_cache=prefill_cache) if arm.draft == "replay" else None
    res = speculative_generate(model, prompt, gen, drafter=arm.draft, k=k, mtp_window=FLAGS.mtp_window,
                               replay_ids=plain.ids if plain else None, prefill_cache=prefill_cache)
  st = dict(res.stats)
  if plain is not None:     # the plain request replay drafts from: the same run's plain speed beside the drafted one
    st["plain"] = {key: plain.stats.get(key) for key in ("decode_tok_s", "ttft_s", "setup_s", "prefill_s",
                                                         "prefill_reused")}
  # a reused prefill's TTFT is the original request's (its compiling run): no prefill figure from it. A replay
  # request reuses its plain request's prefill: where that one prefilled, its TTFT is the figure
  src = plain.stats if plain is not None and st.get("prefill_reused") else st
  st["prefill_tok_s"] = None if src.get("prefill_reused") else (arm.depth / src["ttft_s"] if src["ttft_s"] else 0.0)
  st["tokens"] = [int(t) for t in res.ids]        # the generated tokens: runs compare them across arms
  st["plan"], st["expert_slots"] = plan.to_json(), slots
  if arm.draft != "none":
    from bench.round_model import bytes_model
    st["bytes_model"] = bytes_model(model.params, model.cfg, k, arm.draft)
  return st


# A cell's own account (request, plan, result) goes only to its log file; the terminal keeps the table.
CELL_LOG = pylogging.getLogger("moejax.bench.cell")
CELL_LOG.propagate = False
CELL_LOG.setLevel(pylogging.INFO)


@contextlib.contextmanager
def cell_log(path: str):
  """While a cell runs: its account (CELL_LOG) and whatever the stack logs through absl at the current verbosity
  (warnings under `main`) are appended to the file at `path`."""
  handler = pylogging.FileHandler(path, mode="a")
  handler.setFormatter(pylogging.Formatter("%(asctime)s %(levelname)s %(module)s: %(message)s"))
  loggers = (CELL_LOG, logging.get_absl_logger())
  for lg in loggers:
    lg.addHandler(handler)
  try:
    yield
  finally:
    for lg in loggers:
      lg.removeHandler(handler)
    handler.close()


def _log_result(arm: Arm, seed: int, st: dict) -> None:
  drafts = (f", drafts accepted/proposed per position {st['drafts_accepted']}/{st['drafts_proposed']}"
            if st.get("drafts_proposed") else "")
  prefill = "reused" if st.get("prefill_tok_s") is None else f"{st['prefill_tok_s']:.0f} tok/s"
  split = (f" (setup {st['setup_s']:.3f} s" + (f", prefill {st['prefill_s']:.3f} s)" if st.get("prefill_s") is not None
                                                else ")")) if st.get("setup_s") is not None else ""
  # a reused prefill's TTFT is its original request's (the compiling run's, where that one compiled)
  ttft = f"TTFT {st['ttft_s']:.3f} s" + (" (the reused prefill's own request)" if st.get("prefill_reused") else "")
  CELL_LOG.info("cell %s seed %d: %d prompt tokens, %s%s, prefill %s, %d tokens at %.2f tok/s decode%s",
               arm.name, seed, st["prompt_tokens"], ttft, split, prefill, st["generated_tokens"],
               st["decode_tok_s"], drafts)


COMPILE_TOKENS = 8       # tokens the compiling run generates (a 128K cell's 256 tokens take ~40 s on the GPU)


def compile_run(model, arm: Arm, prefill_cache=None) -> dict:
  """The untimed first run of an arm: COMPILE_TOKENS new tokens in buffers and a ring sized for the timed runs'
  max_new_tokens (engine.GenConfig.buffer_tokens), so it compiles every loop they call; without the sizing a
  shorter run left the first timed run a recompile. With a prefill cache it takes the first seed's prompt
  (--first_seed), whose prefill the first timed run then reuses."""
  return run_cell(model, arm, seed=FLAGS.first_seed if prefill_cache is not None else -1,
                  max_new=min(COMPILE_TOKENS, FLAGS.max_new_tokens), prefill_cache=prefill_cache,
                  buffer=FLAGS.max_new_tokens)


def compile_all(model, arms: list[Arm], jobs: int, prefill_cache=None) -> dict[str, float | Exception]:
  """Every arm's compiling run: arm name -> its wall seconds, or the expected error that refused it. One arm runs
  first on its own (a replay arm where there is one: its plain and drafted requests prefill the first seed's
  prompt under both of their keys), its prefills kept in `prefill_cache` (a private one when None); the others run
  `jobs` at a time in threads (XLA compiles outside the GIL) and take that prefill instead of running their own: a
  32K prompt under the card streams the store 32 times, and four such prefills at once shared the PCIe for minutes.
  The threads share the params, jax's compile caches and the prefill cache (a program two threaded arms need may
  compile twice, once in each)."""
  from bench.prefill_cache import PrefillCache
  cache = prefill_cache if prefill_cache is not None else PrefillCache(capacity=2 * len({(a.ring, a.kv) for a in arms}))

  def one(arm):
    t0 = time.time()
    try:
      compile_run(model, arm, cache)
    except cli.expected_errors() as e:
      return e
    return time.time() - t0
  first = next((a for a in arms if a.draft == "replay"), arms[0])
  done = {first.name: one(first)}
  with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
    futures = {a.name: pool.submit(one, a) for a in arms if a is not first}
  done.update({name: f.result() for name, f in futures.items()})
  return {a.name: done[a.name] for a in arms}


PROFILE_TOKENS = 32      # tokens of a traced request (--trace)


def profile_arm(model, arm: Arm, folder: str) -> dict:
  """One request of `arm` (seed 0, PROFILE_TOKENS new tokens, buffers sized for the timed runs so nothing
  compiles) traced with jax.profiler into `folder`, after an untraced one that prefills its prompt into a prefill
  cache: the traced request reuses that prefill (where the engine caches it: no expert slots, or a prompt that
  streams whole), so its trace is the decode loop's. Returns its stats."""
  import jax

  from bench.prefill_cache import PrefillCache
  cache = PrefillCache(capacity=2)
  kw = dict(seed=0, max_new=min(PROFILE_TOKENS, FLAGS.max_new_tokens), prefill_cache=cache,
            buffer=FLAGS.max_new_tokens)
  run_cell(model, arm, **kw)
  with jax.profiler.trace(folder, create_perfetto_trace=True):
    return run_cell(model, arm, **kw)


def _plan(model, arm: Arm, gen, k: int):
  """The request's memory plan and expert slots (None: all resident), as `generate --plan` makes them."""
  from decode.engine import new_tokens_sized, prefill_chunk, ring_capacity
  from decode.kv_plan import device_budget, plan_request
  ring = ring_capacity(arm.depth + new_tokens_sized(gen) + (k + 1 if k else 0), gen.kv_resident)
  return plan_request(model, ring=ring, kv=arm.kv, max_context=gen.max_context, k=k,
                      mtp_window=FLAGS.mtp_window if arm.draft == "mtp" else None, expert_cache=arm.cache,
                      budget=device_budget(FLAGS.device_budget), prefill_chunk=min(prefill_chunk(gen), arm.depth),
                      fixed_ring=gen.kv_resident is not None, tunings=gen.options.tunings)


def _hit_rate(st: dict, phase: str = "decode") -> float | None:
  """The expert cache's hit rate in one phase of the request ("prefill" | "decode"), None without a cache."""
  xc = st.get("expert_cache")
  return xc[phase]["hit_rate"] if xc and phase in xc else None


def _speedups(records: list[dict], arms: list[Arm], a: Arm) -> str:
  """Measured decode speed-up of drafted arm `a` over the plain arm of the same ring/kv/depth/cache, and the
  byte model's prediction at the measured tokens per round (1 + mean accepted drafts)."""
  plain = [b for b in arms if b.draft == "none" and (b.ring, b.kv, b.depth, b.cache) == (a.ring, a.kv, a.depth, a.cache)]
  rs = [r for r in records if r["arm"] == a.name]
  ps = [r for r in records if plain and r["arm"] == plain[0].name]
  if a.draft == "none" or not rs:
    return "-"
  bm = rs[0]["stats"]["bytes_model"]
  tokens = 1 + statistics.median(r["stats"]["mean_accepted_len"] for r in rs)
  # rounds without a draft (lookup without a match) are one plain step: weigh the round's bytes by the share
  # of rounds that verified
  verified = statistics.median(min(1.0, r["stats"]["drafts_proposed"][0] / max(r["stats"]["rounds"], 1)) for r in rs)
  model_x = tokens * bm["step_bytes"] / (verified * bm["round_bytes"] + (1 - verified) * bm["step_bytes"])
  own = [r["stats"]["plain"]["decode_tok_s"] for r in rs if r["stats"].get("plain")]
  if not ps and not own:
    return f"? (model {model_x:.2f}x)"
  # the plain arm's records; else (replay without a plain arm) the plain request each replay run made first
  base = statistics.median(r["stats"]["decode_tok_s"] for r in ps) if ps else statistics.median(own)
  x = statistics.median(r["stats"]["decode_tok_s"] for r in rs) / base
  return f"{x:.2f}x{'' if ps else ' (its plain requests)'} (model {model_x:.2f}x)"


def _table(records: list[dict], arms: list[Arm]) -> str:
  rows = ["| arm | ring | draft | kv | depth | experts | decode tok/s (median) | prefill tok/s | "
          "drafts accepted/proposed per seed | vs plain (bytes model) | expert hits prefill / decode |",
          "| --- | ---: | --- | --- | ---: | --- | ---: | ---: | --- | --- | ---: |"]
  for a in arms:
    rs = [r for r in records if r["arm"] == a.name]
    if not rs:
      continue
    med = statistics.median(r["stats"]["decode_tok_s"] for r in rs)
    pres = [r["stats"]["prefill_tok_s"] for r in rs if r["stats"].get("prefill_tok_s") is not None]
    pre = f"{statistics.median(pres):.0f}" if pres else "reused"
    drafts = " ".join(f"{sum(r['stats'].get('drafts_accepted', [0]))}/{sum(r['stats'].get('drafts_proposed', [0]))}"
                      for r in rs) if a.draft != "none" else "-"
    hits = {ph: [h for h in (_hit_rate(r["stats"], ph) for r in rs) if h is not None] for ph in ("prefill", "decode")}
    hit_cell = " / ".join(f"{statistics.median(hits[ph]):.1%}" for ph in hits if hits[ph]) or "-"
    slots = rs[0]["stats"].get("expert_slots")
    cache = "all" if slots is None else f"{a.cache}: {slots} slots"
    rows.append(f"| {a.name} | {a.ring} | {a.draft} | {a.kv} | {a.depth} | {cache} | {med:.1f} | {pre} | {drafts} | "
                f"{_speedups(records, arms, a)} | {hit_cell} |")
  return "\n".join(rows)


def _verdicts(records: list[dict], bars) -> list[str]:
  out = []
  by = {}
  for r in records:
    by.setdefault(r["arm"], []).append(r)
  for a, b, tol, what in bars:
    if a not in by or b not in by:
      continue
    if what == "decode tok/s":
      va = statistics.median(r["stats"]["decode_tok_s"] for r in by[a])
      vb = statistics.median(r["stats"]["decode_tok_s"] for r in by[b])
      rel = abs(vb - va) / va if va else float("inf")
      if tol is None:
        out.append(f"{b}/{a} decode tok/s = {vb / va if va else float('inf'):.3f} (deep cell: reported, no bar)")
      else:     # a gap no larger than an arm's own spread over its seeds is not a measured difference
        sa, sb = _spread(by[a]), _spread(by[b])
        note = f"; seeds' spread {a} {sa:.1%}, {b} {sb:.1%}" if max(len(by[a]), len(by[b])) > 1 else ""
        verdict = "PASS" if rel < tol else "INCONCLUSIVE (inside the seeds' spread)" if rel <= max(sa, sb) else "FAIL"
        out.append(f"|{b}-{a}|/{a} = {rel:.1%} (bar < {tol:.0%}{note}): {verdict}")
    else:
      out.append(_accepted_verdict(what, a, by[a], b, by[b]))
      text, same = _token_match(by[a], by[b])
      if _rings_hold(by[a] + by[b]):      # invariant 1: both rings hold the request, so the tokens must be equal
        out.append(f"generated tokens {a} vs {b} (bar: identical, both rings hold the request): {text}: "
                   f"{'PASS' if same else 'FAIL'}")
      else:
        out.append(f"generated tokens {a} vs {b} (reported: beyond the smaller ring's window): {text}")
  return out


def _accepted_verdict(what: str, a: str, ra: list[dict], b: str, rb: list[dict]) -> str:
  """The acceptance bar of a ring pair, seed by seed: the drafts accepted per position must be identical on every
  seed both arms ran (records without a seed pair in order). A seed only one arm ran (a call cut short) is named
  as unpaired, never counted as a difference."""
  key = lambda rs: {r.get("seed", i): r["stats"].get("drafts_accepted") for i, r in enumerate(rs)}  # noqa: E731
  sa, sb = key(ra), key(rb)
  both = [s for s in sa if s in sb]
  ca, cb = [sa[s] for s in both], [sb[s] for s in both]
  unpaired = [f"{n} seed {s}" for n, mine, other in ((a, sa, sb), (b, sb, sa)) for s in mine if s not in other]
  if not both:
    return f"{what} {a} vs {b} (bar: identical): no seed run by both ({', '.join(unpaired)})"
  verdict = "PASS" if ca == cb else "FAIL"
  note = f"; unpaired, not compared: {', '.join(unpaired)}" if unpaired else ""
  return f"{what} {a} {ca} vs {b} {cb} (bar: identical{note}): {verdict}"


def _spread(records: list[dict]) -> float:
  """An arm's decode tok/s over its seeds: (max - min) / median, 0 for one seed."""
  v = [r["stats"]["decode_tok_s"] for r in records]
  m = statistics.median(v)
  return (max(v) - min(v)) / m if len(v) > 1 and m else 0.0


def _rings_hold(records: list[dict]) -> bool:
  """Whether every record's ring holds its whole request (prompt, new tokens and the scratch slots), so that no
  position ever leaves for a host tier. False where a record lacks its config or has an auto ring."""
  from decode.engine import TIER_SCRATCH
  try:
    return all(r["config"]["depth"] + r["config"]["max_new_tokens"] + TIER_SCRATCH <= int(r["config"]["ring"])
               for r in records)
  except (KeyError, TypeError, ValueError):
    return False


def _token_match(ra: list[dict], rb: list[dict]) -> tuple[str, bool]:
  """Whether two arms generated the same tokens, seed by seed: ("seed s identical, ...", all identical), or the first
  position that differs. Within the smaller ring's window the invariants make them equal; deeper, the host tier's
  log-sum-exp merge sums in another order than the ring alone, and a near-tie may pick another token."""
  sb = {r.get("seed"): r["stats"].get("tokens") for r in rb}
  out = []
  for r in ra:
    ta, tb = r["stats"].get("tokens"), sb.get(r.get("seed"))
    if ta is None or tb is None:
      continue
    diff = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
    if diff is None and len(ta) != len(tb):
      diff = min(len(ta), len(tb))
    out.append(f"seed {r.get('seed')} " + ("identical" if diff is None else f"differ from token {diff} of {len(ta)}"))
  return ", ".join(out) or "not recorded", bool(out) and all(x.endswith("identical") for x in out)


def _plot(records, arms, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 4))
  groups = {}
  for a in arms:
    key = (a.ring, a.draft, a.kv, a.cache)
    rs = [r for r in records if r["arm"] == a.name]
    if rs:
      groups.setdefault(key, []).append((a.depth, statistics.median(r["stats"]["decode_tok_s"] for r in rs)))
  for (ring, draft, kv, cache), pts in groups.items():
    pts.sort()
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
            label=f"R={ring} {draft} {kv}" + ("" if cache == "all" else f" experts {cache}"))
  ax.set_xscale("log", base=2)
  ax.set_xlabel("depth (prompt tokens)")
  ax.set_ylabel("decode tok/s (median over seeds)")
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def report(paths: list[str]) -> str:
  """The table, verdicts and plot of records already written (--report): one record per timed run, kept where its
  arm is one of the flags' arms at that arm's depth; a later record of the same arm and seed replaces an earlier."""
  arms, bars = _arms()
  want = {(a.name, a.depth) for a in arms}
  kept = {}
  for p in paths:
    with open(p) as f:
      for n, line in enumerate(f, 1):
        try:
          r = json.loads(line)
        except json.JSONDecodeError as e:
          raise CLIError(f"{p}:{n}: not a JSON record ({e.msg})") from None
        if (r.get("arm"), r.get("config", {}).get("depth")) in want:
          kept[(r["arm"], r.get("seed"))] = r
  if not kept:
    raise CLIError(f"--report {','.join(paths)}: no record of the arms {sorted(n for n, _ in want)}")
  records = list(kept.values())
  caches = {r["arm"]: r.get("config", {}).get("cache") for r in records}   # the arms as run (the flags' default
  arms = [dataclasses.replace(a, cache=caches.get(a.name) or a.cache) for a in arms]   # cache is "all")
  runs = {(r.get("commit"), r.get("device")) for r in records}
  lines = [f"{len(records)} records from {len(paths)} files; commit/device: "
           + "; ".join(f"{c} on {d}" for c, d in sorted(runs, key=str)), "", _table(records, arms)]
  lines += _verdicts(records, bars)
  if FLAGS.plot:
    _plot(records, arms, FLAGS.plot)
    lines.append(f"plot: {FLAGS.plot}")
  return "\n".join(lines)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  if FLAGS.report:                                # a missing or broken record file: one line (the edge's catch)
    print(report(FLAGS.report))
    return
  from tqdm import tqdm

  from bench.glue import glue_options
  glue_options(FLAGS.glue)                        # a malformed --glue: one line before any model is built
  from configs.default import default_model_path
  from model.loader import load_model
  from ops.qtensor import with_kernels
  from decode.engine import TIER_SCRATCH
  from model.mesh import MeshError
  path, the_mesh = FLAGS.gguf, mesh()
  if the_mesh is not None and FLAGS.max_context:       # before the model loads
    tiered = [a.ring for a in _arms()[0] if a.ring != "auto" and FLAGS.max_context + TIER_SCRATCH > int(a.ring)]
    if tiered:
      raise CLIError(f"--max_context {FLAGS.max_context}: above ring {tiered[0]} less {TIER_SCRATCH} scratch slots "
                     f"(a host tier) under --mesh {FLAGS.mesh}, expected no host tier (not supported under a mesh "
                     f"yet)")
  if path is None and FLAGS.preset and FLAGS.in_memory:
    try:
      model = _in_memory_model(FLAGS.preset, FLAGS.experts, the_mesh)   # placed on the mesh tensor by tensor
    except MeshError as e:
      raise CLIError(f"--mesh: {e}") from None
    path = f"in-memory:{FLAGS.preset}:{FLAGS.experts}"
  elif path is None and FLAGS.preset:
    from configs import synth
    os.makedirs(FLAGS.synth_dir, exist_ok=True)
    path = os.path.join(FLAGS.synth_dir, f"{FLAGS.preset}-{FLAGS.experts}.gguf")
    if not os.path.isfile(path):
      try:
        synth.write(FLAGS.preset, path, experts=FLAGS.experts)
      except synth.SynthError as e:
        raise CLIError(f"--experts {FLAGS.experts}: {e}") from None
  if not path or not path.startswith("in-memory"):
    path = path or default_model_path()
    try:
      model = load_model(path, mesh=the_mesh)        # under a mesh: placed one tensor at a time as it loads
    except MeshError as e:
      raise CLIError(f"--mesh: {e}") from None
  model.params = with_kernels(model.params, FLAGS.kernels)
  from ops import attention_pallas, qgemm_pallas
  table_dots = attention_pallas.TUNING.get(model.cfg.head_dim, attention_pallas.DEFAULT_TUNING).dots
  arms, bars = _arms()
  os.makedirs(os.path.dirname(os.path.abspath(FLAGS.cells)), exist_ok=True)
  from bench.provenance import commit as _commit, device as _device
  commit, device = _commit(), _device()
  records = []
  from bench.prefill_cache import PrefillCache
  # one entry per distinct (ring, k) request of a seed's prompt: a plain and a drafted request per ring for seed4
  cache = PrefillCache(capacity=2 * len({(a.ring, a.kv) for a in arms})) if FLAGS.reuse_prefill else None
  seeds = range(FLAGS.first_seed, FLAGS.first_seed + FLAGS.seeds)
  runs = [(a, s) for s in seeds for a in arms] if cache is not None else [(a, s) for a in arms for s in seeds]
  log_dir = os.path.splitext(os.path.abspath(FLAGS.cells))[0] + ".logs"
  os.makedirs(log_dir, exist_ok=True)
  first_run, failed = {}, set()
  if FLAGS.compile_jobs > 1:
    t0 = time.time()
    for name, got in compile_all(model, arms, FLAGS.compile_jobs, cache).items():
      if isinstance(got, Exception):
        failed.add(name)
        tqdm.write(f"cell {name}: {str(got).splitlines()[0]}", file=sys.stderr)
      else:
        first_run[name] = got
        print(f"arm {name}: first (compiling) run {got:.1f} s", file=sys.stderr)
    print(f"compiling runs, {FLAGS.compile_jobs} at a time: {time.time() - t0:.1f} s", file=sys.stderr)
  with open(FLAGS.cells, "a") as out:
    for arm, seed in tqdm(runs, desc="cells", unit="run", file=sys.stderr):
      if arm.name in failed:
        continue
      log_path = os.path.join(log_dir, f"{arm.name.replace('@', '-k')}-s{seed}.log")    # '@': not a file name everywhere
      try:
        with cell_log(log_path):
          if arm.name not in first_run:
            t0 = time.time()
            CELL_LOG.info("arm %s: the compiling run (%d tokens, untimed)", arm.name, COMPILE_TOKENS)
            compile_run(model, arm, cache)
            first_run[arm.name] = time.time() - t0
            CELL_LOG.info("arm %s: first (compiling) run %.1f s", arm.name, first_run[arm.name])
            print(f"arm {arm.name}: first (compiling) run {first_run[arm.name]:.1f} s", file=sys.stderr)
          t0 = time.time()
          st = run_cell(model, arm, seed, FLAGS.max_new_tokens, cache)
          _log_result(arm, seed, st)
        rec = {"arm": arm.name, "config": dataclasses.asdict(arm) | {"max_new_tokens": FLAGS.max_new_tokens,
               "mtp_draft": FLAGS.mtp_draft, "mtp_window": FLAGS.mtp_window, "kernels": FLAGS.kernels,
               "prefill_chunk": FLAGS.prefill_chunk,
               "reuse_prefill": FLAGS.reuse_prefill, "compile_jobs": FLAGS.compile_jobs,
               "attn_kernel": FLAGS.attn_kernel or table_dots, "glue": FLAGS.glue,
               "prefill_gemm": qgemm_pallas.prefill_gemm(FLAGS.kernels, FLAGS.prefill_precision),
               "model": path, "arch": model.cfg.arch, "mesh": FLAGS.mesh}, "seed": seed, "commit": commit,
               "device": device,
               "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "wall_s": time.time() - t0,
               "first_run_s": first_run[arm.name], "log": log_path, "stats": st}
        records.append(rec)
        out.write(json.dumps(rec) + "\n")
        out.flush()
        if FLAGS.trace and seed == seeds[-1]:              # the arm's last timed run: trace one more request
          folder = os.path.join(FLAGS.trace, arm.name)
          with cell_log(log_path):
            st = profile_arm(model, arm, folder)
            CELL_LOG.info("arm %s: traced request in %s (prefill reused: %s)", arm.name, folder, st["prefill_reused"])
      except cli.expected_errors() as e:         # a refused request or plan fails its arm; the others still run
        failed.add(arm.name)
        with cell_log(log_path):
          CELL_LOG.error("cell %s: %s", arm.name, str(e).splitlines()[0])
        tqdm.write(f"cell {arm.name}: {str(e).splitlines()[0]}", file=sys.stderr)
  print(f"\n{path} ({model.cfg.arch}), device {device}, commit {commit}, {FLAGS.max_new_tokens} tokens, "
        f"{FLAGS.seeds} seeds\n")
  print(_table(records, arms))
  for v in _verdicts(records, bars):
    print(v)
  if len({a.depth for a in arms}) > 1 or FLAGS.plot:
    png = FLAGS.plot or os.path.splitext(FLAGS.cells)[0] + ".png"
    _plot(records, arms, png)
    print(f"plot: {png}")
  if failed:
    sys.exit(f"bench.cells: {len(failed)} of {len(arms)} arms failed ({', '.join(sorted(failed))}: their lines "
             f"above), the table has the rest")


if __name__ == "__main__":
  cli.run(main)
