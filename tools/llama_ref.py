"""llama.cpp (through llama-cpp-python, CPU) as the reference engine: logits and greedy tokens on a GGUF file, and
llama.cpp's own quantizer. Shared by the tests and the training script (tools/train_default.py)."""
from __future__ import annotations

import ctypes
import functools

import numpy as np


@functools.lru_cache(maxsize=4)
def _llm(path: str, n_ctx: int):
  """A llama.cpp context on `path` with the CPU's extra buffer types (weight repacking, AMX) off: with them,
  llama.cpp 0.3.36's build segfaults in decode on quantized tiny models on this AVX-512/AMX CPU."""
  import llama_cpp
  import llama_cpp.llama as ll
  orig = ll.llama_cpp.llama_model_default_params

  def no_extra_bufts():
    p = orig()
    p.use_extra_bufts = False
    return p

  ll.llama_cpp.llama_model_default_params = no_extra_bufts
  try:
    return llama_cpp.Llama(model_path=path, logits_all=True, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=2,
                           verbose=False, seed=0)
  finally:
    ll.llama_cpp.llama_model_default_params = orig


def logits(path: str, tokens: list[int], n_ctx: int = 256) -> np.ndarray:
  """llama.cpp's logits [T, V] (float32) for `tokens` from position 0 (no BOS added)."""
  llm = _llm(path, n_ctx)
  llm.reset()
  llm.eval(list(tokens))
  return np.array(llm.scores[: len(tokens)], dtype=np.float32)


def greedy(path: str, prompt: list[int], n: int, n_ctx: int = 256) -> list[int]:
  """n greedy tokens after `prompt` (argmax of llama.cpp's logits, one token at a time)."""
  llm = _llm(path, n_ctx)
  llm.reset()
  llm.eval(list(prompt))
  out = []
  for _ in range(n):
    tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    out.append(tok)
    llm.eval([tok])
  return out


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def quantize(src: str, dst: str, mix: str) -> None:
  """llama.cpp's own quantizer (`llama_model_quantize`), no importance matrix."""
  import llama_cpp
  p = llama_cpp.llama_model_quantize_default_params()
  p.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{mix}")
  p.nthread = 2
  rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(p))
  if rc != 0:
    raise RuntimeError(f"llama_model_quantize({src} -> {mix}) returned {rc}")


def tensor_types(path: str) -> dict[str, str]:
  import gguf
  return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
