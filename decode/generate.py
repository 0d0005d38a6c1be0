"""`python -m decode.generate`: generate text from a GGUF model.

  python -m decode.generate --prompt "def main" --max_new_tokens 32          # the embedded default model
  python -m decode.generate --gguf model.gguf --prompt "Hi" --temperature 0 --json

Prints the text and decode tok/s; with --json the last stdout line is one JSON object with prompt_ids, ids,
text and stats. Every flag is checked before any work (check_flags; the request's window and the memory plan
once the model is loaded); bad input (a broken GGUF, a prompt over max_context, a refused plan, ...) exits 1 with
a one-line error (decode.cli's one catch), while an unexpected exception keeps its traceback.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

from absl import flags, logging

from decode import cli
from decode.cli import CLIError

FLAGS = flags.FLAGS
flags.DEFINE_string("gguf", None, "GGUF model file (default: the embedded default model)")
flags.DEFINE_string("prompt", None, "prompt text")
flags.DEFINE_string("prompt_file", None, "read the prompt text from this file")
flags.DEFINE_integer("prompt_tokens", None, "use a synthetic prompt of N tokens (cycling through the vocabulary)")
flags.DEFINE_integer("max_new_tokens", 32, "tokens to generate")
flags.DEFINE_float("temperature", 0.0, "0 = greedy")
flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass")
flags.DEFINE_integer("seed", 0, "sampling seed")
flags.DEFINE_enum("kv", "bf16", ["f32", "bf16", "int8"], "K/V cache dtype")
flags.DEFINE_string("kv_resident", "auto", "main ring capacity R (tokens), or auto")
flags.DEFINE_integer("max_context", None, "longest prompt + generation accepted (default: the ring's capacity)")
flags.DEFINE_enum("kernels", "auto", ["auto", "pallas", "xla"],
                  "quantized kernels: Pallas (auto on GPU) or the XLA dequantize-then-dot reference (auto on CPU)")
flags.DEFINE_enum("mtp", "on", ["on", "off"], "MTP (NextN) drafting when the model has a NextN block")
flags.DEFINE_integer("mtp_draft", 3, "drafts per round (k)")
flags.DEFINE_integer("mtp_window", 4096, "the NextN drafter ring's sliding window (entries)")
flags.DEFINE_enum("draft", "auto", ["auto", "mtp", "lookup", "replay", "none"],
                  "drafter: auto = mtp when --mtp on and the model has NextN, else none; replay proposes the plain "
                  "greedy continuation (run first, untimed) to measure the mechanics at 100 % acceptance")
flags.DEFINE_integer("prefill_chunk", None, "prompt tokens per prefill call (default: 1,024 on a GPU, the remainder 8 a call; 2,048 on CPU)")
flags.DEFINE_enum("prefill_precision", "auto", ["auto", "f32", "bf16"],
                  "the prefill GEMMs' operands: f32 (float32-accurate), bf16 (one MMA, ~2e-3 per dot; finer than "
                  "llama.cpp's 8-bit x), auto: bf16 on a GPU, f32 elsewhere (ops.qgemm_pallas.GEMM_FORMS)")
flags.DEFINE_bool("plan", False, "print the memory plan (kv_plan) before generating")
flags.DEFINE_string("device_budget", None, "refuse plans over this many bytes of device memory (e.g. 24GiB)")
flags.DEFINE_string("expert_cache", "all", "all (every expert resident), auto (device slots sized from the memory "
                    "plan) or N slots over a store in host memory")
flags.DEFINE_enum("expert_policy", "lru", ["lru", "lfu"], "expert cache eviction policy")
flags.DEFINE_string("cache_dir", None, "orbax cache of loaded params (a second load skips GGUF parsing)")
flags.DEFINE_bool("json", False, "print one JSON object as the last stdout line")
flags.DEFINE_bool("eager", False, "run the decode loop eagerly (debugging)")
flags.DEFINE_string("mesh", None, "split the model over this host's devices: ep=N[,tp=M] (routed experts split by "
                    "expert id over N devices; K/V rings and attention split by head over M where the heads divide; "
                    "the rest replicated); default: one device")


def check_flags() -> str | None:
  """Every flag that needs no model, checked before any work: a CLIError (or PlanError for --device_budget) naming
  the first bad one. Returns the prompt text (None with --prompt_tokens)."""
  from decode.engine import TIER_SCRATCH
  from decode.kv_plan import parse_bytes
  given = [n for n in ("prompt", "prompt_file", "prompt_tokens") if getattr(FLAGS, n) is not None]
  if len(given) > 1:
    raise CLIError(f"flags: give one of --prompt, --prompt_file, --prompt_tokens (got {', '.join(given)})")
  cli.check("max_new_tokens", FLAGS.max_new_tokens, FLAGS.max_new_tokens >= 0, "an integer >= 0")
  cli.number_in("temperature", FLAGS.temperature, 0.0)
  cli.number_in("top_p", FLAGS.top_p, 0.0, 1.0, lo_open=True)
  if FLAGS.kv_resident != "auto":
    cli.positive_int("kv_resident", FLAGS.kv_resident, "auto")
  if FLAGS.max_context is not None:
    cli.check("max_context", FLAGS.max_context, FLAGS.max_context >= 1, "a positive integer")
  max_k = TIER_SCRATCH - 1                          # a round's k + 1 verify rows fit the ring's scratch slots
  cli.check("mtp_draft", FLAGS.mtp_draft, 1 <= FLAGS.mtp_draft <= max_k,
            f"1 to {max_k} drafts per round (k + 1 verify rows fit the ring's {TIER_SCRATCH} scratch slots)")
  cli.check("mtp_window", FLAGS.mtp_window, FLAGS.mtp_window >= 1, "a positive number of drafter ring entries")
  if FLAGS.prefill_chunk is not None:
    cli.check("prefill_chunk", FLAGS.prefill_chunk, FLAGS.prefill_chunk >= 1, "at least 1 token per call")
  if FLAGS.expert_cache not in ("all", "auto"):
    cli.positive_int("expert_cache", FLAGS.expert_cache, "all or auto")
  if FLAGS.device_budget is not None:
    parse_bytes(FLAGS.device_budget)
  if FLAGS.draft == "mtp" and FLAGS.mtp == "off":
    raise CLIError("--draft mtp contradicts --mtp off")
  if FLAGS.cache_dir is not None and os.path.exists(FLAGS.cache_dir) and not os.path.isdir(FLAGS.cache_dir):
    raise CLIError(f"--cache_dir {FLAGS.cache_dir}: is a file, expected a directory")
  if mesh_spec().size > 1 and FLAGS.expert_cache != "all":
    raise CLIError(f"--mesh {FLAGS.mesh} with --expert_cache {FLAGS.expert_cache}: expert slots under a mesh are not "
                   f"supported, expected --expert_cache all")
  if mesh_spec().size > 1 and FLAGS.kv_resident != "auto" and FLAGS.max_context is not None:
    cli.check("max_context", FLAGS.max_context, FLAGS.max_context + TIER_SCRATCH <= int(FLAGS.kv_resident),
              f"at most --kv_resident {FLAGS.kv_resident} less {TIER_SCRATCH} scratch slots under --mesh (a host "
              f"tier under a mesh is not supported yet)")
  if FLAGS.prompt_tokens is not None:
    cli.check("prompt_tokens", FLAGS.prompt_tokens, FLAGS.prompt_tokens >= 1, "a positive number")
    return None
  if FLAGS.prompt_file is not None:
    return cli.read_utf8("prompt_file", FLAGS.prompt_file)
  return cli.utf8_text("prompt", FLAGS.prompt) if FLAGS.prompt is not None else "The"


def mesh_spec():
  """--mesh parsed against this host's devices (model.mesh.parse_mesh); a CLIError naming the flag otherwise."""
  import jax

  from model.mesh import MeshError, parse_mesh
  try:
    return parse_mesh(FLAGS.mesh, len(jax.devices()))
  except MeshError as e:
    raise CLIError(f"--mesh: {e}") from None


