"""GGUF reading and validation: metadata -> `ModelConfig`, tensors -> the params pytree.

Quantized tensors stay packed (`QTensor` over the file's bytes); no full-precision copy of an expert is made.
Every problem with a file is a `GGUFError` whose message is one line naming the file, the key or tensor,
and what was expected.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from model.config import ARCHS, ModelConfig

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "IQ3_S", "IQ4_NL", "IQ4_XS")


class GGUFError(ValueError):
  """A GGUF file we cannot use; the message is one line."""


_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}   # GGUF value type -> bytes
_STRING, _ARRAY = 8, 9


def check_layout(path: str) -> None:
  """Walk the header (without gguf-py) and check that every tensor's bytes lie inside the file.

  gguf-py fails on short files with whatever numpy error the first bad view raises; this names the problem.
  """
  import struct

  import gguf
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    buf = f.read(min(size, 64 << 20))
  pos = 0

  def take(n: int) -> bytes:
    nonlocal pos
    if pos + n > len(buf):
      what = "header" if len(buf) == size else "header (over 64 MiB)"
      raise GGUFError(f"{path}: truncated GGUF ({size} bytes): the {what} ends at byte {len(buf)}, needed {pos + n}")
    b = buf[pos:pos + n]
    pos += n
    return b

  u32 = lambda: struct.unpack("<I", take(4))[0]  # noqa: E731
  u64 = lambda: struct.unpack("<Q", take(8))[0]  # noqa: E731

  def skip_value(vt: int) -> None:
    if vt == _STRING:
      take(u64())
    elif vt == _ARRAY:
      sub, n = u32(), u64()
      if sub in _SCALAR:
        take(_SCALAR[sub] * n)
      else:
        for _ in range(n):
          skip_value(sub)
    elif vt in _SCALAR:
      take(_SCALAR[vt])
    else:
      raise GGUFError(f"{path}: corrupt GGUF: unknown metadata value type {vt}")

  take(4)
  version = u32()
  if version not in (2, 3):
    raise GGUFError(f"{path}: GGUF version {version}, expected 2 or 3")
  n_tensors, n_kv = u64(), u64()
  alignment = 32
  for _ in range(n_kv):
    key = take(u64()).decode("utf-8", "replace")
    vt = u32()
    if key == "general.alignment" and vt == 4:
      alignment = u32()
    else:
      skip_value(vt)
  infos = []
  for _ in range(n_tensors):
    name = take(u64()).decode("utf-8", "replace")
    dims = [u64() for _ in range(u32())]
    tid, off = u32(), u64()
    try:
      qt = gguf.GGMLQuantizationType(tid)
    except ValueError:
      raise GGUFError(f"{path}: tensor '{name}' has unknown type id {tid}; supported: {', '.join(SUPPORTED_TYPES)}") from None
    bs, ts = gguf.GGML_QUANT_SIZES[qt]
    n = 1
    for d in dims:
      n *= d
    infos.append((name, off, n // bs * ts))
  start = (pos + alignment - 1) // alignment * alignment
  for name, off, nbytes in infos:
    if start + off + nbytes > size:
      raise GGUFError(f"{path}: truncated GGUF ({size} bytes): tensor '{name}' needs bytes up to {start + off + nbytes}")


class GGUFFile:
  """Metadata (`md`: key -> python value) and tensors (`tensors`: name -> gguf ReaderTensor) of one file."""

  def __init__(self, path: str | os.PathLike):
    import gguf  # gguf-py: parses the container; we validate what it returns
    self.path = str(path)
    if not os.path.isfile(self.path):
      raise GGUFError(f"{self.path}: no such file")
    with open(self.path, "rb") as f:
      magic = f.read(4)
    if magic != b"GGUF":
      raise GGUFError(f"{self.path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    size = os.path.getsize(self.path)
    check_layout(self.path)
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
      v = field.contents()
      self.md[name] = v
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


def read_config(f: GGUFFile) -> ModelConfig:
  """ModelConfig from metadata (and, for optional features, from which tensors exist)."""
  arch = f.get("general.architecture")
  if arch is None:
    raise GGUFError(f"{f.path}: missing required key 'general.architecture'")
  if arch not in ARCHS:
    raise GGUFError(f"{f.path}: unsupported arch '{arch}' (general.architecture); supported: {', '.join(ARCHS)}")
  k = lambda s: f"{arch}.{s}"  # noqa: E731
  n_blocks = f.require(k("block_count"), int)
  n_nextn = int(f.get(k("nextn_predict_layers"), 0) or 0)
  d_model = f.require(k("embedding_length"), int)
  n_heads = f.require(k("attention.head_count"), int)
  n_kv = f.require(k("attention.head_count_kv"), int)
  head_dim = int(f.get(k("attention.key_length"), d_model // n_heads))
  if "token_embd.weight" not in f.tensors:
    raise GGUFError(f"{f.path}: missing tensor 'token_embd.weight'")
  vocab = int(f.tensors["token_embd.weight"].shape[1])
  toks = f.get("tokenizer.ggml.tokens")
  if toks is not None and len(toks) != vocab:
    raise GGUFError(f"{f.path}: key 'tokenizer.ggml.tokens' has {len(toks)} entries, expected {vocab} (token_embd rows)")
  n_experts = f.require(k("expert_count"), int)
  top_k = f.require(k("expert_used_count"), int)
  d_ff_exp = f.require(k("expert_feed_forward_length"), int)
  kw: dict[str, Any] = {}
  if arch == "glm4moe":
    gating = int(f.get(k("expert_gating_func"), 2) or 2)
    if gating != 2:
      raise GGUFError(f"{f.path}: key '{k('expert_gating_func')}' is {gating}, expected 2 (sigmoid)")
    n_shared = int(f.get(k("expert_shared_count"), 0))
    kw.update(routing="sigmoid", norm_topk=bool(f.get(k("expert_weights_norm"), False)),
              routed_scale=float(f.get(k("expert_weights_scale"), 1.0)), n_dense_lead=int(f.get(k("leading_dense_block_count"), 0)),
              n_shared_experts=n_shared, d_ff_shared=d_ff_exp * n_shared)
  elif arch == "qwen3moe":
    kw.update(routing="softmax", norm_topk=True)
  else:  # qwen2moe
    has_sh = "blk.0.ffn_gate_inp_shexp.weight" in f.tensors
    kw.update(routing="softmax", norm_topk=False, shared_expert_gate=has_sh, n_shared_experts=int(has_sh),
              d_ff_shared=int(f.get(k("expert_shared_feed_forward_length"), 0)))
  if kw.get("n_dense_lead"):
    kw["d_ff"] = f.require(k("feed_forward_length"), int)
  return ModelConfig(
      arch=arch, vocab_size=vocab, d_model=d_model, n_layers=n_blocks - n_nextn, n_heads=n_heads, n_kv_heads=n_kv,
      head_dim=head_dim, rope_dim=int(f.get(k("rope.dimension_count"), head_dim)),
      rope_theta=float(f.get(k("rope.freq_base"), 10000.0)), rms_eps=float(f.require(k("attention.layer_norm_rms_epsilon"), float)),
      n_experts=n_experts, top_k=top_k, d_ff_expert=d_ff_exp, n_nextn=n_nextn,
      qk_norm="blk.0.attn_q_norm.weight" in f.tensors, qkv_bias="blk.0.attn_q.bias" in f.tensors,
      tied_embeddings="output.weight" not in f.tensors, context_length=int(f.get(k("context_length"), 4096)), **kw)


def _block_map(c: ModelConfig, i: int) -> dict[tuple[str, ...], tuple[str, tuple[int, ...]]]:
  """Param path (inside the block) -> (GGUF tensor name, numpy shape) for block i."""
  D, Hq, Hkv, Dh = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim
  b = f"blk.{i}."
  m = {
      ("attn_norm",): (b + "attn_norm.weight", (D,)),
      ("ffn_norm",): (b + ("post_attention_norm.weight" if c.arch == "glm4moe" else "ffn_norm.weight"), (D,)),
      ("attn", "wq"): (b + "attn_q.weight", (Hq * Dh, D)),
      ("attn", "wk"): (b + "attn_k.weight", (Hkv * Dh, D)),
      ("attn", "wv"): (b + "attn_v.weight", (Hkv * Dh, D)),
      ("attn", "wo"): (b + "attn_output.weight", (D, Hq * Dh)),
  }
  if c.qkv_bias:
    m.update({("attn", "bq"): (b + "attn_q.bias", (Hq * Dh,)), ("attn", "bk"): (b + "attn_k.bias", (Hkv * Dh,)),
              ("attn", "bv"): (b + "attn_v.bias", (Hkv * Dh,))})
  if c.qk_norm:
    m.update({("attn", "q_norm"): (b + "attn_q_norm.weight", (Dh,)), ("attn", "k_norm"): (b + "attn_k_norm.weight", (Dh,))})
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


def tensor_map(c: ModelConfig, f: GGUFFile | None = None) -> dict[tuple[str, ...], tuple[str, tuple[int, ...]]]:
  """Every param path -> (GGUF name, numpy shape). Optional NextN tensors are included when `f` has them."""
  V, D = c.vocab_size, c.d_model
  m = {("token_embd",): ("token_embd.weight", (V, D)), ("output_norm",): ("output_norm.weight", (D,))}
  if not c.tied_embeddings:
    m[("output",)] = ("output.weight", (V, D))
  for i in range(c.n_layers):
    m.update({(f"blk_{i}",) + p: v for p, v in _block_map(c, i).items()})
  for j in range(c.n_nextn):
    i = c.n_layers + j
    n = f"blk.{i}.nextn."
    mm = {("enorm",): (n + "enorm.weight", (D,)), ("hnorm",): (n + "hnorm.weight", (D,)),
          ("eh_proj",): (n + "eh_proj.weight", (D, 2 * D)), ("shared_head_norm",): (n + "shared_head_norm.weight", (D,))}
    for opt, shape in (("embed_tokens", (V, D)), ("shared_head_head", (V, D))):
      if f is not None and f.has(n + opt + ".weight"):
        mm[(opt,)] = (n + opt + ".weight", shape)
    mm.update({("blk",) + p: v for p, v in _block_map(c, i).items()})
    m.update({(f"mtp_{j}",) + p: v for p, v in mm.items()})
  return m


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


def load_params(f: GGUFFile, c: ModelConfig, place=None) -> dict:
  """The params pytree (nested dicts of arrays / QTensors) for `c` from file `f`; `place(path, param)`, when
  given, is applied to each param as soon as it is built (e.g. model.expert_cache.placer: the routed experts
  go to host memory one tensor at a time)."""
  params: dict = {}
  for path, (name, shape) in tensor_map(c, f).items():
    qtype, data = f.tensor(name, shape)
    if len(shape) == 1 and qtype not in ("F32", "F16", "BF16"):
      raise GGUFError(f"{f.path}: tensor '{name}' is {qtype}, expected a float type for a 1-D tensor")
    node = params
    for p in path[:-1]:
      node = node.setdefault(p, {})
    param = _to_param(qtype, data, shape)
    node[path[-1]] = place(tuple(path), param) if place else param
  return params


def load_gguf(path: str | os.PathLike, place=None):
  """Read and validate a file: (ModelConfig, params, Tokenizer, GGUFFile); `place` as in load_params."""
  from model.tokenizer import Tokenizer
  f = GGUFFile(path)
  cfg = read_config(f)
  params = load_params(f, cfg, place)
  try:
    tok = Tokenizer.from_metadata(f.md)
  except ValueError as e:
    raise GGUFError(f"{f.path}: {str(e).splitlines()[0]}") from None
  return cfg, params, tok, f
