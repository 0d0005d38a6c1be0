"""Test model files: tiny random GGUFs written by our writer, and llama.cpp-quantized mixes of them.

Files are made once per session into a shared temp folder (and reused across sessions on the same machine
through MOEJAX_TEST_MODELS, when set).
"""
from __future__ import annotations

import os
import tempfile

from configs.presets import TINY_GLM4MOE, TINY_QWEN2MOE, TINY_QWEN3MOE, TINY_QWEN3NEXT, TINY_QWEN35MOE
from configs.vocab import load_vocab
from model.writer import float_policy, write_gguf
from tools.llama_ref import quantize, tensor_types  # noqa: F401  (re-exported for the tests)

CFGS = {"qwen3moe": TINY_QWEN3MOE, "glm4moe": TINY_GLM4MOE, "qwen2moe": TINY_QWEN2MOE,
        "qwen3next": TINY_QWEN3NEXT, "qwen35moe": TINY_QWEN35MOE}
# llama.cpp's quantizer mixes (what `llama-quantize` writes for these file types).
MIXES = ("Q8_0", "Q4_K_M", "Q6_K", "IQ3_S")

def _code_hash() -> str:
  """Files are keyed by the code that writes them, so a changed writer never reuses stale files."""
  import hashlib
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  h = hashlib.sha256()
  for rel in ("model/writer.py", "configs/presets.py", "configs/vocab.py", "configs/data/vocab_1024.json"):
    with open(os.path.join(here, rel), "rb") as f:
      h.update(f.read())
  return h.hexdigest()[:10]


_ROOT = os.environ.get("MOEJAX_TEST_MODELS") or os.path.join(
    tempfile.gettempdir(), f"moejax-test-models-{os.getuid()}-{_code_hash()}")


def model_path(arch: str, kind: str) -> str:
  """Path of the tiny `arch` file of `kind` ("F32", "F16" or a mix in MIXES); written on first use."""
  os.makedirs(_ROOT, exist_ok=True)
  path = os.path.join(_ROOT, f"tiny-{arch}-{kind}.gguf")
  if os.path.isfile(path):
    return path
  tmp = path + f".{os.getpid()}.tmp"
  if kind in ("F32", "F16"):
    write_gguf(tmp, CFGS[arch], load_vocab(1024), types=float_policy(kind), seed=1234, name=f"tiny-{arch}")
  else:
    quantize(model_path(arch, "F32"), tmp, kind)
  os.replace(tmp, path)
  return path
