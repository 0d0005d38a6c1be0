"""`python -m decode.generate`: generate text from a GGUF model.

  python -m decode.generate --prompt "def main" --max_new_tokens 32          # the embedded default model
  python -m decode.generate --gguf model.gguf --prompt "Hi" --temperature 0 --json

Prints the text and decode tok/s; with --json the last stdout line is one JSON object with prompt_ids, ids,
text and stats. Bad input (a broken GGUF, a prompt over max_context, ...) exits 1 with a one-line error.
"""
from __future__ import annotations

import json
import sys

from absl import app, flags, logging

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
flags.DEFINE_enum("kernels", "xla", ["pallas", "xla"], "quantized kernels: Pallas on GPU or the XLA reference")
flags.DEFINE_string("cache_dir", None, "orbax cache of loaded params (a second load skips GGUF parsing)")
flags.DEFINE_bool("json", False, "print one JSON object as the last stdout line")
flags.DEFINE_bool("eager", False, "run the decode loop eagerly (debugging)")


class CLIError(Exception):
  pass


def _prompt_ids(tok) -> list[int]:
  given = [n for n in ("prompt", "prompt_file", "prompt_tokens") if getattr(FLAGS, n) is not None]
  if len(given) > 1:
    raise CLIError(f"flags: give one of --prompt, --prompt_file, --prompt_tokens (got {', '.join(given)})")
  if FLAGS.prompt_tokens is not None:
    n = FLAGS.prompt_tokens
    if n <= 0:
      raise CLIError(f"--prompt_tokens: {n}, expected a positive number")
    base = tok.encode("The quick brown fox jumps over the lazy dog. ", add_bos=False) or [0]
    return [base[i % len(base)] for i in range(n)]
  if FLAGS.prompt_file is not None:
    try:
      with open(FLAGS.prompt_file, encoding="utf-8") as f:
        text = f.read()
    except OSError as e:
      raise CLIError(f"--prompt_file {FLAGS.prompt_file}: {e.strerror}") from None
  else:
    text = FLAGS.prompt if FLAGS.prompt is not None else "The"
  return tok.encode(text)


def run() -> dict:
  from decode.engine import GenConfig, RequestError, generate
  from model.gguf_io import GGUFError
  from model.loader import default_model_path, load_model
  try:
    path = FLAGS.gguf or default_model_path()
    model = load_model(path, FLAGS.cache_dir)
    ids = _prompt_ids(model.tokenizer)
    kvr = None if FLAGS.kv_resident == "auto" else _int_flag("kv_resident", FLAGS.kv_resident)
    gen = GenConfig(max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature, top_p=FLAGS.top_p,
                    seed=FLAGS.seed, kv=FLAGS.kv, kv_resident=kvr, max_context=FLAGS.max_context)
    res = generate(model, ids, gen, eager=FLAGS.eager)
  except (GGUFError, RequestError, CLIError, ValueError) as e:
    print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
    sys.exit(1)
  res.stats.update(model=path, arch=model.cfg.arch, load_s=model.load_s, from_cache=model.from_cache)
  print(res.text)
  print(f"[{len(res.ids)} tokens, decode {res.stats['decode_tok_s']:.1f} tok/s, TTFT {res.stats['ttft_s'] * 1e3:.0f} ms]",
        file=sys.stderr if FLAGS.json else sys.stdout)
  out = {"prompt_ids": res.prompt_ids, "ids": res.ids, "text": res.text, "stats": res.stats}
  if FLAGS.json:
    print(json.dumps(out))
  return out


def _int_flag(name: str, v: str) -> int:
  try:
    n = int(v)
  except ValueError:
    raise CLIError(f"--{name}: {v!r}, expected an integer or auto") from None
  if n <= 0:
    raise CLIError(f"--{name}: {n}, expected a positive integer")
  return n


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  run()


if __name__ == "__main__":
  app.run(main)
