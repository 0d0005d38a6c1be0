"""GGUF reading and validation: metadata -> `ModelConfig`, tensors -> the params pytree.

Quantized tensors stay packed (`QTensor` over the file's bytes); no full-precision copy of an expert is made.
Every problem with a file is a `GGUFError` whose message is one line naming the file, the key or tensor,
and what was expected.
"""
from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from model.config import ARCHS, HYBRID_ARCHS, ModelConfig

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "IQ3_S", "IQ4_NL", "IQ4_XS")


class GGUFError(ValueError):
  """A GGUF file we cannot use; the message is one line."""


_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}   # GGUF value type -> bytes
_STRING, _ARRAY = 8, 9


MAX_LAYERS = 512          # llama.cpp 0.3.36 LLAMA_MAX_LAYERS: block_count in [1, 512]
MAX_EXPERTS = 1024        # llama.cpp 0.3.36 LLAMA_MAX_EXPERTS
MAX_NAME = 64             # ggml's GGML_MAX_NAME: a tensor name is shorter
MAX_DIMS = 4              # ggml's GGML_MAX_DIMS
_TYPE_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32", 7: "bool",
               8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64"}


def check_layout(path: str) -> int:
  """Walk the header (without gguf-py) and check it as llama.cpp 0.3.36's gguf.cpp does; return the data section's
  start (the header's length, padded to the alignment).

  Checked: version 2 or 3; counts that fit the bytes left; non-empty, unique keys of known value types;
  `general.alignment` a uint32 power of two; per tensor a name shorter than 64 bytes and unique, at most 4
  dimensions, an element count below 2^63, rows a multiple of its type's block size, an offset that is a multiple
  of the alignment, bytes inside the file and overlapping no other tensor's. gguf-py fails on short files with
  whatever numpy error the first bad view raises, and takes misaligned or overlapping tensors as they are; this
  names the problem.
  """
  import struct

  import gguf
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    buf = f.read(min(size, 64 << 20))
  pos = 0

  def truncated(need: int) -> GGUFError:
    what = "header" if len(buf) == size else "header (over 64 MiB)"
    return GGUFError(f"{path}: truncated GGUF ({size} bytes): the {what} ends at byte {len(buf)}, needed {need}")

  def take(n: int) -> bytes:
    nonlocal pos
    if pos + n > len(buf):
      raise truncated(pos + n)
    b = buf[pos:pos + n]
    pos += n
    return b

  u32 = lambda: struct.unpack("<I", take(4))[0]  # noqa: E731
  u64 = lambda: struct.unpack("<Q", take(8))[0]  # noqa: E731

  def need(count: int, each: int) -> None:        # count items of at least `each` bytes must fit what is left
    if count * each > len(buf) - pos:
      raise truncated(pos + count * each)

  def text(what: str) -> str:                      # a key or tensor name: UTF-8, as gguf-py reads it
    raw = take(u64())
    try:
      return raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise GGUFError(f"{path}: corrupt GGUF: {what} {raw[:40]!r} is not valid UTF-8 (byte {e.start})") from None

  def skip_value(vt: int) -> None:
    if vt == _STRING:
      take(u64())
    elif vt == _ARRAY:
      sub, n = u32(), u64()
      if sub in _SCALAR:
        need(n, _SCALAR[sub])
        take(_SCALAR[sub] * n)
      elif sub in (_STRING, _ARRAY):
        need(n, 8 if sub == _STRING else 12)
        for _ in range(n):
          skip_value(sub)
      else:
        raise GGUFError(f"{path}: corrupt GGUF: unknown metadata array element type {sub}")
    elif vt in _SCALAR:
      take(_SCALAR[vt])
    else:
      raise GGUFError(f"{path}: corrupt GGUF: unknown metadata value type {vt}")

  take(4)
  version = u32()
  if version not in (2, 3):
    raise GGUFError(f"{path}: GGUF version {version}, expected 2 or 3")
  n_tensors, n_kv = u64(), u64()
  need(n_kv, 8 + 4 + 1)                            # a key (length, >= 1 byte) and its value type
  alignment = 32
  keys: set[str] = set()
  for i in range(n_kv):
    key = text(f"metadata key {i}")
    if not key:
      raise GGUFError(f"{path}: corrupt GGUF: metadata key {i} is empty")
    if key in keys:
      raise GGUFError(f"{path}: corrupt GGUF: duplicate metadata key '{key}'")
    keys.add(key)
    vt = u32()
    if key == "general.alignment":
      if vt != 4:
        raise GGUFError(f"{path}: key 'general.alignment' is of type {_TYPE_NAMES.get(vt, vt)}, expected uint32")
      alignment = u32()
      if alignment == 0 or alignment & (alignment - 1):
        raise GGUFError(f"{path}: key 'general.alignment' is {alignment}, expected a power of two")
    else:
      skip_value(vt)
  need(n_tensors, 8 + 4 + 4 + 8)                   # name length, n_dims, type, offset
  infos = []
  names: set[str] = set()
  for i in range(n_tensors):
    name = text(f"the name of tensor {i}")
    if len(name.encode("utf-8")) >= MAX_NAME:
      raise GGUFError(f"{path}: tensor name '{name[:80]}' is {len(name)} bytes long, expected fewer than {MAX_NAME}")
    if name in names:
      raise GGUFError(f"{path}: corrupt GGUF: duplicate tensor name '{name}'")
    names.add(name)
    nd = u32()
    if nd > MAX_DIMS:
      raise GGUFError(f"{path}: tensor '{name}' has {nd} dimensions, expected at most {MAX_DIMS}")
    dims = [u64() for _ in range(nd)]
    tid, off = u32(), u64()
    try:
      qt = gguf.GGMLQuantizationType(tid)
    except ValueError:
      raise GGUFError(f"{path}: tensor '{name}' has unknown type id {tid}; supported: {', '.join(SUPPORTED_TYPES)}") from None
    bs, ts = gguf.GGML_QUANT_SIZES[qt]
    n = 1
    for d in dims:
      n *= d
    if n >= 1 << 63:
      raise GGUFError(f"{path}: tensor '{name}' has shape {dims}: {n} elements, expected fewer than 2^63")
    if dims and dims[0] % bs:
      raise GGUFError(f"{path}: tensor '{name}' of type {qt.name} has {dims[0]} elements per row, expected a "
                      f"multiple of its block size {bs}")
    if off % alignment:
      raise GGUFError(f"{path}: tensor '{name}' has offset {off}, expected a multiple of general.alignment "
                      f"{alignment}")
    infos.append((name, off, n // bs * ts))
  start = (pos + alignment - 1) // alignment * alignment
  for name, off, nbytes in infos:
    if start + off + nbytes > size:
      raise GGUFError(f"{path}: truncated GGUF ({size} bytes): tensor '{name}' needs bytes up to {start + off + nbytes}")
  by_off = sorted(infos, key=lambda t: (t[1], t[2]))
  for (a, off_a, nb_a), (b, off_b, _) in zip(by_off, by_off[1:]):
    if off_a + nb_a > off_b:
      raise GGUFError(f"{path}: tensor '{a}' (data bytes {off_a}..{off_a + nb_a}) overlaps tensor '{b}' (from "
                      f"{off_b}), expected each tensor's bytes apart")
  return start


def open_checked(path: str):
  """`path` opened for reading (binary), or a GGUFError naming why not: missing, a directory, unreadable."""
  if os.path.isdir(path):
    raise GGUFError(f"{path}: is a directory, expected a GGUF file")
  if not os.path.exists(path):
    raise GGUFError(f"{path}: no such file")
  try:
    return open(path, "rb")
  except OSError as e:
    raise GGUFError(f"{path}: cannot read the file ({e.strerror or type(e).__name__})") from None


def identity(path: str, data_start: int) -> dict:
  """What identifies a file's contents cheaply: its size, mtime and the SHA-256 of its first `data_start` bytes
  (the header and the tensor table)."""
  import hashlib
  st = os.stat(path)
  with open_checked(path) as f:
    head = f.read(data_start)
  return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "data_start": data_start,
          "header_sha256": hashlib.sha256(head).hexdigest()}


class GGUFFile:
  """Metadata (`md`: key -> python value) and tensors (`tensors`: name -> gguf ReaderTensor) of one file;
  `data_start`: where its data section starts (check_layout)."""

  def __init__(self, path: str | os.PathLike):
    import gguf  # gguf-py: parses the container; we validate what it returns
    self.path = str(path)
    with open_checked(self.path) as f:
      magic = f.read(4)
    if magic != b"GGUF":
      raise GGUFError(f"{self.path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    size = os.path.getsize(self.path)
    self.data_start = check_layout(self.path)
    try:
      r = gguf.GGUFReader(self.path)
    except Exception as e:  # gguf-py raises ValueError / IndexError / struct errors on short or bad files
      msg = str(e).splitlines()[0] if str(e) else type(e).__name__
      if "reshape" in msg or "exceeds remaining" in msg or isinstance(e, (IndexError, EOFError)):
        raise GGUFError(f"{self.path}: truncated GGUF ({size} bytes): {msg}") from None
      if "GGMLQuantizationType" in msg:
        raise GGUFError(f"{self.path}: unsupported tensor type ({msg}); supported: {', '.join(SUPPORTED_TYPES)}") from None
      raise GGUFError(f"{self.path}: corrupt GGUF: {msg}") from None
    self.md: dict[str, Any] = {}
    for name, field in r.fields.items():
      if name.startswith("GGUF."):
        continue
      try:
        self.md[name] = field.contents()
      except UnicodeDecodeError as e:
        raise GGUFError(f"{self.path}: key '{name}' holds a string that is not valid UTF-8 ({e.reason} at byte "
                        f"{e.start})") from None
    self.tensors = {t.name: t for t in r.tensors}
    for t in r.tensors:
      if t.data_offset + t.n_bytes > size:
        raise GGUFError(f"{self.path}: truncated GGUF ({size} bytes): tensor '{t.name}' needs bytes up to "
                        f"{t.data_offset + t.n_bytes}")

  # -- metadata ---------------------------------------------------------------------------------------
  def get(self, key: str, default: Any = None) -> Any:
    return self.md.get(key, default)

  def require(self, key: str, kind: type | tuple = (int, float)) -> Any:
    if key not in self.md:
      raise GGUFError(f"{self.path}: missing required key '{key}'")
    v = self.md[key]
    if isinstance(v, list) and kind is not list:
      v = v[0] if v else None  # per-layer arrays (e.g. expert_feed_forward_length): layers share one value here
    if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
      raise GGUFError(f"{self.path}: key '{key}' is {v!r}, expected {getattr(kind, '__name__', kind)}")
    return v

  # -- tensors ----------------------------------------------------------------------------------------
  def has(self, name: str) -> bool:
    return name in self.tensors

  def tensor(self, name: str, shape: tuple[int, ...]):
    """The tensor as (qtype name, numpy view), checked against the expected numpy shape."""
    if name not in self.tensors:
      raise GGUFError(f"{self.path}: missing tensor '{name}' (expected shape {list(shape)})")
    t = self.tensors[name]
    qtype = t.tensor_type.name
    got = tuple(int(d) for d in reversed(t.shape.tolist()))
    if got != tuple(shape):
      raise GGUFError(f"{self.path}: tensor '{name}' has shape {list(got)}, expected {list(shape)}")
    if qtype not in SUPPORTED_TYPES:
      raise GGUFError(f"{self.path}: tensor '{name}' has unsupported type {qtype}; supported: {', '.join(SUPPORTED_TYPES)}")
    return qtype, t.data


def _range(lo: int, hi: int | None) -> str:
  return f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi}]"


