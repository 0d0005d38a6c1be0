"""`python -m configs.synth`: write a full-size synthetic GGUF of a preset's shape.

Every quantized tensor is random *valid* blocks written directly as bytes (finite, small scales), so a 30B-shape
file needs no real weights and no quantizer:

  python -m configs.synth --preset qwen3moe-30b-a3b --experts IQ3_S --out /tmp/q3.gguf
  python -m configs.synth --preset seed-mtp --experts IQ3_S --other Q8_0 --out /tmp/seed.gguf

A bad type or an unwritable --out exits 1 with one line (the one catch in `main`; configs/ does not import
decode/, so it is not decode.cli's); any other exception keeps its traceback.
"""
from __future__ import annotations

import os
import sys

from absl import app, flags

from configs.presets import PRESETS, preset

FLAGS = flags.FLAGS
flags.DEFINE_enum("preset", "qwen3moe-30b-a3b", list(PRESETS), "model shape")
flags.DEFINE_string("experts", "IQ3_S", "GGUF type of the routed experts")
flags.DEFINE_string("other", "Q8_0", "GGUF type of the other matrices (router and 1-D tensors stay F32)")
flags.DEFINE_string("out", None, "output path", required=True)
flags.DEFINE_integer("seed", 0, "random seed")
flags.DEFINE_float("block_scale", 1e-3, "size of the f16 scale fields of the random blocks")


class SynthError(ValueError):
  """A synth request refused (one line)."""


def write(name: str, out: str, experts: str = "IQ3_S", other: str = "Q8_0", seed: int = 0, block_scale: float = 1e-3,
          progress: bool = True) -> str:
  from configs.vocab import load_vocab
  from model.writer import quant_policy, write_gguf
  from ops.quant import GGML_TYPES
  for t in (experts, other):
    if t not in GGML_TYPES:
      raise SynthError(f"synth: type {t!r} is not one of {', '.join(GGML_TYPES)}")
  tmp = out + ".tmp"
  write_gguf(tmp, preset(name), load_vocab(1024), types=quant_policy(experts, other), seed=seed, progress=progress,
             block_scale=block_scale, name=f"synthetic {name} ({experts} experts)")
  os.replace(tmp, out)
  return out


def main(argv):
  del argv
  try:
    path = write(FLAGS.preset, FLAGS.out, FLAGS.experts, FLAGS.other, FLAGS.seed, FLAGS.block_scale)
  except (SynthError, OSError) as e:
    print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
    sys.exit(1)
  print(f"{path}: {os.path.getsize(path) / 2**30:.2f} GiB")


if __name__ == "__main__":
  app.run(main)
