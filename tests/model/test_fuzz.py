"""Fuzz the loader (issue 28): a seeded loop of 240 cases mutates the tiny test files' header, metadata values and
structure, tensor table and float / quantized data at random, and each load must either give finite logits on a
short prompt or stop in one line: a GGUFError naming the file, or the decode loops' finite check refusing the
logits (decode.engine.check_finite, what generate runs on the prefill's logits). Never a traceback (any other
exception fails the test with its own), a case past CASE_BOUND_S seconds, or non-finite logits that nothing reports.

Mutations write bytes at offsets found once per base file (gguf-py's reader over the original), so a case costs a
copy, a load and, when it loads, one prefill; the prefill compiles once per distinct ModelConfig, and a mutated
context_length (informative, read by no computation) runs under the base file's value so that it reuses that
compile. About 60 s on 2 CPU cores.
"""
from __future__ import annotations

import collections
import os
import signal
import time

import gguf
import numpy as np
import pytest

from decode import engine
from model.gguf_io import GGUFError
from model.loader import load_model
from tests.models import model_path

SEED = 28
N_CASES = 240
CASE_BOUND_S = 60
BASES = (("qwen3moe", "Q8_0"), ("glm4moe", "Q4_K_M"), ("qwen3next", "Q8_0"), ("qwen35moe", "F16"))
PROMPT = [11, 222, 333, 44, 5]
GEN = engine.GenConfig(max_new_tokens=1, kv="f32", stop_at_eos=False)
KINDS = ("header", "meta_value", "meta_struct", "tensor_info", "float_data", "quant_data", "header_bytes")
WEIGHTS = (1, 4, 2, 4, 4, 3, 2)

_NP = {gguf.GGUFValueType.UINT8: np.uint8, gguf.GGUFValueType.INT8: np.int8, gguf.GGUFValueType.UINT16: np.uint16,
       gguf.GGUFValueType.INT16: np.int16, gguf.GGUFValueType.UINT32: np.uint32, gguf.GGUFValueType.INT32: np.int32,
       gguf.GGUFValueType.FLOAT32: np.float32, gguf.GGUFValueType.UINT64: np.uint64,
       gguf.GGUFValueType.INT64: np.int64, gguf.GGUFValueType.FLOAT64: np.float64, gguf.GGUFValueType.BOOL: np.uint8}


class Base:
  """A tiny test file's bytes and the offsets a mutation writes at."""

  def __init__(self, arch: str, kind: str):
    self.path = model_path(arch, kind)
    with open(self.path, "rb") as f:
      self.blob = f.read()
    r = gguf.GGUFReader(self.path)
    at = lambda a: int(a.__array_interface__["data"][0] - r.data.__array_interface__["data"][0])  # noqa: E731
    self.data_start = r.data_offset
    self.values = []                    # (offset, numpy dtype, count) of each scalar or numeric array value
    self.structs = []                   # (offset, numpy dtype) of key lengths, value types, array counts
    for name, f in r.fields.items():
      if name.startswith("GGUF."):
        continue
      vt = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else f.types[0]
      self.structs += [(at(f.parts[0]), np.uint64), (at(f.parts[2]), np.uint32)]
      if f.types[0] == gguf.GGUFValueType.ARRAY:
        self.structs.append((at(f.parts[4]), np.uint64))
      if vt in _NP:
        self.values += [(at(f.parts[i]), _NP[vt], 1) for i in f.data[:64]]
      elif vt == gguf.GGUFValueType.STRING:
        self.values += [(at(f.parts[i]), np.uint8, len(f.parts[i])) for i in f.data[:64] if len(f.parts[i])]
    self.tensors = []                   # (name, {part: (offset, dtype)}, type name, data offset, n_bytes)
    for t in r.tensors:
      p = t.field.parts
      parts = {"name": (at(p[1]), np.uint8), "n_dims": (at(p[2]), np.uint32), "type": (at(p[4]), np.uint32),
               "offset": (at(p[5]), np.uint64)}
      parts.update({f"dim{j}": (at(p[3]) + 8 * j, np.uint64) for j in range(len(p[3]))})
      self.tensors.append((t.name, parts, t.tensor_type.name, t.data_offset, t.n_bytes))
    self.floats = [t for t in self.tensors if t[2] in ("F32", "F16")]
    self.quants = [t for t in self.tensors if t[2] not in ("F32", "F16", "BF16")]
    self.cfg = load_model(self.path).cfg


def _pick(rng, options: list):
  return options[int(rng.integers(len(options)))]