def _prompt_ids(tok, text: str | None) -> list[int]:
  if text is None:                                  # --prompt_tokens N
    base = tok.encode("The quick brown fox jumps over the lazy dog. ", add_bos=False) or [0]
    return [base[i % len(base)] for i in range(FLAGS.prompt_tokens)]
  return tok.encode(text)


def run() -> dict:
  """The request the flags describe; failures raise (main's one catch, decode.cli, reports the expected ones)."""
  from decode.engine import GenConfig, generate
  from model.options import Options
  from configs.default import default_model_path
  from model.loader import load_model
  from ops.qtensor import with_kernels
  text = check_flags()
  path = FLAGS.gguf or default_model_path()
  # an expert cache (auto or N slots) loads the routed experts straight into the store's memory (pinned host on
  # a GPU): device memory never holds them all, so the plan's free memory is real
  store = None
  if FLAGS.expert_cache != "all":
    from model.expert_cache import store_memory_kind
    store = store_memory_kind()
  from model.mesh import MeshError, make_mesh
  mesh = make_mesh(mesh_spec())
  try:
    model = load_model(path, FLAGS.cache_dir, expert_store=store, mesh=mesh)
  except MeshError as e:
    raise CLIError(f"--mesh: {e}") from None
  model.params = with_kernels(model.params, _kernels())
  ids = _prompt_ids(model.tokenizer, text)
  kvr = None if FLAGS.kv_resident == "auto" else int(FLAGS.kv_resident)
  gen = GenConfig(max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature, top_p=FLAGS.top_p,
                  seed=FLAGS.seed, kv=FLAGS.kv, kv_resident=kvr, max_context=FLAGS.max_context,
                  prefill_chunk=FLAGS.prefill_chunk,
                  options=Options(prefill_precision=FLAGS.prefill_precision, mesh=mesh))
  drafter = _drafter(model.cfg)
  _check_window(gen, len(ids), FLAGS.mtp_draft if drafter != "none" else 0)
  plan, slots = _plan(model, gen, len(ids), drafter)
  if slots is not None:
    gen = dataclasses.replace(gen, expert_slots=slots, expert_policy=FLAGS.expert_policy)
  elif store not in (None, "device"):             # auto found that every expert fits: back to the device
    from model.expert_cache import place_store
    model.params = place_store(model.params, model.cfg, "device")
  if FLAGS.plan:
    print(plan.table(), file=sys.stderr if FLAGS.json else sys.stdout)
  if drafter == "none":
    res = generate(model, ids, gen, eager=FLAGS.eager)
  else:
    from decode.speculative import speculative_generate
    replay = generate(model, ids, gen).ids if drafter == "replay" else None
    res = speculative_generate(model, ids, gen, drafter=drafter, k=FLAGS.mtp_draft, mtp_window=FLAGS.mtp_window,
                               replay_ids=replay, eager=FLAGS.eager)
  res.stats["plan"] = plan.to_json()
  from ops import qgemm_pallas
  res.stats["prefill_gemm"] = qgemm_pallas.prefill_gemm(_kernels(), gen.options.prefill_precision)
  res.stats.update(model=path, arch=model.cfg.arch, load_s=model.load_s, from_cache=model.from_cache)
  print(res.text)
  print(f"[{len(res.ids)} tokens, decode {res.stats['decode_tok_s']:.1f} tok/s, TTFT {res.stats['ttft_s'] * 1e3:.0f} ms]",
        file=sys.stderr if FLAGS.json else sys.stdout)
  out = {"prompt_ids": res.prompt_ids, "ids": res.ids, "text": res.text, "stats": res.stats}
  if FLAGS.json:
    print(json.dumps(out))
  return out


