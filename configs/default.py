"""The embedded default model: `configs/data/default.gguf` (card: `configs/data/default.md`), the file the CLIs,
the quickstart and the tests use when no `--gguf` is given."""
from __future__ import annotations

import os

from configs.presets import TINY_GLM4MOE
from configs.vocab import load_vocab
from model.writer import write_gguf

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def default_model_path() -> str:
  """configs/data/default.gguf when shipped, else a tiny random glm4moe+NextN file our writer makes once (under
  ~/.cache/moejax)."""
  here = os.path.join(DATA, "default.gguf")
  if os.path.isfile(here):
    return here
  out = os.path.join(os.path.expanduser("~"), ".cache", "moejax", "tiny-glm4moe-f16.gguf")
  if not os.path.isfile(out):
    os.makedirs(os.path.dirname(out), exist_ok=True)
    write_gguf(out + ".tmp", TINY_GLM4MOE, seed=0, name="tiny-glm4moe (random weights)", vocab=load_vocab(1024))
    os.replace(out + ".tmp", out)
  return out