def _int_key(f: GGUFFile, key: str, default: int | None = None, lo: int = 1, hi: int | None = None,
             why: str = "") -> int:
  """Int key `key` (required when `default` is None), checked to lie in [lo, hi]; `why` says where hi comes from."""
  v = f.require(key, int) if default is None or key in f.md else default
  if v < lo or hi is not None and v > hi:
    got = f"is {v}" if key in f.md else f"is absent (default {v})"
    raise GGUFError(f"{f.path}: key '{key}' {got}, expected {_range(lo, hi)}{f' ({why})' if why else ''}")
  return v


def _positive_key(f: GGUFFile, key: str, default: float | None = None, kind: type | tuple = (int, float)) -> float:
  """A number key (required when `default` is None), checked to be finite and > 0."""
  v = f.require(key, kind) if default is None or key in f.md else default
  if not math.isfinite(v) or v <= 0:
    raise GGUFError(f"{f.path}: key '{key}' is {v}, expected a finite number > 0")
  return float(v)


def _bool_key(f: GGUFFile, key: str, default: bool) -> bool:
  v = f.get(key, default)
  if not isinstance(v, (bool, int)) or v not in (0, 1):
    raise GGUFError(f"{f.path}: key '{key}' is {v!r}, expected a bool")
  return bool(v)