def _check_window(gen, n_prompt: int, k: int) -> None:
  """On a fixed ring without --max_context the request must fit the ring's window (its capacity less k + 1
  scratch slots with k drafts): a CLIError naming --kv_resident otherwise."""
  if gen.kv_resident is None or gen.max_context:
    return
  slack = k + 1 if k else 0
  window, need = gen.kv_resident - slack, n_prompt + gen.max_new_tokens
  if need > window:
    less = f" less {slack} scratch slots for {k} drafts" if slack else ""
    raise CLIError(f"--kv_resident {gen.kv_resident}: the ring's window is {window} tokens ({gen.kv_resident} "
                   f"slots{less}), expected at least prompt {n_prompt} + max_new_tokens {gen.max_new_tokens} = "
                   f"{need} (or give --max_context for a host tier)")


def _kernels() -> str:
  import jax
  if FLAGS.kernels == "auto":
    return "xla" if jax.default_backend() == "cpu" else "pallas"
  if FLAGS.kernels == "pallas" and jax.default_backend() == "cpu":
    return "interpret"           # the same kernels through Pallas' interpreter (slow; for checking)
  return FLAGS.kernels


def _drafter(cfg) -> str:
  d = FLAGS.draft
  if d == "auto":
    return "mtp" if FLAGS.mtp == "on" and cfg.n_nextn else "none"
  return d


def _plan(model, gen, n_prompt: int, drafter: str):
  """The request's memory plan (refused over budget) and the expert-cache slots it gives."""
  from decode.engine import prefill_chunk, ring_capacity
  from decode.kv_plan import GiB, PlanError, check_host_memory, device_budget, plan_request
  k = FLAGS.mtp_draft if drafter != "none" else 0
  ring = ring_capacity(n_prompt + gen.max_new_tokens + (k + 1 if k else 0), gen.kv_resident)
  kw = dict(kv=gen.kv, max_context=gen.max_context, mtp_window=FLAGS.mtp_window if drafter == "mtp" else None, k=k,
            expert_cache=FLAGS.expert_cache, budget=device_budget(FLAGS.device_budget),
            prefill_chunk=min(prefill_chunk(gen), n_prompt),
            fixed_ring=gen.kv_resident is not None, tunings=gen.options.tunings)
  plan, slots = plan_request(model, ring=ring, **kw)
  import jax
  if plan.budget is None and jax.default_backend() == "cpu":   # no device budget: the host's memory holds every item
    check_host_memory(plan)
  if FLAGS.plan and plan.budget is not None:
    out = sys.stderr if FLAGS.json else sys.stdout
    name = lambda n: "all experts" if n is None else f"{n} expert slots"  # noqa: E731
    changes = [(f"ring +16K ({ring} -> {ring + 16384})", dict(kw, ring=ring + 16384))]
    if kw["mtp_window"]:
      w = kw["mtp_window"]
      changes.append((f"MTP window x2 ({w} -> {2 * w})", dict(kw, ring=ring, mtp_window=2 * w)))
    moves = []
    for what, kw2 in changes:       # what a change of ring or drafter window moves (the seed's plan line)
      try:
        p2, s2 = plan_request(model, **kw2)
        moves.append(f"{what}: {plan.free / GiB:.2f} -> {p2.free / GiB:.2f} GiB free, {name(slots)} -> {name(s2)}")
      except PlanError as e:
        moves.append(f"{what}: does not fit ({e})")
    print(f"plan: {plan.free / GiB:.2f} GiB free, {name(slots)}; " + "; ".join(moves), file=out)
  return plan, slots


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  run()


if __name__ == "__main__":
  cli.run(main)