def _hostile(rng, dtype):
  if np.issubdtype(dtype, np.floating):
    return _pick(rng, [np.nan, np.inf, -np.inf, 0.0, -1.0, 1e-45, 3e38, float(rng.normal() * 1e4)])
  info = np.iinfo(dtype)
  return _pick(rng, [0, 1, int(info.max), int(info.min), int(info.max) // 2 + 1, int(rng.integers(0, 1 << 20))])


def _put(blob: bytearray, off: int, dtype, value) -> None:
  blob[off:off + np.dtype(dtype).itemsize] = np.array(value).astype(dtype).tobytes()


def mutate(base: Base, kind: str, rng) -> tuple[bytearray, str]:
  """A mutated copy of the base's bytes and a description of the mutation."""
  b = bytearray(base.blob)
  if kind == "quant_data" and not base.quants:      # a float file: its big matrices take the float mutations
    kind = "float_data"
  if kind == "header":                               # magic, version, tensor and key counts
    off = int(rng.integers(0, 24))
    b[off] ^= 1 << int(rng.integers(0, 8))
    return b, f"header byte {off} bit flip"
  if kind == "meta_value":
    off, dtype, n = base.values[int(rng.integers(len(base.values)))]
    if dtype == np.uint8 and n > 1:                  # string bytes
      i = off + int(rng.integers(n))
      b[i] = int(rng.integers(256))
      return b, f"string byte at {i}"
    v = _hostile(rng, dtype)
    _put(b, off, dtype, v)
    return b, f"value at {off} ({np.dtype(dtype).name}) = {v}"
  if kind == "meta_struct":
    off, dtype = base.structs[int(rng.integers(len(base.structs)))]
    v = _hostile(rng, dtype)
    _put(b, off, dtype, v)
    return b, f"field structure at {off} = {v}"
  if kind == "tensor_info":
    name, parts, *_ = base.tensors[int(rng.integers(len(base.tensors)))]
    part = list(parts)[int(rng.integers(len(parts)))]
    off, dtype = parts[part]
    old = int(np.frombuffer(bytes(b[off:off + np.dtype(dtype).itemsize]), dtype)[0])
    if part == "name":
      b[off] = int(rng.integers(32, 127))
      return b, f"tensor {name}: name byte"
    if part == "offset":
      v = max(0, old + _pick(rng, [-64, -32, -2, 1, 2, 32, 4096, 1 << 40]))
    elif part == "type":
      v = int(rng.integers(0, 42))
    else:
      v = _pick(rng, [0, 1, old + 1, old * 2, max(1, old // 2), 5, 1 << 40])
    _put(b, off, dtype, v)
    return b, f"tensor {name}: {part} {old} -> {v}"
  if kind == "float_data":
    name, _, qtype, off, nb = base.floats[int(rng.integers(len(base.floats)))]
    dt = np.float32 if qtype == "F32" else np.float16
    n = nb // np.dtype(dt).itemsize
    vals = []
    for _ in range(int(rng.integers(1, 4))):
      i = int(rng.integers(n))
      v = _pick(rng, [np.nan, np.inf, -np.inf, 65504.0, -65504.0, float(rng.normal() * 100)])
      _put(b, off + i * np.dtype(dt).itemsize, dt, v)
      vals.append(f"[{i}]={v}")
    return b, f"tensor {name} ({qtype}) {' '.join(vals)}"
  if kind == "quant_data":
    name, _, qtype, off, nb = base.quants[int(rng.integers(len(base.quants)))]
    bs, ts = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    blk = int(rng.integers(nb // ts))
    if rng.random() < 0.6:                           # an f16 scale: first bytes of Q8_0 / IQ / Q4_K blocks, last of Q6_K
      at = off + blk * ts + (ts - 2 if qtype == "Q6_K" else 0)
      v = _pick(rng, [np.nan, np.inf, -np.inf, 65504.0])
      _put(b, at, np.float16, v)
      return b, f"tensor {name} ({qtype}) block {blk} scale = {v}"
    at = off + blk * ts + int(rng.integers(ts))
    b[at] = int(rng.integers(256))
    return b, f"tensor {name} ({qtype}) block {blk} byte"
  off = int(rng.integers(24, base.data_start))     # header_bytes: anywhere in metadata or tensor table
  b[off] ^= 1 << int(rng.integers(0, 8))
  return b, f"header byte {off} bit flip"


class _Timeout(Exception):
  pass


def _alarm(signum, frame):
  raise _Timeout()


def run_case(path: str, base: Base) -> str:
  """"refused" (one line), "finite" (finite logits) or "stopped" (the finite check refused the logits); an
  AssertionError when a rule is broken."""
  try:
    m = load_model(path)
  except GGUFError as e:
    msg = str(e)
    assert "\n" not in msg and msg.startswith(path + ": "), msg
    return "refused"
  if m.cfg.replace(context_length=base.cfg.context_length) == base.cfg:
    m.cfg = base.cfg                                 # context_length is informative: the base's compile serves
  st = engine.start_request(m, PROMPT, GEN)
  logits = np.asarray(st.logits)
  if np.isfinite(logits).all():
    return "finite"
  with pytest.raises(engine.NonFiniteError) as e:
    engine.check_finite(st.logits[-1], 0, len(PROMPT))
  assert "\n" not in str(e.value)
  return "stopped"


def test_fuzzed_files_load_finite_or_stop_in_one_line(tmp_path):
  rng = np.random.default_rng(SEED)
  bases = [Base(*b) for b in BASES]
  path = str(tmp_path / "case.gguf")
  seen = collections.Counter()
  old = signal.signal(signal.SIGALRM, _alarm)
  t_all = time.perf_counter()
  try:
    for i in range(N_CASES):
      base = bases[i % len(bases)]
      kind = KINDS[int(rng.choice(len(KINDS), p=np.asarray(WEIGHTS) / sum(WEIGHTS)))]
      blob, what = mutate(base, kind, rng)
      with open(path, "wb") as f:
        f.write(blob)
      signal.alarm(CASE_BOUND_S)
      try:
        got = run_case(path, base)
      except _Timeout:
        pytest.fail(f"case {i} ({os.path.basename(base.path)}: {what}) ran past {CASE_BOUND_S} s")
      except Exception as e:  # noqa: BLE001 - re-raised with the case named, so the traceback shows the bug
        raise AssertionError(f"case {i} ({os.path.basename(base.path)}: {what}): {type(e).__name__}") from e
      finally:
        signal.alarm(0)
      seen[(kind, got)] += 1
  finally:
    signal.signal(signal.SIGALRM, old)
  print(f"{N_CASES} cases in {time.perf_counter() - t_all:.0f} s: {dict(sorted(seen.items()))}")
  outcomes = collections.Counter(g for (_, g), n in seen.items() for _ in range(n))
  assert outcomes["refused"] >= N_CASES // 4 and outcomes["finite"] >= N_CASES // 10, outcomes