def _heads(f: GGUFFile, k, n_heads: int, n_kv: int) -> None:
  if n_heads % n_kv:
    raise GGUFError(f"{f.path}: key '{k('attention.head_count')}' / '{k('attention.head_count_kv')}' are "
                    f"{n_heads} / {n_kv}, expected head_count a multiple of head_count_kv")


def _rope_dim(f: GGUFFile, k, head_dim: int) -> int:
  rope_dim = _int_key(f, k("rope.dimension_count"), head_dim, lo=2, hi=head_dim, why="attention.key_length")
  if rope_dim % 2:
    raise GGUFError(f"{f.path}: key '{k('rope.dimension_count')}' is {rope_dim}, expected an even number")
  return rope_dim


def _config(f: GGUFFile, **kw) -> ModelConfig:
  """ModelConfig(**kw); its own checks (which the keys' checks above should make unreachable) as a GGUFError."""
  try:
    return ModelConfig(**kw)
  except ValueError as e:
    raise GGUFError(f"{f.path}: {str(e).splitlines()[0]}") from None


def read_config(f: GGUFFile) -> ModelConfig:
  """ModelConfig from metadata (and, for optional features, from which tensors exist).

  Every key is checked as llama.cpp 0.3.36 checks it, before any per-layer work: block_count in [1, 512],
  nextn_predict_layers below it, head counts >= 1 with head_count a multiple of head_count_kv, expert_count in
  [1, 1024] and expert_used_count in [1, expert_count], widths >= 1, RMS epsilon and RoPE base finite and > 0,
  rope.dimension_count even and at most the head dim."""
  arch = f.get("general.architecture")
  if arch is None:
    raise GGUFError(f"{f.path}: missing required key 'general.architecture'")
  if arch not in ARCHS:
    raise GGUFError(f"{f.path}: unsupported arch '{arch}' (general.architecture); supported: {', '.join(ARCHS)}")
  if arch in HYBRID_ARCHS:
    return _read_hybrid_config(f, arch)
  k = lambda s: f"{arch}.{s}"  # noqa: E731
  n_blocks = _int_key(f, k("block_count"), hi=MAX_LAYERS, why="llama.cpp's LLAMA_MAX_LAYERS")
  n_nextn = _int_key(f, k("nextn_predict_layers"), 0, lo=0, hi=n_blocks - 1, why=f"below block_count {n_blocks}")
  n_layers = n_blocks - n_nextn
  d_model = _int_key(f, k("embedding_length"))
  n_heads = _int_key(f, k("attention.head_count"))
  n_kv = _int_key(f, k("attention.head_count_kv"), hi=n_heads, why="attention.head_count")
  _heads(f, k, n_heads, n_kv)
  head_dim = _int_key(f, k("attention.key_length"), d_model // n_heads)
  rope_dim = _rope_dim(f, k, head_dim)
  vocab = _vocab_size(f)
  n_experts = _int_key(f, k("expert_count"), hi=MAX_EXPERTS, why="llama.cpp's LLAMA_MAX_EXPERTS")
  top_k = _int_key(f, k("expert_used_count"), hi=n_experts, why=f"expert_count {n_experts}")
  d_ff_exp = _int_key(f, k("expert_feed_forward_length"))
  kw: dict[str, Any] = {}
  if arch == "glm4moe":
    gating = _int_key(f, k("expert_gating_func"), 2, lo=0) or 2
    if gating != 2:
      raise GGUFError(f"{f.path}: key '{k('expert_gating_func')}' is {gating}, expected 2 (sigmoid)")
    n_shared = _int_key(f, k("expert_shared_count"), 0, lo=0)
    kw.update(routing="sigmoid", norm_topk=_bool_key(f, k("expert_weights_norm"), False),
              routed_scale=_positive_key(f, k("expert_weights_scale"), 1.0),
              n_dense_lead=_int_key(f, k("leading_dense_block_count"), 0, lo=0, hi=n_layers,
                                    why=f"trunk blocks {n_layers}"),
              n_shared_experts=n_shared, d_ff_shared=d_ff_exp * n_shared)
  elif arch == "qwen3moe":
    kw.update(routing="softmax", norm_topk=True)
  else:  # qwen2moe
    has_sh = "blk.0.ffn_gate_inp_shexp.weight" in f.tensors
    kw.update(routing="softmax", norm_topk=False, shared_expert_gate=has_sh, n_shared_experts=int(has_sh),
              d_ff_shared=_int_key(f, k("expert_shared_feed_forward_length"), 0, lo=int(has_sh)))
  if kw.get("n_dense_lead"):
    kw["d_ff"] = _int_key(f, k("feed_forward_length"))
  return _config(
      f, arch=arch, vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
      head_dim=head_dim, rope_dim=rope_dim, rope_theta=_positive_key(f, k("rope.freq_base"), 10000.0),
      rms_eps=_positive_key(f, k("attention.layer_norm_rms_epsilon"), kind=float),
      n_experts=n_experts, top_k=top_k, d_ff_expert=d_ff_exp, n_nextn=n_nextn,
      qk_norm="blk.0.attn_q_norm.weight" in f.tensors, qkv_bias="blk.0.attn_q.bias" in f.tensors,
      tied_embeddings="output.weight" not in f.tensors, context_length=_int_key(f, k("context_length"), 4096),
      **kw)


def _vocab_size(f: GGUFFile) -> int:
  if "token_embd.weight" not in f.tensors:
    raise GGUFError(f"{f.path}: missing tensor 'token_embd.weight'")
  shape = f.tensors["token_embd.weight"].shape
  if len(shape) != 2 or not shape[1]:
    raise GGUFError(f"{f.path}: tensor 'token_embd.weight' has GGUF shape {shape.tolist()}, expected [embedding_length, "
                    f"vocab] with vocab >= 1")
  vocab = int(shape[1])
  toks = f.get("tokenizer.ggml.tokens")
  if toks is not None and len(toks) != vocab:
    raise GGUFError(f"{f.path}: key 'tokenizer.ggml.tokens' has {len(toks)} entries, expected {vocab} (token_embd rows)")
  return vocab


def _int_list(f: GGUFFile, key: str, n: int, what: str) -> list[int]:
  """A key llama.cpp reads with get_key_or_arr: one value for all n entries, or an array of exactly n."""
  v = f.md.get(key)
  if isinstance(v, list):
    if len(v) != n:
      raise GGUFError(f"{f.path}: key '{key}' has {len(v)} entries, expected {n} ({what})")
    vals = v
  else:
    vals = [v] * n
  if not all(isinstance(x, int) for x in vals):
    raise GGUFError(f"{f.path}: key '{key}' is {v!r}, expected int or an array of int")
  return [int(x) for x in vals]


def _read_hybrid_config(f: GGUFFile, arch: str) -> ModelConfig:
  """qwen3next / qwen35moe as llama.cpp 0.3.36 reads them (src/models/{qwen3next,qwen35moe}.cpp
  load_arch_hparams, llama-model.cpp load_hparams)."""
  k = lambda s: f"{arch}.{s}"  # noqa: E731
  n_blocks = _int_key(f, k("block_count"), hi=MAX_LAYERS, why="llama.cpp's LLAMA_MAX_LAYERS")
  n_nextn = _int_key(f, k("nextn_predict_layers"), 0, lo=0, hi=n_blocks - 1, why=f"below block_count {n_blocks}")
  n_layers = n_blocks - n_nextn
  d_model = _int_key(f, k("embedding_length"))
  rkey = k("attention.recurrent_layers")
  if rkey in f.md:
    arr = f.md[rkey]
    if not isinstance(arr, list) or len(arr) != n_blocks or not all(isinstance(x, (bool, int)) for x in arr):
      raise GGUFError(f"{f.path}: key '{rkey}' is {arr!r}, expected an array of {n_blocks} bools (block_count)")
    if any(arr[n_layers:]):
      raise GGUFError(f"{f.path}: key '{rkey}' marks a NextN block recurrent, expected false for blocks >= {n_layers}")
    recurrent = tuple(bool(x) for x in arr[:n_layers])
  else:
    interval = f.get(k("full_attention_interval"), 4)      # llama.cpp's default: 4
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
      raise GGUFError(f"{f.path}: key '{k('full_attention_interval')}' is {interval!r}, expected an int >= 1")
    recurrent = tuple((i + 1) % interval != 0 for i in range(n_layers))
  attn = [i for i in range(n_layers) if not recurrent[i]] + list(range(n_layers, n_blocks))
  if not attn:
    raise GGUFError(f"{f.path}: every block is recurrent ('{rkey}'): no attention layer to read head counts from")
  if k("attention.head_count") not in f.md:
    raise GGUFError(f"{f.path}: missing required key '{k('attention.head_count')}'")
  heads = _int_list(f, k("attention.head_count"), n_blocks, "block_count")
  kvh = (_int_list(f, k("attention.head_count_kv"), n_blocks, "block_count") if k("attention.head_count_kv") in f.md
         else heads)
  n_heads, n_kv = heads[attn[0]], kvh[attn[0]]
  for i in attn:
    if (heads[i], kvh[i]) != (n_heads, n_kv):
      raise GGUFError(f"{f.path}: attention block {i} has {heads[i]}/{kvh[i]} heads, expected the same "
                      f"{n_heads}/{n_kv} in every attention block")
  for key, v in ((k("attention.head_count"), n_heads), (k("attention.head_count_kv"), n_kv)):
    if v < 1:
      raise GGUFError(f"{f.path}: key '{key}' is {v} for attention block {attn[0]}, expected an int >= 1")
  _heads(f, k, n_heads, n_kv)
  head_dim = _int_key(f, k("attention.key_length"), d_model // n_heads)
  head_dim_v = _int_key(f, k("attention.value_length"), d_model // n_heads)
  if head_dim_v != head_dim:
    raise GGUFError(f"{f.path}: key '{k('attention.value_length')}' is {head_dim_v}, expected key_length {head_dim}")
  rope_dim = _rope_dim(f, k, head_dim)
  vocab = _vocab_size(f)
  n_experts = _int_key(f, k("expert_count"), hi=MAX_EXPERTS, why="llama.cpp's LLAMA_MAX_EXPERTS")
  top_k = _int_key(f, k("expert_used_count"), hi=n_experts, why=f"expert_count {n_experts}")
  n_ff = _int_list(f, k("feed_forward_length"), n_blocks, "block_count")[0] if k("feed_forward_length") in f.md else 0
  d_ff_exp = _int_key(f, k("expert_feed_forward_length"), 0, lo=0)
  d_ff_exp = d_ff_exp or n_ff // top_k                # llama.cpp: n_ff_exp, else n_ff / n_expert_used
  d_ff_sh = _int_key(f, k("expert_shared_feed_forward_length"), 0, lo=0) or n_ff   # llama.cpp: n_ff_shexp, else n_ff
  for key, v in (("expert_feed_forward_length", d_ff_exp), ("expert_shared_feed_forward_length", d_ff_sh)):
    if v <= 0:
      raise GGUFError(f"{f.path}: missing required key '{k(key)}' (nor a '{k('feed_forward_length')}' to derive it "
                      f"from)")
  ssm = {}
  for name, key in (("ssm_conv_kernel", "conv_kernel"), ("ssm_inner", "inner_size"), ("ssm_state", "state_size"),
                    ("ssm_dt_rank", "time_step_rank"), ("ssm_groups", "group_count")):
    ssm[name] = f.require(k(f"ssm.{key}"), int)
    if ssm[name] <= 0:
      raise GGUFError(f"{f.path}: key '{k('ssm.' + key)}' is {ssm[name]}, expected > 0")
  if ssm["ssm_inner"] != ssm["ssm_dt_rank"] * ssm["ssm_state"]:
    raise GGUFError(f"{f.path}: key '{k('ssm.inner_size')}' is {ssm['ssm_inner']}, expected time_step_rank x "
                    f"state_size = {ssm['ssm_dt_rank'] * ssm['ssm_state']} (llama.cpp: value head dim == key head dim)")
  if ssm["ssm_dt_rank"] % ssm["ssm_groups"]:
    raise GGUFError(f"{f.path}: key '{k('ssm.time_step_rank')}' is {ssm['ssm_dt_rank']}, expected a multiple of "
                    f"ssm.group_count {ssm['ssm_groups']}")
  for i in attn:                # llama.cpp would also take a fused attn_qkv or q/k/v biases here: refuse, not ignore
    for n in ("attn_qkv.weight", "attn_qkv.bias", "attn_q.bias", "attn_k.bias", "attn_v.bias"):
      if f.has(f"blk.{i}.{n}"):
        raise GGUFError(f"{f.path}: tensor 'blk.{i}.{n}' in attention block {i} is not supported, expected separate "
                        f"attn_q / attn_k / attn_v weights without biases")
  kw: dict[str, Any] = {}
  if arch == "qwen35moe":                             # required (get_key_or_arr(..., 4, true)): M-RoPE sections
    skey = k("rope.dimension_sections")
    if skey not in f.md:
      raise GGUFError(f"{f.path}: missing required key '{skey}'")
    sec = _int_list(f, skey, 4, "M-RoPE sections")
    if min(sec) < 0 or not any(sec[:3]) or sum(sec) > rope_dim:
      raise GGUFError(f"{f.path}: key '{skey}' is {sec}, expected counts >= 0, one of the first three > 0 and a sum "
                      f"<= rope.dimension_count {rope_dim}")
    kw.update(rope_mode="imrope", rope_sections=tuple(sec))
  return _config(
      f, arch=arch, vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
      head_dim=head_dim, rope_dim=rope_dim, rope_theta=_positive_key(f, k("rope.freq_base"), 10000.0),
      rms_eps=_positive_key(f, k("attention.layer_norm_rms_epsilon"), kind=float), n_experts=n_experts, top_k=top_k,
      d_ff_expert=d_ff_exp, n_shared_experts=1, d_ff_shared=d_ff_sh, shared_expert_gate=True,
      routing="softmax", norm_topk=True, qk_norm=True, n_nextn=n_nextn,
      tied_embeddings="output.weight" not in f.tensors, context_length=_int_key(f, k("context_length"), 4096),
      recurrent=recurrent, attn_output_gate=True, **ssm, **kw)


def _ffn_map(c: ModelConfig, i: int) -> dict[tuple[str, ...], tuple[str, tuple[int, ...]]]:
  D, b = c.d_model, f"blk.{i}."
  m: dict[tuple[str, ...], tuple[str, tuple[int, ...]]] = {}
  if c.is_moe_layer(i):
    E, F = c.n_experts, c.d_ff_expert
    m.update({("ffn", "router"): (b + "ffn_gate_inp.weight", (E, D)),
              ("ffn", "gate_exps"): (b + "ffn_gate_exps.weight", (E, F, D)),
              ("ffn", "up_exps"): (b + "ffn_up_exps.weight", (E, F, D)),
              ("ffn", "down_exps"): (b + "ffn_down_exps.weight", (E, D, F))})
    if c.routing == "sigmoid":
      m[("ffn", "router_bias")] = (b + "exp_probs_b.bias", (E,))
    if c.n_shared_experts or c.shared_expert_gate:
      Fs = c.d_ff_shared
      m.update({("ffn", "gate_shexp"): (b + "ffn_gate_shexp.weight", (Fs, D)),
                ("ffn", "up_shexp"): (b + "ffn_up_shexp.weight", (Fs, D)),
                ("ffn", "down_shexp"): (b + "ffn_down_shexp.weight", (D, Fs))})
    if c.shared_expert_gate:
      m[("ffn", "shexp_gate")] = (b + "ffn_gate_inp_shexp.weight", (D,))
  else:
    m.update({("ffn", "gate"): (b + "ffn_gate.weight", (c.d_ff, D)), ("ffn", "up"): (b + "ffn_up.weight", (c.d_ff, D)),
              ("ffn", "down"): (b + "ffn_down.weight", (D, c.d_ff))})
  return m


def _gdn_map(c: ModelConfig, i: int, f=None) -> dict[tuple[str, ...], tuple[str, tuple[int, ...]]]:
  """A Gated DeltaNet layer's mixer tensors (llama.cpp 0.3.36 create_tensor shapes, numpy order)."""
  D, Hv, Dv, b = c.d_model, c.Hv, c.Dv, f"blk.{i}."
  m: dict[tuple[str, ...], tuple[str, tuple[int, ...]]] = {}
  if c.arch == "qwen3next" and f is not None and not f.has(b + "attn_qkv.weight") and f.has(b + "ssm_in.weight"):
    m[("gdn", "w_in")] = (b + "ssm_in.weight", (c.Cc + Hv * Dv, D))        # legacy: split by load_params
  else:
    m[("gdn", "wqkv")] = (b + "attn_qkv.weight", (c.Cc, D))
    m[("gdn", "wz")] = (b + "attn_gate.weight", (Hv * Dv, D))
  m.update({("gdn", "conv"): (b + "ssm_conv1d.weight", (c.Cc, c.Kc)),
            ("gdn", "dt_bias"): (b + "ssm_dt.bias", (Hv,)),
            ("gdn", "a"): (b + "ssm_a", (Hv,))})
  if c.arch == "qwen3next":
    m[("gdn", "wba")] = (b + "ssm_ba.weight", (2 * Hv, D))                  # split by load_params
  else:
    m[("gdn", "wbeta")] = (b + "ssm_beta.weight", (Hv, D))
    m[("gdn", "walpha")] = (b + "ssm_alpha.weight", (Hv, D))
  m.update({("gdn", "norm"): (b + "ssm_norm.weight", (Dv,)), ("gdn", "wo"): (b + "ssm_out.weight", (D, Hv * Dv))})
  return m


def _block_map(c: ModelConfig, i: int, f=None) -> dict[tuple[str, ...], tuple[str, tuple[int, ...]]]:
  """Param path (inside the block) -> (GGUF tensor name, numpy shape) for block i."""
  D, Hq, Hkv, Dh = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim
  b = f"blk.{i}."
  post_norm = c.arch == "glm4moe" or c.is_hybrid
  m = {("attn_norm",): (b + "attn_norm.weight", (D,)),
       ("ffn_norm",): (b + ("post_attention_norm.weight" if post_norm else "ffn_norm.weight"), (D,))}
  if c.is_recurrent(i):
    m.update(_gdn_map(c, i, f))
  else:
    nq = 2 if c.attn_output_gate else 1                 # gated: per head [query | gate], split by load_params
    m.update({
        ("attn", "wqg" if c.attn_output_gate else "wq"): (b + "attn_q.weight", (nq * Hq * Dh, D)),
        ("attn", "wk"): (b + "attn_k.weight", (Hkv * Dh, D)),
        ("attn", "wv"): (b + "attn_v.weight", (Hkv * Dh, D)),
        ("attn", "wo"): (b + "attn_output.weight", (D, Hq * Dh)),
    })
    if c.qkv_bias:
      m.update({("attn", "bq"): (b + "attn_q.bias", (Hq * Dh,)), ("attn", "bk"): (b + "attn_k.bias", (Hkv * Dh,)),
                ("attn", "bv"): (b + "attn_v.bias", (Hkv * Dh,))})
    if c.qk_norm:
      m.update({("attn", "q_norm"): (b + "attn_q_norm.weight", (Dh,)), ("attn", "k_norm"): (b + "attn_k_norm.weight", (Dh,))})
  m.update(_ffn_map(c, i))
  return m


def tensor_map(c: ModelConfig, f: GGUFFile | None = None) -> dict[tuple[str, ...], tuple[str, tuple[int, ...]]]:
  """Every param path -> (GGUF name, numpy shape). Optional NextN tensors are included when `f` has them.

  The params tree (`load_params`; numpy shapes [out, in]: y = x @ w.T; letters as docs/SHAPES.md):
    token_embd [V, D], output_norm [D], output [V, D] (absent when tied: the head is token_embd)
    blk_{i} (trunk block i < n_layers), mtp_{j}/blk (NextN block j, GGUF block n_layers + j):
      attn_norm [D]; ffn_norm [D] (ffn_norm.weight, or post_attention_norm.weight for glm4moe and the hybrid archs)
      attention block: attn/wq [H Dh, D], wk, wv [Hkv Dh, D], wo [D, H Dh], optional bq / bk / bv,
        q_norm / k_norm [Dh]; with attn_output_gate (hybrid) also attn/wgate [H Dh, D]: the file's attn_q is
        [H, 2, Dh] rows (per head its Dh query rows, then its Dh gate rows), split at load into wq and wgate; the
        layer's output is attention [T, H Dh] * sigmoid(x @ wgate.T) before wo
      Gated DeltaNet block (ModelConfig.is_recurrent(i)): attn_norm, ffn_norm and
        gdn/wqkv [Cc, D]   attn_qkv: rows q [Hk Dk] | k [Hk Dk] | v [Hv Dv], head-major (head h at h Dk / h Dv)
        gdn/wz [Hv Dv, D]  attn_gate: z, the gate of the output norm (value head h at rows h Dv)
        gdn/wbeta, gdn/walpha [Hv, D]  value-head rows: beta = sigmoid(x @ wbeta.T), alpha = x @ walpha.T
                           (qwen35moe: ssm_beta / ssm_alpha; qwen3next: ssm_ba [Hk, 2, Hv / Hk] rows, per key head
                           its Hv / Hk beta rows then its alpha rows, split at load; value head h = g (Hv / Hk) + j)
        gdn/conv [Cc, Kc]  ssm_conv1d (F32 in llama.cpp's files): out[t, c] = sum_k x[t - Kc + 1 + k, c] conv[c, k]
        gdn/dt_bias [Hv]   ssm_dt.bias; gdn/a [Hv] ssm_a = -exp(A_log): log-decay g = softplus(alpha + dt_bias) * a
        gdn/norm [Dv]      ssm_norm: RMSNorm over each value head, times silu(z)
        gdn/wo [D, Hv Dv]  ssm_out
        (legacy qwen3next files with ssm_in [Hk, 2 Dk + 2 (Hv / Hk) Dv] rows, per key head q | k | v | z, load into
        the same gdn/wqkv and gdn/wz)
      ffn (MoE blocks): router [E, D], gate_exps / up_exps [E, F, D], down_exps [E, D, F], router_bias [E]
        (glm4moe), gate_shexp / up_shexp [Fs, D], down_shexp [D, Fs], shexp_gate [D] (qwen2moe, hybrid: the
        shared expert's output times sigmoid(x . shexp_gate)); dense blocks: ffn/gate, up [Fd, D], down [D, Fd]
    mtp_{j}: enorm, hnorm [D], eh_proj [D, 2 D] (input: embedding first, then hidden), shared_head_norm [D],
      optional embed_tokens, shared_head_head [V, D], and blk (the block above).

  Keys here name file tensors; the three split ones (attn/wqg, gdn/wba, gdn/w_in) are replaced at load by the
  pieces `row_splits` names."""
  V, D = c.vocab_size, c.d_model
  m = {("token_embd",): ("token_embd.weight", (V, D)), ("output_norm",): ("output_norm.weight", (D,))}
  if not c.tied_embeddings:
    m[("output",)] = ("output.weight", (V, D))
  for i in range(c.n_layers):
    m.update({(f"blk_{i}",) + p: v for p, v in _block_map(c, i, f).items()})
  for j in range(c.n_nextn):
    i = c.n_layers + j
    n = f"blk.{i}.nextn."
    mm = {("enorm",): (n + "enorm.weight", (D,)), ("hnorm",): (n + "hnorm.weight", (D,)),
          ("eh_proj",): (n + "eh_proj.weight", (D, 2 * D)), ("shared_head_norm",): (n + "shared_head_norm.weight", (D,))}
    for opt, shape in (("embed_tokens", (V, D)), ("shared_head_head", (V, D))):
      if f is not None and f.has(n + opt + ".weight"):
        mm[(opt,)] = (n + opt + ".weight", shape)
    mm.update({("blk",) + p: v for p, v in _block_map(c, i, f).items()})
    m.update({(f"mtp_{j}",) + p: v for p, v in mm.items()})
  return m


def row_splits(c: ModelConfig, path: tuple[str, ...]) -> dict[str, np.ndarray] | None:
  """For a file tensor that load_params splits by rows: new last path key -> the source rows it takes, in order
  (a row permutation: quantized rows move whole, so every type splits exactly). None for other tensors."""
  key = path[-1]
  if key == "wqg":                                   # attn_q: [H, 2, Dh] rows
    r = np.arange(2 * c.n_heads * c.head_dim).reshape(c.n_heads, 2, c.head_dim)
    return {"wq": r[:, 0].reshape(-1), "wgate": r[:, 1].reshape(-1)}
  if key == "wba":                                   # ssm_ba: [Hk, 2, Hv / Hk] rows
    g = c.Hv // c.Hk
    r = np.arange(2 * c.Hv).reshape(c.Hk, 2, g)
    return {"wbeta": r[:, 0].reshape(-1), "walpha": r[:, 1].reshape(-1)}
  if key == "w_in":                                  # legacy ssm_in: [Hk, q Dk | k Dk | v (Hv/Hk) Dv | z (Hv/Hk) Dv]
    gv = c.Hv // c.Hk * c.Dv
    r = np.arange(c.Hk * (2 * c.Dk + 2 * gv)).reshape(c.Hk, 2 * c.Dk + 2 * gv)
    q, k, v, z = np.split(r, [c.Dk, 2 * c.Dk, 2 * c.Dk + gv], axis=1)
    return {"wqkv": np.concatenate([q.reshape(-1), k.reshape(-1), v.reshape(-1)]), "wz": z.reshape(-1)}
  return None


def _to_param(qtype: str, data: np.ndarray, shape: tuple[int, ...]):
  import jax.numpy as jnp

  from ops.qtensor import QTensor
  if qtype == "F32":
    return jnp.asarray(np.asarray(data, np.float32).reshape(shape))
  if qtype == "F16":
    return jnp.asarray(np.asarray(data, np.float16).reshape(shape))
  if qtype == "BF16":  # gguf-py hands BF16 over as raw bytes / uint16
    raw = np.ascontiguousarray(data).view(np.uint16).reshape(shape)
    return jnp.asarray(raw).view(jnp.bfloat16)
  return QTensor.from_gguf(data, qtype, shape[-1])


def to_params(c: ModelConfig, path: tuple[str, ...], qtype: str, data: np.ndarray,
              shape: tuple[int, ...]) -> list[tuple[tuple[str, ...], Any]]:
  """The params one file tensor gives: [(path, param)], split by rows where `row_splits` says (data's first axis is
  the tensor's rows for every type: values, or each row's quantized blocks)."""
  split = row_splits(c, path)
  if split is None:
    return [(path, _to_param(qtype, data, shape))]
  data = np.asarray(data).reshape(shape[0], -1)
  return [(path[:-1] + (key,), _to_param(qtype, data[rows], (len(rows),) + tuple(shape[1:])))
          for key, rows in split.items()]


# 2-D float tensors small enough to check at load beside every 1-D one (norms, biases, ssm_a, ssm_dt): the routers
# and the DeltaNet conv. A non-finite value in the big matrices shows in the logits, which the decode loops check.
SMALL_TENSORS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")


def check_finite(f: GGUFFile, name: str, qtype: str, data: np.ndarray) -> None:
  """A GGUFError naming the first NaN / Inf of float tensor `name` (F32, F16 or BF16 data as gguf-py gives it)."""
  if qtype == "BF16":
    vals = (np.ascontiguousarray(data).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
  else:
    vals = np.asarray(data)
  ok = np.isfinite(vals)
  if not ok.all():
    i = int(np.argmin(ok.reshape(-1)))
    raise GGUFError(f"{f.path}: tensor '{name}' has a non-finite value ({vals.reshape(-1)[i]} at flat index {i} of "
                    f"{vals.size}), expected finite weights")


def load_params(f: GGUFFile, c: ModelConfig, place=None) -> dict:
  """The params pytree (nested dicts of arrays / QTensors; layout: `tensor_map`) for `c` from file `f`;
  `place(path, param)`, when given, is applied to each param as soon as it is built (e.g.
  model.expert_cache.placer: the routed experts go to host memory one tensor at a time). Every 1-D tensor and
  the SMALL_TENSORS are checked finite (check_finite)."""
  params: dict = {}
  for path, (name, shape) in tensor_map(c, f).items():
    qtype, data = f.tensor(name, shape)
    if len(shape) == 1 and qtype not in ("F32", "F16", "BF16"):
      raise GGUFError(f"{f.path}: tensor '{name}' is {qtype}, expected a float type for a 1-D tensor")
    if qtype in ("F32", "F16", "BF16") and (len(shape) == 1 or name.endswith(SMALL_TENSORS)):
      check_finite(f, name, qtype, data)
    for ppath, param in to_params(c, path, qtype, data, shape):
      node = params
      for p in ppath[:-1]:
        node = node.setdefault(p, {})
      node[ppath[-1]] = place(tuple(ppath), param) if place else param
  return params


def load_gguf(path: str | os.PathLike, place=None):
  """Read and validate a file: (ModelConfig, params, Tokenizer, GGUFFile); `place` as in load_params."""
  from model.tokenizer import Tokenizer
  f = GGUFFile(path)
  cfg = read_config(f)
  _check_tokenizer_keys(f)
  params = load_params(f, cfg, place)
  try:
    tok = Tokenizer.from_metadata(f.md)
  except ValueError as e:
    raise GGUFError(f"{f.path}: {str(e).splitlines()[0]}") from None
  if tok.add_bos and tok.bos_id is None:
    raise GGUFError(f"{f.path}: the tokenizer adds BOS (tokenizer.ggml.add_bos_token or its pre default) but key "
                    f"'tokenizer.ggml.bos_token_id' is missing")
  return cfg, params, tok, f


_TOKENIZER_KEYS = {"tokenizer.ggml.model": str, "tokenizer.ggml.pre": str, "tokenizer.ggml.tokens": [str],
                   "tokenizer.ggml.merges": [str], "tokenizer.ggml.token_type": [int],
                   "tokenizer.ggml.bos_token_id": int, "tokenizer.ggml.eos_token_id": int,
                   "tokenizer.ggml.add_bos_token": bool}


def _check_tokenizer_keys(f: GGUFFile) -> None:
  """The tokenizer's keys, where present, have the types the tokenizer reads (a string, an int, a bool, or an array
  of them)."""
  for key, kind in _TOKENIZER_KEYS.items():
    if key not in f.md:
      continue
    v = f.md[key]
    if isinstance(kind, list):
      bad = [x for x in v if not isinstance(x, kind[0]) or isinstance(x, bool)][:1] if isinstance(v, list) else [v]
      if bad:
        raise GGUFError(f"{f.path}: key '{key}' holds {bad[0]!r:.80}, expected an array of {kind[0].__name__}")
    elif not isinstance(v, kind) or kind is not bool and isinstance(v, bool):
      raise GGUFError(f"{f.path}: key '{key}' is {v!r:.80}, expected {kind.__name__}")
